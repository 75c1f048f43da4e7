"""bubblewrap against the real bwrap, slirp4netns and cgroups of this machine (CI too)."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import pytest

from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import CacheMode, CpuLimit, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.bubblewrap import BubblewrapRuntime
from fusion_oci.runtimes.bubblewrap import runtime as bubblewrap
from fusion_oci.runtimes.linux.cgroups import CgroupSupport
from fusion_oci.sandbox import Sandbox
from tests.backends import require, require_runtime
from tests.conftest import git_init

pytestmark = pytest.mark.bubblewrap

PNPM_PROJECT = Path(__file__).resolve().parent.parent / "data" / "pnpm-project"


@pytest.fixture(autouse=True)
def _bwrap() -> None:
    require_runtime("bubblewrap")


def _env(home: Path) -> dict[str, str]:
    return {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}


@asynccontextmanager
async def sandbox(
    tmp_path: Path,
    worktree: Path,
    policy: SandboxPolicy,
    *,
    task: str = "t1",
    cache_mode: CacheMode = CacheMode.SHARED,
    project: Path | None = None,
) -> AsyncIterator[Sandbox]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    settings = SandboxSettings(backend="bubblewrap", policy=policy)
    async with Sandbox(settings, env=_env(home), cache_root=tmp_path / "cache") as sb:
        await sb.prepare(
            PrepareContext(
                task_id=task,
                run_id="r1",
                worktree_path=str(worktree),
                policy=policy,
                cache_mode=cache_mode,
                project_dir=str(project) if project else None,
            )
        )
        yield sb


def _leaves() -> set[str]:
    out = set()
    for root in (
        "/sys/fs/cgroup/memory",
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup/cpu",
        "/sys/fs/cgroup/unified",
    ):
        for dirpath, dirnames, _ in os.walk(root):
            out.update(os.path.join(dirpath, d) for d in dirnames if d.startswith("fusion-oci."))
    return out


def _slirps() -> set[int]:
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "comm").read_text().strip() == "slirp4netns":
                    pids.add(int(proc.name))
            except OSError:
                continue
    return pids


# ---------------------------------------------------------------------------- pnpm + caches


def _pnpm_available() -> None:
    require(
        "bubblewrap",
        shutil.which("pnpm") is not None,
        "pnpm is not installed on the host (scripts/install.sh installs it)",
    )


@pytest.mark.slow
async def test_pnpm_project_installs_tests_and_builds_with_egress(tmp_path: Path) -> None:
    """A real dependency from the npm registry through the TLS-intercepting proxy (host CA),
    then offline reuse of the shared store by a second task, and none for an isolated one."""
    _pnpm_available()
    project = tmp_path / "project"
    project.mkdir()
    first = tmp_path / "task-a"
    shutil.copytree(PNPM_PROJECT, first)
    git_init(first)
    egress = SandboxPolicy(network="egress")  # type: ignore[arg-type]
    long = RunOptions(timeout_ms=180_000)
    async with sandbox(tmp_path, first, egress, task="a", project=project) as sb:
        env = await sb.run("env", long)
        # The host's whole store, read by Node.js through OpenSSL (no NODE_EXTRA_CA_CERTS,
        # whose parse every Node.js start pays): the install below goes through the
        # TLS-intercepting proxy on it.
        assert "NODE_OPTIONS=--use-openssl-ca" in env.stdout
        assert "SSL_CERT_FILE=/etc/fusion-oci/host-ca.pem" in env.stdout
        assert "NODE_EXTRA_CA_CERTS" not in env.stdout
        install = await sb.run("pnpm install --frozen-lockfile", long)
        assert install.exit_code == 0, install.stderr + install.stdout
        test = await sb.run("pnpm test", long)
        assert test.exit_code == 0 and "fixture tests passed" in test.stdout, test.stderr
        build = await sb.run("pnpm build", long)
        assert build.exit_code == 0, build.stderr
    assert (first / "dist" / "result.json").read_text() == '{"sum":6}\n'
    assert (first / "node_modules" / "is-number" / "package.json").exists()

    # Shared cache: a second task of the same project installs with no network at all.
    second = tmp_path / "task-b"
    shutil.copytree(PNPM_PROJECT, second)
    git_init(second)
    offline = SandboxPolicy(allow_network=False)
    async with sandbox(tmp_path, second, offline, task="b", project=project) as sb:
        again = await sb.run("pnpm install --frozen-lockfile --offline && pnpm test", long)
        assert again.exit_code == 0, again.stderr + again.stdout

    # Isolated cache: nothing from task a is visible, so the same offline install fails.
    third = tmp_path / "task-c"
    shutil.copytree(PNPM_PROJECT, third)
    git_init(third)
    async with sandbox(
        tmp_path, third, offline, task="c", project=project, cache_mode=CacheMode.ISOLATED
    ) as sb:
        cold = await sb.run("pnpm install --frozen-lockfile --offline", long)
        assert cold.exit_code != 0


# ---------------------------------------------------------------------------- git


async def test_git_commit_in_a_linked_worktree(
    tmp_path: Path, linked_worktree: tuple[Path, Path]
) -> None:
    repo, wt = linked_worktree
    async with sandbox(tmp_path, wt, SandboxPolicy(allow_network=False)) as sb:
        result = await sb.run(
            "git status --short && echo change > new.txt && git add new.txt && "
            "git -c user.name=bot -c user.email=bot@example.invalid commit -qm 'from sandbox'"
            " && git log --oneline -1"
        )
        assert result.exit_code == 0, result.stderr
        # ...and the common dir's hooks and config stay read-only meanwhile
        hooks = await sb.run(f"touch {repo}/.git/hooks/pre-commit || echo refused")
        assert "refused" in hooks.stdout
    from tests.conftest import git

    assert "from sandbox" in git(wt, "log", "--oneline", "-1")
    assert git(repo, "log", "--oneline", "-1", "task").strip().endswith("from sandbox")


# ---------------------------------------------------------------------------- lifecycle


async def test_limits_live_in_a_leaf_cgroup_that_is_removed(tmp_path: Path, worktree: Path) -> None:
    before = _leaves()
    policy = SandboxPolicy(
        allow_network=False,
        memory_limit_mb=128,
        pids_limit=100,
        cpu_limit=CpuLimit(max_cores=0.5, max_ms=20_000),
    )
    async with sandbox(tmp_path, worktree, policy) as sb:
        result = await sb.run("cat /proc/self/cgroup; ulimit -t")
    assert result.exit_code == 0, result.stderr
    assert "fusion-oci." in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "20"
    assert not _leaves() - before


async def test_abort_and_max_buffer_leave_nothing_behind(tmp_path: Path, worktree: Path) -> None:
    slirps, leaves = _slirps(), _leaves()
    policy = SandboxPolicy(network="egress", pids_limit=50)  # type: ignore[arg-type]
    async with sandbox(tmp_path, worktree, policy) as sb:
        task = asyncio.ensure_future(sb.run("sleep 600"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        flood = await sb.run("yes", RunOptions(max_buffer=10_000))
        assert flood.truncated and flood.reason == "max-buffer"
    assert not _slirps() - slirps  # nothing new (other runs may end theirs)
    assert not _leaves() - leaves


async def test_network_none_has_no_route_and_egress_reaches_out(
    tmp_path: Path, worktree: Path
) -> None:
    async with sandbox(tmp_path, worktree, SandboxPolicy(allow_network=False)) as sb:
        none = await sb.run("cat /proc/net/route | wc -l")
    assert none.stdout.strip() == "1"  # the header only: no route anywhere
    egress = SandboxPolicy(network="egress")  # type: ignore[arg-type]
    async with sandbox(tmp_path, worktree, egress) as sb:
        out = await sb.run("cat /etc/resolv.conf; getent hosts registry.npmjs.org")
    assert "nameserver 10.0.2.3" in out.stdout and "registry.npmjs.org" in out.stdout


# ---------------------------------------------------------------------------- honesty


def test_availability_details_for_doctor() -> None:
    runtime = BubblewrapRuntime(SandboxSettings(backend="bubblewrap"), dict(os.environ))
    avail = runtime.availability()
    assert avail.available and avail.version
    for key in ("bwrap", "userns", "cgroups", "egress", "cpu-time", "enforces"):
        assert key in avail.details


async def test_lifecycle_refuses_limits_this_host_cannot_enforce(
    tmp_path: Path, worktree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = bubblewrap.probe_host_support(os.environ.get("PATH", os.defpath), os.geteuid())
    no_cgroups = dataclasses_replace(real, problem=None, cgroups=CgroupSupport("none"))
    monkeypatch.setattr(bubblewrap, "probe_host_support", lambda path, uid: no_cgroups)
    policy = SandboxPolicy(allow_network=False, memory_limit_mb=64)
    with pytest.raises(PolicyNotEnforceableError, match="memoryLimitMb"):
        async with sandbox(tmp_path, worktree, policy):
            pass


async def test_planned_argv_runs_unprivileged(tmp_path: Path) -> None:
    """The translation needs no privilege: the same sandbox argv, run as an unprivileged
    user, and a command run in it by its agent."""
    import pwd
    import socket
    import tempfile

    from fusion_oci.agent.client import Agent
    from fusion_oci.oci.host import probe_host
    from fusion_oci.policy.layout import TaskLayout
    from fusion_oci.resolve import ResolvedTask
    from fusion_oci.runtimes.bubblewrap import (
        LaunchFds,
        bwrap_argv,
        bwrap_spawn,
        seccomp_program,
    )

    user = os.environ.get("FUSION_OCI_ROOTLESS_USER", "fusionci")
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        pw = None
    require(
        "bubblewrap",
        os.geteuid() == 0 and pw is not None,
        f"needs root and the unprivileged user {user} (scripts/install.sh creates it)",
    )
    assert pw is not None
    wt = Path(tempfile.mkdtemp(prefix="fusion-oci-rootless-"))
    try:
        os.chown(wt, pw.pw_uid, pw.pw_gid)
        host = dataclasses_replace(probe_host(), uid=pw.pw_uid, gid=pw.pw_gid)
        policy = SandboxPolicy(allow_network=False)
        ctx = PrepareContext(task_id="u", run_id="r", worktree_path=str(wt), policy=policy)
        layout = TaskLayout(str(wt), None, (), None)
        task = ResolvedTask(ctx=ctx, layout=layout, host=host, env={})
        spec = task.spec
        runtime = BubblewrapRuntime(SandboxSettings(backend="bubblewrap"), dict(os.environ))
        program = seccomp_program(spec)
        assert program is not None
        r, w = os.pipe()
        os.write(w, program)
        os.close(w)
        ours, theirs = socket.socketpair()
        argv = bwrap_argv(
            spec, task.user, runtime.host_for(spec), LaunchFds(seccomp=r, agent=theirs.fileno())
        )
        proc = await asyncio.create_subprocess_exec(
            "runuser",
            "-u",
            user,
            "--",
            *argv,
            pass_fds=(r, theirs.fileno()),
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(r)
        theirs.close()
        agent = await Agent.over(ours, proc, 20.0)
        try:
            spawn = bwrap_spawn(
                task.process(
                    "id -u; echo ok > made-here; cat /proc/self/status"
                    " | grep -E '^(CapEff|Seccomp):'",
                    RunOptions(),
                )
            )
            done = await agent.run(spawn.argv, env=spawn.env, cwd=spawn.cwd, timeout_s=30)
        finally:
            await agent.close()
        assert proc.returncode is not None  # the sandbox ended with its agent
        assert done.returncode == 0, done.stderr
        lines = done.stdout.decode().split()
        assert lines[0] == str(pw.pw_uid)
        assert b"0000000000000000" in done.stdout and b"Seccomp:\t2" in done.stdout
        assert (wt / "made-here").stat().st_uid == pw.pw_uid
    finally:
        shutil.rmtree(wt, ignore_errors=True)


# ---------------------------------------------------------------------------- the launch


async def test_large_environments_reach_the_command_and_oversized_args_fail_as_in_a_shell(
    tmp_path: Path, worktree: Path
) -> None:
    """200 KB of environment (more than a pipe holds) reaches the command through the agent;
    one argument over the kernel's 128 KiB fails its exec as a shell says it (126), and the
    sandbox goes on."""
    policy = SandboxPolicy(allow_network=False, env_allowlist=["BIG_A", "BIG_B"])
    env = {"BIG_A": "a" * 100_000, "BIG_B": "b" * 100_000}
    async with sandbox(tmp_path, worktree, policy) as sb:
        out = await sb.run(
            'echo "${#BIG_A} ${#BIG_B}"; ulimit -n',
            RunOptions(env={**_env(tmp_path / "home"), **env}),
        )
        assert out.exit_code == 0, out.stderr
        assert out.stdout.split() == ["100000", "100000", "20000"]
        big = await sb.run(["/bin/echo", "x" * 200_000])
        assert big.exit_code == 126 and "Argument list too long" in big.stderr
        assert (await sb.run("true")).exit_code == 0


async def test_seccomp_is_compiled_once_per_sandbox_and_high_bits_do_not_dodge_it(
    tmp_path: Path, worktree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libseccomp compiles the bundle's profile at prepare, not per command; in the kernel,
    socket() with AF_PACKET in the low 32 bits of the family and junk above is refused."""
    from fusion_oci.runtimes.bubblewrap import argv as bubblewrap_argv

    compiled: list[int] = []
    real = bubblewrap_argv.compile_bpf

    def counting(profile: dict[str, object], arch: str) -> bytes:
        compiled.append(1)
        return real(profile, arch)

    monkeypatch.setattr(bubblewrap_argv, "compile_bpf", counting)
    probe = (
        "import ctypes, errno\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "fd = libc.syscall(41, ctypes.c_ulong(0x100000011), 3, 0)\n"
        "print(fd, errno.errorcode.get(ctypes.get_errno()))\n"
    )
    policy = SandboxPolicy(allow_network=False)
    async with sandbox(tmp_path, worktree, policy) as sb:
        for _ in range(3):
            assert (await sb.run("true")).exit_code == 0
        out = await sb.run(["python3", "-c", probe])
    assert len(compiled) == 1
    assert out.exit_code == 0, out.stderr
    assert out.stdout.split() == ["-1", "EPERM"]


