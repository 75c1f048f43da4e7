"""The native runtime and the lifecycle, run for real. What every runtime must do (exit
statuses, signals, stdin, cwd, output, maxBuffer, timeouts, limits) is tests/contract."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusion_oci.audit import AuditEvent, AuditLog, DisposeEvent, RunEvent, read_events
from fusion_oci.errors import PolicyNotEnforceableError, RuntimeUnavailableError
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import Sandbox, SyncSandbox
from tests.hostside import pids_with

pytestmark = pytest.mark.native


def ctx(worktree: Path, **policy: object) -> PrepareContext:
    return PrepareContext(
        task_id="t1", run_id="r1", worktree_path=str(worktree), policy=SandboxPolicy(**policy)
    )  # type: ignore[arg-type]


def run(
    worktree: Path,
    command: str | list[str],
    opts: RunOptions | None = None,
    settings: SandboxSettings | None = None,
    env: dict[str, str] | None = None,
    audit: AuditLog | None = None,
    **policy: object,
):  # type: ignore[no-untyped-def]
    with SyncSandbox(settings or SandboxSettings(), env=env or dict(os.environ), audit=audit) as sb:
        sb.prepare(ctx(worktree, **policy))
        return sb.run(command, opts)


def test_daemon_left_behind_after_normal_exit_is_ended(worktree: Path) -> None:
    marker = f"fusion-oci-daemon-{os.getpid()}-{time.monotonic_ns()}"
    r = run(worktree, f"setsid sh -c 'sleep 1000; :' {marker} >/dev/null 2>&1 & echo started")
    assert r.exit_code == 0
    assert r.stdout == "started\n"
    time.sleep(0.1)
    assert pids_with(marker) == []


def test_env_allowlist_applies_when_the_policy_sets_one(worktree: Path) -> None:
    env = {**os.environ, "GITHUB_TOKEN": "ghp_x", "AWS_SECRET_ACCESS_KEY": "y", "KEEP": "k"}
    r = run(worktree, "env", env=env, env_allowlist=["KEEP"])
    names = {line.split("=", 1)[0] for line in r.stdout.splitlines()}
    assert "GITHUB_TOKEN" not in names
    assert "AWS_SECRET_ACCESS_KEY" not in names
    assert "KEEP=k" in r.stdout.splitlines()
    assert f"HOME={os.environ['HOME']}" in r.stdout.splitlines()  # the basics stay the caller's
    assert "envAllowlist" not in r.unenforced


def test_native_is_the_status_quo(worktree: Path, tmp_path: Path) -> None:
    """HOME, PATH, the whole env and git's identity are the caller's (brief Phase A)."""
    home = tmp_path / "caller-home"
    home.mkdir()
    (home / ".gitconfig").write_text(
        "[user]\n\tname = Caller Person\n\temail = caller@example.invalid\n"
    )
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "callers-tool").write_text("#!/bin/sh\necho tool ran\n")
    (tools / "callers-tool").chmod(0o755)
    env = {
        **os.environ,
        "HOME": str(home),
        "PATH": f"{tools}:{os.environ['PATH']}",
        "SOME_TOKEN": "t0k",
    }
    r = run(
        worktree, 'env -0; printf "\\n--\\n"; callers-tool; git var GIT_AUTHOR_IDENT; pwd', env=env
    )
    dumped, rest = r.stdout.split("\n--\n")
    seen = dict(item.split("=", 1) for item in dumped.split("\0") if "=" in item)
    for key in ("HOME", "PATH", "SOME_TOKEN"):
        assert seen[key] == env[key]
    lines = rest.splitlines()
    assert lines[0] == "tool ran"
    assert lines[1].startswith("Caller Person <caller@example.invalid>")
    assert lines[2] == str(worktree)
    assert "envAllowlist" in r.unenforced  # nothing reduced, and it says so


def test_native_leaves_no_scratch_folder(worktree: Path) -> None:
    import tempfile

    before = {p.name for p in Path(tempfile.gettempdir()).glob("fusion-oci-native-*")}
    run(worktree, "true")
    after = {p.name for p in Path(tempfile.gettempdir()).glob("fusion-oci-native-*")}
    assert after <= before


def _tree(marker: str) -> str:
    return f"setsid sh -c 'sleep 1000; :' {marker} & sh -c 'sleep 999; :' {marker}"


def _gone(marker: str) -> bool:
    deadline = time.monotonic() + 5
    while pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids_with(marker) == []


def test_cancelling_run_ends_the_tree_and_audits_aborted(worktree: Path, tmp_path: Path) -> None:
    marker = f"fusion-oci-abort-{os.getpid()}-{time.monotonic_ns()}"
    audit = AuditLog(tmp_path / "audit.jsonl")

    async def go() -> None:
        async with Sandbox(SandboxSettings(), env=dict(os.environ), audit=audit) as sb:
            await sb.prepare(ctx(worktree))
            task = asyncio.ensure_future(sb.run(_tree(marker)))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert _gone(marker)
    events = list(read_events(tmp_path / "audit.jsonl"))
    run, dispose = events[-2:]
    assert isinstance(run, RunEvent) and run.end_reason == "aborted", run
    assert isinstance(dispose, DisposeEvent), dispose


def test_abort_returns_an_aborted_result(worktree: Path) -> None:
    marker = f"fusion-oci-abort-{os.getpid()}-{time.monotonic_ns()}"

    async def go() -> None:
        async with Sandbox(SandboxSettings(), env=dict(os.environ)) as sb:
            await sb.prepare(ctx(worktree))
            task = asyncio.ensure_future(sb.run(_tree(marker)))
            await asyncio.sleep(0.5)
            sb.abort()
            result = await task
            assert (result.reason, result.exit_code) == ("aborted", None)
            assert result.shell_status == 128 + signal.SIGTERM

    asyncio.run(go())
    assert _gone(marker)


def test_sync_sandbox_abort_from_another_thread(worktree: Path) -> None:
    import threading

    marker = f"fusion-oci-abort-{os.getpid()}-{time.monotonic_ns()}"
    with SyncSandbox(SandboxSettings(), env=dict(os.environ)) as sb:
        sb.prepare(ctx(worktree))
        threading.Timer(0.5, sb.abort).start()
        started = time.monotonic()
        result = sb.run(_tree(marker))
    assert result.reason == "aborted"
    assert time.monotonic() - started < 6
    assert _gone(marker)


def test_native_lists_unenforced_policy_in_result_and_audit(worktree: Path, tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl")
    r = run(worktree, "true", audit=audit, allow_network=False, memory_limit_mb=64)
    assert "memoryLimitMb" in r.unenforced
    assert "network none" in r.unenforced
    assert "filesystem isolation" in r.unenforced
    prepare = next(e for e in read_events(tmp_path / "audit.jsonl") if e.type == "sandbox:prepare")
    assert prepare.unenforced == r.unenforced


# --- failure modes ---------------------------------------------------------------------------


def test_unavailable_backend_fail_hard(worktree: Path, tmp_path: Path) -> None:
    events: list[AuditEvent] = []
    audit = AuditLog(tmp_path / "audit.jsonl")
    audit.subscribe(events.append)
    settings = SandboxSettings(backend="custom", failure_mode="fail-hard")
    with SyncSandbox(settings, audit=audit) as sb, pytest.raises(RuntimeUnavailableError) as info:
        sb.prepare(ctx(worktree))
    assert info.value.exit_code == 125
    assert "custom" in str(info.value)
    assert [e.type for e in events] == ["sandbox:failure"]
    assert events[0].reason and "customRuntime" in events[0].reason


def test_unavailable_backend_fallback_native(worktree: Path, tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl")
    settings = SandboxSettings(backend="custom", failure_mode="fallback-native")
    with SyncSandbox(settings, audit=audit) as sb:
        sb.prepare(ctx(worktree, allow_network=False))
        r = sb.run("echo ran")
    assert r.stdout == "ran\n"
    assert r.fell_back
    assert r.backend == "native"
    assert "network none" in r.unenforced
    types = [e.type for e in read_events(tmp_path / "audit.jsonl")]
    assert types == [
        "sandbox:failure",
        "sandbox:fallback",
        "sandbox:prepare",
        "sandbox:run",
        "sandbox:dispose",
    ]
    fallback = list(read_events(tmp_path / "audit.jsonl"))[1]
    assert fallback.details == {"from": "custom", "kind": "backend-unavailable"}
    assert fallback.unenforced and "network none" in fallback.unenforced
    assert fallback.policy_hash and fallback.policy_hash.startswith("sha256:")


def test_unenforceable_policy_is_refused_not_weakened(worktree: Path, tmp_path: Path) -> None:
    from fusion_oci.runtimes import registry
    from fusion_oci.runtimes.native import NativeRuntime
    from fusion_oci.runtimes.requirements import Requirement

    class FsOnly(NativeRuntime):
        id = "fs-only"

        def enforces(self) -> frozenset[Requirement]:
            return frozenset(
                {
                    Requirement.FILESYSTEM,
                    Requirement.PROC_PATHS,
                    Requirement.ENV,
                    Requirement.HOST_PROCESSES,
                    Requirement.NETWORK_EGRESS,
                }
            )

    original = registry.runtime_class
    registry.runtime_class = (  # type: ignore[assignment]
        lambda backend, settings: NativeRuntime if backend == "native" else FsOnly
    )
    try:
        audit = AuditLog(tmp_path / "a.jsonl")
        settings = SandboxSettings(backend="bubblewrap", failure_mode="fail-hard")
        with (
            SyncSandbox(settings, audit=audit) as sb,
            pytest.raises(PolicyNotEnforceableError) as info,
        ):
            sb.prepare(ctx(worktree, memory_limit_mb=64))
        assert info.value.unenforced == ["memoryLimitMb"]
        events = list(read_events(tmp_path / "a.jsonl"))
        assert events[0].type == "sandbox:failure"
        assert events[0].unenforced == info.value.unenforced
        # fallback-native: that is exactly what it is for; the native run lists every part.
        settings = SandboxSettings(backend="bubblewrap", failure_mode="fallback-native")
        with SyncSandbox(settings, audit=audit) as sb:
            sb.prepare(ctx(worktree, memory_limit_mb=64))
            r = sb.run("echo ran")
        assert (r.stdout, r.fell_back, r.backend) == ("ran\n", True, "native")
        assert "memoryLimitMb" in r.unenforced and "filesystem isolation" in r.unenforced
    finally:
        registry.runtime_class = original  # type: ignore[assignment]


@pytest.mark.parametrize("failure_mode", ["fail-hard", "fallback-native"])
def test_a_bad_policy_path_is_exit_2_and_runs_nothing(
    worktree: Path, tmp_path: Path, failure_mode: str
) -> None:
    from fusion_oci.errors import SettingsError

    audit = AuditLog(tmp_path / "a.jsonl")
    canary = worktree / "ran"
    settings = SandboxSettings(backend="bubblewrap", failure_mode=failure_mode)  # type: ignore[arg-type]
    with SyncSandbox(settings, audit=audit) as sb, pytest.raises(SettingsError) as info:
        sb.prepare(ctx(worktree, allowed_paths=[str(tmp_path / "typo-in-the-path")]))
        sb.run(f"touch {canary}")
    assert info.value.exit_code == 2
    assert "allowedPaths[0]" in info.value.what
    assert not canary.exists()
    assert [e.type for e in read_events(tmp_path / "a.jsonl")] == ["sandbox:failure"]


@pytest.mark.parametrize("where", ["root", "home", "not-git", "sub-folder"])
def test_unsafe_worktrees_are_refused(tmp_path: Path, where: str) -> None:
    from fusion_oci.errors import FlagError

    home = tmp_path / "home"
    repo = tmp_path / "home" / "repo"
    (repo / "src").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    path = {"root": Path("/"), "home": home, "not-git": plain, "sub-folder": repo / "src"}[where]
    env = {**os.environ, "HOME": str(home)}
    with SyncSandbox(SandboxSettings(), env=env) as sb, pytest.raises(FlagError) as info:
        sb.prepare(ctx(path))
    assert info.value.exit_code == 2 and info.value.kind == "bad-flags"
    assert "--unsafe-worktree" in info.value.hint
    if where != "root":  # said explicitly: accepted (the root would get a /.fusion/)
        with SyncSandbox(SandboxSettings(), env=env) as sb:
            sb.prepare(
                PrepareContext(
                    task_id="t", run_id="r", worktree_path=str(path), unsafe_worktree=True
                )
            )


# --- audit under concurrency ----------------------------------------------------------------

WRITER = """
import sys
from fusion_oci.audit import AuditLog, RunEvent
log = AuditLog(__import__("pathlib").Path(sys.argv[1]))
for i in range(200):
    log.emit(RunEvent(task_id="w" + sys.argv[2], run_id=str(i),
                        backend="native", command="x" * (i * 37 % 3000)))
"""


def test_concurrent_writers_leave_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(n)]) for n in range(6)]
    assert all(p.wait(60) == 0 for p in procs)
    lines = path.read_text().splitlines()
    assert len(lines) == 1200
    for line in lines:
        json.loads(line)
    from fusion_oci.audit import verify_chain

    assert verify_chain(path).ok  # one chain, whatever the interleaving
