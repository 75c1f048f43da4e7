"""The runtime contract: one suite, run against every runtime this machine has.

Whatever isolates it, a runtime must give a task's command the same observable behaviour:
its own exit status (126 and 127 as a shell reports them, a real ``exit 130`` apart from death
by SIGINT), stdin, the working directory, only the allow-listed environment, output as UTF-8
text (bytes that are not UTF-8 replaced, never an error), 10 MB of output kept whole and in
order, the maxBuffer cut, a timeout and an abort that end the whole tree, setsid'd and
double-forked descendants included, and one end reason for each resource limit it enforces
(a limit it does not enforce is refused, or listed as unenforced by native, and the harmful
command never runs).

A runtime joins by adding its name to ``RUNTIMES`` (harness.py); a missing one skips, or fails
where CI requires it (tests/backends.py). ``podman-rootless`` is the podman runtime driven as the
unprivileged CI user (one ``rootless_driver session`` per sandbox, under ``runuser``), and
``docker-rootless`` the docker runtime driven the same way against that user's rootless dockerd;
``plugin`` is a third party's runtime that implements only the protocol
(tests/plugin_runtime.py), reached through the registry's entry points.

Run one runtime with ``-k``: ``pytest tests/contract -k bubblewrap``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import CpuLimit, RunOptions, RunResult
from fusion_oci.runtimes.registry import create_runtime
from tests.contract.harness import DOCKERLESS, ROOTLESS, Runtime, sandbox
from tests.hostside import pids_with

# ---------------------------------------------------------------------------- exit statuses


async def test_exit_statuses(runtime: Runtime, worktree: Path) -> None:
    async with sandbox(runtime, worktree) as sb:
        got = {code: (await sb.run(f"exit {code}")).exit_code for code in (0, 1, 126, 127, 255)}
        assert got == {0: 0, 1: 1, 126: 126, 127: 127, 255: 255}
        by_shell = await sb.run("nosuchcommand-contract")
        assert (by_shell.exit_code, by_shell.signal) == (127, None), by_shell


async def test_death_by_signal_is_reported_as_the_signal(runtime: Runtime, worktree: Path) -> None:
    async with sandbox(runtime, worktree) as sb:
        killed = await sb.run("kill -TERM $$")
        assert (killed.exit_code, killed.signal) == (None, "SIGTERM"), killed
        assert killed.reason == "signal" and killed.shell_status == 143
        group = await sb.run("sleep 30 & kill -TERM 0; wait")
        assert (group.exit_code, group.signal) == (None, "SIGTERM"), group


async def test_death_by_sigint_and_exit_130_both_read_130(runtime: Runtime, worktree: Path) -> None:
    async with sandbox(runtime, worktree) as sb:
        interrupted = await sb.run("kill -INT $$")
        assert (interrupted.exit_code, interrupted.signal) == (None, "SIGINT"), interrupted
        own = await sb.run("exit 130")
        assert own.shell_status == interrupted.shell_status == 130, own


async def test_a_real_exit_130_is_not_death_by_sigint(runtime: Runtime, worktree: Path) -> None:
    async with sandbox(runtime, worktree) as sb:
        own = await sb.run("exit 130")
        assert (own.exit_code, own.signal, own.reason) == (130, None, "exit"), own


async def test_exec_failures_as_a_shell_reports_them(runtime: Runtime, worktree: Path) -> None:
    async with sandbox(runtime, worktree) as sb:
        missing = await sb.run(["nosuchcommand-contract"])
        assert (missing.exit_code, missing.signal) == (127, None), missing
        not_executable = await sb.run(["/etc/passwd"])
        assert (not_executable.exit_code, not_executable.signal) == (126, None), not_executable


# ---------------------------------------------------------------------------- input, output


async def test_stdin_cwd_and_env_allowlist(runtime: Runtime, worktree: Path) -> None:
    (worktree / "sub").mkdir()
    env = {"ALLOWED": "yes", "SECRET_TOKEN": "nope", "OTHER": "no", "PATH": "/usr/bin:/bin"}
    async with sandbox(runtime, worktree, env_allowlist=["ALLOWED"]) as sb:
        r = await sb.run(
            "pwd; echo $ALLOWED ${SECRET_TOKEN:-unset} ${OTHER:-unset}; cat",
            RunOptions(cwd="sub", env=env, stdin=b"from stdin\n"),
        )
        assert r.exit_code == 0, r.stderr
        assert r.stdout.splitlines() == [str(worktree / "sub"), "yes unset unset", "from stdin"]
        closed = await sb.run("cat; echo done")
        assert closed.stdout == "done\n", "stdin is closed unless given"
        later = await sb.run("echo ${ALLOWED:-gone}", RunOptions(env={}))
        assert later.stdout == "gone\n", "one run's env does not leak into the next"
        odd = "a=b c \"q\" 'q' $HOME `x` é\nsecond line"
        value = await sb.run('printf "%s|" "$ALLOWED"', RunOptions(env={"ALLOWED": odd}))
        assert value.stdout == odd + "|", "a value passes as it is: =, quotes, $, newline"
        argv = await sb.run(["/bin/sh", "-c", 'pwd; printf "%s|" "$0"', "a b"])
        assert argv.stdout == f"{worktree}\na b|", "argv as given; the worktree by default"


async def test_concurrent_commands_of_a_task_each_finish_and_their_files_stay(
    runtime: Runtime, worktree: Path
) -> None:
    """An executor runs a task's commands side by side (a watcher beside the tests): each
    gets its own result, and what each wrote is in the worktree after (on kubernetes, each
    run's transfers take turns on the task's one stream; they once read each other's
    replies)."""
    n = 6
    async with sandbox(runtime, worktree) as sb:
        results = await asyncio.gather(
            *(
                sb.run(
                    f"sleep 0.2; head -c 200000 /dev/zero | tr '\\0' {i} > out-{i}.txt; echo {i}",
                    RunOptions(timeout_ms=120_000),
                )
                for i in range(n)
            )
        )
        assert [(r.exit_code, r.stdout) for r in results] == [(0, f"{i}\n") for i in range(n)], [
            r.model_dump(exclude={"stdout"}) for r in results
        ]
        for i in range(n):
            assert (worktree / f"out-{i}.txt").read_text() == str(i) * 200_000


async def test_ten_megabytes_of_stdin_arrive_whole(runtime: Runtime, worktree: Path) -> None:
    data = b"".join(b"%07d\n" % i for i in range(1, 1_250_001))
    async with sandbox(runtime, worktree) as sb:
        r = await sb.run("wc -c; echo done >&2", RunOptions(stdin=data, timeout_ms=120_000))
    assert (r.exit_code, r.stdout.strip(), r.stderr) == (0, str(len(data)), "done\n"), r


async def test_utf8_and_binary_output(runtime: Runtime, worktree: Path) -> None:
    async with sandbox(runtime, worktree) as sb:
        text = await sb.run(
            "printf 'h\\303\\251llo \\342\\234\\223\\n'; printf '\\342\\234\\227 err\\n' >&2"
        )
        assert (text.stdout, text.stderr) == ("héllo ✓\n", "✗ err\n")
        binary = await sb.run("printf '\\377\\376\\000ok'")
        assert binary.exit_code == 0
        assert binary.stdout == "\ufffd\ufffd\x00ok"


async def test_ten_megabytes_of_output_are_kept_whole_and_in_order(
    runtime: Runtime, worktree: Path
) -> None:
    lines = 1_250_000  # 7 digits and a newline each: 10,000,000 bytes, under the default cut
    async with sandbox(runtime, worktree) as sb:
        r = await sb.run(f"seq -w 1 {lines}; echo end >&2", RunOptions(timeout_ms=120_000))
    assert (r.exit_code, r.truncated, r.reason, r.stderr) == (0, False, "exit", "end\n")
    assert len(r.stdout) == 10_000_000
    assert r.stdout == "".join(f"{i:07d}\n" for i in range(1, lines + 1))


async def test_max_buffer_cuts_the_output_and_ends_the_command(
    runtime: Runtime, worktree: Path
) -> None:
    async with sandbox(runtime, worktree) as sb:
        r = await sb.run(
            "head -c 1000000 /dev/zero | tr '\\0' x; sleep 30",
            RunOptions(max_buffer=4096, timeout_ms=60_000),
        )
        assert r.truncated and r.reason == "max-buffer", r.model_dump(exclude={"stdout"})
        assert r.stdout == "x" * 4096
        assert r.duration_ms < 25_000, "the command was ended, not waited for"
        err = await sb.run(
            "head -c 1000000 /dev/zero | tr '\\0' y >&2; sleep 30",
            RunOptions(max_buffer=4096, timeout_ms=60_000),
        )
        assert err.truncated and err.reason == "max-buffer", err.model_dump(exclude={"stderr"})
        assert (err.stdout, err.stderr) == ("", "y" * 4096)


# ---------------------------------------------------------------------------- ending the tree


async def test_what_a_command_leaves_behind_is_ended_when_it_exits(
    runtime: Runtime, worktree: Path
) -> None:
    """A daemon left running by a command that exits 0 (holding its stdout open) neither
    holds the result back nor outlives the command."""
    marker = new_marker()
    daemon = (
        f'trap "" TERM HUP; n=0; while :; do n=$((n+1)); echo $n > heartbeat; '
        f"sleep 0.1; done # {marker}"
    )
    async with sandbox(runtime, worktree) as sb:
        start = time.monotonic()
        r = await sb.run(
            f"( ( setsid sh -c '{daemon}' & ) & ); "
            "while [ ! -s heartbeat ]; do sleep 0.05; done; echo hi",
            RunOptions(timeout_ms=60_000),
        )
        assert (r.exit_code, r.reason, r.stdout) == (0, "exit", "hi\n"), r
        assert time.monotonic() - start < 20, "the daemon's open stdout held the result"
    assert_tree_ended(worktree, marker, "its command")


def tree(marker: str) -> str:
    """A command whose setsid'd, double-forked daemon ignores TERM and HUP and beats a
    heartbeat file in the worktree; the command waits for the first beat, then sleeps.

    The heartbeat is seen from the host on every runtime, also where the sandbox's processes
    are not host processes (gVisor's are tasks of its own kernel, so no host pid shows them).
    """
    daemon = (
        f'trap "" TERM HUP; n=0; while :; do n=$((n+1)); echo $n > heartbeat; '
        f"sleep 0.1; done # {marker}"
    )
    return (
        f"( ( setsid sh -c '{daemon}' >/dev/null 2>&1 & ) & ); "
        f"while [ ! -s heartbeat ]; do sleep 0.05; done; touch started; echo started; "
        f"sleep {marker}"
    )


def new_marker() -> str:
    return f"{700 + secrets.randbelow(99)}.{secrets.randbelow(10**6)}"


async def test_timeout_ends_a_setsid_double_forked_tree(runtime: Runtime, worktree: Path) -> None:
    marker = new_marker()
    async with sandbox(runtime, worktree) as sb:
        start = time.monotonic()
        r: RunResult = await sb.run(tree(marker), RunOptions(timeout_ms=3000))
        assert r.timed_out and r.reason == "timeout", r
        assert r.shell_status == 124
        assert time.monotonic() - start < 20
    assert_tree_ended(worktree, marker, "the timeout")


async def test_abort_ends_the_whole_tree(runtime: Runtime, worktree: Path) -> None:
    marker = new_marker()
    said = asyncio.Event()
    started = worktree / "started"

    def seen(stream: str, chunk: bytes) -> None:
        if b"started" in chunk:
            said.set()

    async with sandbox(runtime, worktree) as sb:
        run = asyncio.ensure_future(
            sb.run(tree(marker), RunOptions(timeout_ms=120_000, on_output=seen))
        )
        # Where the worktree is the host's the file shows here (the rootless drivers hand no
        # output over before the end); a remote sandbox's (kubernetes) comes back when the
        # command ends, and its output streams: either says the tree is up.
        deadline = time.monotonic() + 60
        up = lambda: said.is_set() or started.exists()  # noqa: E731
        while not up() and not run.done() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        assert up(), await run
        sb.abort()
        r = await asyncio.wait_for(run, 30)
        assert (r.reason, r.exit_code, r.timed_out) == ("aborted", None, False), r
        after = await sb.run("echo still usable")
        assert after.stdout == "still usable\n", "an abort ends the command, not the sandbox"
    assert_tree_ended(worktree, marker, "the abort")


def assert_tree_ended(worktree: Path, marker: str, what: str) -> None:
    assert left_after(marker, 5.0) == [], f"a descendant outlived {what}"
    beat = worktree / "heartbeat"
    assert beat.exists(), "the daemon never ran: the check would prove nothing"
    deadline = time.monotonic() + 5
    last = beat.read_text()
    while True:
        time.sleep(0.5)
        now = beat.read_text()
        if now == last:
            return
        assert time.monotonic() < deadline, f"a descendant outlived {what}: it still beats"
        last = now


def left_after(marker: str, within_s: float) -> list[int]:
    """Host pids with ``marker`` still there after ``within_s`` (exits take a moment)."""
    deadline = time.monotonic() + within_s
    while pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids_with(marker)


# ---------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class Limit:
    policy: dict[str, Any]
    command: str
    timeout_ms: int
    part: str
    """The requirement's name in ``unenforced`` lists."""


LIMITS = {
    # A bomb held at the limit until the timeout ends it: the reason names the limit that
    # held it, not the timeout. The shell that waits forks once, before the bomb starts, then
    # execs (were it to fork at the limit, dash would exit "Cannot fork" before the timeout).
    "pids": Limit(
        {"pids_limit": 64}, "bomb() { bomb | bomb & }; (bomb) & exec sleep 600", 3000, "pidsLimit"
    ),
    "oom": Limit(
        {"memory_limit_mb": 64},
        "head -c 512m /dev/zero | tail > /dev/null",
        60_000,
        "memoryLimitMb",
    ),
    "cpu-time": Limit(
        {"cpu_limit": CpuLimit(max_ms=1000)}, "while :; do :; done", 30_000, "cpuLimit.maxMs"
    ),
}

NOT_ENFORCED = {
    ("pids", "native"),
    ("oom", "native"),
    ("pids", "plugin"),
    ("oom", "plugin"),
    # landlock: no namespace and no cgroup.
    ("pids", "landlock"),
    ("oom", "landlock"),
    # gVisor's processes are tasks of its own kernel: a host pids cgroup cannot count them.
    ("pids", "oci-runsc"),
    # Rootless podman and rootless dockerd on a cgroup v1 host have no cgroup of their own.
    ("pids", ROOTLESS),
    ("oom", ROOTLESS),
    ("pids", DOCKERLESS),
    ("oom", DOCKERLESS),
    # A Pod cannot set its pids limit (the kubelet's podPidsLimit is one for the node).
    ("pids", "kubernetes"),
}
"""What each runtime does not enforce on this machine (cgroups v1): it says so (refused by the
lifecycle; native runs and lists it) and the harmful command is never run."""


@pytest.mark.parametrize("limit", sorted(LIMITS))
async def test_each_limit_ends_with_its_own_reason(
    runtime: Runtime, worktree: Path, limit: str
) -> None:
    spec = LIMITS[limit]
    if (limit, runtime.name) in NOT_ENFORCED:
        await _assert_not_enforced(runtime, worktree, spec)
        return
    async with sandbox(runtime, worktree, **spec.policy) as sb:
        r = await sb.run(spec.command, RunOptions(timeout_ms=spec.timeout_ms))
    assert r.reason == limit, r.model_dump(exclude={"stdout", "stderr"})
    if limit == "pids":
        assert r.timed_out, "held at the limit until the timeout, and still read as pids"
        async with sandbox(runtime, worktree, **spec.policy) as sb:
            gave_up = await sb.run("for i in $(seq 100); do sleep 5 & done; wait")
        assert gave_up.reason == "pids", gave_up  # a shell that exits "Cannot fork"
        assert gave_up.exit_code not in (0, None) and "fork" in gave_up.stderr.lower()
    if limit == "oom":
        # The OOM killer's SIGKILL, as the shell saw it: the shell itself, or (where a
        # launcher reports the shell's status as a signal) 128+9 read back as SIGKILL.
        assert r.shell_status == 137, r


async def test_one_precedence_when_a_child_is_oom_killed(
    runtime: Runtime, worktree: Path, request: pytest.FixtureRequest
) -> None:
    """A limit that fired names the reason whenever the command did not succeed; a command
    that survived it (only a child was killed) ended by its own exit."""
    spec = LIMITS["oom"]
    if ("oom", runtime.name) in NOT_ENFORCED:
        await _assert_not_enforced(runtime, worktree, spec)
        return
    if runtime.name == "oci-runsc":
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                reason="under gVisor the host's OOM killer ends the whole sandbox "
                "(its memory is the sentry's), so no command survives a child's OOM",
            )
        )
    async with sandbox(runtime, worktree, **spec.policy) as sb:
        survived = await sb.run(
            f"({spec.command}); echo survived", RunOptions(timeout_ms=spec.timeout_ms)
        )
        failed = await sb.run(f"({spec.command}); exit 3", RunOptions(timeout_ms=spec.timeout_ms))
    assert (survived.exit_code, survived.reason, survived.stdout) == (0, "exit", "survived\n"), (
        survived
    )
    assert (failed.exit_code, failed.reason) == (3, "oom"), failed


