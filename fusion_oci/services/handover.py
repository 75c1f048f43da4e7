"""Host sockets handed to a sandbox's exec agent (``SCM_RIGHTS``), and to whom.

A TCP grant's connection is moved by the agent itself when it can (no host process in the data
path): the relay hands it the socket connected to the grant (:func:`hand_over`), or keeps a
pool of unconnected host sockets in its hands (:data:`POOL`; :meth:`TaskRelays._pool
<fusion_oci.services.relay.TaskRelays._pool>`). A host socket in a sandbox is a way out if a
command holds it (an unconnected one connects anywhere on the host's loopback, and
``connect(AF_UNSPEC)`` disconnects a connected one), so sockets go only to the sandbox's init,
the agent (:func:`dialled_by_sandbox_init`).
"""

from __future__ import annotations

import array
import asyncio
import errno
import socket
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path

POOL = 8
"""Unconnected sockets a sandbox's agent holds per TCP grant (agent.c's FWD_POOL)."""
GIVE_AT_ONCE = 4
"""Sockets per message to the agent (agent.c's FDS_PER_BYTE): it reports handed-over
connections half a pool at a time, and gets as many back in one message."""
RECORD = 32
RECORD_FORMAT = struct.Struct("!c3xIQQI4x")
"""The agent's record on its pool connection: type (``O`` a socket taken, ``D`` a connection
done), id, bytes to the service, bytes from it, the connect's errno (0: it connected)."""


def _nspid(pid: int | str) -> list[int] | None:
    """``pid``'s ids from its own pid namespace up to ours (``NSpid``), outermost first."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return None


def dialled_by_sandbox_init(sock: socket.socket) -> bool:
    """Whether the peer of the connected unix socket ``sock`` is PID 1 of a pid namespace
    one level below ours: a sandbox's exec agent (bubblewrap ``--as-pid-1``, a container's
    init). A command never is: it is not its sandbox's init, and a pid namespace a command
    makes is a level further down. Checked while the peer holds the connection open (its
    pid cannot be reused meanwhile).

    Under gVisor every dialer inside is, to the host, gVisor's own process, the init of its
    own pid namespace: True for a command too. Its runtime therefore turns the handing off
    (:attr:`TaskRelays.hand_sockets <fusion_oci.services.relay.TaskRelays.hand_sockets>`,
    :attr:`TaskPorts.dial_back <fusion_oci.services.publish.TaskPorts.dial_back>`) rather
    than count on gVisor dropping the sockets."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid = struct.unpack("3i", creds)[0]
    if pid <= 0:  # the dialer is in a pid namespace we cannot see
        return False
    theirs, ours = _nspid(pid), _nspid("self")
    return (
        theirs is not None and ours is not None and len(theirs) == len(ours) + 1 and theirs[-1] == 1
    )


async def hand_over(
    down: socket.socket, up: socket.socket, *, give: bool = True
) -> dict[str, int] | None:
    """Give ``up`` (connected to the grant) to the agent at ``down``; once it has it, wait
    for the connection's end and return its byte counts. None when the agent asks the
    relay to splice (no fd arrived, or ``give`` is False: the byte goes alone); OSError when
    it went away."""
    loop = asyncio.get_running_loop()
    try:
        fds = []
        if give and dialled_by_sandbox_init(down):
            fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [up.fileno()]))]
        down.sendmsg([b"\x01"], fds)
        # No timeout of its own: the agent answers at once, or its sandbox ended (EOF);
        # the task's stop cancels this like any connection.
        answer = await loop.sock_recv(down, 1)
    except BaseException:
        up.close()
        down.close()
        raise
    if answer == b"S":
        return None
    # Ours is a second reference to the agent's socket: the connection is the agent's now.
    up.close()
    if answer != b"K" or not fds:
        down.close()
        raise OSError(errno.EPROTO, "the dialer neither took the socket nor asked to splice")
    counts = b""
    try:
        while len(counts) < 16:
            part = await loop.sock_recv(down, 16 - len(counts))
            if not part:
                break
            counts += part
    finally:
        down.close()
    if len(counts) < 16:  # the sandbox ended before the agent could say
        return {"up": 0, "down": 0}
    return {"up": int.from_bytes(counts[:8], "big"), "down": int.from_bytes(counts[8:], "big")}


Record = tuple[bytes, int, int, int, int]
"""One agent record: kind, id, bytes to the far side, bytes back, the connect's errno."""


async def agent_records(sock: socket.socket) -> AsyncIterator[Record]:
    """The agent's records on a pool or inbound connection (:data:`RECORD_FORMAT`), in order,
    until it closes the connection; OSError when it breaks."""
    loop = asyncio.get_running_loop()
    buf = b""
    while True:
        part = await loop.sock_recv(sock, 64 * RECORD)
        if not part:
            return
        buf += part
        while len(buf) >= RECORD:
            kind, ident, up, down, err = RECORD_FORMAT.unpack_from(buf)
            buf = buf[RECORD:]
            yield kind, ident, up, down, err


async def read_records(sock: socket.socket, on_records: Callable[[list[Record]], None]) -> None:
    """Hand the agent's records on ``sock`` to ``on_records``, every record that one read
    brought at once (the agent sends its ``H`` records half a pool at a time), until it
    closes the connection; OSError when it breaks, and whatever ``on_records`` raised.

    A reader callback for the connection's life rather than :func:`agent_records`' awaited
    ``sock_recv`` per read (a failed recv, a future and two ``epoll_ctl`` each time): a pool
    connection is read once every few connections a command makes, on the path of the
    next ones (benchmarks/bench_services.py)."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()
    buf = bytearray()

    def readable() -> None:
        error: Exception | None = None
        try:
            part = sock.recv(64 * RECORD)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            part, error = b"", exc
        if part:
            buf.extend(part)
            whole = len(buf) - len(buf) % RECORD
            if not whole:
                return
            records: list[Record] = [
                RECORD_FORMAT.unpack_from(buf, at) for at in range(0, whole, RECORD)
            ]
            del buf[:whole]
            try:
                on_records(records)
                return
            except Exception as exc:  # a bug there ends this connection, never the loop
                error = exc
        loop.remove_reader(fd)  # at EOF the fd stays readable: no spinning on it
        if not ended.done():
            if error is None:
                ended.set_result(None)
            else:
                ended.set_exception(error)

    loop.add_reader(fd, readable)
    try:
        await ended
    finally:
        loop.remove_reader(fd)


async def dial_spliced(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """One connection to a TCP grant through its relay's socket at ``path``, asked for as
    any dialer but a sandbox's init is (the kubernetes runtime's executor, for a pod's
    connection carried back over the agent's stream): ``C``, the relay's byte (never with a
    socket: this process is no sandbox's init), ``S``; the relay then connects to its grant,
    splices and audits the connection as for any other. OSError when the relay closes
    instead (the grant refused, the task's bound reached: audited there)."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(b"C")
        await writer.drain()
        if await reader.read(1) != b"\x01":
            raise ConnectionRefusedError(errno.ECONNREFUSED, "the relay closed the connection")
        writer.write(b"S")
        await writer.drain()
    except BaseException:
        writer.close()
        raise
    return reader, writer
