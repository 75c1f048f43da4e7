"""The egress proxy against real sockets: HTTP servers in a network namespace this test makes
(a veth pair from the host; never the internet), names mapped to them with resolve_override.

Needs root (``ip netns``), like the rootful backends' tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from fusion_oci.audit import AuditEvent, AuditLog, read_events, verify_chain
from fusion_oci.egress import EgressRules, Limits, start_proxy
from fusion_oci.egress.proxy import EgressProxy

SERVER = textwrap.dedent("""
    import http.server, json, sys

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            if self.path.startswith("/bytes/"):
                body = b"x" * int(self.path.split("/")[2])
            else:
                body = json.dumps({"path": self.path, "headers": dict(self.headers)}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Handler)
    print("ready", flush=True)
    server.serve_forever()
""")


@dataclass(frozen=True)
class NetnsServer:
    """An HTTP server on ``address:port`` inside a namespace reachable from the host."""

    netns: str
    address: str
    host_address: str
    port: int
    subnet: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def netns_server() -> Iterator[NetnsServer]:
    assert os.geteuid() == 0, "these tests make a network namespace with `ip netns` (root)"
    tag = secrets.token_hex(3)
    netns, host_if, ns_if = f"fo-egress-{tag}", f"foe{tag}h", f"foe{tag}n"
    octet = 16 + int(tag, 16) % 200
    subnet = f"10.213.{octet}.0/30"
    host_address, address = f"10.213.{octet}.1", f"10.213.{octet}.2"
    _ip("netns", "add", netns)
    proc: subprocess.Popen[str] | None = None
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", netns)
        _ip("addr", "add", f"{host_address}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", netns, "addr", "add", f"{address}/30", "dev", ns_if)
        _ip("-n", netns, "link", "set", ns_if, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-c", SERVER, address, "8080"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield NetnsServer(netns, address, host_address, 8080, subnet)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def names(server: NetnsServer) -> dict[str, list[str]]:
    return {
        "allowed.test": [server.address],
        "www.allowed.test": [server.address],
        "denied.test": [server.address],
        "unlisted.test": [server.address],
        "loopback.test": ["127.0.0.1"],
        "mapped.test": ["::ffff:127.0.0.1"],
        "metadata.test": ["169.254.169.254"],
        "dashboard.test": ["127.0.0.1"],
        "mixed.test": ["127.0.0.1", server.address],
    }


def rules(server: NetnsServer, **extra: tuple[str, ...]) -> EgressRules:
    return EgressRules(
        allowed=(
            "allowed.test",
            "*.allowed.test",
            "loopback.test",
            "mapped.test",
            "metadata.test",
            "dashboard.test",
            "mixed.test",
            "denied.test",
            "169.254.169.254",
        ),
        denied=("denied.test",),
        allow_addresses=(server.subnet, *extra.get("allow_addresses", ())),
    )


@pytest.fixture
async def proxy(netns_server: NetnsServer, tmp_path: Path) -> AsyncIterator[EgressProxy]:
    audit = AuditLog(tmp_path / "audit.jsonl", key=b"k" * 32)
    p = await start_proxy(
        task_id="task-1",
        rules=rules(netns_server),
        state_dir=tmp_path,
        audit=audit,
        resolve_override=names(netns_server),
        tcp=True,
        backend="test",
    )
    p.set_run("run-1")
    yield p
    await p.stop()


_CLIENTS: list[asyncio.StreamWriter] = []


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _CLIENTS:
        writer = _CLIENTS.pop()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def connect(p: EgressProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(str(p.unix_socket))
    _CLIENTS.append(writer)
    return reader, writer


async def http_connect(
    p: EgressProxy, target: str
) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await connect(p)
    writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    return head, reader, writer


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


async def socks(
    p: EgressProxy, request: bytes
) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await connect(p)
    writer.write(b"\x05\x01\x00")
    assert await reader.readexactly(2) == b"\x05\x00"
    writer.write(request)
    return await reader.readexactly(10), reader, writer


def socks_domain(name: str, port: int) -> bytes:
    return b"\x05\x01\x00\x03" + bytes([len(name)]) + name.encode() + port.to_bytes(2, "big")


async def events(p: EgressProxy, count: int) -> list[dict[str, object]]:
    assert p.audit is not None and p.audit.path is not None
    for _ in range(200):
        found = [e.model_dump(exclude_none=True) for e in read_events(p.audit.path)]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"wanted {count} audit events, have {found}")


async def test_connect_to_an_allowed_name_answers(
    proxy: EgressProxy, netns_server: NetnsServer
) -> None:
    head, reader, writer = await http_connect(proxy, f"allowed.test:{netns_server.port}")
    assert head.startswith(b"HTTP/1.1 200")
    writer.write(b"GET /hello HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    _, body = await read_response(reader)
    assert json.loads(body)["path"] == "/hello"
    writer.close()
    [event] = await events(proxy, 1)
    assert event["type"] == "sandbox:egress" and event["allowed"] is True
    assert event["task_id"] == "task-1" and event["run_id"] == "run-1"
    assert event["host"] == "allowed.test" and event["port"] == netns_server.port
    assert event["address"] == netns_server.address
    assert event["rule"] == "allowedDomains entry 'allowed.test'"
    assert event["bytes_up"] > 40 and event["bytes_down"] > 100
    assert event["details"] == {"protocol": "http"}


async def test_plain_http_absolute_uri_is_forwarded_without_hop_by_hop_headers(
    proxy: EgressProxy, netns_server: NetnsServer
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.tcp_port)
    _CLIENTS.append(writer)
    writer.write(
        f"GET http://www.allowed.test:{netns_server.port}/p?q=1 HTTP/1.1\r\n"
        "Host: www.allowed.test\r\nProxy-Connection: keep-alive\r\n"
        "Proxy-Authorization: Basic eDp5\r\nX-Keep: yes\r\n\r\n".encode()
    )
    head, body = await read_response(reader)
    assert head.startswith(b"HTTP/1.1 200")
    seen = json.loads(body)
    assert seen["path"] == "/p?q=1"
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert headers["host"] == f"www.allowed.test:{netns_server.port}"
    assert headers["connection"] == "close" and headers["x-keep"] == "yes"
    assert "proxy-connection" not in headers and "proxy-authorization" not in headers
    assert await reader.read() == b""  # one request per connection


async def test_audit_events_land_in_the_order_they_happened(
    proxy: EgressProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first append is slow (a busy disk, a contended flock): the second still lands
    after it. A thread per event wrote the later one first (seen in CI as a SOCKS BIND's
    refusal before the denied CONNECT that came before it)."""
    import threading

    assert proxy.audit is not None
    emit_many = proxy.audit.emit_many  # the writer appends what queued up, in batches
    writing = threading.Event()

    def slow_first(events: Sequence[AuditEvent]) -> None:
        if not writing.is_set():
            writing.set()
            time.sleep(0.3)
        emit_many(events)

    monkeypatch.setattr(proxy.audit, "emit_many", slow_first)
    _, reader, _ = await http_connect(proxy, "denied.test:8080")
    await reader.read()
    assert await asyncio.to_thread(writing.wait, 5)  # the first event is being written, slowly
    _, reader, _ = await http_connect(proxy, "unlisted.test:443")
    await reader.read()
    found = await events(proxy, 2)
    assert [e["host"] for e in found] == ["denied.test", "unlisted.test"], found