async def _assert_not_enforced(runtime: Runtime, worktree: Path, spec: Limit) -> None:
    # docker-rootless names its daemon's socket in the settings, so this process can ask that
    # daemon what it is too (podman-rootless finds its socket only as its user).
    if runtime.user is None or runtime.name == DOCKERLESS:
        backend = runtime.settings.backend
        probe = create_runtime(backend, runtime.settings, os.environ)
        if spec.part in {r.value for r in probe.enforces()}:
            pytest.fail(
                f"{runtime.name} enforces {spec.part} now: move it out of "
                "NOT_ENFORCED so that the contract holds it to the reason"
            )
    if runtime.name == "native":  # the status quo runs it and lists it, so run no harm
        async with sandbox(runtime, worktree, **spec.policy) as sb:
            r = await sb.run("true")
        assert spec.part in r.unenforced, r
        return
    with pytest.raises(PolicyNotEnforceableError) as refused:
        async with sandbox(runtime, worktree, **spec.policy) as sb:
            await sb.run("echo the harmful command would run here")
    assert spec.part in refused.value.unenforced


# ---------------------------------------------------------------------------- threads, /proc/self

PYTHON_THREADS = """
import socket, threading
seen = []
def resolve():
    seen.append(socket.getaddrinfo("localhost", 80, type=socket.SOCK_STREAM)[0][4][0])
threads = [threading.Thread(target=resolve) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print("python", len(seen), sorted(set(seen)) in (["127.0.0.1"], ["::1"], ["127.0.0.1", "::1"]))
"""
NODE_THREADS = """
const { Worker } = require("worker_threads");
const dns = require("dns");
const worker = new Worker("require('worker_threads').parentPort.postMessage(6 * 7)",
                          { eval: true });
worker.on("message", (n) => {
  console.log("worker", n);
  // dns.lookup runs getaddrinfo on a thread of libuv's pool
  dns.lookup("localhost", (err) => console.log("lookup", err ? err.code : "ok"));
});
worker.on("error", (err) => { console.log("worker-error", err.message); process.exit(3); });
"""


