"""The exec agent over a byte stream (fusion_oci/agent/mux.py and streamed.py), run for real:
what the socket transport cannot show (flow control both ways, the stream cut, the far end
killed). The run contract itself is tests/integration/test_agent.py, over both transports."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.agent.bytestream import PipeStream
from fusion_oci.agent.client import agent_binary
from fusion_oci.agent.protocol import encode, encode_bytes
from fusion_oci.agent.streamed import MUX, StreamedAgent, mux_argv
from fusion_oci.errors import AgentLostError, SandboxSetupError
from tests.hostside import pids_with
from tests.integration.test_agent import ENV, MUX_ARGV, alive, appears, gone, marker, sh

pytestmark = pytest.mark.native

MB = 1 << 20
MUX_MEMORY_BOUND = 40 * MB
"""The mux's peak RSS while 50 MB cross it: a Python at rest is ~10 MB, the windows a few MB;
without flow control the 50 MB would pile up in it."""


def ends(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


@pytest.fixture
async def streamed() -> AsyncIterator[StreamedAgent]:
    a = await StreamedAgent.start(MUX_ARGV)
    try:
        yield a
    finally:
        await a.close()
    assert a.peer_pid is not None and not alive(a.peer_pid)
    assert a.agent_pid is not None and not alive(a.agent_pid)


async def test_fifty_mb_of_output_to_a_slow_reader_stays_bounded_in_the_mux(
    streamed: StreamedAgent,
) -> None:
    got = 0

    async def slow(name: str, chunk: bytes) -> None:
        nonlocal got
        got += len(chunk)
        await asyncio.sleep(0.002)  # a consumer behind the command: the mux must wait for it

    r = await streamed.run(
        ["head", "-c", str(50 * MB), "/dev/zero"],
        env=ENV,
        on_output=slow,
        keep_output=False,
        timeout_s=120,
    )
    assert (r.returncode, got) == (0, 50 * MB)  # all of it, before X
    assert streamed.peer_pid is not None
    assert peak_rss(streamed.peer_pid) < MUX_MEMORY_BOUND


async def test_output_is_complete_when_the_run_ends(streamed: StreamedAgent) -> None:
    """X goes out after the run's last data frame: every byte, in order, also with a
    consumer that keeps the mux waiting."""
    payload = os.urandom(3 * MB)
    seen = bytearray()

    async def slow(name: str, chunk: bytes) -> None:
        seen.extend(chunk)
        await asyncio.sleep(0)

    r = await streamed.run(["cat"], env=ENV, stdin=payload, on_output=slow)
    assert (r.returncode, r.stdout, bytes(seen)) == (0, payload, payload)


async def test_fifty_mb_of_stdin_is_sent_within_the_window(streamed: StreamedAgent) -> None:
    sent = 0

    async def source() -> AsyncIterator[bytes]:
        nonlocal sent
        chunk = b"\0" * (64 << 10)
        while sent < 50 * MB:
            sent += len(chunk)
            yield chunk

    # The command reads nothing for a second: only the window (and a pipe) may cross.
    task = asyncio.ensure_future(
        streamed.run(sh("sleep 1; cat >/dev/null; echo done"), env=ENV, stdin=source())
    )
    await asyncio.sleep(0.7)
    assert sent <= 2 * MB + (64 << 10)
    r = await asyncio.wait_for(task, 60)
    assert (r.returncode, r.stdout, sent) == (0, b"done\n", 50 * MB)
    assert streamed.peer_pid is not None
    assert peak_rss(streamed.peer_pid) < MUX_MEMORY_BOUND


async def test_a_command_that_closes_its_stdin_stops_the_sender(streamed: StreamedAgent) -> None:
    r = await asyncio.wait_for(
        streamed.run(sh("exec 0<&-; sleep 0.2; echo closed"), env=ENV, stdin=os.urandom(20 * MB)),
        20,
    )
    assert (r.returncode, r.stdout) == (0, b"closed\n")
    r = await streamed.run(["head", "-c", "5"], env=ENV, stdin=b"x" * (8 * MB))
    assert (r.returncode, r.stdout) == (0, b"xxxxx")


async def test_a_stalled_consumer_holds_up_only_its_own_run(streamed: StreamedAgent) -> None:
    release = asyncio.Event()

    async def stalled(name: str, chunk: bytes) -> None:
        await release.wait()

    blocked = asyncio.ensure_future(
        streamed.run(["head", "-c", str(5 * MB), "/dev/zero"], env=ENV, on_output=stalled)
    )
    await asyncio.sleep(0.3)
    start = time.monotonic()
    r = await asyncio.wait_for(streamed.run(sh("echo free"), env=ENV), 5)
    assert r.stdout == b"free\n" and time.monotonic() - start < 1
    assert not blocked.done()
    release.set()
    done = await asyncio.wait_for(blocked, 30)
    assert (done.returncode, done.stdout, done.truncated) == (0, b"\0" * 5 * MB, False)


async def test_truncation_at_max_buffer_over_the_stream(streamed: StreamedAgent) -> None:
    r = await streamed.run(["head", "-c", str(8 * MB), "/dev/zero"], env=ENV, max_buffer=MB)
    assert r.truncated and len(r.stdout) == MB
    assert r.returncode == 0 or r.signal in ("SIGTERM", "SIGPIPE")


async def test_the_stream_cut_mid_run_is_a_lost_agent_and_the_tree_goes() -> None:
    """The stream is a socket here (as a websocket would be, not a pipe): cut both ways, the
    run fails as agent-lost, and the far end ends the command's whole tree."""
    tag = marker("cut")
    ours, theirs = socket.socketpair()
    mux = await asyncio.create_subprocess_exec(
        *MUX_ARGV, stdin=theirs.fileno(), stdout=theirs.fileno(), start_new_session=True
    )
    theirs.close()
    try:
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        a = await StreamedAgent.over(PipeStream(reader, writer), timeout_s=10)
        task = asyncio.ensure_future(a.run(sh(f"sh -c 'sleep 1000; :' {tag}"), env=ENV))
        assert await asyncio.to_thread(appears, tag)
        ours.shutdown(socket.SHUT_RDWR)
        with pytest.raises(AgentLostError) as info:
            await asyncio.wait_for(task, 10)
        assert info.value.kind == "agent-lost"
        with pytest.raises(AgentLostError):
            await a.run(["true"], env=ENV)
        assert await asyncio.to_thread(gone, tag, 5.0)
        assert await asyncio.wait_for(mux.wait(), 10) == 0
        assert a.agent_pid is not None and not alive(a.agent_pid)
        await a.close()
    finally:
        if mux.returncode is None:
            mux.kill()
            await mux.wait()


