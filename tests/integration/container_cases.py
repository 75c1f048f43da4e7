"""The container-runtime integration cases, written once and run per engine. What every
runtime must do (statuses, stdin, cwd, env, output, maxBuffer, timeouts, limits) is
tests/contract; these are what containers add (warm keeper, volumes, ownership, gc, networks).

test_docker.py and test_podman.py import these tests and define the ``engine`` fixture
(``docker``, ``podman``); the rootless podman cases run the library as the unprivileged CI user
through :mod:`tests.integration.rootless_driver`. Everything runs against the real engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.errors import FusionOCIError
from fusion_oci.gc import gc
from fusion_oci.models import (
    CacheMode,
    NetworkMode,
    PrepareContext,
    RunOptions,
    SandboxPolicy,
)
from fusion_oci.oci.host import probe_host
from fusion_oci.policy.settings import GateSettings, SandboxSettings
from fusion_oci.runtimes.registry import create_runtime
from fusion_oci.sandbox import Sandbox
from tests.backends import require
from tests.conftest import git, git_init
from tests.hostside import tcp_server
from tests.integration.images_fixture import ensure_node_image

__all__ = [
    "drop_test_cache_volumes",
    "host_loopback_server",
    "settings",
    "test_agent_cannot_be_reached_replaced_or_traced",
    "test_files_belong_to_a_non_root_caller",
    "test_kill_9_mid_run_leaves_only_what_gc_removes",
    "test_killing_the_agent_fails_the_run_loudly_then_disposes_clean",
    "test_no_host_process_is_left_per_command",
    "test_oneshot_mode_creates_and_removes_per_command",
    "test_parallel_prepares_do_not_hang_or_leak",
    "test_pnpm_project_installs_tests_builds_and_commits",
    "test_timeout_ends_everything_the_command_started",
]

ROOT = Path(__file__).resolve().parents[2]
PNPM_PROJECT = ROOT / "tests" / "data" / "pnpm-project"
LONG = RunOptions(timeout_ms=240_000)
TASK_LABEL = "io.fusion-oci.task-id"


def engine_settings(engine: str, **extra: Any) -> SandboxSettings:
    """Settings that reach the engine the CI services run (env of scripts/services.sh)."""
    urls: dict[str, Any] = {}
    if engine == "docker":
        urls["docker_url"] = os.environ.get("DOCKER_HOST")
    elif engine == "podman":
        urls["podman_url"] = os.environ.get("FUSION_OCI_PODMAN_URL")
    return SandboxSettings(
        backend=engine,
        gates=GateSettings(sandbox_provision="allow", network_api="allow"),
        **urls,
        **extra,
    )


def require_engine(engine: str) -> SandboxSettings:
    settings = engine_settings(engine)
    runtime = create_runtime(engine, settings, os.environ)
    avail = runtime.availability()
    require(engine, avail.available, f"{avail.reason} {avail.hint}".strip())
    return settings


def image(engine: str) -> str:
    return ensure_node_image(engine).ref


def ctx(task: str, worktree: Path, engine: str, **kw: Any) -> PrepareContext:
    return PrepareContext(
        task_id=task, run_id="r1", worktree_path=str(worktree), image=image(engine), **kw
    )


def leftovers(engine: str, task: str) -> list[str]:
    """Containers and volumes of a task that the engine still holds."""
    runtime: Any = create_runtime(engine, engine_settings(engine), os.environ)
    try:
        adapter = runtime._connect()
        return [f.name for f in adapter.list_labelled(TASK_LABEL, task)]
    finally:
        runtime.close()


@pytest.fixture
def settings(engine: str) -> SandboxSettings:
    return require_engine(engine)


@pytest.fixture(scope="module", autouse=True)
def drop_test_cache_volumes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Project cache volumes persist by design; the ones bound under this session's temporary
    directory are the tests' own, so they go at the end (the CI machine is shared)."""
    yield
    base = str(tmp_path_factory.getbasetemp())
    for engine in ("docker", "podman"):
        try:
            runtime: Any = create_runtime(engine, engine_settings(engine), os.environ)
            adapter = runtime._connect()
        except FusionOCIError:  # an engine that is not here has nothing to drop
            continue
        try:
            for item in adapter.list_labelled("io.fusion-oci.cache-dir"):
                if item.labels.get("io.fusion-oci.cache-dir", "").startswith(base):
                    adapter.remove_volume(item.name)
        finally:
            runtime.close()


