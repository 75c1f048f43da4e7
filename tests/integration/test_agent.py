"""The exec agent (fusion_oci/agent), run for real: the static binary, its keepers, the client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fusion_oci.agent.client import Agent, agent_binary, listen_socket
from fusion_oci.agent.streamed import MUX, StreamedAgent
from fusion_oci.errors import AgentLostError, SandboxSetupError
from tests.hostside import pids_with

pytestmark = pytest.mark.native

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C"}
MUX_ARGV = ["python3", "-S", "-E", "-s", str(MUX), "--agent", str(agent_binary())]
"""The far end as a pod's exec starts it: the system's python3, no site, no environment."""


def marker(tag: str) -> str:
    return f"fusion-oci-agent-{tag}-{os.getpid()}-{time.monotonic_ns()}"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(proc.name))
    out, todo = [], list(parents.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(parents.get(pid, []))
    return out


def appears(tag: str, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while not pids_with(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(pids_with(tag))


def gone(tag: str, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while pids_with(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids_with(tag) == []


@pytest.fixture(params=["local", "streamed"])
async def agent(request: pytest.FixtureRequest) -> AsyncIterator[Agent | StreamedAgent]:
    """The agent over each transport: a socket with the pipes passed, and a byte stream (the
    mux on a subprocess's stdin/stdout, exactly what a pod's exec gives)."""
    a: Agent | StreamedAgent
    if request.param == "local":
        a = await Agent.start_local()
    else:
        a = await StreamedAgent.start(MUX_ARGV)
    try:
        yield a
    finally:
        await a.close()
    assert a.peer_pid is not None and not alive(a.peer_pid)
    assert a.agent_pid is not None and not alive(a.agent_pid)


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


# --- what a command gets ---------------------------------------------------------------------


async def test_exit_status_stdout_stderr(agent: Agent | StreamedAgent) -> None:
    r = await agent.run(sh("echo out; echo err >&2; exit 7"), env=ENV)
    assert (r.stdout, r.stderr, r.returncode, r.signal, r.timed_out, r.truncated) == (
        b"out\n",
        b"err\n",
        7,
        None,
        False,
        False,
    )
    assert (await agent.run(["true"], env=ENV)).returncode == 0
    assert (await agent.run(sh("exit 255"), env=ENV)).returncode == 255


async def test_death_by_sigint_is_not_exit_130(agent: Agent | StreamedAgent) -> None:
    died = await agent.run(sh("kill -INT $$"), env=ENV)
    exited = await agent.run(sh("exit 130"), env=ENV)
    assert (died.returncode, died.signal) == (None, "SIGINT")
    assert (exited.returncode, exited.signal) == (130, None)
    segv = await agent.run(sh("kill -SEGV $$"), env=ENV)
    assert segv.signal == "SIGSEGV"


async def test_not_found_is_127_and_not_executable_is_126(
    agent: Agent | StreamedAgent, tmp_path: Path
) -> None:
    r = await agent.run(["no-such-command-xyz"], env=ENV)
    assert r.returncode == 127
    assert r.stderr == b"fusion-oci: no-such-command-xyz: command not found\n"
    plain = tmp_path / "plain"
    plain.write_text("echo hi\n")
    plain.chmod(0o644)
    r = await agent.run([str(plain)], env=ENV)
    assert r.returncode == 126
    assert b"Permission denied" in r.stderr
    # argv[0] is searched in the command's PATH, not the agent's
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "only-here").write_text("#!/bin/sh\necho found\n")
    (tools / "only-here").chmod(0o755)
    r = await agent.run(["only-here"], env={**ENV, "PATH": f"{tools}:/usr/bin:/bin"})
    assert r.stdout == b"found\n"


async def test_a_bad_cwd_is_a_setup_error_that_names_it(
    agent: Agent | StreamedAgent, tmp_path: Path
) -> None:
    with pytest.raises(SandboxSetupError) as info:
        await agent.run(["true"], env=ENV, cwd=str(tmp_path / "missing"))
    assert "chdir" in info.value.why
    assert (await agent.run(["true"], env=ENV)).returncode == 0  # the agent is still fine


async def test_stdin_dev_null_bytes_and_stream(agent: Agent | StreamedAgent) -> None:
    assert (await agent.run(sh("cat; echo done"), env=ENV)).stdout == b"done\n"
    assert (await agent.run(["cat"], env=ENV, stdin=b"fed")).stdout == b"fed"
    big = os.urandom(1 << 20)  # more than a pipe holds: written as the command reads
    assert (await agent.run(["cat"], env=ENV, stdin=big)).stdout == big

    async def chunks() -> AsyncIterator[bytes]:
        for part in (b"a\n", b"b\n", b"c\n"):
            await asyncio.sleep(0.01)
            yield part

    assert (await agent.run(["cat"], env=ENV, stdin=chunks())).stdout == b"a\nb\nc\n"


async def test_env_is_exactly_the_given_one_and_cwd_umask(
    agent: Agent | StreamedAgent, tmp_path: Path
) -> None:
    r = await agent.run(["/usr/bin/env"], env={"ONLY": "this", "PATH": "/bin"})
    assert sorted(r.stdout.decode().splitlines()) == ["ONLY=this", "PATH=/bin"]
    r = await agent.run(sh("pwd; umask"), env=ENV, cwd=str(tmp_path), umask=0o027)
    assert r.stdout.decode().splitlines() == [str(tmp_path), "0027"]


async def test_rlimits_apply_to_the_command(agent: Agent | StreamedAgent) -> None:
    r = await agent.run(
        sh("ulimit -t; ulimit -f; ulimit -n"),
        env=ENV,
        rlimits=[("RLIMIT_CPU", 3, 4), ("RLIMIT_FSIZE", 1 << 20, -1), ("RLIMIT_NOFILE", 64, 64)],
    )
    assert r.stdout.decode().split() == ["3", str((1 << 20) // 512), "64"]
    r = await agent.run(
        sh("while :; do :; done"), env=ENV, rlimits=[("RLIMIT_CPU", 1, 2)], timeout_s=20
    )
    assert r.signal in ("SIGXCPU", "SIGKILL")


async def test_the_command_holds_nothing_of_the_agent(agent: Agent | StreamedAgent) -> None:
    """Only its stdin, stdout and stderr: no socket to the agent, no other run's pipe."""
    r = await agent.run(sh("ls /proc/$$/fd"), env=ENV)
    assert sorted(r.stdout.decode().split()) == ["0", "1", "2"]
    assert agent.peer_pid is not None
    r = await agent.run(sh(f"cat /proc/{agent.peer_pid}/status | grep -i '^PPid'"), env=ENV)
    assert r.returncode == 0  # as root it can read; dumpable 0 keeps ptrace out for others


