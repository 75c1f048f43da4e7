"""examples/ci: the workflow is a valid GitHub Actions workflow; its scripts run here for real:
prebuild.sh provisions the settings' image and caches it (a second run is a cache hit), and
reproduce.sh replays a failed recorded run and exports it as a script that runs as is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.backends import require_runtime
from tests.integration.test_repro import cli, committed_worktree

pytestmark = [pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "ci"


def tool(name: str) -> str:
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def shim_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """`fusion-oci` on PATH meaning this checkout's package (as the workflow's pipx install)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "fusion-oci"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m fusion_oci.cli.main "$@"\n')
    shim.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path / "home"),
        **extra,
    }


def test_workflow_is_valid_and_scripts_parse() -> None:
    check = subprocess.run(
        [
            tool("check-jsonschema"),
            "--builtin-schema",
            "vendor.github-workflows",
            str(EXAMPLES / "github-actions.yml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    for script in ("prebuild.sh", "reproduce.sh"):
        assert subprocess.run(["sh", "-n", str(EXAMPLES / script)]).returncode == 0
    text = (EXAMPLES / "github-actions.yml").read_text()
    assert "fusion-oci repro" in text and "prebuild.sh" in text and "actions/cache" in text


@pytest.mark.podman
def test_prebuild_caches_the_settings_image(tmp_path: Path) -> None:
    from tests.integration.images_fixture import ensure_node_image

    ref = ensure_node_image("podman").ref  # the workflow's engine
    project = committed_worktree(tmp_path)
    (project / ".fusion").mkdir()
    (project / ".fusion" / "settings.yaml").write_text("sandbox:\n  image: node\n")
    cache = tmp_path / "cache"
    env = shim_env(tmp_path, FUSION_OCI_BASE="offline")
    env.pop("CONTAINER_HOST", None)  # the podman CLI on its local storage, as on a runner
    argv = ["sh", str(EXAMPLES / "prebuild.sh"), str(project), str(cache), "podman"]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"saving {ref}" in first.stdout
    assert (cache / "task-images-podman.tar").stat().st_size > 1_000_000
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "loading cached images" in again.stdout and "cache hit" in again.stdout


@pytest.mark.podman
def test_reproduce_replays_a_failed_run_and_exports_it(tmp_path: Path) -> None:
    require_runtime("bubblewrap")
    wt = committed_worktree(tmp_path)
    failing = 'echo "the test failed"; exit 7'
    p = cli(
        "run",
        "--backend",
        "bubblewrap",
        "--network",
        "none",
        "--run-id",
        "ci-42",
        "--",
        failing,
        cwd=wt,
    )
    assert p.returncode == 7
    from tests.integration.images_fixture import ensure_node_image

    image = ensure_node_image("podman").ref
    out = tmp_path / "out"
    env = shim_env(tmp_path, FUSION_OCI_IMAGE=image)
    env["HOME"] = str(wt.parent / "home")  # the recording's audit key
    r = subprocess.run(
        ["sh", str(EXAMPLES / "reproduce.sh"), str(wt), "ci-42", "", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 7, r.stdout + r.stderr
    assert "recorded exit 7 on bubblewrap, replayed exit 7 on bubblewrap; stdout same" in r.stdout
    report = json.loads((out / "repro.json").read_text())
    assert report["commands"][0]["sameStatus"] is True
    assert "root filesystem" in (out / "export-notes.txt").read_text()
    # the exported script runs the same command in podman, on the node image
    run_env = {k: v for k, v in os.environ.items() if k != "CONTAINER_HOST"}
    s = subprocess.run(
        ["sh", str(out / "repro.sh")], env=run_env, capture_output=True, text=True, timeout=300
    )
    assert (s.returncode, s.stdout) == (7, "the test failed\n"), s.stderr
