"""The trust boundary and lifecycle as a user meets them on the command line: which folder is
the worktree, machine-readable errors, aborts by signal, audit verification, and that probing
or a kill -9 leaves nothing running."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import git, git_init
from tests.hostside import pids_with

ROOT = Path(__file__).resolve().parents[2]


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        "PYTHONPATH": str(ROOT),
        **extra,
    }
    return env


def cli(
    *args: str, cwd: Path, home: Path, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fusion_oci.cli.main", *args],
        cwd=cwd,
        env=env or cli_env(home),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


# --- which folder is the worktree -----------------------------------------------------------


@pytest.mark.native
def test_from_a_sub_folder_the_worktree_is_the_git_top(worktree: Path, home: Path) -> None:
    git(worktree, "commit", "-q", "--allow-empty", "-m", "init")
    sub = worktree / "src" / "deep"
    sub.mkdir(parents=True)
    p = cli(
        "run",
        "--backend",
        "bubblewrap",
        "--network",
        "none",
        "--",
        "pwd; git status --porcelain >/dev/null && echo git-ok",
        cwd=sub,
        home=home,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [str(worktree), "git-ok"]


@pytest.mark.native
@pytest.mark.parametrize("where", ["root", "home", "not-git", "sub-folder-flag"])
def test_unsafe_worktrees_are_refused_with_the_fix(tmp_path: Path, home: Path, where: str) -> None:
    repo = git_init(home / "repo")
    (repo / "src").mkdir()
    plain = tmp_path / "plain"
    plain.mkdir()
    cwd, extra = {
        "root": (Path("/"), []),
        "home": (home, []),
        "not-git": (plain, []),
        "sub-folder-flag": (home, ["--worktree", str(repo / "src")]),
    }[where]
    had_root_fusion = Path("/.fusion").exists()
    p = cli("run", "--json", *extra, "--", "touch ran-here", cwd=cwd, home=home)
    assert p.returncode == 2, p.stdout + p.stderr
    error = json.loads(p.stdout)["error"]
    assert error["kind"] == "bad-flags"
    assert "refused as a worktree" in error["what"] and error["hint"]
    assert not (cwd / "ran-here").exists()
    assert Path("/.fusion").exists() == had_root_fusion
    if where == "not-git":  # said explicitly: accepted
        p = cli("run", "--unsafe-worktree", "--", "touch ran-here", cwd=cwd, home=home)
        assert p.returncode == 0, p.stderr
        assert (cwd / "ran-here").exists()


@pytest.mark.native
def test_a_created_fusion_folder_is_git_excluded(worktree: Path, home: Path) -> None:
    p = cli("run", "--", "true", cwd=worktree, home=home)
    assert p.returncode == 0, p.stderr
    assert (worktree / ".fusion" / "sandbox-audit.jsonl").is_file()
    assert "/.fusion/" in (worktree / ".git/info/exclude").read_text().splitlines()
    assert git(worktree, "status", "--porcelain", "--untracked-files=all") == ""


@pytest.mark.native
def test_a_linked_worktrees_own_fusion_folder_is_never_read(
    linked_worktree: tuple[Path, Path], home: Path
) -> None:
    repo, wt = linked_worktree
    (repo / ".fusion").mkdir()
    (repo / ".fusion" / "settings.yaml").write_text("sandbox:\n  backend: bubblewrap\n")
    (wt / ".fusion").mkdir()
    (wt / ".fusion" / "settings.yaml").write_text("sandbox:\n  backend: native\n")
    p = cli("settings", "show", "--json", cwd=wt, home=home)
    rows = {r["key"]: r for r in json.loads(p.stdout)}
    assert rows["backend"]["value"] == "bubblewrap"
    assert rows["backend"]["source"] == str(repo / ".fusion" / "settings.yaml")
    other = home / "elsewhere"
    (other / ".fusion").mkdir(parents=True)
    (other / ".fusion" / "settings.yaml").write_text("sandbox:\n  backend: oci\n")
    p = cli("settings", "show", "--json", "--project-dir", str(other), cwd=wt, home=home)
    assert {r["key"]: r for r in json.loads(p.stdout)}["backend"]["value"] == "oci"


# --- machine-readable errors ----------------------------------------------------------------


@pytest.mark.native
@pytest.mark.parametrize(
    "case", ["bad-flags", "bad-flags-usage", "bad-settings", "backend-unavailable"]
)
def test_json_errors_have_a_kind(worktree: Path, home: Path, case: str) -> None:
    args: list[str] = {
        "bad-flags": ["--timeout-ms", "0"],
        "bad-flags-usage": ["--no-such-flag"],
        "bad-settings": [],
        "backend-unavailable": ["--backend", "custom"],
    }[case]
    if case == "bad-settings":
        (worktree / ".fusion").mkdir()
        (worktree / ".fusion" / "settings.yaml").write_text("sandbox:\n  backend: nope\n")
    p = cli("run", "--json", *args, "--", "true", cwd=worktree, home=home)
    error = json.loads(p.stdout)["error"]
    assert error["kind"] == case.removesuffix("-usage")
    assert set(error) == {"kind", "what", "why", "hint", "unenforced"}
    assert p.returncode == (125 if case == "backend-unavailable" else 2)
    assert "Traceback" not in p.stderr
    if case == "bad-flags":
        assert "--timeout-ms" in error["what"] and "0" in error["what"]
        assert "greater than 0" in error["why"]


@pytest.mark.native
@pytest.mark.parametrize(
    "flag,value",
    [("--timeout-ms", "0"), ("--max-buffer", "-1"), ("--task-id", "no spaces allowed")],
)
def test_flag_errors_name_the_flag_and_what_is_accepted(
    worktree: Path, home: Path, flag: str, value: str
) -> None:
    p = cli("run", flag, value, "--", "true", cwd=worktree, home=home)
    assert p.returncode == 2
    assert flag in p.stderr and "errors.pydantic.dev" not in p.stderr
    assert "hint:" in p.stderr


# --- audit verification ---------------------------------------------------------------------


@pytest.mark.native
@pytest.mark.parametrize("tamper", ["edited", "removed", "forged"])
def test_audit_verify_names_the_first_bad_line(worktree: Path, home: Path, tamper: str) -> None:
    for i in range(2):
        assert cli("run", "--", f"exit {i}", cwd=worktree, home=home).returncode == i
    ok = cli("audit", "--verify", cwd=worktree, home=home)
    assert ok.returncode == 0 and "chain intact (hashes and MACs)" in ok.stdout
    path = worktree / ".fusion" / "sandbox-audit.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) >= 6
    if tamper == "edited":
        lines[3] = lines[3].replace('"backend":"native"', '"backend":"bubblewrap"')
    elif tamper == "removed":
        del lines[3]
    else:  # a line with a valid prev hash but no key behind its MAC
        import hashlib

        prev = "sha256:" + hashlib.sha256(lines[2].encode()).hexdigest()
        lines.insert(
            3,
            json.dumps(
                {
                    "type": "sandbox:run",
                    "ts": "2026-01-01T00:00:00.000+00:00",
                    "taskId": "adhoc",
                    "runId": "forged",
                    "backend": "native",
                    "exitCode": 0,
                    "prev": prev,
                },
                separators=(",", ":"),
            ),
        )
    path.write_text("\n".join(lines) + "\n")
    bad = cli("audit", "--verify", "--json", cwd=worktree, home=home)
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert report["ok"] is False and report["firstBadLine"] == 4, report
    shown = cli("audit", cwd=worktree, home=home)
    assert "chain of" in shown.stderr and "broken at line 4" in shown.stderr


# --- aborts ---------------------------------------------------------------------------------

ABORT_BACKENDS = [
    pytest.param("native", marks=pytest.mark.native),
    pytest.param("bubblewrap", marks=pytest.mark.bubblewrap),
    pytest.param("oci", marks=pytest.mark.oci),
    pytest.param("podman", marks=pytest.mark.podman),
    pytest.param("docker", marks=pytest.mark.docker),
]


def _engine_args(backend: str) -> tuple[list[str], dict[str, str]]:
    if backend not in ("podman", "docker"):
        return [], {}
    from tests.integration.images_fixture import ensure_node_image

    image = ensure_node_image(backend).ref
    if backend == "docker":
        return ["--image", image], {"DOCKER_HOST": os.environ.get("DOCKER_HOST", "")}
    return ["--image", image], {"CONTAINER_HOST": os.environ.get("FUSION_OCI_PODMAN_URL", "")}


def _containers(backend: str, task: str) -> list[str]:
    client: Any
    if backend == "docker":
        import docker

        client = docker.DockerClient(base_url=os.environ["DOCKER_HOST"])
    else:
        import podman

        client = podman.PodmanClient(base_url=os.environ["FUSION_OCI_PODMAN_URL"])
    try:
        found = client.containers.list(all=True, filters={"label": f"io.fusion-oci.task-id={task}"})
        return [c.name for c in found]
    finally:
        client.close()


def _scratch(task: str) -> list[Path]:
    return sorted(Path(tempfile.gettempdir()).glob(f"fusion-oci-*-{task}-*"))


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert path.exists(), f"the command never started ({path} missing)"


@pytest.mark.parametrize("backend", ABORT_BACKENDS)
def test_sigterm_to_the_cli_aborts_ends_the_tree_and_leaves_nothing(
    backend: str, worktree: Path, home: Path
) -> None:
    from tests.backends import require_runtime

    engine_args, engine_env = _engine_args(backend)  # requires the engine and its image
    if not engine_env:
        require_runtime(backend)
    task = "abort-" + secrets.token_hex(3)
    marker = f"fusion-oci-abort-{task}"
    cmd = f"touch started; setsid sh -c 'sleep 1000; :' {marker} & sh -c 'sleep 999; :' {marker}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fusion_oci.cli.main",
            "run",
            "--backend",
            backend,
            "--network",
            "none",
            "--task-id",
            task,
            *engine_args,
            "--",
            cmd,
        ],
        cwd=worktree,
        env=cli_env(home, **engine_env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_for(worktree / "started", 240)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    deadline = time.monotonic() + 10
    while pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_with(marker) == []
    assert _scratch(task) == []
    if backend in ("podman", "docker"):
        assert _containers(backend, task) == []
    events = [
        json.loads(line)
        for line in (worktree / ".fusion/sandbox-audit.jsonl").read_text().splitlines()
    ]
    mine = [(e["type"], e.get("endReason")) for e in events if e["taskId"] == task]
    assert mine[-2:] == [("sandbox:run", "aborted"), ("sandbox:dispose", None)], mine


# --- probing creates nothing; nothing outlives its owner ------------------------------------


def _podman_services() -> set[int]:
    """Pids of `podman system service` processes running now."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"system" in args and b"service" in args and any(b"podman" in a for a in args):
                out.add(int(entry.name))
    return out