# ---------------------------------------------------------------------------- the pnpm project


async def test_pnpm_project_installs_tests_builds_and_commits(
    engine: str, settings: SandboxSettings, linked_worktree: tuple[Path, Path], tmp_path: Path
) -> None:
    repo, wt = linked_worktree
    for item in PNPM_PROJECT.iterdir():
        shutil.copy(item, wt / item.name)
    policy = SandboxPolicy(network=NetworkMode.EGRESS, memory_limit_mb=1024, pids_limit=512)
    async with Sandbox(settings, cache_root=tmp_path / "cache") as sb:
        await sb.prepare(ctx("pnpm", wt, engine, policy=policy, project_dir=str(repo)))
        install = await sb.run("pnpm install --frozen-lockfile", LONG)
        assert install.exit_code == 0, install.stderr + install.stdout
        test = await sb.run("pnpm test", LONG)
        assert test.exit_code == 0, test.stderr + test.stdout
        build = await sb.run("pnpm build", LONG)
        assert build.exit_code == 0, build.stderr + build.stdout
        commit = await sb.run(
            "git add -A && git -c user.name=t -c user.email=t@example.invalid "
            "commit -qm 'from the sandbox' && git log --oneline -1",
            LONG,
        )
        assert commit.exit_code == 0, commit.stderr
        hooks = await sb.run(f"echo evil > {repo}/.git/hooks/post-commit", LONG)
        assert hooks.exit_code != 0, "the common dir's hooks must be read-only"
    assert "from the sandbox" in git(repo, "log", "--oneline", "-1", "task")
    me = os.getuid()
    created = [p for p in wt.rglob("*") if ".pnpm" not in p.parts][:200]
    assert created and all(p.lstat().st_uid == me for p in created)
    # The pnpm store is a named volume bound to the project's cache directory.
    stores = list((tmp_path / "cache").rglob("pnpm-store"))
    assert stores and any(any(s.iterdir()) for s in stores)
    assert not (repo / ".git" / "hooks" / "post-commit").exists()


# ---------------------------------------------------------------------------- ownership


async def test_files_belong_to_a_non_root_caller(
    engine: str, settings: SandboxSettings, tmp_path: Path
) -> None:
    """A caller in the docker group (or with rootful podman access) is not root: files the
    command creates in the worktree must still be that caller's."""
    uid = gid = 1001
    wt = git_init(tmp_path / "wt")
    os.chown(wt, uid, gid)
    cache = tmp_path / "cache"
    host = replace(probe_host(), uid=uid, gid=gid)
    async with Sandbox(settings, cache_root=cache, host=host) as sb:
        await sb.prepare(
            ctx(
                "owner",
                wt,
                engine,
                cache_mode=CacheMode.OFF,
                policy=SandboxPolicy(allow_network=False),
            )
        )
        result = await sb.run("id -u; mkdir -p d && echo x > d/f && touch $HOME/h")
        assert result.exit_code == 0, result.stderr
        assert result.stdout.split()[0] == str(uid)
    for path in (wt / "d", wt / "d" / "f"):
        assert (path.stat().st_uid, path.stat().st_gid) == (uid, gid)


# ---------------------------------------------------------------------------- timeouts


