"""``network: filtered`` (issue #22) on landlock and on oci with runc and runsc: real proxies,
real sandboxes, servers in a network namespace this test creates (egress_world), and the
npm registry through the built-in profile on landlock.

The shared probe program (egress_world.PROBE_JS, also the security suite's) is judged here
case by case; the runtime-specific cases are landlock's (no network namespace: the proxy's
TCP port on another address, the host's unix and abstract sockets) and runsc's (the proxy
socket reached from inside gVisor).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO

import pytest

from fusion_oci.models import PrepareContext, RunOptions, RunResult, SandboxPolicy
from fusion_oci.sandbox import Sandbox
from tests.backends import backend_settings, require_runtime
from tests.hostside import tcp_server
from tests.integration.container_cases import checked_rootless_user
from tests.integration.runc_user import run_bundle_as
from tests.security.egress_world import (
    OK,
    EgressWorld,
    allowed_answers,
    egress_world,
    failed,
    parse,
    pnpm_worktree_with_remote,
    probe_command,
    refused,
    resolving,
)

BACKENDS = [
    pytest.param("landlock", marks=pytest.mark.landlock),
    pytest.param("oci", marks=pytest.mark.oci),
    pytest.param("oci-runsc", marks=[pytest.mark.oci, pytest.mark.runsc]),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EgressWorld]:
    with egress_world(tmp_path_factory.mktemp("egress-world")) as made:
        # Held open: servers started later enter the namespace by this descriptor, not by
        # its /run/netns name (seen: `ip netns exec` failing with EINVAL mid-module while
        # other processes on the machine add and delete namespaces).
        _NETNS_FD[made.netns] = os.open(f"/run/netns/{made.netns}", os.O_RDONLY)
        try:
            yield made
        finally:
            os.close(_NETNS_FD.pop(made.netns))


_NETNS_FD: dict[str, int] = {}


def _in_world(
    world: EgressWorld, argv: list[str], stdout: int | IO[bytes], stderr: int | IO[bytes]
) -> subprocess.Popen[bytes]:
    """``argv`` started in the world's network namespace."""
    fd = _NETNS_FD[world.netns]
    return subprocess.Popen(
        ["nsenter", f"--net=/proc/self/fd/{fd}", "--", *argv],
        pass_fds=(fd,),
        stdout=stdout,
        stderr=stderr,
    )


def _env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"}


@contextlib.asynccontextmanager
async def filtered(
    backend: str, worktree: Path, policy: SandboxPolicy, names: dict[str, list[str]] | None = None
) -> AsyncIterator[Sandbox]:
    """A prepared ``backend`` sandbox of ``policy`` (its proxy resolving ``names`` only, when
    given); the project folder outside the worktree, as landlock needs."""
    require_runtime(backend)
    settings = backend_settings(backend, policy=policy)
    project = worktree.parent / "project"
    project.mkdir(exist_ok=True)
    home = worktree.parent / "home"
    home.mkdir(exist_ok=True)
    with resolving(names):
        async with Sandbox(settings, env=_env(home), cache_root=worktree.parent / "cache") as sb:
            await sb.prepare(
                PrepareContext(
                    task_id="filt",
                    run_id="r1",
                    worktree_path=str(worktree),
                    policy=policy,
                    project_dir=str(project),
                )
            )
            yield sb