# --- ending trees ----------------------------------------------------------------------------


def escaping_tree(tag: str) -> list[str]:
    """A daemon in its own session, a double-forked one ignoring TERM, and a TERM-ignoring
    foreground child: everything a process-group kill would miss."""
    return sh(
        f"setsid sh -c 'sleep 1000; :' {tag} & "
        f"( ( sh -c 'trap \"\" TERM; sleep 1001; :' {tag} & ) & ) ; "
        f"sh -c 'trap \"\" TERM; sleep 1002; :' {tag}"
    )


async def test_timeout_ends_a_setsid_double_forked_tree(agent: Agent | StreamedAgent) -> None:
    tag = marker("timeout")
    start = time.monotonic()
    r = await agent.run(escaping_tree(tag), env=ENV, timeout_s=0.5, grace_s=0.5)
    assert r.timed_out
    assert r.signal in ("SIGTERM", "SIGKILL")
    assert time.monotonic() - start < 5
    assert gone(tag, 1.0)


async def test_abort_ends_the_tree(agent: Agent | StreamedAgent) -> None:
    tag = marker("abort")
    task = asyncio.ensure_future(agent.run(escaping_tree(tag), env=ENV, grace_s=0.5))
    await asyncio.sleep(0.5)
    assert pids_with(tag)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gone(tag, 1.0)