async def test_timeout_ends_everything_the_command_started(
    engine: str, settings: SandboxSettings, worktree: Path, tmp_path: Path
) -> None:
    async with Sandbox(settings, cache_root=tmp_path / "cache") as sb:
        await sb.prepare(
            ctx(
                "timeout",
                worktree,
                engine,
                cache_mode=CacheMode.OFF,
                policy=SandboxPolicy(allow_network=False),
            )
        )
        start = time.monotonic()
        result = await sb.run(
            "setsid sh -c 'trap \"\" TERM; sleep 300' & (sleep 301 &) ; "
            "nohup sleep 302 >/dev/null 2>&1 & echo started; sleep 303",
            RunOptions(timeout_ms=1500),
        )
        assert result.timed_out and result.reason == "timeout"
        assert result.shell_status == 124
        assert "started" in result.stdout
        assert time.monotonic() - start < 15
        after = await sb.run("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done")
        assert "sleep 30" not in after.stdout, after.stdout
        assert "/.fusion-oci/agent" in after.stdout, "the agent survives: the container stays warm"
        # Leftovers of a command that ends normally are ended too (as native's reaper does).
        await sb.run("(sleep 310 &) ; echo ok")
        again = await sb.run("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done")
        assert "sleep 310" not in again.stdout
    assert leftovers(engine, "timeout") == []


# ---------------------------------------------------------------------------- modes, leftovers


async def test_oneshot_mode_creates_and_removes_per_command(
    engine: str, worktree: Path, tmp_path: Path
) -> None:
    require_engine(engine)
    settings = engine_settings(engine, container_mode="oneshot")
    async with Sandbox(settings, cache_root=tmp_path / "cache") as sb:
        await sb.prepare(
            ctx(
                "oneshot",
                worktree,
                engine,
                cache_mode=CacheMode.OFF,
                policy=SandboxPolicy(allow_network=False),
            )
        )
        assert leftovers(engine, "oneshot") == []
        first = await sb.run("echo one > f; hostname")
        second = await sb.run("cat f")
        assert first.exit_code == 0 and second.stdout.strip() == "one"
        assert leftovers(engine, "oneshot") == []
        timed = await sb.run("sleep 300", RunOptions(timeout_ms=1000))
        assert timed.timed_out
        assert leftovers(engine, "oneshot") == []


async def test_parallel_prepares_do_not_hang_or_leak(
    engine: str, settings: SandboxSettings, tmp_path: Path
) -> None:
    n = 6
    worktrees = []
    for i in range(n):
        wt = git_init(tmp_path / f"wt{i}")
        worktrees.append(wt)

    async def one(i: int) -> str:
        async with Sandbox(settings, cache_root=tmp_path / "cache") as sb:
            await sb.prepare(
                ctx(
                    f"par{i}",
                    worktrees[i],
                    engine,
                    project_dir=str(tmp_path),
                    policy=SandboxPolicy(allow_network=False),
                )
            )
            result = await sb.run("echo $((6 * 7))")
            return result.stdout.strip()

    start = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 180)
    assert results == ["42"] * n
    assert time.monotonic() - start < 120
    for i in range(n):
        assert leftovers(engine, f"par{i}") == []


CRASHER = textwrap.dedent("""
    import asyncio, os, sys
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.integration.container_cases import engine_settings
    from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy, CacheMode
    from fusion_oci.sandbox import Sandbox

    async def main():
        sb = Sandbox(engine_settings({engine!r}), cache_root=Path({cache!r}))
        await sb.prepare(PrepareContext(task_id={task!r}, run_id="r1", worktree_path={wt!r},
                         image={image!r}, cache_mode=CacheMode.ISOLATED,
                         policy=SandboxPolicy(allow_network=False)))
        print("ready", flush=True)
        await sb.run("sleep 600", RunOptions(timeout_ms=600000))

    asyncio.run(main())
""")