async def test_denied_connect_gets_403_naming_host_rule_and_key(proxy: EgressProxy) -> None:
    head, reader, _ = await http_connect(proxy, "denied.test:8080")
    body = await reader.read()
    assert head.startswith(b"HTTP/1.1 403")
    assert body.decode() == (
        "fusion-oci egress: denied.test:8080 denied by deniedDomains "
        "entry 'denied.test'; to allow it, remove it from "
        "sandbox.policy.deniedDomains\n"
    )
    head, reader, _ = await http_connect(proxy, "unlisted.test:443")
    text = (await reader.read()).decode()
    assert head.startswith(b"HTTP/1.1 403")
    assert "unlisted.test:443" in text and "add it to sandbox.policy.allowedDomains" in text
    found = await events(proxy, 2)
    assert [e["allowed"] for e in found] == [False, False]
    # Each refusal's event is written as its connection ends, so the two may come in either
    # order: told apart by their reason.
    denied = [e for e in found if e["reason"] == body.decode().strip()]
    assert len(denied) == 1, found
    assert "address" not in denied[0]  # nothing was connected to


async def test_denied_plain_http_gets_403(proxy: EgressProxy) -> None:
    reader, writer = await connect(proxy)
    writer.write(b"GET http://unlisted.test/ HTTP/1.1\r\nHost: unlisted.test\r\n\r\n")
    head, body = await read_response(reader)
    assert head.startswith(b"HTTP/1.1 403") and b"unlisted.test:80" in body