async def test_the_mux_killed_is_a_lost_agent_and_the_tree_goes() -> None:
    tag = marker("muxkill")
    a = await StreamedAgent.start(MUX_ARGV)
    assert a.peer_pid is not None and a.agent_pid is not None
    task = asyncio.ensure_future(a.run(sh(f"sh -c 'sleep 1000; :' {tag}"), env=ENV))
    await asyncio.sleep(0.4)
    assert pids_with(tag)
    os.kill(a.peer_pid, signal.SIGKILL)
    with pytest.raises(AgentLostError):
        await asyncio.wait_for(task, 10)
    await asyncio.wait_for(a.close(), 10)
    assert await asyncio.to_thread(gone, tag, 5.0)  # the agent saw its socket close
    assert await asyncio.to_thread(ends, a.agent_pid)


async def test_a_far_end_that_cannot_start_is_a_setup_error_with_its_reason(
    tmp_path: Path,
) -> None:
    with pytest.raises(SandboxSetupError) as info:
        await StreamedAgent.start(mux_argv(tmp_path / "no-agent", python="python3"))
    assert "no-agent" in info.value.why  # the mux's traceback tail, from its stderr
    with pytest.raises(SandboxSetupError):
        await StreamedAgent.start([str(tmp_path / "no-such-program")])