async def test_kill_9_mid_run_leaves_only_what_gc_removes(
    engine: str, settings: SandboxSettings, worktree: Path, tmp_path: Path
) -> None:
    task = f"crash{os.getpid()}"
    script = CRASHER.format(
        root=str(ROOT),
        engine=engine,
        cache=str(tmp_path / "cache"),
        task=task,
        wt=str(worktree),
        image=image(engine),
    )
    proc = subprocess.Popen(  # noqa: ASYNC220  (returns at once; we read it in a thread)
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)
        if line.strip() != b"ready":
            os.kill(proc.pid, signal.SIGKILL)
            pytest.fail(proc.stderr.read().decode() if proc.stderr else "no output")
        await asyncio.sleep(1.0)  # the run's exec is in flight
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    left = leftovers(engine, task)
    assert any(name.startswith(f"fusion-oci-{task}-") for name in left), left
    assert any(name.startswith("fusion-oci-pnpm-store-") for name in left), "task volume"
    # A live owner's containers are never collected: this test process holds one open.
    async with Sandbox(settings, cache_root=tmp_path / "cache") as live:
        await live.prepare(
            ctx(
                f"{task}-live",
                worktree,
                engine,
                cache_mode=CacheMode.OFF,
                policy=SandboxPolicy(allow_network=False),
            )
        )
        report = gc(settings=settings, engines=[engine])
        assert not report.errors, report.errors
        assert any(task in r for r in report.removed), report
        assert leftovers(engine, task) == []
        assert leftovers(engine, f"{task}-live") != []
    assert leftovers(engine, f"{task}-live") == []


# ---------------------------------------------------------------------------- the exec agent

UNIX_CONNECT_JS = (
    "const s=require('net').connect(process.argv[1]);"
    "s.on('connect',()=>{console.log('open');process.exit(0)});"
    "s.on('error',e=>{console.log('closed '+e.code);process.exit(0)})"
)


def agent_of(sb: Sandbox) -> Any:
    """The runtime's exec agent of the warm container (white box: its host-side pid)."""
    runtime: Any = sb.runtime
    return runtime._agents[runtime._container]


async def test_agent_cannot_be_reached_replaced_or_traced(
    engine: str, settings: SandboxSettings, worktree: Path, tmp_path: Path
) -> None:
    """The agent's socket is gone once it has connected (nothing to reach, here or in another
    task's container), its binary and folder are read-only, it cannot be traced or read
    through /proc, and the command holds no fd of its connection: later commands still run
    through the same agent."""
    other_wt = git_init(tmp_path / "other")
    none = SandboxPolicy(allow_network=False)
    async with (
        Sandbox(settings, cache_root=tmp_path / "cache") as sb,
        Sandbox(settings, cache_root=tmp_path / "cache") as other,
    ):
        await sb.prepare(ctx("agent-a", worktree, engine, cache_mode=CacheMode.OFF, policy=none))
        await other.prepare(ctx("agent-b", other_wt, engine, cache_mode=CacheMode.OFF, policy=none))
        before = agent_of(sb).peer_pid
        other_dir = str(other.runtime._scratch)  # type: ignore[union-attr]
        targets = ["/.fusion-oci/run/agent.sock", f"{other_dir}/agent.sock"]
        for target in targets:
            r = await sb.run(["node", "-e", UNIX_CONNECT_JS, target])
            assert r.stdout.startswith("closed"), (target, r)
        listing = await sb.run("ls -A /.fusion-oci/run; ls /proc/self/fd")
        assert listing.exit_code == 0, listing.stderr
        assert listing.stdout.split() == ["0", "1", "2", "3"], "only stdio (and ls's own dir)"
        tamper = {
            "replace binary": "cp /bin/sh /.fusion-oci/agent",
            "chmod binary": "chmod 777 /.fusion-oci/agent",
            "new socket": "node -e \"require('net').createServer().listen("
            "'/.fusion-oci/run/agent.sock').on('error',e=>{console.log(e.code);"
            'process.exit(1)})"',
            "file in folder": "touch /.fusion-oci/run/x",
            "trace the agent": "cat /proc/1/environ",
            "agent memory": "head -c 1 /proc/1/mem",
            "agent fds": "readlink /proc/1/fd/0 || readlink /proc/1/exe",
        }
        for name, cmd in tamper.items():
            r = await sb.run(cmd, RunOptions(timeout_ms=20_000))
            assert r.exit_code not in (0, None), (name, r)
        # Killing the agent (pid 1 of the container) from inside: refused (another user) or
        # dropped (the kernel does not deliver SIGKILL to a namespace's init from inside). The
        # command itself runs to its end either way, and the agent serves the next one.
        r = await sb.run("kill -9 1; echo killed=$?; sleep 1", RunOptions(timeout_ms=20_000))
        assert r.exit_code == 0 and r.stdout.startswith("killed="), r
        os.kill(before, 0)  # the agent's host-side process is still there (else ProcessLookupError)
        after = await sb.run("echo alive")
        assert after.stdout == "alive\n" and agent_of(sb).peer_pid == before, after
        again = await sb.run("echo still here")
        assert again.stdout == "still here\n" and agent_of(sb).peer_pid == before
        assert (await other.run("echo b")).stdout == "b\n", "the other task's agent is intact"