async def test_an_rlimit_the_kernel_refuses_is_a_setup_error_and_the_sandbox_goes_on(
    tmp_path: Path, worktree: Path
) -> None:
    """The agent sets each command's rlimits before its exec; when the kernel refuses one, the
    command never ran, the error names the limit, and the next command runs."""
    from fusion_oci.errors import SandboxSetupError
    from fusion_oci.oci.model import Rlimit

    policy = SandboxPolicy(allow_network=False)
    async with sandbox(tmp_path, worktree, policy) as sb:
        assert (await sb.run("true")).exit_code == 0
        runtime = sb.runtime
        assert isinstance(runtime, BubblewrapRuntime) and sb.task is not None
        process = sb.task.process("true", RunOptions())
        # above fs.nr_open: refused even to root
        process = process.model_copy(
            update={"rlimits": [Rlimit(type="RLIMIT_NOFILE", soft=2**31, hard=2**31)]}
        )
        with pytest.raises(SandboxSetupError, match="RLIMIT_NOFILE"):
            await runtime.execute(runtime.plan(process), RunOptions())
        assert (await sb.run("true")).exit_code == 0


async def test_one_sandbox_per_task_and_nothing_left_after_dispose(
    tmp_path: Path, worktree: Path
) -> None:
    """Commands share the task's sandbox (its /tmp lasts, as a container's does); after
    dispose no process, cgroup or slirp4netns of it is left."""
    slirps, leaves = _slirps(), _leaves()
    policy = SandboxPolicy(network="egress", pids_limit=64)  # type: ignore[arg-type]
    async with sandbox(tmp_path, worktree, policy) as sb:
        runtime = sb.runtime
        assert isinstance(runtime, BubblewrapRuntime) and runtime.box is not None
        bwrap_pid = runtime.box.agent.peer_pid
        assert (await sb.run("echo kept > /tmp/x; (sleep 600 &) ; true")).exit_code == 0
        again = await sb.run("cat /tmp/x; ps -e -o comm= | grep -c sleep || true")
        assert again.stdout.split() == ["kept", "0"]  # the daemon went with its command
    assert bwrap_pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(bwrap_pid, 0)
    assert not _slirps() - slirps  # nothing new (other runs may end theirs)
    assert not _leaves() - leaves