async def test_socks5_allowed_domain_and_ipv4(
    proxy: EgressProxy, netns_server: NetnsServer
) -> None:
    reply, reader, writer = await socks(proxy, socks_domain("allowed.test", netns_server.port))
    assert reply[:2] == b"\x05\x00"
    writer.write(b"GET /s HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    _, body = await read_response(reader)
    assert json.loads(body)["path"] == "/s"
    writer.close()
    # An address literal is a name like any other: it must be allowed (here: it is not).
    addr = bytes(int(x) for x in netns_server.address.split("."))
    reply, _, _ = await socks(proxy, b"\x05\x01\x00\x01" + addr + (8080).to_bytes(2, "big"))
    assert reply[1] == 0x02
    # The tunnel's event is written when the proxy sees it end, which may come after the
    # refusal's: the two are told apart by their verdict, not by their order.
    found = sorted(await events(proxy, 2), key=lambda e: not e["allowed"])
    assert found[0]["details"] == {"protocol": "socks5"} and found[0]["allowed"] is True
    assert found[1]["allowed"] is False and "allowedDomains" in str(found[1]["reason"])


async def test_socks5_error_codes(proxy: EgressProxy) -> None:
    reply, _, _ = await socks(proxy, socks_domain("denied.test", 443))
    assert reply[1] == 0x02  # connection not allowed by ruleset
    reply, _, _ = await socks(proxy, b"\x05\x02\x00\x03\x0callowed.test\x00\x50")  # BIND
    assert reply[1] == 0x07
    reply, _, _ = await socks(proxy, b"\x05\x01\x00\x09\x00\x50")  # unknown ATYP
    assert reply[1] == 0x08
    reply, _, _ = await socks(proxy, socks_domain("nowhere.allowed.test", 443))
    assert reply[1] == 0x04  # does not resolve: host unreachable
    reader, writer = await connect(proxy)
    writer.write(b"\x05\x01\x02")  # only username/password offered
    assert await reader.read() == b"\x05\xff"
    found = await events(proxy, 5)
    assert "deniedDomains entry 'denied.test'" in str(found[0]["reason"])


async def test_socks5_ipv6_literal_refused_unless_allowed(proxy: EgressProxy) -> None:
    reply, _, _ = await socks(proxy, b"\x05\x01\x00\x04" + bytes(15) + b"\x01\x00\x50")
    assert reply[1] == 0x02
    [event] = await events(proxy, 1)
    assert event["host"] == "::1"


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("loopback.test", "address 127.0.0.1 is loopback"),
        ("mapped.test", "address ::ffff:127.0.0.1 is loopback"),
        ("metadata.test", "address 169.254.169.254 is the metadata address"),
    ],
)
async def test_allowed_name_resolving_to_a_forbidden_address_is_refused(
    proxy: EgressProxy, name: str, why: str
) -> None:
    head, reader, _ = await http_connect(proxy, f"{name}:80")
    assert head.startswith(b"HTTP/1.1 403")
    assert why in (await reader.read()).decode()
    reply, _, _ = await socks(proxy, socks_domain(name, 80))
    assert reply[1] == 0x02