def _own_folders(kind: str = "service") -> set[str]:
    """The podman service's socket folders (``service``), or a task's scratch folders."""
    return {p.name for p in Path(tempfile.gettempdir()).glob(f"fusion-oci-podman-{kind}-*")}


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def no_podman_socket() -> Iterator[dict[str, str]]:
    """An env in which no podman socket answers, so the runtime would have to start one."""
    from tests.backends import require

    require("podman", Path("/usr/bin/podman").exists(), "podman is not installed")
    assert os.geteuid() == 0 and not Path("/run/podman/podman.sock").exists(), (
        "this test needs root without a system podman socket (CI has neither)"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("CONTAINER_HOST", "FUSION_OCI_PODMAN_URL")
    }
    yield env


@pytest.mark.podman
def test_plan_doctor_and_availability_start_nothing(
    worktree: Path, home: Path, no_podman_socket: dict[str, str]
) -> None:
    from fusion_oci.models import BACKEND_IDS
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.runtimes.registry import create_runtime

    env = {
        **cli_env(home),
        **{k: v for k, v in no_podman_socket.items() if k not in ("HOME", "PYTHONPATH")},
    }
    env.pop("CONTAINER_HOST", None)
    env.pop("FUSION_OCI_PODMAN_URL", None)
    services, folders = _podman_services(), _own_folders()
    trees = {root: _tree(root) for root in (home, worktree)}
    assert cli("doctor", "--json", cwd=worktree, home=home, env=env).returncode == 0
    for backend in BACKEND_IDS:
        p = cli(
            "plan", "--json", "--backend", backend, "--", "true", cwd=worktree, home=home, env=env
        )
        assert p.returncode == 0, p.stderr
        runtime = create_runtime(backend, SandboxSettings.model_validate({"backend": backend}), env)
        runtime.availability()
        runtime.enforces()
    assert json.loads(cli("doctor", "--json", cwd=worktree, home=home, env=env).stdout)
    time.sleep(0.5)
    assert _podman_services() <= services, "probing started a podman service"
    assert _own_folders() <= folders, "probing left a socket folder"
    for root, before in trees.items():
        assert _tree(root) == before, f"probing created files under {root}"