async def test_killing_the_agent_fails_the_run_loudly_then_disposes_clean(
    engine: str, settings: SandboxSettings, worktree: Path, tmp_path: Path
) -> None:
    """The agent killed from the host (its pid, then the engine's kill of the container) mid
    run: that run and every later one raise AgentLostError within seconds, never hang; dispose
    leaves nothing."""
    from fusion_oci.errors import AgentLostError

    none = SandboxPolicy(allow_network=False)
    for how in ("pid", "engine"):
        task = f"agent-kill-{how}"
        sb = Sandbox(settings, cache_root=tmp_path / "cache")
        try:
            await sb.prepare(ctx(task, worktree, engine, cache_mode=CacheMode.OFF, policy=none))
            runtime: Any = sb.runtime
            running = asyncio.ensure_future(sb.run("sleep 600", RunOptions(timeout_ms=600_000)))
            await asyncio.sleep(1.0)
            if how == "pid":
                os.kill(agent_of(sb).peer_pid, signal.SIGKILL)
            else:
                container = runtime._adapter.client.containers.get(runtime._container)
                await asyncio.to_thread(container.kill)
            start = time.monotonic()
            with pytest.raises(AgentLostError) as lost:
                await asyncio.wait_for(running, 30)
            assert time.monotonic() - start < 20
            assert lost.value.kind == "agent-lost" and lost.value.to_json()["error"]["hint"]
            with pytest.raises(AgentLostError):
                await asyncio.wait_for(sb.run("true"), 10)
        finally:
            await asyncio.wait_for(sb.dispose(), 60)
        assert leftovers(engine, task) == []