async def test_killing_the_agent_fails_the_sandbox_loudly(tmp_path: Path, worktree: Path) -> None:
    """The agent killed from outside: the run in flight and every later one raise
    AgentLostError (kind agent-lost), never a hang; dispose still cleans up."""
    import signal as _signal

    from fusion_oci.errors import AgentLostError

    leaves = _leaves()
    async with sandbox(tmp_path, worktree, SandboxPolicy(allow_network=False, pids_limit=64)) as sb:
        runtime = sb.runtime
        assert isinstance(runtime, BubblewrapRuntime) and runtime.box is not None
        bwrap_pid = runtime.box.agent.peer_pid
        assert bwrap_pid is not None
        running = asyncio.ensure_future(sb.run("sleep 600"))
        await asyncio.sleep(0.5)
        os.killpg(bwrap_pid, _signal.SIGKILL)
        with pytest.raises(AgentLostError) as lost:
            await asyncio.wait_for(running, 20)
        assert lost.value.kind == "agent-lost"
        with pytest.raises(AgentLostError):
            await sb.run("true")
    assert not _leaves() - leaves


async def test_agent_cannot_be_replaced_traced_or_ended_from_inside(
    tmp_path: Path, worktree: Path
) -> None:
    """The agent is the sandbox's PID 1 on a socketpair (no path to reach, here or in another
    task's sandbox); its binary is a read-only bind; it cannot be traced or read through
    /proc; signals from inside do not end it; the command holds no fd of its connection.
    Later commands still run through the same agent, and the other task's is intact."""
    other_wt = git_init(tmp_path / "other")
    none = SandboxPolicy(allow_network=False)
    async with (
        sandbox(tmp_path, worktree, none) as sb,
        sandbox(tmp_path, other_wt, none, task="t2") as other,
    ):
        runtime = sb.runtime
        assert isinstance(runtime, BubblewrapRuntime) and runtime.box is not None
        before = runtime.box.agent.peer_pid
        fds = await sb.run("ls /proc/self/fd")
        assert fds.stdout.split() == ["0", "1", "2", "3"], "only stdio (and ls's own dir)"
        tamper = {
            "replace binary": "cp /bin/sh /dev/fusion-oci-agent",
            "chmod binary": "chmod 777 /dev/fusion-oci-agent",
            "trace the agent": "cat /proc/1/environ",
            "agent memory": "head -c 1 /proc/1/mem",
            "agent fds": "readlink /proc/1/fd/3 || readlink /proc/1/exe",
            "kill the agent": "kill -9 1; kill -TERM 1; kill -HUP 1; sleep 1; kill -0 1 || exit 0;"
            " exit 1",
        }
        for name, cmd in tamper.items():
            r = await sb.run(cmd, RunOptions(timeout_ms=20_000))
            assert r.exit_code not in (0, None), (name, r)
        again = await sb.run("echo still here")
        assert again.stdout == "still here\n", again
        assert runtime.box.agent.peer_pid == before and not runtime.box.agent.lost
        assert (await other.run("echo b")).stdout == "b\n", "the other task's agent is intact"


async def test_a_sandbox_bwrap_cannot_build_is_a_setup_error_with_its_words(
    tmp_path: Path, worktree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bwrap refusing the sandbox at prepare (as a host without mount rights has it say) is
    a typed setup error carrying bwrap's own message, and nothing of it is left."""
    from fusion_oci.errors import SandboxSetupError

    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: Can'\\''t mount proc on /newroot/proc: "
        "Operation not permitted' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    real = bubblewrap.probe_host_support(os.environ.get("PATH", os.defpath), os.geteuid())
    monkeypatch.setattr(
        bubblewrap,
        "probe_host_support",
        lambda path, uid: dataclasses_replace(real, bwrap=str(fake)),
    )
    leaves = _leaves()
    with pytest.raises(SandboxSetupError) as err:
        async with sandbox(tmp_path, worktree, SandboxPolicy(allow_network=False, pids_limit=64)):
            pass
    assert err.value.what == "bwrap could not build the sandbox"
    assert "Can't mount proc" in (err.value.why or ""), err.value
    assert not _leaves() - leaves
