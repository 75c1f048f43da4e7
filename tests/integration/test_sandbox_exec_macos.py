"""sandbox-exec on a real Mac: the generated profile enforces what it says.

Runs only on macOS. Elsewhere the whole module is skipped because the platform is not darwin
(sandbox-exec cannot exist there); that is not a missing backend, and sandbox-exec is not in
the Linux CI's required list. Profile generation itself is tested everywhere in
tests/unit/test_seatbelt.py.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import PrepareContext, RunOptions, RunResult, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox
from tests.backends import require_runtime
from tests.conftest import git
from tests.hostside import tcp_server

pytestmark = [
    pytest.mark.macos,
    pytest.mark.skipif(
        sys.platform != "darwin", reason="macOS only: sandbox-exec (Seatbelt) exists only on darwin"
    ),
]

SETTINGS = SandboxSettings(backend="sandbox-exec")


@pytest.fixture(autouse=True)
def _sandbox_exec() -> None:
    require_runtime("sandbox-exec", SETTINGS)


def run(
    worktree: Path, command: str | list[str], opts: RunOptions | None = None, **policy: Any
) -> RunResult:
    with SyncSandbox(SETTINGS, env=dict(os.environ)) as sb:
        sb.prepare(
            PrepareContext(
                task_id="mac",
                run_id="r1",
                worktree_path=str(worktree),
                policy=SandboxPolicy(**policy),
            )
        )
        return sb.run(command, opts)


@pytest.fixture
def home_secret() -> Iterator[Path]:
    """A file in the caller's home that the sandbox must not read."""
    directory = Path.home() / f".fusion-oci-probe-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    (directory / "secret").write_text("do not read\n")
    try:
        yield directory / "secret"
    finally:
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()


def test_exit_code_stdout_stderr(worktree: Path) -> None:
    r = run(worktree, "echo out; echo err >&2; exit 7")
    assert (r.stdout, r.stderr, r.exit_code, r.backend) == ("out\n", "err\n", 7, "sandbox-exec")


def test_worktree_writable_home_and_outside_not(worktree: Path, home_secret: Path) -> None:
    outside = home_secret.parent / "planted"
    r = run(
        worktree,
        f"echo made > made.txt; cat '{home_secret}'; ls '{home_secret.parent}'; "
        f"echo x > '{outside}'; echo done",
    )
    assert (worktree / "made.txt").read_text() == "made\n"
    assert "do not read" not in r.stdout
    assert not outside.exists()
    assert r.stdout.endswith("done\n")


def test_git_commit_in_a_linked_worktree_with_hooks_read_only(
    linked_worktree: tuple[Path, Path],
) -> None:
    repo, wt = linked_worktree
    common = repo / ".git"
    r = run(
        wt,
        "echo change >> README && git add README && "
        "git -c user.name=s -c user.email=s@example.invalid commit -qm 'from sandbox' && "
        f"(touch {common}/hooks/post-commit 2>/dev/null && echo HOOKS-WRITABLE); "
        f"(echo x >> {common}/config 2>/dev/null && echo CONFIG-WRITABLE); true",
    )
    assert r.exit_code == 0, r.stderr
    assert "WRITABLE" not in r.stdout
    assert git(wt, "log", "-1", "--format=%s").strip() == "from sandbox"


@pytest.mark.parametrize("network", ["none", "egress"])
def test_host_loopback_is_closed(worktree: Path, network: str) -> None:
    with tcp_server() as (port, seen):
        r = run(
            worktree,
            ["/usr/bin/nc", "-z", "-w", "2", "127.0.0.1", str(port)],
            network=network,
            allow_network=network != "none",
        )
        assert r.exit_code != 0
    assert seen == []


def test_timeout_ends_the_tree(worktree: Path) -> None:
    marker = f"fusion-oci-mac-{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    r = run(worktree, f"sh -c 'sleep 1000' {marker} & sleep 1000", RunOptions(timeout_ms=1000))
    assert r.timed_out and time.monotonic() - start < 8
    import subprocess

    ps = subprocess.run(["ps", "-axo", "command"], capture_output=True, text=True).stdout
    assert marker not in ps


def test_memory_limits_are_refused(worktree: Path) -> None:
    with pytest.raises(PolicyNotEnforceableError, match="memoryLimitMb"):
        run(worktree, "true", memory_limit_mb=256)
