"""The landlock runtime on this kernel: git in a linked worktree, networks, failures, leftovers,
and a host where user namespaces are forbidden (simulated in a test-owned user namespace)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.errors import PolicyNotEnforceableError, SandboxSetupError
from fusion_oci.models import PrepareContext, RunOptions, RunResult, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.landlock import LandlockRuntime
from fusion_oci.sandbox import SyncSandbox
from tests.backends import require, require_runtime
from tests.conftest import git, git_init
from tests.hostside import tcp_server

pytestmark = [pytest.mark.landlock]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _landlock_available() -> None:
    require_runtime("landlock")


ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}


@contextmanager
def prepared(worktree: Path, task_id: str = "ll", **policy: Any) -> Iterator[SyncSandbox]:
    """A landlock sandbox on ``worktree``, prepared (``network: none`` unless said)."""
    if "network" not in policy:
        policy.setdefault("allow_network", False)
    settings = SandboxSettings(backend="landlock", policy=SandboxPolicy(**policy))
    env = {**ENV, "HOME": str(worktree.parent)}
    # The project outside the worktree (an executor's layout): landlock refuses a project whose
    # .fusion/ the command could write (test_a_main_worktree_as_the_project_is_refused).
    project = worktree.parent / "project"
    project.mkdir(exist_ok=True)
    with SyncSandbox(settings, env=env, cache_root=worktree.parent / "cache") as sb:
        sb.prepare(
            PrepareContext(
                task_id=task_id,
                run_id="r1",
                worktree_path=str(worktree),
                policy=settings.policy,
                project_dir=str(project),
            )
        )
        yield sb


def run(worktree: Path, command: str, *, timeout_ms: int = 20_000, **policy: Any) -> RunResult:
    with prepared(worktree, **policy) as sb:
        env = {**ENV, "HOME": str(worktree.parent)}
        return sb.run(command, RunOptions(timeout_ms=timeout_ms, env=env))


def test_a_main_worktree_as_the_project_is_refused(worktree: Path) -> None:
    """Landlock cannot make the project's .fusion/ read-only inside the writable worktree:
    the layout is refused (fallback-native or another backend then applies), never weakened."""
    from fusion_oci.errors import PolicyNotEnforceableError

    settings = SandboxSettings(backend="landlock", policy=SandboxPolicy(allow_network=False))
    with (
        SyncSandbox(settings, env=dict(os.environ), cache_root=worktree.parent / "cache") as sb,
        pytest.raises(PolicyNotEnforceableError) as refused,
    ):
        sb.prepare(
            PrepareContext(
                task_id="ll", run_id="r1", worktree_path=str(worktree), policy=settings.policy
            )
        )
    assert any(".fusion" in part for part in refused.value.unenforced)
    assert "linked worktree" in refused.value.hint


def test_commit_in_a_linked_worktree_works_and_hooks_stay_read_only(
    linked_worktree: tuple[Path, Path],
) -> None:
    repo, wt = linked_worktree
    hook = repo / ".git" / "hooks" / "pre-commit"
    result = run(
        wt,
        "echo change > file.txt && git add file.txt && "
        "git -c user.name=t -c user.email=t@e commit -qm from-landlock && "
        f"echo pwn > {hook}; git config core.hooksPath /tmp/x; "
        "git log --oneline | head -1",
    )
    assert "from-landlock" in result.stdout, result.stderr
    assert not hook.exists()
    # The .git file names the git dir the host's next git call uses: put back after the run.
    pointer = (wt / ".git").read_text()
    hijack = run(
        wt,
        "mkdir -p evil && cp -r " + str(repo / ".git") + "/. evil/ && "
        "rm .git && printf 'gitdir: evil\\n' > .git && cat .git",
    )
    assert hijack.stdout == "gitdir: evil\n", hijack
    assert (wt / ".git").read_text() == pointer
    assert any(".git (writable during the command" in u for u in hijack.unenforced), hijack
    assert "hooksPath" not in (repo / ".git" / "config").read_text()
    assert git(repo, "log", "--oneline", "task").startswith(
        git(wt, "rev-parse", "--short", "HEAD").strip()
    )


def test_the_tools_of_a_build_run(worktree: Path) -> None:
    result = run(
        worktree,
        "node -e 'console.log(require(\"os\").cpus().length > 0)'; "
        "python3 -c 'import sys; print(sys.version_info >= (3,))'; "
        'echo data > out.txt && cat out.txt; ls -d "$TMPDIR" "$HOME"',
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[:3] == ["true", "True", "data"]


def test_root_gains_nothing_by_being_root(worktree: Path) -> None:
    result = run(
        worktree,
        "grep -E '^Cap(Eff|Prm|Bnd)' /proc/$$/status; cat /etc/shadow; "
        "ls /root; echo x > /usr/local/pwned; true",
    )
    assert "root" not in result.stdout and not Path("/usr/local/pwned").exists()
    for word in ("/etc/shadow", "/root", "/usr/local/pwned"):
        assert word in result.stderr  # each refused, with the tool's own message


def test_a_command_changes_its_own_limits_and_priorities_but_no_other_process_s(
    worktree: Path,
) -> None:
    """Issue #31: rlimits, nice, I/O class, affinity and policy of the command itself (pid 0,
    which every tool uses on itself) are its own to change; by pid, even its own child's,
    they are refused (the cost of a profile that cannot tell its tree from the host)."""
    cpu = min(os.sched_getaffinity(0))
    result = run(
        worktree,
        "ulimit -n 100; ulimit -n; nice -n 5 nice; ionice -c 3 ionice; "
        f"taskset -c {cpu} sh -c 'taskset -cp $$' | sed 's/.*: //'; chrt -b 0 chrt -p 0 | "
        "head -1 | sed 's/.*: //'; sleep 5 & "
        "renice -n 1 -p $! >/dev/null 2>&1 || echo renice refused; "
        "prlimit --pid $! --nofile=10: 2>/dev/null || echo prlimit refused; kill $!",
    )
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert result.stdout.split("\n") == [
        "100",
        str(min(base + 5, 19)),
        "idle",
        str(cpu),
        "SCHED_BATCH",
        "renice refused",
        "prlimit refused",
        "",
    ], result


def test_network_host_reaches_tcp_but_no_unix_socket(worktree: Path) -> None:
    with tcp_server() as (port, seen):
        result = run(
            worktree,
            f"python3 -c 'import socket; socket.create_connection("
            f'("127.0.0.1", {port})).close(); print("tcp")\'; '
            "python3 -c 'import socket; socket.socket(socket.AF_UNIX)' "
            "2>&1 | tail -1",
            network="host",
        )
    assert result.stdout.splitlines()[0] == "tcp" and seen
    assert "Operation not permitted" in result.stdout


def test_network_none_has_no_socket_but_pipes_between_processes_work(worktree: Path) -> None:
    result = run(
        worktree,
        "python3 -c 'import socket; a, b = socket.socketpair(); "
        'a.send(b"pair"); print(b.recv(4).decode())\'; '
        "python3 -c 'import socket; socket.socket()' 2>&1 | tail -1",
    )
    assert result.stdout.splitlines() == [
        "pair",
        "PermissionError: [Errno 1] Operation not permitted",
    ]


def test_chmod_works_in_the_worktree_and_nowhere_else(worktree: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("x")
    outside.chmod(0o600)
    (worktree / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (worktree / "out-link").symlink_to(outside)
    result = run(
        worktree,
        "chmod +x run.sh && ./run.sh; mkdir -p d && chmod 700 d; "
        "chmod 644 out-link; chmod 666 " + str(outside) + "; chmod u+s run.sh;"
        ' python3 -c \'import os; fd = os.open("/etc/passwd", os.O_RDONLY)'
        "\ntry: os.fchmod(fd, 0o666)\nexcept OSError as e: print(e.errno)'",
    )
    assert result.stdout.splitlines() == ["ran", "1"], result
    assert (worktree / "d").stat().st_mode & 0o777 == 0o700
    assert outside.stat().st_mode & 0o777 == 0o600
    assert not (worktree / "run.sh").stat().st_mode & 0o4000
    assert result.stderr.count("Operation not permitted") == 3, result.stderr


OWN_PROC_SCRIPT = (
    "set -e; grep -q '^Name:.*grep' /proc/self/status && echo status; "
    "grep -q '^Max open files' /proc/self/limits && echo limits; "
    'test -n "$(cat /proc/self/cgroup)" && echo cgroup; '
    'test -n "$(cat /proc/self/maps)" && echo maps; '
    "ls /proc/self/fd | grep -qx 0 && echo fd; "
    "grep -q '^Name:' /proc/thread-self/status && echo thread-self; "
    "tr '\\0' ' ' < /proc/self/cmdline | grep -q '^tr' && echo cmdline; "
    "(cd /proc/self && grep -q '^Pid:' status) && echo relative; "
    "sh -c 'exec grep -q ^Pid: /proc/$$/status' && echo own-pid; "
    "sh -c 'grep -q ^PPid: /proc/$PPID/status' && echo parent-in-sandbox; "
    # The task's agent and this run's keeper are the sandbox's too (as a bwrap sandbox's PID 1
    # is): the supervisor's tree is the reaper's, of which every command is a grandchild.
    # ps writes a file, not a pipe, once sleep has exec'd: a child that has not yet is "sh".
    'sleep 5 & until [ "$(cat /proc/$!/comm)" = sleep ]; do :; done; '
    "ps -o comm= > \"$TMPDIR/ps\"; tr '\\n' ' ' < \"$TMPDIR/ps\" "
    "| grep -qx 'fusion-agent fusion-agent sh sleep ps ' && echo ps; kill $!"
)


def test_each_process_reads_its_own_proc_self(worktree: Path) -> None:
    """No rule can grant each process of the tree its own /proc/<pid> (a new inode per pid):
    the reaper's supervisor opens it for the caller, children included, and the entries of
    the sandbox's other processes (ps lists those, as in a pid namespace)."""
    result = run(worktree, OWN_PROC_SCRIPT)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.split() == [
        "status",
        "limits",
        "cgroup",
        "maps",
        "fd",
        "thread-self",
        "cmdline",
        "relative",
        "own-pid",
        "parent-in-sandbox",
        "ps",
    ], result
    threads = run(
        worktree,
        "python3 -c 'import threading\n"
        'def f(): print(open("/proc/thread-self/status").readline())\n'
        "t = threading.Thread(target=f); t.start(); t.join()'",
    )
    assert threads.stdout.strip() == "Name:\tpython3", threads
    # Another process of the sandbox: what ps reads, not what the kernel guards by ptrace.
    sibling = run(
        worktree,
        "sleep 5 & tr '\\0' ' ' < /proc/$!/cmdline; echo; "
        "cat /proc/$!/environ /proc/$!/maps 2>&1 | grep -c denied; kill $!",
    )
    assert sibling.stdout.split("\n") == ["sleep 5 ", "2", ""], sibling


