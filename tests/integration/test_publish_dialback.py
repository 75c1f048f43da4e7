"""A published port's dial-back (gVisor's way, services/publish.py) with the real agent and
relay on this host, no gVisor in between: the agent runs as PID 1 of a pid namespace of its
own (``unshare --pid --fork``, as a sandbox's init is), and its "sandbox port" is a server on
the host's loopback. What gVisor's own run shows end to end (tests/security/
test_published_ports.py ``oci-runsc``) is here under load: many clients at once, half-closes
both ways, byte counts in the audit, a forged token, and the end of the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fusion_oci.agent.client import Agent, agent_binary
from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.models.publishport import make_published
from fusion_oci.services.publish import (
    DIALBACK_TOKEN,
    TaskPorts,
    attach_ports,
    bind_ports,
    stop_ports,
)


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo until the client's end, then a last line and close (a half-close each way)."""
    total = 0
    while data := await reader.read(65536):
        total += len(data)
        writer.write(data)
        await writer.drain()
    writer.write(b"bye %d\n" % total)
    await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def _published(
    tmp_path: Path, *, serve: bool = True
) -> AsyncIterator[tuple[TaskPorts, list[AuditEvent], int]]:
    """The agent dialling back for one published port, whose inside is an echo server on
    the host's loopback (``serve=False``: a port nothing listens on)."""
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    inside = int(server.sockets[0].getsockname()[1])
    if not serve:
        server.close()
        await server.wait_closed()
    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    ports = await bind_ports(
        task_id="dialback",
        entries=[make_published(inside, None, "127.0.0.1")],
        audit=audit,
        backend="test",
        policy_hash=None,
    )
    ports.dial_back = True
    agent_sock = tmp_path / "agent.sock"
    relay = ports.sockets()[0]
    unshare = shutil.which("unshare")
    assert unshare is not None
    proc = await asyncio.create_subprocess_exec(
        unshare, "--pid", "--fork", "--kill-child",
        str(agent_binary()), "--publish", f"{inside}={relay}", "--connect", str(agent_sock),
        stdin=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    agent: Agent | None = None
    try:
        agent = await Agent.accept(agent_sock, expect_pid=None, timeout_s=10)
        await attach_ports(ports)
        yield ports, events, ports.report()[0]["hostPort"]
    finally:
        if agent is not None:
            with contextlib.suppress(Exception):
                await agent.close()
        await stop_ports(ports)
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        server.close()
        await server.wait_closed()


async def _client(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    writer.write_eof()  # the server answers once it sees our end: half-close inwards
    got = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    return got


async def test_many_clients_at_once_each_reach_the_port_inside_with_their_bytes(
    tmp_path: Path,
) -> None:
    async with _published(tmp_path) as (_, events, port):
        payloads = [bytes([i]) * (1000 * (i + 1)) for i in range(24)]
        answers = await asyncio.gather(*(_client(port, p) for p in payloads))
        for p, got in zip(payloads, answers, strict=True):
            assert got == p + b"bye %d\n" % len(p)
        for _ in range(100):  # each connection's end is audited as the agent reports it
            inbound = [e for e in events if e.type == "sandbox:inbound" and e.allowed]
            if len(inbound) == len(payloads):
                break
            await asyncio.sleep(0.05)
        assert sorted(e.bytes_up or 0 for e in inbound) == sorted(len(p) for p in payloads)
        assert all(e.reason is None for e in inbound)


async def test_a_forged_token_reaches_nothing_and_the_port_still_works(tmp_path: Path) -> None:
    async with _published(tmp_path) as (ports, _, port):
        loop = asyncio.get_running_loop()
        forged = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        forged.setblocking(False)
        await loop.sock_connect(forged, ports.sockets()[0])
        await loop.sock_sendall(forged, b"A" + bytes(DIALBACK_TOKEN))
        assert await asyncio.wait_for(loop.sock_recv(forged, 1), 5) == b""  # closed
        forged.close()
        # A second agent ('I') is closed too: the place is taken.
        second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        second.setblocking(False)
        await loop.sock_connect(second, ports.sockets()[0])
        await loop.sock_sendall(second, b"I")
        assert await asyncio.wait_for(loop.sock_recv(second, 1), 5) == b""
        second.close()
        assert await _client(port, b"still") == b"still" + b"bye 5\n"


async def test_nothing_listening_inside_is_refused_and_audited_and_stop_closes(
    tmp_path: Path,
) -> None:
    async with _published(tmp_path, serve=False) as (_, events, port):
        # The agent's connect was refused: the client is closed (reset: it had sent bytes).
        with contextlib.suppress(ConnectionResetError):
            assert await _client(port, b"anyone?") == b""
        for _ in range(100):
            refused = [e for e in events if e.type == "sandbox:inbound" and not e.allowed]
            if refused:
                break
            await asyncio.sleep(0.05)
        assert refused and "nothing accepted the connection" in (refused[0].reason or "")
    with pytest.raises(OSError):  # the host's port is closed once stopped
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