async def test_leftovers_after_a_normal_exit_are_ended(agent: Agent | StreamedAgent) -> None:
    tag = marker("leftover")
    start = time.monotonic()
    # The daemon keeps stdout open: the run must not wait for it.
    r = await agent.run(sh(f"setsid sh -c 'sleep 1000; :' {tag} & echo started"), env=ENV)
    assert (r.returncode, r.stdout) == (0, b"started\n")
    assert time.monotonic() - start < 2
    assert gone(tag, 1.0)


async def test_max_buffer_truncates_and_ends_the_tree(agent: Agent | StreamedAgent) -> None:
    r = await agent.run(["yes", "fusion"], env=ENV, max_buffer=4096, timeout_s=20)
    assert r.truncated and not r.timed_out
    assert len(r.stdout) == 4096 and r.stdout.startswith(b"fusion\nfusion\n")
    assert r.signal in ("SIGTERM", "SIGPIPE")


async def test_output_streams_as_it_comes(agent: Agent | StreamedAgent) -> None:
    seen: list[tuple[str, bytes]] = []
    r = await agent.run(
        sh("echo one; sleep 0.2; echo two >&2"),
        env=ENV,
        on_output=lambda name, chunk: seen.append((name, chunk)),
    )
    assert seen == [("stdout", b"one\n"), ("stderr", b"two\n")]
    assert r.stdout == b"one\n"
    r = await agent.run(
        ["yes"], env=ENV, keep_output=False, timeout_s=0.3, on_output=lambda name, chunk: None
    )
    assert r.timed_out and r.stdout == b"" and not r.truncated


async def test_twenty_concurrent_runs_each_get_their_own(agent: Agent | StreamedAgent) -> None:
    runs = [agent.run(sh(f"sleep 0.3; echo {i}; exit {i}"), env=ENV) for i in range(20)]
    start = time.monotonic()
    results = await asyncio.gather(*runs)
    assert [(r.stdout, r.returncode) for r in results] == [
        (f"{i}\n".encode(), i) for i in range(20)
    ]
    assert time.monotonic() - start < 5  # concurrent, not one after the other


async def test_a_timeout_in_one_run_leaves_the_others_alone(agent: Agent | StreamedAgent) -> None:
    slow = agent.run(sh("sleep 5"), env=ENV, timeout_s=0.3)
    fine = agent.run(sh("sleep 0.6; echo ok"), env=ENV)
    a, b = await asyncio.gather(slow, fine)
    assert a.timed_out and (b.stdout, b.returncode) == (b"ok\n", 0)


# --- the agent itself ------------------------------------------------------------------------


async def test_killing_the_agent_fails_loudly_then_disposes_cleanly() -> None:
    tag = marker("lost")
    a = await Agent.start_local()
    assert a.peer_pid is not None
    task = asyncio.ensure_future(a.run(sh(f"sh -c 'sleep 1000; :' {tag}"), env=ENV))
    await asyncio.sleep(0.3)
    os.kill(a.peer_pid, signal.SIGKILL)
    with pytest.raises(AgentLostError) as info:
        await asyncio.wait_for(task, 10)
    assert info.value.kind == "agent-lost" and info.value.exit_code == 125
    with pytest.raises(AgentLostError):
        await asyncio.wait_for(a.run(["true"], env=ENV), 5)
    await asyncio.wait_for(a.close(), 10)
    assert not alive(a.peer_pid)
    assert gone(tag, 3.0)  # the keeper saw its agent go and ended the tree


async def test_close_ends_running_trees_and_leaves_no_process() -> None:
    tag = marker("close")
    a = await Agent.start_local()
    assert a.peer_pid is not None
    task = asyncio.ensure_future(a.run(escaping_tree(tag), env=ENV))
    await asyncio.sleep(0.4)
    family = [a.peer_pid, *descendants(a.peer_pid)]
    assert len(family) >= 4  # agent, keeper, the command and its children
    await asyncio.wait_for(a.close(), 20)
    with pytest.raises(AgentLostError):
        await task
    assert not [pid for pid in family if alive(pid)]
    assert gone(tag, 1.0)