def test_other_processes_proc_and_the_hosts_sysctls_stay_out_of_reach(worktree: Path) -> None:
    """A host process's environ and cmdline (canaries in both), its status, pid 1's, magic
    links out of /proc/self, capability-dependent entries, masked paths and sysctl writes: all
    refused; ps lists no host process."""
    canary = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "CANARY-ARG-7f3a"],
        env={"CANARY": "CANARY-ENV-7f3a"},
        stdin=subprocess.DEVNULL,
    )
    try:
        pid = canary.pid
        probes = [
            f"/proc/{pid}/environ",
            f"/proc/{pid}/cmdline",
            f"/proc/{pid}/status",
            f"/proc/{pid}/maps",
            "/proc/1/cmdline",
            "/proc/self/root/etc/hostname",
            "/proc/self/pagemap",
            "/proc/self/stack",
            "/proc/self/net/tcp",
            "/proc/keys",
            "/proc/timer_list",
            "/proc/sys/kernel/hostname",
        ]
        script = "; ".join(f"cat {p} >/dev/null 2>&1 && echo READ {p}" for p in probes)
        script += (
            f"; cat /proc/{pid}/environ /proc/{pid}/cmdline 2>/dev/null; "
            "echo x 2>/dev/null > /proc/self/comm && echo WROTE comm; "
            "echo 1 2>/dev/null > /proc/sys/vm/drop_caches && echo WROTE sysctl; "
            "ps -eo args; echo end"
        )
        result = run(worktree, script)
    finally:
        canary.kill()
        canary.wait()
    listed = result.stdout.splitlines()
    assert listed[0] == "COMMAND" and listed[-1] == "end", result  # nothing READ or WROTE
    assert "ps -eo args" in listed, result  # ps ran, and listed the sandbox only:
    assert "7f3a" not in result.stdout + result.stderr