async def test_metadata_literal_refused_even_when_named(proxy: EgressProxy) -> None:
    """169.254.169.254 passes the name rules here but its address class is refused."""
    head, reader, _ = await http_connect(proxy, "169.254.169.254:80")
    assert head.startswith(b"HTTP/1.1 403")
    assert b"the metadata address" in await reader.read()


async def test_dashboard_port_never_reached(netns_server: NetnsServer, tmp_path: Path) -> None:
    """Loopback allowed by the policy, still never 4040 (refused before any connect)."""
    p = await start_proxy(
        task_id="t",
        rules=rules(netns_server, allow_addresses=("127.0.0.0/8",)),
        state_dir=tmp_path,
        audit=None,
        resolve_override=names(netns_server),
    )
    try:
        head, reader, _ = await http_connect(p, "dashboard.test:4040")
        assert head.startswith(b"HTTP/1.1 403") and b"4040" in await reader.read()
    finally:
        await p.stop()


async def test_mixed_answers_connect_to_the_checked_address_only(
    proxy: EgressProxy, netns_server: NetnsServer
) -> None:
    head, _, writer = await http_connect(proxy, f"mixed.test:{netns_server.port}")
    assert head.startswith(b"HTTP/1.1 200")
    writer.close()
    [event] = await events(proxy, 1)
    assert event["address"] == netns_server.address


async def test_audit_events_are_chained(proxy: EgressProxy, netns_server: NetnsServer) -> None:
    for target in (f"allowed.test:{netns_server.port}", "denied.test:1", "unlisted.test:2"):
        _, _, writer = await http_connect(proxy, target)
        writer.close()
    await events(proxy, 3)
    await proxy.stop()
    assert proxy.audit is not None and proxy.audit.path is not None
    report = verify_chain(proxy.audit.path, b"k" * 32)
    assert report.ok and report.lines == 3 and report.keyed


async def test_stop_closes_open_tunnels_and_removes_the_socket(
    proxy: EgressProxy, netns_server: NetnsServer
) -> None:
    tunnels = []
    for _ in range(3):
        head, reader, writer = await http_connect(proxy, f"allowed.test:{netns_server.port}")
        assert head.startswith(b"HTTP/1.1 200")
        tunnels.append((reader, writer))
    assert proxy.open_connections == 3
    await asyncio.wait_for(proxy.stop(), 5)
    for reader, _ in tunnels:
        assert await asyncio.wait_for(reader.read(), 5) == b""
    assert not proxy.unix_socket.exists()
    assert proxy.open_connections == 0
    with pytest.raises(OSError):
        await connect(proxy)
    assert proxy.tcp_port is not None
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", proxy.tcp_port)
    await proxy.stop()  # idempotent


async def test_limits_connections_and_header_size(
    netns_server: NetnsServer, tmp_path: Path
) -> None:
    p = await start_proxy(
        task_id="t",
        rules=rules(netns_server),
        state_dir=tmp_path,
        audit=AuditLog(tmp_path / "audit.jsonl", key=b"k" * 32),
        resolve_override=names(netns_server),
        limits=Limits(max_connections=2, max_header_bytes=1024, idle_timeout_s=0.5),
    )
    try:
        open_ = [await http_connect(p, f"allowed.test:{netns_server.port}") for _ in range(2)]
        # One over the cap is closed at accept, before a byte of it is read (HTTP or SOCKS
        # alike: the protocol is not known yet), and the closing is on record.
        for _ in range(2):
            reader, writer = await connect(p)
            assert await asyncio.wait_for(reader.read(), 5) == b""
        assert p.open_connections == 2
        assert any("closed at accept" in str(e.get("reason")) for e in await events(p, 3))
        # Idle tunnels are closed after their timeout.
        for _, reader, _ in open_:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        reader, writer = await connect(p)
        writer.write(b"GET http://allowed.test/ HTTP/1.1\r\nX: " + b"a" * 2000 + b"\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431")
    finally:
        await p.stop()


