"""``network: filtered`` (issue #22) for real on bubblewrap (as root and as the unprivileged CI
user), podman and docker (rootful and rootless): the task's proxy on the host, the agent's
forwarder in the sandbox, servers in a network namespace the test creates (never the
internet; tests/security/egress_world.py), and the npm registry through the built-in profile.

The attacks are tests/security/test_egress.py's (the same probe program and judge); here they
run again on bubblewrap as an unprivileged user, after the command tried to take the
forwarder's port and to kill the agent, and beside what a well-behaved tool does: curl through
HTTP_PROXY, ssh's ProxyCommand (the agent's ``connect`` mode), ``pnpm install``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.models import (
    CacheMode,
    NetworkMode,
    PrepareContext,
    RunOptions,
    RunResult,
    SandboxPolicy,
)
from fusion_oci.policy.settings import DockerSettings, GateSettings, SandboxSettings
from fusion_oci.runtimes.registry import create_runtime
from fusion_oci.runtimes.requirements import Requirement
from fusion_oci.sandbox import Sandbox
from tests.backends import backend_settings, require, require_runtime
from tests.conftest import git_init
from tests.hostside import tcp_server
from tests.integration import container_cases as cases
from tests.security.egress_world import (
    PROBE_JS,
    EgressWorld,
    allowed_answers,
    egress_world,
    judge,
    pnpm_worktree_with_remote,
    resolving,
    serving,
)

ROOT = Path(__file__).resolve().parents[2]
LONG = RunOptions(timeout_ms=240_000)
ROOTLESS_USER = os.environ.get("FUSION_OCI_ROOTLESS_USER", "fusionci")
RUNTIMES = {
    "bubblewrap": pytest.mark.bubblewrap,
    "bubblewrap-unprivileged": pytest.mark.bubblewrap,
    "podman": pytest.mark.podman,
    "podman-rootless": pytest.mark.podman_rootless,
    "docker": pytest.mark.docker,
    "docker-rootless": pytest.mark.docker_rootless,
    # the pod's relay listens on its 127.0.0.1:3128, carried back to the executor's proxy
    "kubernetes": pytest.mark.kubernetes,
}
UNPRIVILEGED = {"bubblewrap-unprivileged", "podman-rootless", "docker-rootless"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EgressWorld]:
    with egress_world(tmp_path_factory.mktemp("egress-world")) as made:
        yield made


# ---------------------------------------------------------------------------- a runner


class Runner:
    """One command in a fresh filtered sandbox of ``runtime``: in this process (as root), or
    as the unprivileged CI user through tests/integration/rootless_driver.py."""

    def __init__(self, runtime: str, base: Path, rl: dict[str, Any] | None) -> None:
        self.runtime, self.base, self.rl = runtime, base, rl
        self.engine = runtime.split("-")[0]

    def settings(self) -> SandboxSettings:
        if self.runtime == "bubblewrap" or self.runtime == "bubblewrap-unprivileged":
            return SandboxSettings(backend="bubblewrap")
        if self.runtime == "docker-rootless":
            assert self.rl is not None
            return SandboxSettings(
                backend="docker",
                gates=GateSettings(sandbox_provision="allow"),
                docker=DockerSettings(url=f"unix://{self.rl['xdg']}/docker.sock"),
            )
        if self.runtime == "podman-rootless":
            return SandboxSettings(backend="podman", gates=GateSettings(sandbox_provision="allow"))
        if self.runtime == "kubernetes":
            return backend_settings("kubernetes")  # the test cluster, with its node image
        return cases.require_engine(self.engine)

    def image(self) -> str | None:
        if self.engine in ("bubblewrap", "kubernetes"):
            return None
        from tests.integration.images_fixture import ensure_node_image

        return ensure_node_image(self.runtime).ref

    def worktree(self, name: str) -> Path:
        wt = git_init(self.base / name)
        if self.rl is not None:
            for parent, dirs, files in os.walk(self.base):
                for item in [parent, *(os.path.join(parent, n) for n in dirs + files)]:
                    os.lchown(item, self.rl["user"].pw_uid, self.rl["user"].pw_gid)
        return wt

    async def run(
        self,
        command: str | list[str],
        policy: SandboxPolicy,
        *,
        worktree: Path,
        names: dict[str, list[str]] | None = None,
        opts: RunOptions = LONG,
        cache_mode: CacheMode = CacheMode.OFF,
        task: str = "egress",
    ) -> RunResult:
        settings = self.settings()
        ctx = PrepareContext(
            task_id=task,
            run_id="r1",
            worktree_path=str(worktree),
            policy=policy,
            image=self.image(),
            cache_mode=cache_mode,
        )
        home = self.base / "home"
        home.mkdir(exist_ok=True)
        env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        if self.rl is None:
            with resolving(names):
                async with Sandbox(settings, env=env, cache_root=self.base / "cache") as sb:
                    await sb.prepare(ctx)
                    return await sb.run(command, opts)
        if self.rl is not None:
            os.chown(home, self.rl["user"].pw_uid, self.rl["user"].pw_gid)
        answer = cases.drive_rootless(
            self.rl,
            "probe",
            timeout=opts.timeout_ms / 1000 + 120,
            settings=settings.model_dump(mode="json", by_alias=True),
            ctx=ctx.model_dump(mode="json", by_alias=True),
            opts=opts.model_dump(mode="json", by_alias=True),
            env=env,
            cacheRoot=str(self.base / "cache"),
            command=command,
            egressNames=names,
        )
        assert "refused" not in answer, answer
        return RunResult.model_validate(answer["result"])


@contextlib.contextmanager
def _unprivileged_base(runtime: str) -> Iterator[dict[str, Any]]:
    """The CI user for ``runtime`` (its rootless engine's socket checked), and a base it
    owns."""
    if runtime == "bubblewrap-unprivileged":
        require_runtime("bubblewrap")
        user, xdg = cases.checked_rootless_user(
            runtime, None, "these tests switch user with runuser"
        )
        base = Path(tempfile.mkdtemp(prefix="fusion-oci-egress-"))
        base.chmod(0o755)
        try:
            yield {"user": user, "xdg": xdg, "base": base, "python": cases.rootless_python()}
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return
    if runtime == "docker-rootless":

        def settings(xdg: str) -> SandboxSettings:
            return SandboxSettings(
                backend="docker",
                docker=DockerSettings(url=f"unix://{xdg}/docker.sock"),
                gates=GateSettings(sandbox_provision="allow"),
            )

        with cases.rootless_user(runtime, "docker.sock", settings) as rl:
            yield rl
        return
    with cases.rootless_user(runtime, "podman/podman.sock") as rl:
        yield rl


@pytest.fixture(params=[pytest.param(r, marks=m) for r, m in RUNTIMES.items()])
def runner(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Runner]:
    runtime: str = request.param
    if runtime in ("bubblewrap", "kubernetes"):
        require_runtime(runtime)
        yield Runner(runtime, tmp_path, None)
        return
    if runtime not in UNPRIVILEGED:
        cases.require_engine(runtime)
        yield Runner(runtime, tmp_path, None)
        return
    with _unprivileged_base(runtime) as rl:
        base = rl["base"] / "case"
        base.mkdir()
        yield Runner(runtime, base, rl)


# ---------------------------------------------------------------------------- the cases


def _script(world: EgressWorld, host_port: int, agent_connect: bool = True) -> str:
    """Probe; try to take the forwarder's port and kill the agent; probe again; ssh's
    ProxyCommand (the agent's connect mode) to an allowed and a denied host; curl where the
    sandbox has it (bubblewrap: the host's /usr)."""
    probe = f"node -e {_q(PROBE_JS)} {_q(world.config(host_port))}"
    bind = (
        "node -e \"const s=require('net').createServer();"
        "s.on('error',e=>console.log('BIND '+e.code));"
        "s.listen(3128,'127.0.0.1',()=>{console.log('BIND bound');s.close()})\""
    )
    get = "printf 'GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\nConnection: close\\r\\n\\r\\n'"
    return "\n".join(
        [
            'echo "UID $(id -u)"',
            probe,
            bind,
            "kill -KILL 1 2>/dev/null; kill -TERM 1 2>/dev/null; sleep 0.2",
            probe,
            *(
                [
                    f"{get} | /run/fusion-oci/agent connect allowed.test 8080; "
                    'echo "CONNECT-EXIT $?"',
                    "/run/fusion-oci/agent connect denied.test 8080 </dev/null 2>&1; "
                    'echo "DENIED-EXIT $?"',
                ]
                if agent_connect
                else []
            ),
            "if command -v curl >/dev/null; then",
            "  echo CURL-PLAIN $(curl -sS -m 10 http://allowed.test:8080/)",
            "  echo CURL-TUNNEL $(curl -sS -m 10 -p http://allowed.test:8080/)",
            '  echo CURL-SOCKS $(curl -sS -m 10 -x "$ALL_PROXY" http://allowed.test:8080/)',
            "  echo CURL-DENIED $(curl -sS -m 10 -o /dev/null -w '%{http_code}' "
            "http://denied.test:8080/)",
            "  echo CURL-NOPROXY $(curl -sS -m 5 --noproxy '*' http://allowed.test:8080/ 2>&1)",
            "fi",
            "true",
        ]
    )


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


async def test_filtered_reaches_the_allowed_host_only_and_survives_the_command(
    runner: Runner, world: EgressWorld
) -> None:
    wt = runner.worktree("wt")
    world.log.write_text("")
    with tcp_server() as (port, seen):
        script = _script(world, port)
        result = await runner.run(script, world.policy(), worktree=wt, names=world.names)
    assert result.exit_code == 0, result.stderr[-2000:]
    out = result.stdout
    answers = [
        json.loads(line.removeprefix("EGRESS-PROBE "))
        for line in out.splitlines()
        if line.startswith("EGRESS-PROBE ")
    ]
    assert len(answers) == 2, out[-3000:]
    for answer in answers:  # before and after the attempts on the forwarder
        assert allowed_answers(answer, world), answer
        leaks = {p: d for p, (leaked, d) in judge(answer, world, list(seen)).items() if leaked}
        assert not leaks, leaks
    # The port is the agent's before any command runs; the agent (PID 1) outlives the kill.
    if runner.rl is not None:  # the unprivileged user's own sandbox (its uid, or root inside)
        assert f"UID {runner.rl['user'].pw_uid}" in out or runner.runtime == "docker-rootless"
    assert "BIND EADDRINUSE" in out, out[-2000:]
    assert f"fusion-egress-ok {world.allowed_addr}" in out.split("CONNECT-EXIT")[0]
    assert "CONNECT-EXIT 0" in out
    denied = out.split("CONNECT-EXIT 0", 1)[1].split("DENIED-EXIT")[0]
    assert "403" in denied and "deniedDomains" in denied, denied
    assert "DENIED-EXIT 1" in out
    if runner.engine == "bubblewrap":
        assert f"CURL-PLAIN fusion-egress-ok {world.allowed_addr}" in out, out[-2000:]
        assert f"CURL-TUNNEL fusion-egress-ok {world.allowed_addr}" in out
        assert f"CURL-SOCKS fusion-egress-ok {world.allowed_addr}" in out  # socks5h
        assert "CURL-DENIED 403" in out
        assert "CURL-NOPROXY curl: (6)" in out  # no name resolves without the proxy
    assert not seen


@pytest.mark.docker
async def test_a_oneshot_container_per_command_forwards_too(
    world: EgressWorld, tmp_path: Path
) -> None:
    """container_mode oneshot: each command's own container gets the socket and the
    forwarder (the same AgentMounts as the warm one)."""
    settings = cases.require_engine("docker").model_copy(update={"container_mode": "oneshot"})
    wt = git_init(tmp_path / "wt")
    probe = ["node", "-e", PROBE_JS, world.config(1)]
    ctx = PrepareContext(
        task_id="oneshot",
        run_id="r1",
        worktree_path=str(wt),
        policy=world.policy(),
        image=Runner("docker", tmp_path, None).image(),
        cache_mode=CacheMode.OFF,
    )
    with resolving(world.names):
        async with Sandbox(
            settings, env={"PATH": "/usr/bin:/bin"}, cache_root=tmp_path / "cache"
        ) as sb:
            await sb.prepare(ctx)
            for _ in range(2):
                result = await sb.run(probe, LONG)
                assert result.exit_code == 0, result.stderr
                line = next(x for x in result.stdout.splitlines() if x.startswith("EGRESS-PROBE "))
                assert allowed_answers(json.loads(line.removeprefix("EGRESS-PROBE ")), world)


@pytest.mark.parametrize("backend", ["bubblewrap", "podman", "docker"])
def test_network_policy_is_fine_exactly_where_filtered_is_enforced(backend: str) -> None:
    if backend == "bubblewrap":
        require_runtime(backend)
        settings = SandboxSettings(backend="bubblewrap")
    else:
        settings = cases.require_engine(backend)
    runtime = create_runtime(backend, settings, os.environ)
    assert Requirement.NETWORK_FILTERED in runtime.enforces()
    assert runtime.capabilities().network_policy == "fine"
    native = create_runtime("native", SandboxSettings(backend="native"), os.environ)
    assert Requirement.NETWORK_FILTERED not in native.enforces()
    assert native.capabilities().network_policy != "fine"


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("bubblewrap", marks=pytest.mark.bubblewrap),
        pytest.param("podman", marks=pytest.mark.podman),
        pytest.param("docker", marks=pytest.mark.docker),
    ],
)
async def test_pnpm_install_and_git_fetch_through_the_built_in_profile(
    backend: str, tmp_path: Path, world: EgressWorld
) -> None:
    """The real npm registry, reached through the proxy because the built-in profile lists it
    (``npm config get registry``); a cold, task-private store, so every package is fetched.
    The project's git remote (a dumb-HTTP remote in the world's namespace: the profile lists
    it from ``git remote -v``, the policy lifts the refusal of its private address) fetches.
    Another registry, not in the profile, is denied by the proxy with its reason."""
    if backend == "bubblewrap":
        require_runtime(backend)
        require(backend, shutil.which("pnpm") is not None, "pnpm is not installed on the host")
    runner = Runner(backend, tmp_path, None)
    if backend != "bubblewrap":
        cases.require_engine(backend)
    served, wt = pnpm_worktree_with_remote(tmp_path, world, 8081)
    policy = SandboxPolicy(
        network=NetworkMode.FILTERED, allowed_domains=[f"{world.allowed_addr}/32"]
    )
    command = (
        "git fetch -q origin && git log --oneline FETCH_HEAD && echo FETCHED; "
        "pnpm install --frozen-lockfile && pnpm test && echo INSTALLED; "
        "npm view is-number version --registry=https://registry.yarnpkg.com/ "
        '--fetch-retries=0 2>&1 | tail -5; echo "OTHER-EXIT ${PIPESTATUS:-$?}"'
    )
    with serving(world, served, 8081):
        result = await runner.run(
            ["/bin/bash", "-c", command],
            policy,
            worktree=wt,
            cache_mode=CacheMode.ISOLATED,
            task="pnpm-filtered",
        )
    assert "remote commit" in result.stdout and "FETCHED" in result.stdout, (
        result.stdout[-2000:] + result.stderr[-2000:]
    )
    assert "INSTALLED" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    assert (wt / "node_modules" / "is-number" / "package.json").exists()
    other = result.stdout.split("INSTALLED", 1)[1]
    assert "403" in other and "7.0.0" not in other, other


# ---------------------------------------------------------------------------- the forwarder

CLIENT = r"""
import hashlib, os, socket, sys, threading
n, size = int(sys.argv[1]), int(sys.argv[2])
bad = []
def one(i):
    data = os.urandom(size)
    s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
    def send():
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # half-close: the echo must still come back
    t = threading.Thread(target=send); t.start()
    got = bytearray()
    while True:
        chunk = s.recv(1 << 16)
        if not chunk: break
        got += chunk
    t.join(); s.close()
    if hashlib.sha256(got).digest() != hashlib.sha256(data).digest():
        bad.append((i, len(got)))
threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
[t.start() for t in threads]; [t.join() for t in threads]
print("BAD", bad)
try:
    socket.socket().bind(("127.0.0.1", 3128)); print("BIND ok")
except OSError as e:
    print("BIND", e.errno)
"""


@contextlib.contextmanager
def echo_socket(path: Path) -> Iterator[list[int]]:
    """A unix stream server echoing each connection until EOF (the forwarder carries bytes,
    whatever they say); yields the list of connections it served."""
    import socket
    import threading

    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(256)
    served: list[int] = []

    def echo(conn: socket.socket) -> None:
        with conn:
            while chunk := conn.recv(1 << 16):
                conn.sendall(chunk)
            conn.shutdown(socket.SHUT_WR)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            served.append(1)
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield served
    finally:
        srv.close()


@pytest.mark.native
async def test_the_agents_forwarder_carries_many_connections_whole(tmp_path: Path) -> None:
    """In the agent's own loop (``--egress``), beside the command that uses it: 40 concurrent
    connections of 1 MiB each way arrive whole, half-closes pass, and the port is taken."""
    import asyncio
    import socket
    import sys

    from fusion_oci.agent.client import Agent, agent_binary

    require(
        "native",
        os.geteuid() == 0 and shutil.which("unshare") is not None,
        "needs root for a network namespace (unshare --net)",
    )
    sock_path = tmp_path / "egress.sock"
    with echo_socket(sock_path) as served:
        ours, theirs = socket.socketpair()
        proc = await asyncio.create_subprocess_exec(
            "unshare",
            "--net",
            "--",
            str(agent_binary()),
            "--egress",
            str(sock_path),
            "--fd",
            str(theirs.fileno()),
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
            stdin=asyncio.subprocess.DEVNULL,
        )
        theirs.close()
        agent = await Agent.over(ours, proc, 20.0)
        try:
            done = await agent.run(
                [sys.executable, "-c", CLIENT, "40", str(1 << 20)],
                env={"PATH": "/usr/bin:/bin"},
                timeout_s=120,
            )
        finally:
            await agent.close()
        assert done.returncode == 0, done.stderr
        assert b"BAD []" in done.stdout, done.stdout
        assert b"BIND 98" in done.stdout  # EADDRINUSE: the agent holds 127.0.0.1:3128
        assert len(served) == 40


def test_a_filtered_task_without_its_proxy_is_refused_not_run_offline() -> None:
    """A runtime handed a filtered task with no proxy (not through Sandbox) refuses it at
    prepare: the sandbox would have no way out, and no other network stands in for it."""
    from types import SimpleNamespace

    from fusion_oci.errors import SandboxSetupError
    from fusion_oci.runtimes.linux.egress import proxy_socket

    def task(network: NetworkMode, egress: object) -> object:
        return SimpleNamespace(spec=SimpleNamespace(network=network), egress=egress)

    with pytest.raises(SandboxSetupError, match="egress proxy"):
        proxy_socket(task(NetworkMode.FILTERED, None))  # type: ignore[arg-type]
    given = SimpleNamespace(unix_socket=Path("/tmp/x/egress.sock"))
    assert proxy_socket(task(NetworkMode.FILTERED, given)) == "/tmp/x/egress.sock"  # type: ignore[arg-type]
    assert proxy_socket(task(NetworkMode.EGRESS, given)) is None  # type: ignore[arg-type]
