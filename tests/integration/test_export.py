"""`fusion-oci export`, checked with the engines' own tools: `docker-compose config` and `run`,
`podman kube play` (and the manifest against the Kubernetes schemas with kubernetes-validate),
the devcontainer.json against the Dev Container spec's schema, the script run as is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import jsonschema
import pytest

from tests.backends import require_runtime
from tests.integration.test_repro import cli, committed_worktree

pytestmark = [pytest.mark.slow]

COMMAND = 'echo "exported-$REPRO_FOO"; exit 3'
DATA = Path(__file__).resolve().parents[1] / "data" / "schemas"


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    require_runtime("bubblewrap")
    wt = committed_worktree(tmp_path)
    p = cli(
        "run",
        "--backend",
        "bubblewrap",
        "--network",
        "none",
        "--env",
        "REPRO_FOO",
        "--memory-mb",
        "256",
        "--pids",
        "200",
        "--run-id",
        "exp1",
        "--task-id",
        "t15",
        "--",
        COMMAND,
        cwd=wt,
    )
    assert (p.returncode, p.stdout) == (3, "exported-bar\n"), p.stderr
    return wt


def export(wt: Path, fmt: str, out: Path, image: str, *extra: str) -> str:
    p = cli("export", *extra, "--format", fmt, "--image", image, "-o", str(out), cwd=wt)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    # what cannot be expressed: at the top of the file and on stderr, the same items
    for line in p.stderr.splitlines():
        item = line.split(": ", 2)[-1]
        assert item in text, (item, text[:2000])
    return p.stderr


@pytest.mark.docker
def test_compose_config_and_run(recorded: Path, tmp_path: Path) -> None:
    from tests.integration.images_fixture import ensure_node_image

    image = ensure_node_image("docker").ref
    out = tmp_path / "c" / "compose.yaml"
    out.parent.mkdir()
    stderr = export(recorded, "compose", out, image, "exp1")
    assert "root filesystem" in stderr and "seccomp" in stderr
    env = {**os.environ, "REPRO_FOO": "from-compose"}
    project = f"fo{uuid.uuid4().hex[:8]}"
    base = ["docker-compose", "-p", project, "-f", str(out)]
    cfg = subprocess.run([*base, "config"], env=env, capture_output=True, text=True, timeout=60)
    assert cfg.returncode == 0, cfg.stderr
    assert "not set" not in cfg.stderr  # `$REPRO_FOO` is the command's, not compose's
    try:
        run = subprocess.run(
            [*base, "run", "--rm", "-T", "task"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert (run.returncode, run.stdout) == (3, "exported-from-compose\n"), run.stderr
    finally:
        subprocess.run(
            [*base, "down", "--remove-orphans"], env=env, capture_output=True, timeout=120
        )


@pytest.mark.podman
def test_kube_pod_validates_and_plays(recorded: Path, tmp_path: Path) -> None:
    from tests.integration.images_fixture import ensure_node_image

    image = ensure_node_image("podman").ref
    out = tmp_path / "pod.yaml"
    stderr = export(recorded, "kube", out, image, "exp1")
    assert "pidsLimit 200" in stderr and "REPRO_FOO" in stderr
    validator = shutil.which("kubernetes-validate") or str(
        Path(sys.executable).parent / "kubernetes-validate"
    )
    check = subprocess.run(
        [validator, "--strict", str(out)], capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "pod/" in check.stdout and "networkpolicy/" in check.stdout
    # podman's default ulimits for root exceed this host's hard limits (machine notes) and a
    # Pod cannot set rlimits: give kube play defaults within them.
    conf = tmp_path / "containers.conf"
    conf.write_text(
        '[containers]\ndefault_ulimits = ["nofile=1024:1024", '
        '"nproc=1024:1024"]\n[engine]\nruntime = "runc"\n'
    )
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    env.pop("CONTAINER_HOST", None)
    play = subprocess.run(
        ["podman", "kube", "play", str(out)], env=env, capture_output=True, text=True, timeout=180
    )
    try:
        assert play.returncode == 0, play.stderr
        wait = subprocess.run(
            ["podman", "wait", "fusion-oci-t15-task"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert wait.stdout.strip() == "3", wait.stderr
        logs = subprocess.run(
            ["podman", "logs", "fusion-oci-t15-task"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert logs.stdout == "exported-\n"  # the Secret for REPRO_FOO does not exist here
    finally:
        subprocess.run(
            ["podman", "kube", "down", str(out)], env=env, capture_output=True, timeout=120
        )


def test_devcontainer_matches_its_schema(recorded: Path, tmp_path: Path) -> None:
    out = tmp_path / "devcontainer.json"
    export(recorded, "devcontainer", out, "localhost/fusion-oci/node:any", "exp1")
    text = out.read_text()
    body = "\n".join(line for line in text.splitlines() if not line.startswith("//"))
    doc = json.loads(body)
    schema = json.loads((DATA / "devContainer.base.schema.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(doc)
    assert doc["remoteEnv"] == {"REPRO_FOO": "${localEnv:REPRO_FOO}"}
    assert "--network=none" in doc["runArgs"] and "--pids-limit=200" in doc["runArgs"]
    assert doc["workspaceFolder"] == str(recorded)


@pytest.mark.podman
def test_script_runs_as_is(recorded: Path, tmp_path: Path) -> None:
    from tests.integration.images_fixture import ensure_node_image

    image = ensure_node_image("podman").ref
    out = tmp_path / "task.sh"
    export(recorded, "script", out, image, "exp1")
    assert os.access(out, os.X_OK)
    env = {**os.environ, "REPRO_FOO": "from-script"}
    env.pop("CONTAINER_HOST", None)
    run = subprocess.run([str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert (run.returncode, run.stdout) == (3, "exported-from-script\n"), run.stderr


def test_export_from_current_settings(recorded: Path, tmp_path: Path) -> None:
    out = tmp_path / "now.yaml"
    p = cli(
        "export",
        "--format",
        "compose",
        "--command",
        "true",
        "--image",
        "localhost/x:1",
        "-o",
        str(out),
        cwd=recorded,
    )
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert "image: localhost/x:1" in text and "- 'true'" in text
    bad = cli("export", "--format", "helm", cwd=recorded)
    assert bad.returncode == 2 and "--format helm" in bad.stderr
    assert "Traceback" not in bad.stderr