async def test_download_through_the_tunnel_is_complete(
    proxy: EgressProxy, netns_server: NetnsServer
) -> None:
    size = 20 * 1024 * 1024
    _, reader, writer = await http_connect(proxy, f"allowed.test:{netns_server.port}")
    writer.write(f"GET /bytes/{size} HTTP/1.1\r\nHost: allowed.test\r\n\r\n".encode())
    _, body = await read_response(reader)
    assert len(body) == size
    writer.close()
    [event] = await events(proxy, 1)
    assert event["bytes_down"] > size


def test_sync_callers_keep_the_proxy_serving_between_calls(
    netns_server: NetnsServer, tmp_path: Path
) -> None:
    """The proxy lives on the proxy thread: it answers while the starter's loop is idle."""
    p = asyncio.run(
        start_proxy(
            task_id="t",
            rules=rules(netns_server),
            state_dir=tmp_path,
            audit=None,
            resolve_override=names(netns_server),
        )
    )
    try:
        import socket

        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(p.unix_socket))
            sock.sendall(b"CONNECT unlisted.test:443 HTTP/1.1\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 403")
    finally:
        asyncio.run(p.stop())


KILLED_OWNER = textwrap.dedent("""
    import asyncio, sys
    from fusion_oci.egress import EgressRules
    from fusion_oci.egress.task import start_task_proxy
    from fusion_oci.models import PrepareContext, SandboxPolicy

    async def main():
        ctx = PrepareContext(task_id="killed-task", run_id="r", worktree_path=sys.argv[1],
                             policy=SandboxPolicy(network="filtered"))
        proxy, _ = await start_task_proxy(ctx, {"PATH": "/usr/bin:/bin", "HOME": sys.argv[1]},
                                       audit=None, tcp=False, backend="test")
        print(proxy.unix_socket, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def test_socket_folder_removed_by_gc_after_kill_9(tmp_path: Path) -> None:
    from fusion_oci.host.scratch import gc_scratch

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    owner = subprocess.Popen(
        [sys.executable, "-c", KILLED_OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    sock = Path(owner.stdout.readline().strip())
    assert sock.exists() and sock.parent.name.startswith("fusion-oci-egress-killed-task-")
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    owner.stdout.close()
    deadline = time.monotonic() + 5
    while sock.parent.exists() and time.monotonic() < deadline:
        gc_scratch()
        time.sleep(0.05)
    assert not sock.parent.exists()


def _egress_folders() -> set[Path]:
    import tempfile

    from fusion_oci.host.scratch import OWNER_FILE, owner_stamp

    mine = owner_stamp()
    found = set()
    for path in Path(tempfile.gettempdir()).glob("fusion-oci-egress-*"):
        try:
            if (path / OWNER_FILE).read_text() == mine:
                found.add(path)
        except OSError:
            continue
    return found


def test_sandbox_starts_the_proxy_before_prepare_and_removes_it_at_dispose(
    worktree: Path, tmp_path: Path
) -> None:
    """The lifecycle (native: filtered is listed unenforced there, the proxy still runs):
    started at prepare, handed to the runtime in ResolvedTask.egress, serving between
    SyncSandbox calls, audited with the task's ids, gone at dispose."""
    import socket

    from fusion_oci.models import PrepareContext, SandboxPolicy
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.sandbox import SyncSandbox

    before = _egress_folders()
    audit = AuditLog(tmp_path / "audit.jsonl", key=b"k" * 32)
    ctx = PrepareContext(
        task_id="t-egress",
        run_id="r-egress",
        worktree_path=str(worktree),
        policy=SandboxPolicy(network="filtered", denied_domains=["blocked.example.com"]),
    )
    with SyncSandbox(SandboxSettings(backend="native"), audit=audit, env=dict(os.environ)) as sb:
        sb.prepare(ctx)
        proxy = sb.sandbox.egress
        assert proxy is not None and sb.sandbox.task is not None
        assert sb.sandbox.task.egress is proxy
        assert proxy.unix_socket.exists() and proxy.tcp_port is None
        assert proxy.rules.denied == ("blocked.example.com",)
        assert sb.run(["true"]).exit_code == 0
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(proxy.unix_socket))
            sock.sendall(b"CONNECT blocked.example.com:443 HTTP/1.1\r\n\r\n")
            answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 403")
        assert b"remove it from sandbox.policy.deniedDomains" in answer
        folder = proxy.unix_socket.parent
    assert not folder.exists()
    assert sb.sandbox.egress is None
    assert _egress_folders() == before
    egress = [e for e in read_events(tmp_path / "audit.jsonl") if e.type == "sandbox:egress"]
    assert len(egress) == 1
    assert (egress[0].task_id, egress[0].run_id, egress[0].backend) == (
        "t-egress",
        "r-egress",
        "native",
    )
    assert egress[0].allowed is False and egress[0].host == "blocked.example.com"
    assert verify_chain(tmp_path / "audit.jsonl", b"k" * 32).ok