async def run(sb: Sandbox, command: str | list[str], timeout_ms: int = 90_000) -> RunResult:
    return await sb.run(command, RunOptions(timeout_ms=timeout_ms))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_only_what_the_proxy_allows_is_reached(
    backend: str, world: EgressWorld, worktree: Path
) -> None:
    world.log.write_text("")
    with tcp_server() as (port, seen):
        async with filtered(backend, worktree, world.policy(), world.names) as sb:
            assert sb.egress is not None
            result = await run(sb, probe_command(world, port))
            # A real tool, through the proxy variables the sandbox got.
            curl = await run(
                sb,
                "curl -sS http://allowed.test:8080/; "
                "curl -sS -p http://allowed.test:8080/; "
                "curl -sS http://denied.test:8080/",
            )
    assert result.exit_code == 0, result.stderr[-2000:]
    out = parse(result.stdout)
    server = world.seen()
    # The allowed host answers, by name, through the proxy (CONNECT and plain HTTP).
    assert allowed_answers(out, world), out
    assert curl.stdout.count(f"{OK} {world.allowed_addr}") == 2, curl
    # The denied one gets the 403 with its reason: the host, the rule and the key to change.
    assert refused(out["denied"], "denied.test", "deniedDomains"), out["denied"]
    assert refused(out["unlisted"], "other.test", "allowedDomains"), out["unlisted"]
    assert "denied.test" in curl.stdout and "deniedDomains" in curl.stdout, curl.stdout
    # A direct connect to its address, or by name (ignoring the proxy variables), fails.
    for key in ("direct_allowed", "direct_denied", "direct_name"):
        assert failed(out[key]), (key, out[key])
    assert all(line.split()[1] == world.host_addr for line in server if line.startswith("tcp ")), (
        server
    )  # only the proxy reached the world
    # No raw UDP, no DNS of its own.
    assert failed(out["udp"]) and not any(line.startswith("udp ") for line in server), (
        out["udp"],
        server,
    )
    assert failed(out["dns_outside"]) and failed(out["dns_system"]), out
    # The host's loopback and the metadata address: neither directly nor through the proxy.
    assert OK not in out["direct_host_loopback"] and not seen, (out, seen)
    assert refused(out["host_loopback_proxy"]) and refused(out["metadata_proxy"]), out
    assert failed(out["direct_metadata"]) and failed(out["direct_slirp_gateway"]), out
    # An allowed name that resolves to loopback is refused (the address is checked).
    assert refused(out["loop"], "loop.test"), out["loop"]


async def test_landlock_connects_nowhere_else_on_the_proxys_port(
    world: EgressWorld, worktree: Path
) -> None:
    """Landlock's TCP rules know ports, not addresses: a server on the proxy's own port on
    another host (here the world's allowed address) must still be unreachable, and so must
    the host's unix sockets (a path under /run, an abstract name) and other loopback ports;
    and no TCP socket may listen (an inbound channel)."""
    run_dir = Path("/run") / f"fusion-oci-test-{os.getpid()}"
    run_dir.mkdir(mode=0o755)
    path_sock = socket.socket(socket.AF_UNIX)
    abstract = socket.socket(socket.AF_UNIX)
    try:
        path_sock.bind(str(run_dir / "host.sock"))
        path_sock.listen()
        abstract.bind(f"\0fusion-oci-test-{os.getpid()}")
        abstract.listen()
        with tcp_server() as (loop_port, seen):
            async with filtered("landlock", worktree, world.policy(), world.names) as sb:
                assert sb.egress is not None and sb.egress.tcp_port is not None
                proxy_port = sb.egress.tcp_port
                with _listener_in(world, proxy_port) as hits:
                    script = _connects(
                        [
                            (world.allowed_addr, proxy_port),
                            ("127.0.0.1", loop_port),
                            ("127.0.0.1", proxy_port),
                        ],
                        [str(run_dir / "host.sock"), f"@fusion-oci-test-{os.getpid()}", "own.sock"],
                    )
                    result = await run(sb, ["python3", "-c", script])
    finally:
        path_sock.close()
        abstract.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    lines = result.stdout.splitlines()
    assert result.exit_code == 0, result.stderr
    assert lines[0].startswith(f"tcp {world.allowed_addr} ") and "refused" in lines[0], lines
    assert "refused" in lines[1] and not seen, lines  # another host loopback port
    assert lines[2].endswith(" connected"), lines  # the proxy itself
    assert "refused" in lines[3] and "refused" in lines[4], lines  # the host's unix sockets
    assert lines[5].endswith(" connected"), lines  # the command's own, in the worktree
    # No inbound way out either: a TCP listen (autobound to every address) is refused.
    assert "refused" in lines[6] and "refused" in lines[7], lines
    assert hits.read_text() == "", "a connection reached the world on the proxy's port"


RACE = r"""
import ctypes, socket, struct, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
proxy, far, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
def sockaddr(host):
    return struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(host) \
        + bytes(8)
good, bad = sockaddr(proxy), sockaddr(far)
buf = ctypes.create_string_buffer(good, 16)
stop = False
def flip():
    while not stop:  # the address between the check and the connect, as often as it can
        ctypes.memmove(buf, bad, 16)
        ctypes.memmove(buf, good, 16)
threading.Thread(target=flip, daemon=True).start()
ok = 0
for _ in range(int(sys.argv[4])):
    s = socket.socket()
    if libc.connect(s.fileno(), buf, 16) == 0:
        ok += 1
        if s.getpeername()[0] != proxy:
            print("LEAK", s.getpeername())
    s.close()
stop = True
print("connected", ok)
"""