async def test_closing_the_stream_ends_running_trees() -> None:
    tag = marker("close")
    a = await StreamedAgent.start(MUX_ARGV)
    task = asyncio.ensure_future(a.run(sh(f"sh -c 'sleep 1000; :' {tag}"), env=ENV))
    await asyncio.sleep(0.4)
    await asyncio.wait_for(a.close(), 20)
    with pytest.raises(AgentLostError):
        await task
    assert await asyncio.to_thread(gone, tag, 3.0)
    assert a.agent_pid is not None and not alive(a.agent_pid)


def test_the_mux_is_not_dumpable() -> None:
    """As the agent: a command of the mux's uid can neither ptrace it nor open its stream."""
    probe = (
        f"import sys, ctypes; sys.path.insert(0, {str(MUX.parent)!r}); import mux; "
        "print(mux.undumpable(), ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))"  # PR_GET_DUMPABLE
    )
    out = subprocess.run(
        ["python3", "-S", "-E", "-s", "-c", probe], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "0"], out


class _ScriptedStream:
    """A ByteStream of another kind (as a websocket is): it says hello, then fails with an
    error of its own, not an OSError."""

    def __init__(self, hello: bytes) -> None:
        self.incoming: asyncio.Queue[bytes | BaseException] = asyncio.Queue()
        self.incoming.put_nowait(hello)
        self.written: list[bytes] = []

    async def read(self, n: int) -> bytes:
        item = await self.incoming.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def write(self, data: bytes) -> None:
        self.written.append(data)

    def describe(self) -> str:
        return "a scripted stream"

    async def close(self) -> None:
        return None


async def test_a_stream_failing_its_own_way_is_a_lost_agent_not_a_hang() -> None:
    from fusion_oci.agent.protocol import encode

    stream = _ScriptedStream(encode(b"H", [("version", "1"), ("pid", "9"), ("window", "65536")]))
    a = await StreamedAgent.over(stream, timeout_s=5)
    assert a.agent_pid == 9
    task = asyncio.ensure_future(a.run(["true"], env=ENV))
    await asyncio.sleep(0.05)
    assert stream.written and stream.written[0][4:5] == b"S"  # the spawn went out
    stream.incoming.put_nowait(RuntimeError("websocket: close 1006 (abnormal closure)"))
    with pytest.raises(AgentLostError) as info:
        await asyncio.wait_for(task, 5)
    assert "1006" in info.value.why
    await a.close()


async def test_a_far_end_that_is_not_the_mux_is_refused() -> None:
    from fusion_oci.agent.protocol import encode

    stream = _ScriptedStream(encode(b"H", [("version", "1"), ("pid", "1")]))  # an agent's own
    with pytest.raises(SandboxSetupError) as info:
        await StreamedAgent.over(stream, timeout_s=5)
    assert "not mux.py" in info.value.what


async def test_a_far_end_that_floods_past_its_credit_is_a_lost_agent() -> None:
    """The pod is the command's: a mux it took over could send output without end. The host
    holds at most one window per run unacknowledged; past it the stream is not trusted."""
    from fusion_oci.agent.protocol import STDOUT, decode_fields, encode, encode_data

    stream = _ScriptedStream(encode(b"H", [("version", "1"), ("pid", "9"), ("window", "65536")]))
    a = await StreamedAgent.over(stream, timeout_s=5)
    task = asyncio.ensure_future(a.run(["true"], env=ENV, on_output=lambda s, d: asyncio.sleep(1)))
    await asyncio.sleep(0.05)
    spawn = b"".join(stream.written)
    run_id = decode_fields(spawn[5 : 4 + int.from_bytes(spawn[:4], "big")])["id"]
    # 1.25 MiB in one read against a 64 KiB window (and the 1 MiB a finished run's pipes
    # may still hold): the consumer takes the first chunk (and credits it back), then waits
    stream.incoming.put_nowait(
        b"".join(encode_data(run_id, STDOUT, b"x" * (32 << 10)) for _ in range(40))
    )
    with pytest.raises(AgentLostError) as info:
        await asyncio.wait_for(task, 5)
    assert "past its credit" in info.value.why
    await a.close()