def test_egress_and_cgroup_limits_are_refused_not_weakened(worktree: Path) -> None:
    for policy in (
        {"network": "egress"},
        {"memory_limit_mb": 64},
        {"pids_limit": 10},
        {"tmp_size_mb": 8},
    ):
        with pytest.raises(PolicyNotEnforceableError):
            run(worktree, "true", **policy)


def test_a_plain_repositorys_hooks_and_config_are_put_back_and_listed(worktree: Path) -> None:
    config = (worktree / ".git" / "config").read_text()
    result = run(
        worktree,
        "printf '#!/bin/sh\\necho owned\\n' > .git/hooks/pre-commit; "
        "git config core.fsmonitor 'touch /tmp/x'; "
        "echo ok > kept.txt",
    )
    assert not (worktree / ".git" / "hooks" / "pre-commit").exists()
    assert (worktree / ".git" / "config").read_text() == config
    assert (worktree / "kept.txt").read_text() == "ok\n"  # the worktree itself is the command's
    assert "restored" in result.stderr
    listed = " ".join(result.unenforced)
    assert ".git/hooks" in listed and "restored after each command" in listed, result


def test_nothing_left_behind(worktree: Path) -> None:
    before = set(Path("/tmp").glob("fusion-oci-ll-*"))
    assert run(worktree, "exit 3").exit_code == 3
    timed = run(worktree, "sleep 30", timeout_ms=500)
    assert timed.timed_out and timed.reason == "timeout"
    assert set(Path("/tmp").glob("fusion-oci-ll-*")) == before