async def test_threads_start_and_names_resolve_on_a_thread(
    runtime: Runtime, worktree: Path
) -> None:
    """Python threads, a node worker thread and a name resolution on libuv's thread pool: a
    sandbox that refuses new threads (runsc once did: its seccomp answered clone3 with EPERM,
    so glibc never fell back to clone) breaks node, pnpm and curl in every step."""
    async with sandbox(runtime, worktree) as sb:
        py = await sb.run(["python3", "-c", PYTHON_THREADS])
        node = await sb.run(["node", "-e", NODE_THREADS])
    assert (py.exit_code, py.stdout) == (0, "python 8 True\n"), py
    assert (node.exit_code, node.stdout) == (0, "worker 42\nlookup ok\n"), node


OWN_PROC = """set -e
grep '^Name:' /proc/self/status
cat /proc/self/cgroup >/dev/null && echo cgroup
test -n "$(cat /proc/self/maps)" && echo maps
python3 -c 'import os; print(min(os.listdir("/proc/self/fd")))'
grep '^Name:' /proc/thread-self/status
sh -c 'exec grep -c ^Pid: /proc/$$/status'
"""


async def test_a_command_reads_its_own_proc_self(runtime: Runtime, worktree: Path) -> None:
    """ps, JVMs, Go and Node helpers read their own status, maps, fds and cgroup. (gVisor
    20221219 has no /proc/self/limits, an empty cgroup file, and its ls cannot stat
    /proc/self/fd: the landlock tests read those in full.)"""
    async with sandbox(runtime, worktree) as sb:
        r = await sb.run(OWN_PROC)
    assert (r.exit_code, r.stdout.split("\n")) == (
        0,
        ["Name:\tgrep", "cgroup", "maps", "0", "Name:\tgrep", "1", ""],
    ), r