async def test_landlock_a_thread_rewriting_the_address_reaches_nothing(
    world: EgressWorld, worktree: Path
) -> None:
    """The supervisor decides on its own copy of the address and connects that: a second
    thread flipping the caller's sockaddr between the proxy and another host (listening on
    the proxy's port) after the check reaches the other host never."""
    async with filtered("landlock", worktree, world.policy(), world.names) as sb:
        assert sb.egress is not None and sb.egress.tcp_port is not None
        with _listener_in(world, sb.egress.tcp_port) as hits:
            result = await run(
                sb,
                [
                    "python3",
                    "-c",
                    RACE,
                    "127.0.0.1",
                    world.allowed_addr,
                    str(sb.egress.tcp_port),
                    "300",
                ],
            )
    assert result.exit_code == 0, result.stderr
    assert "LEAK" not in result.stdout and hits.read_text() == "", result.stdout
    # Most attempts still connect (to the proxy): the race did not just break connect.
    assert int(result.stdout.split("connected ")[1]) > 0, result.stdout


def _connects(tcp: list[tuple[str, int]], unix: list[str]) -> str:
    """A python program: one line per attempt, ``connected`` or ``refused (errno)``."""
    return f"""
import os, socket
def attempt(label, family, addr):
    s = socket.socket(family)
    s.settimeout(3)
    try:
        s.connect(addr)
        print(label, "connected")
    except OSError as e:
        print(label, "refused", e.errno)
    finally:
        s.close()
for host, port in {tcp!r}:
    attempt(f"tcp {{host}} {{port}}", socket.AF_INET, (host, port))
own = socket.socket(socket.AF_UNIX)
own.bind("own.sock")
own.listen()
for path in {unix!r}:
    attempt(f"unix {{path}}", socket.AF_UNIX, "\\0" + path[1:] if path[0] == "@" else path)
for family in (socket.AF_INET, socket.AF_INET6):  # listen() autobinds on every address
    s = socket.socket(family)
    try:
        s.listen()
        print("listen", family, "listening", s.getsockname())
    except OSError as e:
        print("listen", family, "refused", e.errno)
"""


@contextlib.contextmanager
def _listener_in(world: EgressWorld, port: int) -> Iterator[Path]:
    """A TCP server on ``port`` in the world's namespace that logs every connection."""
    hits = world.log.parent / f"hits-{port}"
    hits.write_text("")
    code = (
        "import socket, sys\ns = socket.socket()\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('0.0.0.0', {port}))\ns.listen()\nprint('up', flush=True)\n"
        "while True:\n    c, peer = s.accept()\n"
        "    open(sys.argv[1], 'a').write(f'{peer}\\n')\n    c.close()\n"
    )
    errors = world.log.parent / f"hits-{port}.err"
    with errors.open("wb") as err:
        proc = _in_world(
            world, [sys.executable, "-c", code, str(hits)], stdout=subprocess.PIPE, stderr=err
        )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n", errors.read_text()
        yield hits
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.landlock
async def test_pnpm_install_and_git_fetch_through_the_built_in_profile_on_landlock(
    tmp_path: Path, world: EgressWorld
) -> None:
    """The profile allows the npm registry (npm config) and the project's git remote (here a
    dumb-HTTP remote in the world's namespace, named by address: the policy lifts the refusal
    of that private address, nothing else); a registry the profile does not list is denied."""
    from fusion_oci.egress.profile import resolve_profile

    served, worktree = pnpm_worktree_with_remote(tmp_path, world, 8081)
    profile = await resolve_profile(worktree, _env(tmp_path))
    assert any(h.pattern == f"{world.allowed_addr}:8081" for h in profile), profile
    policy = SandboxPolicy(network="filtered", allowed_domains=[f"{world.allowed_addr}/32"])
    with _http_server_in(world, served, 8081):
        async with filtered("landlock", worktree, policy) as sb:
            install = await run(sb, "pnpm install --frozen-lockfile && pnpm test", 180_000)
            fetch = await run(sb, "git fetch -q origin && git log --oneline FETCH_HEAD")
            other = await run(
                sb,
                "curl -sS https://registry.npmmirror.com/is-number; "
                "pnpm view is-number version "
                "--registry https://registry.npmmirror.com/ 2>&1 | tail -3",
            )
    assert install.exit_code == 0, install.stderr + install.stdout
    assert "fixture tests passed" in install.stdout
    assert (worktree / "node_modules" / "is-number" / "package.json").exists()
    assert fetch.exit_code == 0 and "remote commit" in fetch.stdout, fetch.stderr
    assert "403" in other.stdout + other.stderr, other
    assert "7.0.0" not in other.stdout