AGENT_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def up(pid):
    status = open(f"/proc/{pid}/status").read()
    return status.split()[1], int(status.split("PPid:")[1].split()[0])
name, parent = up(os.getpid())
while name != "fusion-agent":  # the keeper of this run, its parent the agent
    name, parent = up(parent)
agent = parent
fds = sorted(os.listdir("/proc/self/fd"))
pidfd = libc.syscall(434, agent, 0)  # pidfd_open: allowed; pidfd_getfd (438): refused
got = libc.syscall(438, pidfd, 3, 0) if pidfd >= 0 else -1
print(agent, fds, got, ctypes.get_errno(), sep="|")
"""


def test_one_confined_agent_runs_every_command_and_keeps_its_connection(worktree: Path) -> None:
    """Both commands are spawn frames to the same agent (a keeper's child, the keeper its
    child), which holds no fd of the command's, and none can take its connection; the launch
    file is gone once it started."""
    import errno

    from tests.integration.test_agent import marker, pids_with

    settings = SandboxSettings(backend="landlock", policy=SandboxPolicy(allow_network=False))
    project = worktree.parent / "project"
    project.mkdir(exist_ok=True)
    tag = marker("ll-leftover")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    with SyncSandbox(settings, env=env, cache_root=worktree.parent / "cache") as sb:
        sb.prepare(
            PrepareContext(
                task_id="ll-agent",
                run_id="r1",
                worktree_path=str(worktree),
                policy=settings.policy,
                project_dir=str(project),
            )
        )
        runtime = sb.sandbox.runtime
        assert isinstance(runtime, LandlockRuntime)
        scratch = Path(runtime._dirs()[0]).parent
        assert not (scratch / "launch").exists()
        seen = []
        for _ in range(2):
            result = sb.run(f"python3 -c '{AGENT_PROBE}'", RunOptions(env=env))
            assert result.exit_code == 0, result.stderr
            agent, fds, got, err = result.stdout.strip().split("|")
            seen.append(int(agent))
            assert fds == "['0', '1', '2', '3']", result.stdout  # 3: the listing itself
            assert int(got) == -1 and int(err) == errno.EPERM, result.stdout
        assert seen[0] == seen[1]
        from fusion_oci.runtimes.landlock import MIN_SCOPE_ABI, host_abi

        if host_abi() >= MIN_SCOPE_ABI:  # each run's domain is nested in the agent's
            stop = sb.run(f"kill -STOP {seen[0]}", RunOptions(env=env))
            assert stop.exit_code != 0 and "not permitted" in stop.stderr, stop
            assert sb.run("echo alive", RunOptions(env=env)).stdout == "alive\n"
        # A setsid'd, double-forked leftover ends with its run, not at dispose.
        left = sb.run(f"setsid sh -c 'sleep 300; : {tag}' & echo started", RunOptions(env=env))
        assert left.exit_code == 0, left.stderr
        assert pids_with(tag) == []
    from tests.integration.test_agent import alive

    assert not alive(seen[0])  # dispose ended the agent (and the reaper with it)


def test_the_task_ends_with_its_caller(worktree: Path, tmp_path: Path) -> None:
    """A caller killed outright (no dispose) mid-run: the reaper (PDEATHSIG) ends the agent
    and the command's whole tree, a setsid'd part included."""
    from tests.integration.test_agent import appears, gone, marker

    tag = marker("ll-caller-dies")
    project = worktree.parent / "project"
    project.mkdir(exist_ok=True)
    script = tmp_path / "caller.py"
    script.write_text(
        "import os\n"
        "from pathlib import Path\n"
        "from fusion_oci.models import PrepareContext, SandboxPolicy\n"
        "from fusion_oci.policy.settings import SandboxSettings\n"
        "from fusion_oci.sandbox import SyncSandbox\n"
        "p = SandboxPolicy(allow_network=False)\n"
        "sb = SyncSandbox(SandboxSettings(backend='landlock', policy=p), env=dict(os.environ),\n"
        f"                cache_root=Path({str(worktree.parent / 'cache')!r}))\n"
        "sb.prepare(PrepareContext(task_id='ll-dies', run_id='r1', policy=p,\n"
        f"           worktree_path={str(worktree)!r}, project_dir={str(project)!r}))\n"
        f"sb.run(\"setsid sh -c 'sleep 1000; : {tag}' & sleep 1000; : {tag}\")\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen([sys.executable, str(script)], env=env) as caller:
        assert appears(tag, 10.0)
        caller.kill()
    assert gone(tag, 5.0)


def test_a_confinement_that_fails_fails_the_command(
    worktree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fusion_oci.runtimes.landlock.runtime as mod  # where launch_config is used

    real = mod.launch_config

    def broken(*args: Any) -> dict[str, Any]:
        return {**real(*args), "arch": "not-this-machine"}

    monkeypatch.setattr(mod, "launch_config", broken)
    with pytest.raises(SandboxSetupError, match="could not confine"):
        run(worktree, "echo must-not-run > ran.txt")
    assert not (worktree / "ran.txt").exists()


def test_plan_is_printable_and_says_what_is_granted(worktree: Path) -> None:
    from fusion_oci.oci.host import probe_host
    from fusion_oci.policy.layout import resolve_layout
    from fusion_oci.resolve import ResolvedTask

    ctx = PrepareContext(
        task_id="ll",
        run_id="r1",
        worktree_path=str(worktree),
        policy=SandboxPolicy(allow_network=False),
    )
    host = probe_host()
    layout = resolve_layout(ctx, cache_root=worktree.parent / "cache", ca_bundle=None)
    task = ResolvedTask(ctx=ctx, layout=layout, host=host, env={})
    runtime = LandlockRuntime(SandboxSettings(backend="landlock"), {}, host=host)
    runtime.adopt(task)
    process = task.process("true", RunOptions())
    plan = runtime.plan(process).to_json()
    # What runs: the command as a spawn frame, beside the task's launch (the shim with the
    # launch file, its confined child the agent; no placeholder for the shim).
    launch = plan["sandbox"]["argv"]
    assert launch == runtime.launch_command("<task scratch>/launch", "N")
    assert launch[launch.index("--") - 2 :][:2] == ["SANDBOX=<task scratch>/launch", "AGENT=N"]
    assert "argv=true" in plan["spawn"]["fields"] or "argv=/bin/sh" in plan["spawn"]["fields"]
    assert any(str(worktree) in n for n in plan["notes"])


# --- a host where user namespaces are forbidden -----------------------------------------------

FORBIDDEN_HOST = r"""
import json, os, sys
from pathlib import Path
# This namespace may create no user namespace below it: the host of the test.
Path("/proc/sys/user/max_user_namespaces").write_text("0")
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.registry import create_runtime
from fusion_oci.sandbox import SyncSandbox

