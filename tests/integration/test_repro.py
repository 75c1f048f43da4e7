"""`fusion-oci repro`: a run recorded on bubblewrap replays with the same stdout and exit status
on bubblewrap, oci, podman and docker; a recorded image digest that is gone fails clearly; a
changed worktree is reported; the record holds env names, never values."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fusion_oci.audit import read_events
from fusion_oci.replay import load_record
from tests.backends import require_runtime
from tests.conftest import git

pytestmark = [pytest.mark.slow]

COMMAND = 'echo "replayed-$REPRO_FOO"; echo to-stderr >&2; exit 3'
SECRET = "s3cr3t-value-never-stored"


def cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    full_env = {
        **os.environ,
        "HOME": str(cwd.parent / "home"),
        "XDG_CONFIG_HOME": str(cwd.parent / "home/.config"),
        "REPRO_FOO": "bar",
        "REPRO_TOKEN": SECRET,
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "fusion_oci.cli.main", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def committed_worktree(tmp_path: Path) -> Path:
    wt = tmp_path / "wt"
    wt.mkdir()
    git(wt, "init", "-q")
    (wt / "a.txt").write_text("one\n")
    git(wt, "add", "a.txt")
    git(wt, "commit", "-qm", "init")
    return wt


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    """A worktree with run `rec1` recorded on bubblewrap."""
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
        "--env",
        "REPRO_TOKEN",
        "--run-id",
        "rec1",
        "--task-id",
        "t15",
        "--",
        COMMAND,
        cwd=wt,
    )
    assert (p.returncode, p.stdout) == (3, "replayed-bar\n"), p.stderr
    return wt


def engine_env(backend: str) -> dict[str, str]:
    if backend == "podman":
        return {"CONTAINER_HOST": os.environ.get("FUSION_OCI_PODMAN_URL", "")}
    return {}


def test_record_names_env_never_values(recorded: Path) -> None:
    runs = [
        e
        for e in read_events(recorded / ".fusion" / "sandbox-audit.jsonl")
        if e.type == "sandbox:run"
    ]
    assert len(runs) == 1 and runs[0].replay and runs[0].version
    assert runs[0].env_names == ["REPRO_FOO", "REPRO_TOKEN"]
    assert runs[0].worktree_head and runs[0].worktree_status
    record = load_record(recorded, runs[0].replay)
    assert record.command == COMMAND and record.backend == "bubblewrap"
    assert "REPRO_TOKEN" in record.spec["process"]["env"]
    assert record.host["arch"] and record.host["system_mounts"]
    for path in (recorded / ".fusion").rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("bubblewrap", marks=pytest.mark.bubblewrap),
        pytest.param("oci", marks=pytest.mark.oci),
        pytest.param("podman", marks=pytest.mark.podman),
        pytest.param("docker", marks=pytest.mark.docker),
    ],
)
def test_bubblewrap_run_replays_everywhere(recorded: Path, backend: str) -> None:
    require_runtime(backend)
    if backend in ("podman", "docker"):
        from tests.integration.images_fixture import ensure_node_image

        ensure_node_image(backend)  # the backend's default image, present
    p = cli(
        "repro",
        "rec1",
        "--backend",
        backend,
        "--allow-provision",
        cwd=recorded,
        env=engine_env(backend),
    )
    assert p.returncode == 3, p.stderr
    assert p.stdout == "replayed-bar\n"
    assert "to-stderr" in p.stderr and "unchanged since the recording" in p.stderr
    j = cli(
        "repro", "t15", "--backend", backend, "--json", cwd=recorded, env=engine_env(backend)
    )  # a task id: its last run (which is rec1's replay)
    assert j.returncode == 3, j.stderr
    report = json.loads(j.stdout)
    assert report["worktreeChanged"] is False
    [cmd] = report["commands"]
    assert cmd["sameStdout"] and cmd["sameStatus"], cmd
    assert cmd["replay"]["backend"] == backend


def test_changed_worktree_is_reported(recorded: Path) -> None:
    (recorded / "a.txt").write_text("two\n")
    p = cli("repro", "rec1", "--json", cwd=recorded)
    assert p.returncode == 3
    report = json.loads(p.stdout)
    assert report["worktreeChanged"] is True
    assert "uncommitted" in report["worktreeChange"]
    git(recorded, "commit", "-qam", "two")
    p = cli("repro", "rec1", cwd=recorded)
    assert p.returncode == 3
    assert "CHANGED since the recording (HEAD was" in p.stderr


def test_other_worktree_and_unknown_run(recorded: Path, tmp_path: Path) -> None:
    p = cli("repro", "nope", cwd=recorded)
    assert p.returncode == 2 and "no run or task 'nope'" in p.stderr
    assert "Traceback" not in p.stderr
    other = tmp_path / "copy"
    subprocess.run(["git", "clone", "-q", str(recorded), str(other)], check=True)
    p = cli(
        "repro",
        "rec1",
        "--worktree",
        str(other),
        "--project-dir",
        str(recorded),
        "--json",
        cwd=recorded,
    )
    assert p.returncode == 3, p.stderr
    report = json.loads(p.stdout)
    assert report["worktree"] == str(other)
    assert any("worktree" in d for d in report["differences"])


@pytest.mark.docker
def test_gone_image_digest_fails_clearly(tmp_path: Path) -> None:
    require_runtime("docker")
    import docker

    from tests.integration.images_fixture import ensure_base

    ensure_base("docker")
    client = docker.DockerClient(base_url=os.environ.get("DOCKER_HOST"))
    ref = f"localhost/fusion-oci/repro-gone:{uuid.uuid4().hex[:12]}"
    # A label-only image: its own id, made in a second, removable without touching others.
    dockerfile = f"FROM localhost/fusion-oci/base:bookworm\nLABEL io.fusion-oci.test={ref}\n"
    image, _ = client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=ref, rm=True)
    try:
        wt = committed_worktree(tmp_path)
        p = cli(
            "run",
            "--backend",
            "docker",
            "--image",
            ref,
            "--network",
            "none",
            "--run-id",
            "gone1",
            "--",
            "echo from-image",
            cwd=wt,
        )
        assert (p.returncode, p.stdout) == (0, "from-image\n"), p.stderr
        [ev] = [
            e
            for e in read_events(wt / ".fusion" / "sandbox-audit.jsonl")
            if e.type == "sandbox:run"
        ]
        assert ev.image_digest == image.id
        ok = cli("repro", "gone1", "--json", cwd=wt)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["commands"][0]["replay"]["imageDigest"] == image.id
    finally:
        client.images.remove(image.id, force=True)
    p = cli("repro", "gone1", cwd=wt)
    assert p.returncode == 125
    assert f"the recorded image {image.id} is not in docker" in p.stderr
    assert "hint:" in p.stderr and "Traceback" not in p.stderr
    client.close()


def test_edited_audit_log_is_refused(recorded: Path) -> None:
    log = recorded / ".fusion" / "sandbox-audit.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    lines = [ln.replace('"exitCode":3', '"exitCode":0') for ln in lines]
    log.write_text("".join(lines))
    p = cli("repro", "rec1", cwd=recorded)
    assert p.returncode == 2 and "fails its integrity check" in p.stderr
    p = cli("repro", "rec1", "--ignore-chain", "--json", cwd=recorded)
    assert p.returncode == 3
    assert "integrity check failed" in json.loads(p.stdout)["differences"][0]