def test_a_failed_prepare_stops_the_proxy(worktree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusion_oci.models import PrepareContext, SandboxPolicy
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.resolve import ResolvedTask
    from fusion_oci.runtimes.native import NativeRuntime
    from fusion_oci.sandbox import SyncSandbox

    seen: list[Path] = []

    async def failing_prepare(self: NativeRuntime, task: ResolvedTask) -> ResolvedTask:
        assert task.egress is not None
        seen.append(task.egress.unix_socket)
        raise OSError("prepare failed on purpose")

    monkeypatch.setattr(NativeRuntime, "prepare", failing_prepare)
    before = _egress_folders()
    ctx = PrepareContext(
        task_id="t-fail",
        run_id="r",
        worktree_path=str(worktree),
        policy=SandboxPolicy(network="filtered"),
    )
    with (
        SyncSandbox(SandboxSettings(backend="native"), env=dict(os.environ)) as sb,
        pytest.raises(OSError, match="on purpose"),
    ):
        sb.prepare(ctx)
    assert seen and not seen[0].parent.exists()
    assert sb.sandbox.egress is None
    assert _egress_folders() == before


async def test_stalled_handshakes_are_closed(netns_server: NetnsServer, tmp_path: Path) -> None:
    """A client that never finishes its request head (HTTP or SOCKS) holds no slot for long."""
    p = await start_proxy(
        task_id="t",
        rules=rules(netns_server),
        state_dir=tmp_path,
        audit=None,
        resolve_override=names(netns_server),
        limits=Limits(handshake_timeout_s=0.3),
    )
    try:
        reader, writer = await connect(p)
        writer.write(b"CONNECT allowed.test:80 HTTP/1.1\r\n")  # no blank line, ever
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 408")
        reader, writer = await connect(p)
        writer.write(b"\x05\x01\x00\x05\x01\x00\x03")  # the address never comes
        assert await asyncio.wait_for(reader.read(), 5) == b"\x05\x00"
        for _ in range(100):
            if p.open_connections == 0:
                break
            await asyncio.sleep(0.02)
        assert p.open_connections == 0
    finally:
        await p.stop()


async def test_a_flood_of_refused_connections_is_audited_within_its_budget(
    proxy: EgressProxy, tmp_path: Path
) -> None:
    """9,000 refused CONNECTs in 5 s wrote 6 MB of audit log before the budget: now the burst
    is written one by one, the rest as counts (fusion_oci/egress/budget.py)."""
    from fusion_oci.egress.budget import BURST

    floods = 1200

    async def one() -> None:
        reader, writer = await asyncio.open_unix_connection(str(proxy.unix_socket))
        writer.write(b"CONNECT nope.invalid:443 HTTP/1.1\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 403")
        writer.close()

    for start in range(0, floods, 32):
        await asyncio.gather(*(one() for _ in range(min(32, floods - start))))
    await proxy.stop()
    events = list(read_events(tmp_path / "audit.jsonl"))
    one_by_one = [e for e in events if e.host == "nope.invalid"]
    summaries = [e for e in events if e.details and "suppressed" in e.details]
    held = sum(n for e in summaries for n in e.details["suppressed"].values())  # type: ignore[union-attr]
    assert BURST <= len(one_by_one) < BURST + 100, len(one_by_one)
    assert summaries and len(one_by_one) + held == floods, (len(one_by_one), held)
    assert verify_chain(tmp_path / "audit.jsonl", key=b"k" * 32).ok