base = Path(sys.argv[1])
env = {"PATH": os.environ["PATH"], "HOME": str(base / "home"), "LANG": "C.UTF-8"}
out = {}
for backend in ("bubblewrap", "landlock"):
    avail = create_runtime(backend, SandboxSettings(backend=backend), env).availability()
    out[backend] = {"available": avail.available, "reason": avail.reason,
                    "details": avail.details}
settings = SandboxSettings(backend="landlock", policy=SandboxPolicy(allow_network=False))
with SyncSandbox(settings, env=env, cache_root=base / "cache") as sb:
    (base / "project").mkdir(exist_ok=True)
    sb.prepare(PrepareContext(task_id="userns", run_id="r", worktree_path=str(base / "wt"),
                              policy=settings.policy, project_dir=str(base / "project")))
    result = sb.run(f"cat {base}/home/.ssh/id_ed25519; echo pwn > {base}/outside; "
                    "unshare --user true; echo inside > inside.txt",
                    RunOptions(timeout_ms=20000, env=env))
out["run"] = {"stdout": result.stdout, "stderr": result.stderr, "exit": result.exit_code}
import subprocess
doctor = subprocess.run([sys.executable, "-m", "fusion_oci.cli.main", "doctor"],
                        capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"})
out["doctor"] = doctor.stdout
print(json.dumps(out))
"""


def test_userns_forbidden_host_bubblewrap_unavailable_landlock_still_isolates(
    tmp_path: Path,
) -> None:
    unshare = shutil.which("unshare")
    require("landlock", unshare is not None, "unshare (util-linux) is missing")
    assert unshare is not None
    canary = "CANARY-userns-forbidden"
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    (tmp_path / "home" / ".ssh" / "id_ed25519").write_text(canary)
    git_init(tmp_path / "wt")
    done = subprocess.run(
        [
            unshare,
            "--user",
            "--map-root-user",
            "--",
            sys.executable,
            "-c",
            FORBIDDEN_HOST,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    bwrap = out["bubblewrap"]
    assert not bwrap["available"]
    assert "user.max_user_namespaces=0" in bwrap["reason"], bwrap
    landlock = out["landlock"]
    assert landlock["available"], landlock
    assert "landlock is the runtime that still isolates" in landlock["details"]["recommendation"]
    assert "landlock is the runtime that still isolates" in out["doctor"], out["doctor"]
    ran = out["run"]
    assert canary not in ran["stdout"] + ran["stderr"]
    assert not (tmp_path / "outside").exists()
    assert (tmp_path / "wt" / "inside.txt").read_text() == "inside\n"


def test_commands_killed_inside_a_supervised_call_leave_the_supervisor_serving(
    worktree: Path,
) -> None:
    """A process killed while its open waits for the supervisor (a timeout ending a tree
    that reads /proc in a loop) withdraws its notification, and the supervisor's next receive
    finds none (ENOENT). It must take the next call, not stop: a supervisor that stopped left
    every later command of the task hanging in its first open (a CI run's maxBuffer test)."""
    loop = "while :; do head -c1 /proc/self/stat >/dev/null; done"
    env = ENV
    with prepared(worktree, task_id="ll-enoent") as sb:
        for _ in range(12):
            busy = sb.run(f"{loop} & {loop} & {loop} & {loop}", RunOptions(env=env, timeout_ms=300))
            assert busy.reason == "timeout", busy
            after = sb.run("head -c4 /proc/self/stat", RunOptions(env=env, timeout_ms=10_000))
            assert after.reason == "exit" and after.exit_code == 0, after
