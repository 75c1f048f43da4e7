"""The oci runtime with gVisor's runsc: the same bundle as runc, networks, cgroups,
leftovers. What every runtime must do (statuses, output, timeouts, limits) is tests/contract."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.models import PrepareContext, RunOptions, RunResult, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.oci import OciRuntime
from fusion_oci.sandbox import Sandbox
from tests.backends import require, require_runtime
from tests.conftest import git
from tests.hostside import pids_with, tcp_server
from tests.integration.test_oci_runc import (
    assert_egress_without_host_loopback,
    connect_script,
    new_marker,
)
from tests.integration.test_oci_runc import test_network as test_network  # fixture

pytestmark = [pytest.mark.oci, pytest.mark.runsc]

SETTINGS = SandboxSettings(backend="oci", oci_runtime="runsc")


@pytest.fixture(autouse=True)
def _runsc_available() -> None:
    require_runtime("oci-runsc", SETTINGS)


@contextlib.asynccontextmanager
async def sandbox(worktree: Path, **policy: Any) -> AsyncIterator[Sandbox]:
    async with Sandbox(SETTINGS, env=dict(os.environ)) as sb:
        await sb.prepare(
            PrepareContext(
                task_id="rs",
                run_id="r1",
                worktree_path=str(worktree),
                policy=SandboxPolicy(**policy),
            )
        )
        yield sb


async def run(
    worktree: Path, command: str | list[str], opts: RunOptions | None = None, **policy: Any
) -> RunResult:
    async with sandbox(worktree, **policy) as sb:
        return await sb.run(command, opts)


async def test_the_command_runs_on_gvisors_kernel(worktree: Path) -> None:
    r = await run(worktree, "uname -r; echo made > made.txt", allow_network=False)
    assert r.exit_code == 0, r.stderr
    # gVisor reports its own kernel version, whatever the host runs.
    assert r.stdout.splitlines()[0] != os.uname().release
    assert (worktree / "made.txt").read_text() == "made\n"


async def test_network_none_reaches_nothing_of_the_host(worktree: Path) -> None:
    with tcp_server("127.0.0.1", b"hello\n") as (port, seen):
        r = await run(
            worktree, connect_script([("127.0.0.1", port), ("10.0.2.2", port)]), allow_network=False
        )
    assert [line.split()[1] for line in r.stdout.splitlines()] == ["closed", "closed"], r
    assert seen == []


async def test_egress_reaches_out_but_not_host_loopback(worktree: Path, test_network: str) -> None:
    ok, why = OciRuntime(SETTINGS, dict(os.environ)).egress_status()
    require("oci-runsc", ok, f"egress: {why}")
    await assert_egress_without_host_loopback(run, worktree, test_network)


async def test_network_host_reaches_host_loopback(worktree: Path) -> None:
    with tcp_server("127.0.0.1", b"hello\n") as (port, seen):
        r = await run(worktree, connect_script([("127.0.0.1", port)]), network="host")
    assert r.stdout == "127.0.0.1 open\n", r
    assert len(seen) == 1


async def test_memory_limit_ends_in_oom_and_leaves_no_cgroup(worktree: Path) -> None:
    from fusion_oci.runtimes.linux.cgroups import LEAF_PREFIX

    def leaves() -> set[Path]:
        return {p for p in Path("/sys/fs/cgroup").glob(f"*/**/{LEAF_PREFIX}{os.getpid()}.*")}

    r = await run(
        worktree,
        ["/usr/bin/python3", "-c", "b = []\nwhile True: b.append(bytearray(8 << 20))"],
        allow_network=False,
        memory_limit_mb=64,
    )
    assert r.reason == "oom" and r.signal == "SIGKILL", r
    assert leaves() == set()


async def test_timeout_ends_the_tree_keeps_the_sandbox_and_dispose_leaves_nothing(
    worktree: Path,
) -> None:
    marker = new_marker()
    async with sandbox(worktree, allow_network=False) as sb:
        runtime = sb.runtime
        assert isinstance(runtime, OciRuntime) and runtime._task is not None
        root, task_dir = runtime._task.root, runtime._task.dir
        r = await sb.run(
            f"trap '' TERM; setsid sleep 600 & sleep 600 # {marker}", RunOptions(timeout_ms=1500)
        )
        assert r.timed_out and r.reason == "timeout", r
        # Inside gVisor the tree is gone (the agent's keeper ended it); the sandbox runs on.
        left = await sb.run("ps -eo args | grep -c '[s]leep 600' || true")
        assert left.stdout.strip() == "0", left
        assert (await sb.run("echo next")).stdout == "next\n"
        assert list(root.iterdir()) != []
    assert not task_dir.exists()  # runsc's state files went with it
    assert pids_with(marker) == []


async def test_git_commit_in_a_linked_worktree(linked_worktree: tuple[Path, Path]) -> None:
    repo, wt = linked_worktree
    common = repo / ".git"
    r = await run(
        wt,
        "echo change >> README && git add README && "
        "git -c user.name=s -c user.email=s@e commit -qm 'from gvisor' && "
        f"(touch {common}/hooks/post-commit 2>/dev/null && echo HOOKS-WRITABLE);"
        " true",
        allow_network=False,
    )
    assert r.exit_code == 0, r.stderr
    assert "WRITABLE" not in r.stdout
    assert git(wt, "log", "-1", "--format=%s").strip() == "from gvisor"


TRUNCATE = """import errno, os, sys
for flags in (os.O_WRONLY | os.O_CREAT | os.O_TRUNC, os.O_RDONLY | os.O_TRUNC):
    try:
        os.close(os.open(sys.argv[1], flags))
        print("opened")
    except OSError as e:
        print(errno.errorcode[e.errno])
"""


async def test_a_file_under_a_read_only_bind_survives_an_open_with_o_trunc(
    worktree: Path,
) -> None:
    """The shell's ``>`` and O_RDONLY|O_TRUNC on a file of the read-only hooks folder. With
    directfs, runsc 20240729 empties the file (the first even answers EROFS); through the
    gofer (``--directfs=false``, what fusion-oci passes a runsc that has it) both are EROFS
    and the file is whole."""
    hook = worktree / ".git" / "hooks" / "pre-commit.sample"
    before = hook.read_bytes()
    assert before
    r = await run(worktree, ["python3", "-c", TRUNCATE, str(hook)], allow_network=False)
    assert (r.exit_code, r.stdout.split()) == (0, ["EROFS", "EROFS"]), r
    assert hook.read_bytes() == before