# --- egress back through the stream (mux.py --egress-listen; agent/tunnel.py) ------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeProxy:
    """A unix socket server standing in for the task's egress proxy: per connection it reads
    to the end (or ``hold_s`` later), then answers with what ``answer`` makes of it and closes."""

    def __init__(self, path: Path, answer: Callable[[bytes], bytes], hold_s: float = 0.0) -> None:
        self.path = path
        self.answer = answer
        self.hold_s = hold_s
        self.server: asyncio.AbstractServer | None = None
        self.connections = 0

    async def __aenter__(self) -> FakeProxy:
        self.server = await asyncio.start_unix_server(self._serve, str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await asyncio.sleep(self.hold_s)
        got = await reader.read()  # to the command's half-close
        writer.write(self.answer(got))
        await writer.drain()
        writer.close()

    def dial(self) -> Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        return asyncio.open_unix_connection(str(self.path))


async def exchange(port: int, payload: bytes, read_delay_s: float = 0.0) -> bytes:
    """Connect as a command would, send everything, half-close, read the answer to its end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        writer.write_eof()
        await asyncio.sleep(read_delay_s)
        return await reader.read()
    finally:
        writer.close()  # also when refused: a reset may come at any step


async def test_egress_bytes_cross_both_ways_with_half_close(tmp_path: Path) -> None:
    port = free_port()
    payload = os.urandom(3 * MB)
    async with FakeProxy(tmp_path / "p.sock", lambda b: hashlib.sha256(b).digest() * 2) as proxy:
        a = await StreamedAgent.start(
            mux_argv(agent_binary(), python="python3", egress_listen=port), egress=proxy.dial
        )
        try:
            # concurrent connections, each its own answer; the agent's runs go on beside them
            answers = await asyncio.gather(*(exchange(port, payload[i:]) for i in range(8)))
            assert answers == [hashlib.sha256(payload[i:]).digest() * 2 for i in range(8)]
            r = await a.run(sh("echo still"), env=ENV)
            assert r.stdout == b"still\n"
            # a command in the sandbox, through its own socket (not the test's)
            script = (
                "import socket,sys; s=socket.create_connection(('127.0.0.1',PORT)); "
                "s.sendall(b'x'*100000); s.shutdown(socket.SHUT_WR); "
                "d=b''.join(iter(lambda: s.recv(65536), b'')); sys.stdout.write(d.hex())"
            ).replace("PORT", str(port))
            r = await a.run(["python3", "-c", script], env=ENV, timeout_s=30)
            assert r.stdout.decode() == (hashlib.sha256(b"x" * 100000).digest() * 2).hex()
            assert proxy.connections == 9 and a._tunnels.open == 0
        finally:
            await a.close()


async def test_egress_a_slow_side_never_piles_up(tmp_path: Path) -> None:
    """The proxy takes nothing for a second while 40 MB come, then the command reads its
    40 MB answer slowly: within the windows both ways, the mux's memory stays bounded."""
    port = free_port()
    size = 40 * MB
    async with FakeProxy(tmp_path / "p.sock", lambda b: b * 2, hold_s=1.0) as proxy:
        a = await StreamedAgent.start(
            mux_argv(agent_binary(), python="python3", egress_listen=port), egress=proxy.dial
        )
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            sent = 0

            async def send() -> None:
                nonlocal sent
                chunk = b"y" * (1 << 16)
                while sent < size // 2:
                    writer.write(chunk)
                    await writer.drain()
                    sent += len(chunk)
                writer.write_eof()

            sender = asyncio.ensure_future(send())
            await asyncio.sleep(0.6)
            # the proxy holds: what crossed is the windows and the sockets' buffers, no more
            assert sent < 12 * MB
            await asyncio.wait_for(sender, 60)
            got = 0
            while chunk := await reader.read(1 << 16):
                got += len(chunk)
                await asyncio.sleep(0.0005)  # a slow reader in the pod
            writer.close()
            assert got == size
            assert a.peer_pid is not None
            assert peak_rss(a.peer_pid) < MUX_MEMORY_BOUND
        finally:
            await a.close()


async def test_egress_without_a_dialer_or_a_proxy_is_refused(tmp_path: Path) -> None:
    port = free_port()
    a = await StreamedAgent.start(mux_argv(agent_binary(), python="python3", egress_listen=port))
    try:
        # refused: closed at once (the command's half-close may already find it gone)
        with contextlib.suppress(OSError):
            assert (
                await asyncio.wait_for(exchange(port, b"CONNECT x:443 HTTP/1.1\r\n\r\n"), 5) == b""
            )
    finally:
        await a.close()

    async def nowhere() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(str(tmp_path / "absent.sock"))

    a = await StreamedAgent.start(
        mux_argv(agent_binary(), python="python3", egress_listen=port), egress=nowhere
    )
    try:
        with contextlib.suppress(OSError):
            assert await asyncio.wait_for(exchange(port, b"GET / HTTP/1.1\r\n\r\n"), 5) == b""
        r = await a.run(sh("echo alive"), env=ENV)  # a refused connection harms nothing else
        assert r.stdout == b"alive\n"
    finally:
        await a.close()


async def test_egress_a_taken_port_fails_the_start_closed() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(SandboxSetupError) as info:
            await StreamedAgent.start(
                mux_argv(agent_binary(), python="python3", egress_listen=port),
                egress=lambda: asyncio.open_connection("127.0.0.1", 9),
            )
        assert "cannot listen" in info.value.why


async def test_egress_a_mux_without_the_listener_is_refused() -> None:
    with pytest.raises(SandboxSetupError) as info:
        await StreamedAgent.start(MUX_ARGV, egress=lambda: asyncio.open_connection("127.0.0.1", 9))
    assert "does not carry egress" in info.value.what


HOSTILE = {
    "unknown id": lambda: encode_bytes(7, b"x"),
    "open out of order": lambda: encode(b"O", [("id", "5")]),
    "past credit": lambda: encode(b"O", [("id", "1")]) + encode_bytes(1, b"z" * (80 << 10)),
    "too many": lambda: b"".join(encode(b"O", [("id", str(i))]) for i in range(1, 514)),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_egress_a_hostile_far_end_is_a_lost_agent(case: str, tmp_path: Path) -> None:
    hello = encode(
        b"H", [("version", "1"), ("pid", "9"), ("window", "65536"), ("egress_window", "65536")]
    )
    stream = _ScriptedStream(hello)
    # a proxy that never reads: what the far end sends is held by this side until credited
    hold = await asyncio.start_unix_server(
        lambda r, w: asyncio.sleep(30), str(tmp_path / "hold.sock")
    )
    try:
        a = await StreamedAgent.over(
            stream, 5, egress=lambda: asyncio.open_unix_connection(str(tmp_path / "hold.sock"))
        )
        task = asyncio.ensure_future(a.run(["true"], env=ENV))
        await asyncio.sleep(0.05)
        stream.incoming.put_nowait(HOSTILE[case]())
        with pytest.raises(AgentLostError):
            await asyncio.wait_for(task, 5)
        assert a.lost and a._tunnels.open == 0
        await a.close()
    finally:
        hold.close()


async def test_egress_an_open_in_the_hellos_own_read_is_relayed(tmp_path: Path) -> None:
    """The mux accepts right after its hello: an O may come in the same read, before the
    host's setup has returned; it is relayed, not refused."""
    hello = encode(
        b"H", [("version", "1"), ("pid", "9"), ("window", "65536"), ("egress_window", "65536")]
    )
    stream = _ScriptedStream(hello + encode(b"O", [("id", "1")]) + encode_bytes(1, b"ping"))
    async with FakeProxy(tmp_path / "p.sock", lambda b: b"pong:" + b) as proxy:
        a = await StreamedAgent.over(stream, 5, egress=proxy.dial)
        stream.incoming.put_nowait(encode_bytes(1, b""))  # the command's half-close
        for _ in range(100):
            if any(w.startswith(encode_bytes(1, b"pong:ping")) for w in stream.written):
                break
            await asyncio.sleep(0.02)
        sent = b"".join(stream.written)
        assert encode_bytes(1, b"pong:ping") in sent
        assert encode(b"C", [("id", "1")]) not in sent  # not refused
        assert encode_bytes(1, b"") in sent  # the proxy's end, passed on
        await a.close()


# --- host services back through the stream (mux.py --service-listen; the grant's relay) --------


class Service:
    """A TCP server on the host's loopback standing in for a granted service: per connection
    it reads to the end and answers its name and the bytes' hash."""

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.port = 0
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> Service:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        got = await reader.read()
        writer.write(self.name + b":" + hashlib.sha256(got).digest() * 64)
        await writer.drain()
        writer.close()


async def test_service_bytes_cross_whole_to_the_granted_address_only(tmp_path: Path) -> None:
    """Two listeners of the mux, each answered with its own grant's relay (the task's relays,
    which connect to the grant and audit each connection): every byte arrives both ways, each
    listener's connections reach its own grant and no other."""
    from fusion_oci.audit import AuditEvent, AuditLog
    from fusion_oci.models.hostservice import parse_grant
    from fusion_oci.services import start_relays, stop_relays
    from fusion_oci.services.handover import dial_spliced

    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    ports = [free_port(), free_port()]
    payload = os.urandom(3 * MB)
    async with Service(b"first") as first, Service(b"second") as second:
        grants = [f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"]
        relays = await start_relays(
            task_id="svc-stream",
            grants=[(parse_grant(g), False) for g in grants],
            audit=audit,
            tcp=False,
            backend="kubernetes",
            policy_hash=None,
        )
        sockets = relays.sockets()
        a = await StreamedAgent.start(
            mux_argv(
                agent_binary(), python="python3", service_listen=[f"127.0.0.1:{p}" for p in ports]
            ),
            services=[functools.partial(dial_spliced, sockets[g]) for g in grants],
        )
        try:
            answers = await asyncio.gather(*(exchange(ports[i % 2], payload[i:]) for i in range(6)))
            for i, answer in enumerate(answers):
                name = b"first" if i % 2 == 0 else b"second"
                assert answer == name + b":" + hashlib.sha256(payload[i:]).digest() * 64
            assert (first.connections, second.connections) == (3, 3)
            r = await a.run(sh("echo still"), env=ENV)  # the runs go on beside them
            assert r.stdout == b"still\n"
            assert a._tunnels.open == 0
        finally:
            await a.close()
            await stop_relays(relays)
    seen = [e for e in events if e.type == "sandbox:egress"]
    assert sorted((e.details or {}).get("service") for e in seen) == sorted(grants * 3)
    assert all(e.allowed and e.bytes_up and e.bytes_down for e in seen), seen


async def test_service_a_listener_the_host_did_not_set_up_is_a_lost_agent(
    tmp_path: Path,
) -> None:
    """The far end names a listener by index; one this host did not set up (or a malformed
    one) breaks the stream; a listener's connection dials that listener's own dialer."""
    dialled: list[str] = []

    def dialer(name: str) -> Callable[[], Awaitable[tuple[Any, Any]]]:
        async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            dialled.append(name)
            return await asyncio.open_unix_connection(str(tmp_path / "absent.sock"))

        return dial

    hello = encode(
        b"H",
        [("version", "1"), ("pid", "9"), ("window", "65536"), ("egress_window", "65536"),
         ("services", "2")],
    )  # fmt: skip
    for bad in ("2", "-1", "x", "01", ""):
        stream = _ScriptedStream(hello)
        a = await StreamedAgent.over(stream, 5, services=[dialer("zero"), dialer("one")])
        stream.incoming.put_nowait(encode(b"O", [("id", "1"), ("listener", "1")]))
        for _ in range(100):
            if encode(b"C", [("id", "1")]) in b"".join(stream.written):
                break  # dialled (nowhere: refused) and said so
            await asyncio.sleep(0.02)
        task = asyncio.ensure_future(a.run(["true"], env=ENV))
        await asyncio.sleep(0.05)
        stream.incoming.put_nowait(encode(b"O", [("id", "2"), ("listener", bad)]))
        with pytest.raises(AgentLostError):
            await asyncio.wait_for(task, 5)
        assert a.lost and a._tunnels.open == 0, bad
        await a.close()
    assert dialled == ["one"] * 5  # the listener's own dialer, never another; no egress


async def test_service_a_mux_without_the_listeners_is_refused() -> None:
    dial = functools.partial(asyncio.open_connection, "127.0.0.1", 9)
    with pytest.raises(SandboxSetupError) as info:
        await StreamedAgent.start(MUX_ARGV, services=[dial])
    assert "host services" in info.value.what
    port = free_port()
    with pytest.raises(SandboxSetupError) as info:  # one listener for a host that set up two
        await StreamedAgent.start(
            mux_argv(agent_binary(), python="python3", service_listen=[f"127.0.0.1:{port}"]),
            services=[dial, dial],
        )
    assert "host services" in info.value.what


async def test_service_an_ipv6_listener_takes_only_its_own_family() -> None:
    """``[::1]:PORT`` listens on ::1 only (IPV6_V6ONLY): the same port on 127.0.0.1 is not
    its; a port taken by another fails the start closed."""
    port = free_port()
    # these machines have ::1 (the host-service probes use it too): a missing one fails here
    assert socket.has_ipv6 and _has_ipv6_loopback(), "no IPv6 loopback on this machine"
    async with Service(b"v6") as svc:
        a = await StreamedAgent.start(
            mux_argv(agent_binary(), python="python3", service_listen=[f"[::1]:{port}"]),
            services=[functools.partial(asyncio.open_connection, "127.0.0.1", svc.port)],
        )
        try:
            reader, writer = await asyncio.open_connection("::1", port)
            writer.write(b"ping")
            writer.write_eof()
            assert (await reader.read()).startswith(b"v6:")
            writer.close()
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", port)
        finally:
            await a.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(SandboxSetupError) as info:
            await StreamedAgent.start(
                mux_argv(
                    agent_binary(),
                    python="python3",
                    service_listen=[f"127.0.0.1:{taken.getsockname()[1]}"],
                ),
                services=[functools.partial(asyncio.open_connection, "127.0.0.1", 9)],
            )
        assert "cannot listen" in info.value.why


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def test_service_a_unix_grant_listens_at_its_path_and_reaches_its_socket_only(
    tmp_path: Path,
) -> None:
    """``--service-listen unix:/PATH`` (a unix grant on kubernetes): the mux makes the
    socket's folder and listens at PATH; a connection there is carried to the grant's relay,
    which connects to the granted socket only and audits it; the socket at that path is the
    mux's own and an existing file there fails the start closed."""
    from fusion_oci.audit import AuditEvent, AuditLog
    from fusion_oci.models.hostservice import parse_grant
    from fusion_oci.services import start_relays, stop_relays

    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    served = tmp_path / "host" / "svc.sock"
    served.parent.mkdir()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got = await reader.read()
        writer.write(b"unix:" + hashlib.sha256(got).digest())
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(answer, str(served))
    grant = f"unix:{served}"
    relays = await start_relays(
        task_id="svc-unix-stream",
        grants=[(parse_grant(grant), False)],
        audit=audit,
        tcp=False,
        backend="kubernetes",
        policy_hash=None,
    )
    inside = tmp_path / "pod" / "run" / "s.sock"  # its folder does not exist yet
    payload = os.urandom(MB)
    try:
        a = await StreamedAgent.start(
            mux_argv(agent_binary(), python="python3", service_listen=[f"unix:{inside}"]),
            services=[functools.partial(asyncio.open_unix_connection, relays.sockets()[grant])],
        )
        try:
            for _ in range(3):
                reader, writer = await asyncio.open_unix_connection(str(inside))
                writer.write(payload)
                await writer.drain()
                writer.write_eof()
                assert await reader.read() == b"unix:" + hashlib.sha256(payload).digest()
                writer.close()
        finally:
            await a.close()
        with pytest.raises(SandboxSetupError):  # the path is taken: never replaced
            (tmp_path / "taken.sock").write_text("")
            await StreamedAgent.start(
                mux_argv(
                    agent_binary(),
                    python="python3",
                    service_listen=[f"unix:{tmp_path / 'taken.sock'}"],
                ),
                services=[functools.partial(asyncio.open_unix_connection, str(served))],
            )
    finally:
        await stop_relays(relays)
        server.close()
        await server.wait_closed()
    seen = [e for e in events if e.type == "sandbox:egress"]
    assert [(e.details or {}).get("service") for e in seen] == [grant] * 3, seen
    assert all(e.allowed and e.bytes_up and e.bytes_down for e in seen), seen


# --- published ports through the stream (mux.py --publish-port; a client of the host's) ------


async def _echo_server() -> tuple[asyncio.Server, int]:
    """A server on this machine's 127.0.0.1 standing in for a dev server in the pod: it echoes
    each connection's bytes back, upper-cased, and closes at the client's end."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write((await reader.read()).upper())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


async def _through(a: StreamedAgent, port: int, data: bytes) -> tuple[bytes, tuple[int, int, int]]:
    """A host client's connection carried to ``port``: what it got back, and the result."""
    ours, theirs = socket.socketpair()
    carried = asyncio.ensure_future(a.inbound(port, theirs))
    reader, writer = await asyncio.open_connection(sock=ours)
    writer.write(data)
    writer.write_eof()
    try:
        got = await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:  # refused: closed with our bytes unread
        got = b""
    writer.close()
    return got, await asyncio.wait_for(carried, 10)


async def test_published_a_hosts_client_reaches_the_published_port_only() -> None:
    """The host asks the far end (``N``) for the pod's 127.0.0.1:PORT; it connects only to a
    port it was started with: another port is EPERM, a published port with nothing on it
    ECONNREFUSED, each one an O the host counts; bytes and half-close cross both ways."""
    server, port = await _echo_server()
    other, other_port = await _echo_server()  # listening, but not published
    empty = free_port()  # published, nothing listening
    a = await StreamedAgent.start(
        mux_argv(agent_binary(), python="python3", publish_ports=[port, empty]), published=2
    )
    try:
        got, result = await _through(a, port, b"hello" * 20_000)
        assert got == b"HELLO" * 20_000
        assert result == (100_000, 100_000, 0)
        assert (await _through(a, other_port, b"x"))[1] == (0, 0, 1)  # EPERM: not published
        assert (await _through(a, empty, b"x"))[1] == (0, 0, 111)  # ECONNREFUSED
        results = await asyncio.gather(*(_through(a, port, b"%d" % i) for i in range(20)))
        assert [g for g, _ in results] == [b"%d" % i for i in range(20)]
        run = await a.run(["echo", "still"], env=ENV)
        assert run.stdout == b"still\n"
    finally:
        await a.close()
        server.close()
        other.close()


async def test_published_a_mux_without_the_ports_is_refused_and_a_forged_answer_is_lost() -> None:
    with pytest.raises(SandboxSetupError) as info:
        await StreamedAgent.start(MUX_ARGV, published=1)
    assert "published ports" in info.value.what
    hello = encode(
        b"H",
        [("version", "1"), ("pid", "9"), ("window", "65536"), ("egress_window", "65536"),
         ("publish", "1")],
    )  # fmt: skip
    stream = _ScriptedStream(hello)
    a = await StreamedAgent.over(stream, 5, published=1)
    task = asyncio.ensure_future(a.run(["true"], env=ENV))
    await asyncio.sleep(0.05)
    # an answer to a connection this host never asked for: the stream is not trusted
    stream.incoming.put_nowait(encode(b"O", [("id", "1"), ("inbound", "7")]))
    with pytest.raises(AgentLostError):
        await asyncio.wait_for(task, 5)
    assert a.lost
    await a.close()