@contextlib.contextmanager
def _http_server_in(world: EgressWorld, root: Path, port: int) -> Iterator[None]:
    proc = _in_world(
        world,
        [
            sys.executable,
            "-m",
            "http.server",
            str(port),
            "--bind",
            world.allowed_addr,
            "--directory",
            str(root),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            with (
                contextlib.suppress(OSError),
                socket.create_connection((world.allowed_addr, port), timeout=1),
            ):
                break
            assert proc.poll() is None
            time.sleep(0.1)
        yield
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_nothing_of_the_proxy_is_left_after_dispose(
    backend: str, world: EgressWorld, worktree: Path
) -> None:
    async with filtered(backend, worktree, world.policy(), world.names) as sb:
        assert sb.egress is not None
        socket_path, port = sb.egress.unix_socket, sb.egress.tcp_port
        assert (await run(sb, "true")).exit_code == 0
    assert not socket_path.exists() and not socket_path.parent.exists()
    if port is not None:  # landlock's TCP listener is gone too
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()


@pytest.mark.oci
def test_rootless_runc_runs_the_filtered_bundle(world: EgressWorld) -> None:
    """The rootless translation of a filtered bundle (one mapping: the caller to root inside)
    run by runc as the unprivileged CI user: the forwarder in its own empty netns reaches the
    proxy's socket, the allowed host answers, a denied one gets the 403, nothing direct."""
    from dataclasses import replace

    from fusion_oci.agent.client import agent_binary
    from fusion_oci.egress import EgressRules, start_proxy
    from fusion_oci.oci.bundle import write_bundle
    from fusion_oci.oci.host import probe_host
    from fusion_oci.policy.layout import resolve_layout
    from fusion_oci.resolve import compile_spec
    from fusion_oci.runtimes.oci.launch import bundle_spec
    from tests.tasks import resolved

    account, _ = checked_rootless_user(
        "oci", None, "switching to the rootless test user needs root"
    )
    # Not tmp_path: pytest's base directory is 0700 root, which the user cannot traverse.
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-filtered-", dir="/tmp"))
    base.chmod(0o755)
    proxy = None
    try:
        wt, state, status = base / "wt", base / "egress", base / "status"
        for folder in (wt, state, status):
            folder.mkdir()
        agent = shutil.copy(agent_binary(), base / "agent")
        rules = EgressRules(
            allowed=("allowed.test",),
            denied=("denied.test",),
            allow_addresses=(f"{world.allowed_addr}/32",),
        )
        # The proxy serves on its own thread: it keeps serving after this loop returns.
        proxy = asyncio.run(
            start_proxy(
                task_id="rootless",
                rules=rules,
                state_dir=state,
                audit=None,
                resolve_override=world.names,
            )
        )
        host = replace(probe_host(), uid=account.pw_uid, gid=account.pw_gid)
        policy = SandboxPolicy(network="filtered", allowed_domains=["allowed.test"])
        context = PrepareContext(
            task_id="rootless", run_id="r1", worktree_path=str(wt), policy=policy
        )
        layout = resolve_layout(context, cache_root=base / "cache", ca_bundle=host.ca_bundle)
        command = (
            f"curl -sS -m 10 http://allowed.test:8080/; "
            f"curl -sS -m 10 -o /dev/null -w '%{{http_code}}\\n' http://denied.test:8080/; "
            f"curl -sS -m 3 --noproxy '*' http://{world.allowed_addr}:8080/ 2>&1 | tail -1"
        )
        spec = compile_spec(resolved(context, layout, host), command, RunOptions())
        rootless = bundle_spec(
            spec,
            rootless_ids=(account.pw_uid, account.pw_gid),
            exec_status=(str(agent), str(status)),
            egress_proxy=(str(proxy.unix_socket), str(agent)),
        )
        bundle = write_bundle(rootless, base / "bundle")
        done = run_bundle_as(account, base, bundle.path, "filtered-1")
    finally:
        if proxy is not None:
            asyncio.run(proxy.stop())
        shutil.rmtree(base, ignore_errors=True)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    assert lines[0] == f"{OK} {world.allowed_addr}", lines
    assert lines[1] == "403", lines
    assert OK not in lines[2] and "curl:" in lines[2], lines