async def test_a_missing_binary_is_a_setup_error_naming_the_build(tmp_path: Path) -> None:
    with pytest.raises(SandboxSetupError) as info:
        await Agent.start_local(tmp_path / "fusion-oci-agent")
    assert "hatch_build.py" in info.value.hint
    assert agent_binary().name == "fusion-oci-agent"


def test_the_agent_dies_with_its_host(tmp_path: Path) -> None:
    """A host killed outright (no close): the agent ends its trees and exits on its own."""
    tag = marker("host-dies")
    script = tmp_path / "host.py"
    script.write_text(
        "import asyncio, sys\n"
        "from fusion_oci.agent.client import Agent\n"
        "async def main():\n"
        "    a = await Agent.start_local()\n"
        "    print(a.peer_pid, flush=True)\n"
        f"    await a.run(['/bin/sh', '-c', \"sleep 1000; : {tag}\"], env={{'PATH': '/bin'}})\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env) as host:
        assert host.stdout is not None
        agent_pid = int(host.stdout.readline())
        deadline = time.monotonic() + 5
        while not pids_with(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        host.kill()
    deadline = time.monotonic() + 5
    while alive(agent_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(agent_pid)
    assert gone(tag, 3.0)


# --- a container's init: --connect and accept ------------------------------------------------


async def connecting_agent(path: Path) -> asyncio.subprocess.Process:
    """The agent as a container's init would run it (here a host process)."""
    return await asyncio.create_subprocess_exec(
        str(agent_binary()),
        "--connect",
        str(path),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


async def test_accept_takes_one_connection_then_nothing_can_reach_it(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    listener = listen_socket(path)
    proc = await connecting_agent(path)
    try:
        a = await Agent.accept(listener, expect_pid=proc.pid, timeout_s=5)
        assert not path.exists()  # unlinked: nothing else can connect
        intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with pytest.raises(OSError):
            intruder.connect(str(path))
        intruder.close()
        r = await a.run(sh("echo via-connect"), env=ENV)
        assert r.stdout == b"via-connect\n"
        assert a.agent_pid == proc.pid == a.peer_pid
        await a.close()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_accept_refuses_a_peer_that_is_not_the_expected_init(tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    proc = await connecting_agent(path)
    try:
        with pytest.raises(SandboxSetupError) as info:
            await Agent.accept(path, expect_pid=proc.pid + 100000, timeout_s=5)
        assert "peer pid" in info.value.why
        assert not path.exists()
        # the refused agent saw its connection close and left
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_accept_times_out_with_a_setup_error(tmp_path: Path) -> None:
    with pytest.raises(SandboxSetupError) as info:
        await Agent.accept(tmp_path / "agent.sock", expect_pid=None, timeout_s=0.2)
    assert "did not connect" in info.value.what
    assert not (tmp_path / "agent.sock").exists()


# --- through the lifecycle -------------------------------------------------------------------


async def test_a_killed_agent_fails_the_sandbox_loudly_then_it_disposes(
    worktree: Path, tmp_path: Path
) -> None:
    from fusion_oci.audit import AuditLog, read_events
    from fusion_oci.models import PrepareContext
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.runtimes.native import NativeRuntime
    from fusion_oci.sandbox import Sandbox

    audit = AuditLog(tmp_path / "audit.jsonl")
    sb = Sandbox(SandboxSettings(), env=dict(os.environ), audit=audit)
    await sb.prepare(PrepareContext(task_id="t", run_id="r", worktree_path=str(worktree)))
    assert isinstance(sb.runtime, NativeRuntime) and sb.runtime.box is not None
    agent_pid = sb.runtime.box.agent.peer_pid
    assert agent_pid is not None
    assert (await sb.run("echo before")).stdout == "before\n"
    os.kill(agent_pid, signal.SIGKILL)
    for _ in range(2):  # the run that finds it gone, and every later one
        with pytest.raises(AgentLostError):
            await asyncio.wait_for(sb.run("echo after"), 10)
    await asyncio.wait_for(sb.dispose(), 10)
    assert not alive(agent_pid)
    kinds = [
        e.details.get("kind")
        for e in read_events(tmp_path / "audit.jsonl")
        if e.type == "sandbox:failure" and e.details
    ]
    assert kinds == ["agent-lost", "agent-lost"]


async def test_dispose_leaves_no_process_of_the_sandbox(worktree: Path) -> None:
    from fusion_oci.models import PrepareContext
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.runtimes.native import NativeRuntime
    from fusion_oci.sandbox import Sandbox

    tag = marker("dispose")
    sb = Sandbox(SandboxSettings(), env=dict(os.environ))
    await sb.prepare(PrepareContext(task_id="t", run_id="r", worktree_path=str(worktree)))
    assert isinstance(sb.runtime, NativeRuntime) and sb.runtime.box is not None
    agent_pid = sb.runtime.box.agent.peer_pid
    assert agent_pid is not None
    running = asyncio.ensure_future(sb.run(f"sh -c 'sleep 1000; :' {tag}"))
    await asyncio.sleep(0.3)
    family = [agent_pid, *descendants(agent_pid)]
    await asyncio.wait_for(sb.dispose(), 20)
    with contextlib.suppress(AgentLostError, asyncio.CancelledError):
        await running
    assert not [pid for pid in family if alive(pid)]
    assert gone(tag, 1.0)


async def test_large_argv_and_env_cross_many_reads(agent: Agent | StreamedAgent) -> None:
    """A frame far larger than one read: the fds ride its first bytes, the rest follows."""
    arg = "x" * 100_000
    env = {**ENV, **{f"BIG_{i}": "y" * 10_000 for i in range(50)}}
    runs = [
        agent.run(sh('printf %s "$1" | wc -c; printf %s "$BIG_49" | wc -c'), env=env)
        for _ in range(3)
    ]
    runs.append(agent.run([*sh('printf %s "$0" | wc -c'), arg], env=env))
    results = await asyncio.gather(*runs)
    assert [r.stdout.split() for r in results[:3]] == [[b"0", b"10000"]] * 3
    assert results[3].stdout.split() == [b"100000"]


async def test_as_pid_1_of_a_pid_namespace_it_reaps_and_ends_trees(tmp_path: Path) -> None:
    """A container's init: PID 1 in its own pid namespace (with its own /proc), reached by
    --connect; orphans re-parent to it or to a keeper, and a timeout still ends the tree."""
    tag = marker("pid1")
    path = tmp_path / "agent.sock"
    listener = listen_socket(path)
    proc = await asyncio.create_subprocess_exec(
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        "--kill-child",
        str(agent_binary()),
        "--connect",
        str(path),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        a = await Agent.accept(listener, expect_pid=None, timeout_s=5)
        assert a.agent_pid == 1
        r = await a.run(sh("echo $$; ps -o pid= -p 1 >/dev/null && echo has-1"), env=ENV)
        assert r.returncode == 0 and r.stdout.split()[1] == b"has-1"
        r = await a.run(escaping_tree(tag), env=ENV, timeout_s=0.5, grace_s=0.3)
        assert r.timed_out
        assert gone(tag, 1.0)
        await a.close()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_the_reaper_path_stays_for_platforms_without_the_agent(
    worktree: Path, tmp_path: Path
) -> None:
    from fusion_oci.models import PrepareContext, RunOptions
    from fusion_oci.oci.host import probe_host
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.resolve import resolve
    from fusion_oci.runtimes.native import NativeRuntime

    runtime = NativeRuntime(SandboxSettings(), dict(os.environ))
    runtime.uses_agent = False  # what macOS gets
    ctx = PrepareContext(
        task_id="t", run_id="r", worktree_path=str(worktree), project_dir=str(tmp_path / "project")
    )
    task = await runtime.prepare(
        resolve(
            SandboxSettings(),
            ctx,
            probe_host(),
            env=dict(os.environ),
            cache_root=tmp_path / "cache",
        )
    )
    try:
        assert runtime.box is None
        opts = RunOptions()
        r = await runtime.execute(runtime.plan(task.process("echo shim; exit 3", opts)), opts)
        assert (r.stdout, r.exit_code) == ("shim\n", 3)
    finally:
        await runtime.dispose()


async def test_an_output_callback_that_raises_ends_the_run_and_is_raised(
    agent: Agent | StreamedAgent,
) -> None:
    tag = marker("callback")

    def boom(name: str, chunk: bytes) -> None:
        raise RuntimeError("the caller's callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        await agent.run(
            sh(f"echo hi; sh -c 'sleep 1000; :' {tag}"), env=ENV, on_output=boom, grace_s=0.3
        )
    assert gone(tag, 1.0)
    assert (await agent.run(["true"], env=ENV)).returncode == 0


@pytest.mark.parametrize(
    "garbage", [b"\xff\xff\xff\xff", b"\0\0\0\x0aXid=1\0stat", b"\0\0\0\x0fXid=1\0status=x\0"]
)
async def test_a_stream_that_cannot_be_read_is_a_lost_agent_not_a_hang(garbage: bytes) -> None:
    from fusion_oci.agent.protocol import encode

    ours, theirs = socket.socketpair()
    a = Agent(ours)
    theirs.sendall(encode(b"H", [("version", "1"), ("pid", "1")]))
    await a._greeted(2)
    task = asyncio.ensure_future(a.run(["true"], env=ENV))
    await asyncio.sleep(0.05)
    theirs.sendall(garbage)
    if garbage.startswith(b"\0\0\0\x0a"):
        theirs.close()  # a frame cut short by the end of the stream
    with pytest.raises(AgentLostError):
        await asyncio.wait_for(task, 5)
    assert a.lost
    await a.close()
    theirs.close()


async def test_an_agent_that_stops_answering_is_lost_after_the_backstop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connected but silent (hung): the timeout's kill gets no answer; past grace and the
    backstop the run fails as agent-lost instead of waiting forever."""
    import fusion_oci.agent.session as session
    from fusion_oci.agent.protocol import encode

    monkeypatch.setattr(session, "KILL_BACKSTOP_S", 0.3)
    ours, theirs = socket.socketpair()
    a = Agent(ours)
    theirs.sendall(encode(b"H", [("version", "1"), ("pid", "1")]))
    await a._greeted(2)
    start = time.monotonic()
    with pytest.raises(AgentLostError) as info:
        await a.run(["sleep", "100"], env=ENV, timeout_s=0.2, grace_s=0.1)
    assert "outlived its kill" in info.value.why
    assert time.monotonic() - start < 3
    with pytest.raises(AgentLostError):
        await a.run(["true"], env=ENV)
    await a.close()
    theirs.close()


async def test_close_of_a_hung_agent_kills_everything_below_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent that ignores the closed connection (here a fake that greets, starts a child in
    a session of its own and hangs): past the wait, close() kills its whole tree."""
    import fusion_oci.agent.client as client

    monkeypatch.setattr(client, "CLOSE_WAIT_S", 0.5)
    tag = marker("hung")
    fake = tmp_path / "fake-agent"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import os, socket, subprocess, sys, time\n"
        "fd = int(sys.argv[2])\n"
        "s = socket.socket(fileno=fd)\n"
        "s.sendall(b'\\0\\0\\0\\x11Hversion=1\\0pid=1\\0')\n"
        f"subprocess.Popen(['sh', '-c', 'sleep 1000; : {tag}'], start_new_session=True)\n"
        "time.sleep(1000)\n"
    )
    fake.chmod(0o755)
    a = await Agent.start_local(fake)
    assert await asyncio.to_thread(appears, tag)
    await asyncio.wait_for(a.close(), 10)
    assert a.peer_pid is not None and not alive(a.peer_pid)
    assert gone(tag, 2.0)
