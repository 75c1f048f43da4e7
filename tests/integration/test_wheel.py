"""A wheel is a complete install: built with ``python -m build`` (wheel and sdist), each
installed into a fresh venv outside the checkout lists, builds and prebuilds the node image from
the image definitions it carries (fusion_oci/_images), under the tag a checkout uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from fusion_oci.images.provision import default_image_ref
from fusion_oci.images.spec import BASE_REF
from fusion_oci.shims import REAPER
from tests.integration.images_fixture import ensure_base

pytestmark = [pytest.mark.slow, pytest.mark.docker]

TOP = Path(__file__).resolve().parents[2]


def _env(tmp: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "FUSION_OCI_IMAGES_DIR", "VIRTUAL_ENV")
    }
    env["HOME"] = str(tmp / "home")
    env.setdefault("PIP_CERT", "/etc/ssl/certs/ca-certificates.crt")
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(TOP)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def test_build_makes_wheel_and_sdist_with_images(dist: Path) -> None:
    wheel = next(dist.glob("fusion_oci-*.whl"))
    sdist = next(dist.glob("fusion_oci-*.tar.gz"))
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert "fusion_oci/_images/node/Containerfile" in names
    assert "fusion_oci/py.typed" in names
    # The exec agent is compiled by the build hook and ships as an executable: the wheel is
    # platform-tagged, the sdist carries the source and the hook, never a binary.
    with zipfile.ZipFile(wheel) as zf:
        agent = zf.getinfo("fusion_oci/agent/fusion-oci-agent")
    assert (agent.external_attr >> 16) & 0o111
    assert not wheel.name.endswith("-none-any.whl"), wheel.name
    # The shims run by path (python -S -E -s .../fusion_oci/shims/reaper.py): all of them ship.
    shims = {f"fusion_oci/shims/{p.name}" for p in REAPER.parent.glob("*.py")}
    assert {"fusion_oci/shims/reaper.py", "fusion_oci/shims/confine.py"} <= shims <= names
    with tarfile.open(sdist) as tf:
        members = {m.name.split("/", 1)[1] for m in tf.getmembers() if "/" in m.name}
    assert "images/node/Containerfile" in members
    assert "pyproject.toml" in members
    assert {"fusion_oci/agent/agent.c", "hatch_build.py", "fusion_oci/shims/reaper.py"} <= members
    assert "fusion_oci/agent/fusion-oci-agent" not in members


@pytest.mark.parametrize("kind", ["whl", "tar.gz"])
def test_install_in_fresh_venv_lists_builds_and_prebuilds_node(
    dist: Path, tmp_path: Path, kind: str
) -> None:
    ensure_base("docker")
    env = _env(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True, timeout=120)
    package = next(dist.glob(f"fusion_oci-*.{kind}"))
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(package)],
        check=True,
        env=env,
        timeout=600,
        capture_output=True,
    )
    project = tmp_path / "project"  # outside the checkout: no images/ anywhere near
    project.mkdir()

    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import fusion_oci.images.spec as s; print(s.default_images_dir())",
        ],
        cwd=project,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(venv), where
    assert where.endswith("fusion_oci/_images")
    # The installed package runs commands through its own agent binary.
    ran = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import asyncio, fusion_oci.agent.client as c\n"
            "async def main():\n"
            "    a = await c.Agent.start_local()\n"
            "    r = await a.run(['/bin/sh', '-c', 'echo agent-ok'], env={'PATH': '/bin'})\n"
            "    await a.close()\n"
            "    print(c.agent_binary(), r.stdout.decode().strip())\n"
            "asyncio.run(main())",
        ],
        cwd=project,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert Path(ran[0]).is_relative_to(venv) and ran[1] == "agent-ok", ran
    # The installed reaper runs by path as the package runs it: no site-packages, no env.
    reaper = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "from fusion_oci.shims import REAPER; print(REAPER)"],
        cwd=project,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert Path(reaper).is_relative_to(venv), reaper
    shim = [str(venv / "bin" / "python"), "-S", "-E", "-s", reaper, "2.0", str(os.getpid())]
    done = subprocess.run([*shim, "--", "/bin/sh", "-c", "exit 3"], cwd=project, timeout=60)
    assert done.returncode == 3

    cli = str(venv / "bin" / "fusion-oci")
    # On a machine without the image this is a real build from the wheel's copy; where the
    # checkout already built it, the same content-hash tag is found present, which is the
    # point: a wheel install and a checkout name the same image.
    built = subprocess.run(
        [cli, "images", "build", "node", "--engine", "docker", "--base", "offline", "--json"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    rows = json.loads(built.stdout)
    want = default_image_ref("node", project_dir=project, base=BASE_REF)  # toolchain: project's
    assert [r["reference"] for r in rows] == [want]
    assert rows[0]["action"] in ("built", "present", "loaded")

    listed = subprocess.run(
        [cli, "images", "list", "--engine", "docker", "--json"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    node = [r for r in json.loads(listed.stdout) if r["reference"] == want]
    assert node and node[0]["current"] is True

    (project / ".fusion").mkdir()
    (project / ".fusion" / "settings.yaml").write_text("sandbox:\n  image: node\n")
    pre = subprocess.run(
        [
            cli,
            "images",
            "prebuild",
            "--engine",
            "docker",
            "--base",
            "offline",
            "--project",
            str(project),
            "--json",
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pre.returncode == 0, pre.stderr
    assert [r["reference"] for r in json.loads(pre.stdout)] == [want]