@pytest.mark.podman
def test_kill_9_of_the_cli_during_a_podman_run_leaves_no_service(
    worktree: Path, home: Path, no_podman_socket: dict[str, str]
) -> None:
    from tests.integration.images_fixture import ensure_node_image

    image = ensure_node_image("podman").ref
    env = {
        **cli_env(home),
        **{k: v for k, v in no_podman_socket.items() if k not in ("HOME", "PYTHONPATH")},
    }
    env.pop("CONTAINER_HOST", None)  # cli_env copies the harness's sockets back in
    env.pop("FUSION_OCI_PODMAN_URL", None)
    services, folders = _podman_services(), _own_folders()
    task = "kill9-" + secrets.token_hex(3)
    assert not _own_folders(task)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fusion_oci.cli.main",
            "run",
            "--backend",
            "podman",
            "--network",
            "none",
            "--image",
            image,
            "--task-id",
            task,
            "--",
            "touch started; sleep 120",
        ],
        cwd=worktree,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(worktree / "started", 240)
        assert _podman_services() - services, "the run should have started its own service"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while (
            _podman_services() - services or _own_folders() - folders
        ) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _podman_services() - services == set(), "the service outlived its owner"
        assert _own_folders() - folders == set(), "the socket folder outlived its owner"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        # The task's container and scratch folder are the next prepare's (or gc's) to
        # remove: do it now, and see that it does.
        cli("gc", "--json", cwd=worktree, home=home, env=env, timeout=180)
    assert _own_folders(task) == set(), "gc removes the scratch folder a kill -9 left"


@pytest.mark.bubblewrap
def test_the_next_prepare_removes_scratch_folders_a_kill_9_left(worktree: Path, home: Path) -> None:
    task = "k9b-" + secrets.token_hex(3)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fusion_oci.cli.main",
            "run",
            "--backend",
            "bubblewrap",
            "--network",
            "none",
            "--task-id",
            task,
            "--",
            "touch started; sleep 120",
        ],
        cwd=worktree,
        env=cli_env(home),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(worktree / "started", 60)
        left = _scratch(task)
        assert left, "the run should have a scratch folder"
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10  # bwrap --die-with-parent takes the command down
    while pids_with("sleep 120") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _scratch(task) == left  # nobody cleaned up after a SIGKILL...
    p = cli(
        "run", "--backend", "bubblewrap", "--network", "none", "--", "true", cwd=worktree, home=home
    )
    assert p.returncode == 0, p.stderr
    assert _scratch(task) == []  # ...until the next prepare's gc