def _monitor_processes(cid: str) -> list[str]:
    """Host processes that name the container in their argv (conmon, shims, exec sessions)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cid in cmd:
            out.append(f"{entry.name} {cmd[:120]}")
    return sorted(out)


async def test_no_host_process_is_left_per_command(
    engine: str, settings: SandboxSettings, worktree: Path, tmp_path: Path
) -> None:
    """20 commands start no engine exec: the host processes of the container (podman's
    conmon, docker's shim) are the same before and after, none lingering per command."""
    async with Sandbox(settings, cache_root=tmp_path / "cache") as sb:
        await sb.prepare(
            ctx(
                "no-conmon",
                worktree,
                engine,
                cache_mode=CacheMode.OFF,
                policy=SandboxPolicy(allow_network=False),
            )
        )
        cid = sb.runtime._container  # type: ignore[union-attr]
        before = _monitor_processes(cid)
        assert before, "the container's own monitor is found by its id"
        for i in range(20):
            r = await sb.run(f"echo {i}")
            assert r.stdout == f"{i}\n"
        assert _monitor_processes(cid) == before


# ---------------------------------------------------------------------------- network


@pytest.fixture
def host_loopback_server() -> Iterator[tuple[int, list[str]]]:
    """A TCP server on the host's 127.0.0.1 that records every connection it accepts."""
    with tcp_server("127.0.0.1") as served:
        yield served


PROBE_JS = (
    "const net=require('net');const [h,p]=process.argv.slice(1);"
    "const s=net.connect({{host:h,port:+p,timeout:2000}},()=>{{console.log('open');s.end()}});"
    "s.on('error',e=>console.log('closed '+e.code));"
    "s.on('timeout',()=>{{console.log('closed timeout');s.destroy()}});"
)


def connect_cmd(host: str, port: int) -> str:
    return f'node -e "{PROBE_JS.format()}" {host} {port}'


async def network_matrix(
    engine: str,
    settings: SandboxSettings,
    worktree: Path,
    tmp_path: Path,
    port: int,
    canary: tuple[str, int] | None,
) -> dict[str, dict[str, str]]:
    """What each network mode reaches: host loopback (direct and through the gateway) and
    a canary service on a container network."""
    out: dict[str, dict[str, str]] = {}
    for mode in (NetworkMode.NONE, NetworkMode.EGRESS):
        async with Sandbox(settings, cache_root=tmp_path / "cache") as sb:
            await sb.prepare(
                ctx(
                    f"net-{mode.value}",
                    worktree,
                    engine,
                    cache_mode=CacheMode.OFF,
                    policy=SandboxPolicy(network=mode),
                )
            )
            gw = await sb.run(
                "ip route 2>/dev/null | awk '/default/ {print $3}' || true; "
                "awk '$2==\"00000000\" {print $3}' /proc/net/route"
            )
            gateway = next((w for w in gw.stdout.split() if "." in w), "")
            if not gateway:
                hexgw = next((w for w in gw.stdout.split() if len(w) == 8), "")
                gateway = (
                    ".".join(str(int(hexgw[i : i + 2], 16)) for i in (6, 4, 2, 0)) if hexgw else ""
                )
            targets = {
                "127.0.0.1": "127.0.0.1",
                "gateway": gateway or "192.0.2.1",
                "slirp-host": "10.0.2.2",
            }
            if canary is not None:
                targets["canary"] = canary[0]
            row: dict[str, str] = {}
            for name, host in targets.items():
                p = canary[1] if name == "canary" and canary else port
                r = await sb.run(connect_cmd(host, p), RunOptions(timeout_ms=15_000))
                row[name] = r.stdout.strip() or r.stderr.strip()[:80]
            out[mode.value] = row
    return out


def assert_network(matrix: dict[str, dict[str, str]], seen: list[str], with_canary: bool) -> None:
    for name, outcome in matrix["none"].items():
        assert not outcome.startswith("open"), ("none", name, matrix)
    for name in ("127.0.0.1", "gateway", "slirp-host"):
        assert not matrix["egress"][name].startswith("open"), ("egress", name, matrix)
    if with_canary:
        assert matrix["egress"]["canary"].startswith("open"), matrix
    assert seen == [], f"the host loopback server saw connections: {seen}"


def dump(data: Any) -> str:
    return json.dumps(data, indent=1)


ROOTLESS_USER = os.environ.get("FUSION_OCI_ROOTLESS_USER", "fusionci")
_staged: list[Path] = []


def _user_can(flag: str, path: Path) -> bool:
    try:
        return (
            subprocess.run(
                ["runuser", "-u", ROOTLESS_USER, "--", "test", flag, str(path)],
                capture_output=True,
                timeout=30,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def checked_rootless_user(
    backend: str, socket: str | None, why: str
) -> tuple[pwd.struct_passwd, str]:
    """The CI user that drives ``backend`` and its runtime dir, checked (a missing setup fails
    where CI requires it): the user exists, we are root (``why``: we switch to it with
    runuser) and, unless ``socket`` is None, its engine's ``socket`` is under that dir."""
    try:
        user = pwd.getpwnam(ROOTLESS_USER)
    except KeyError:
        require(backend, False, f"user {ROOTLESS_USER} does not exist")
        raise
    require(backend, os.getuid() == 0, why)
    xdg = f"/run/user/{user.pw_uid}"
    if socket is not None:
        require(
            backend,
            Path(xdg, socket).exists(),
            f"no {backend} socket in {xdg} (scripts/services.sh start {backend})",
        )
    return user, xdg


def rootless_python() -> list[str]:
    """``env PYTHONPATH=... PYTHON`` that the unprivileged user can run with this checkout.

    The venv's interpreter may live where the user cannot go (a pyenv python under /root),
    and so may the checkout itself (CI clones anywhere): then the system python3 of the same
    minor version runs a world-readable copy of the package and the venv's site-packages,
    made once per test session.
    """
    # The checkout's venv, or (a git worktree has none) the venv running the tests.
    venv = ROOT / ".venv" if (ROOT / ".venv").is_dir() else Path(sys.prefix)
    site = next((venv / "lib").glob("python3*/site-packages"))
    venv_python = (venv / "bin" / "python").resolve()
    python = str(venv_python) if _user_can("-x", venv_python) else "/usr/bin/python3"
    if _user_can("-r", ROOT / "fusion_oci" / "__init__.py") and _user_can(
        "-r", site / "pydantic" / "__init__.py"
    ):
        return ["env", f"PYTHONPATH={ROOT}:{site}", python]
    if not _staged:
        import atexit
        import tempfile

        stage = Path(tempfile.mkdtemp(prefix="fusion-oci-rootless-py-"))
        shutil.copytree(ROOT / "fusion_oci", stage / "src" / "fusion_oci")
        (stage / "src" / "tests" / "integration").mkdir(parents=True)
        for rel in (
            "tests/__init__.py",
            "tests/integration/__init__.py",
            "tests/integration/rootless_driver.py",
        ):
            shutil.copy(ROOT / rel, stage / "src" / rel)
        shutil.copytree(PNPM_PROJECT, stage / "pnpm-project")
        shutil.copytree(site, stage / "site-packages", symlinks=True)
        subprocess.run(["chmod", "-R", "a+rX", str(stage)], check=True)
        atexit.register(shutil.rmtree, stage, True)
        _staged.append(stage)
    stage = _staged[0]
    return ["env", f"PYTHONPATH={stage / 'src'}:{stage / 'site-packages'}", python]


def rootless_project() -> Path:
    """The pnpm project where the unprivileged user can read it."""
    rootless_python()
    return _staged[0] / "pnpm-project" if _staged else PNPM_PROJECT


@contextlib.contextmanager
def rootless_user(
    backend: str, sock: str, settings: Callable[[str], SandboxSettings] | None = None
) -> Iterator[dict[str, Any]]:
    """The unprivileged CI user for ``backend``'s rootless cases: its runtime dir (where its
    engine's socket ``sock`` must answer), a scratch base it can use, an interpreter it can
    run, and (for an engine other than podman) the settings its driver gets, made from the
    runtime dir. Collects the user's garbage at the end."""
    import tempfile

    user, xdg = checked_rootless_user(backend, sock, "these tests switch user with runuser")
    base = Path(tempfile.mkdtemp(prefix=f"fusion-oci-{backend}-"))
    base.chmod(0o755)
    rl: dict[str, Any] = {"user": user, "xdg": xdg, "base": base, "python": rootless_python()}
    if settings is not None:
        rl["settings"] = settings(xdg).model_dump(mode="json", by_alias=True)
    try:
        yield rl
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
    report = drive_rootless(rl, "gc")
    assert report["errors"] == [], report


def drive_rootless(
    rl: dict[str, Any], scenario: str, timeout: float = 300, **args: Any
) -> dict[str, Any]:
    """One ``rootless_driver`` scenario as the unprivileged user of ``rl`` (its ``user``,
    ``xdg`` and ``python``; with ``settings``, those of the engine it drives, else podman's):
    the scenario's last JSON line."""
    user = rl["user"]
    env = [
        "env",
        "-i",
        f"HOME={user.pw_dir}",
        f"USER={user.pw_name}",
        f"XDG_RUNTIME_DIR={rl['xdg']}",
        "PATH=/usr/local/bin:/usr/bin:/bin",
        "LANG=C.UTF-8",
        *rl["python"][1:-1],
    ]  # env PYTHONPATH=... PYTHON
    ask = {"settings": rl["settings"], **args} if "settings" in rl else args
    out = subprocess.run(
        [
            "runuser",
            "-u",
            user.pw_name,
            "--",
            *env,
            rl["python"][-1],
            "-m",
            "tests.integration.rootless_driver",
            scenario,
            json.dumps(ask),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def rootless_workdir(rl: dict[str, Any], name: str) -> Path:
    """A folder of the unprivileged user under ``rl``'s base."""
    path: Path = rl["base"] / name
    path.mkdir()
    os.chown(path, rl["user"].pw_uid, rl["user"].pw_gid)
    return path
