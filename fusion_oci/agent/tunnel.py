"""A pod's egress and host-service connections, carried back over the agent's stream
(PROTOCOL.md, "Egress back through the stream").

``mux.py --egress-listen PORT`` accepts the pod's connections to 127.0.0.1:PORT and sends each
as ``O`` (open), ``B`` (bytes; empty: that direction's end), ``W`` (credit back) and ``C``
(gone). :class:`Tunnels` is the host's half, inside
:class:`~fusion_oci.agent.streamed.StreamedAgent`: per ``O`` it dials (the task's egress
proxy's unix socket) and relays both ways without reading the bytes: the proxy decides,
audits and brokers, exactly as for a local sandbox.

``mux.py --service-listen ADDR:PORT`` (a host-service grant) does the same for a listener on
the pod's loopback; its ``O`` carries ``listener=N``, the place of that option, and this side
dials the N-th dialer it was given (the grant's relay, which connects to the grant and audits
each connection): the far end picks a listener the host set up, never an address.

``mux.py --publish-port PORT`` (a published port) goes the other way: :meth:`Tunnels.inbound`
takes a client's socket of the host's published port and asks the far end (``N``) to connect
to the pod's 127.0.0.1:PORT; its ``O`` names this side's ``inbound`` ref, and the connection is
relayed as any other, with the client's socket in place of a dialled one.

The far end is the sandbox's, so its word is bounded: ids count up from 1 (an id never opened
or opened twice is a broken stream), at most :data:`MAX_EGRESS_CONNS` at once, and no more
than the window of bytes unacknowledged per connection; any of these raises
:class:`ProtocolError`, which ends the stream as ``agent-lost``, as for runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import Awaitable, Callable, Sequence

from fusion_oci.agent.protocol import (
    EGRESS_ACK,
    EGRESS_BYTES,
    EGRESS_CLOSE,
    EGRESS_OPEN,
    INBOUND_OPEN,
    MAX_EGRESS_CONNS,
    ProtocolError,
    decode_fields,
    encode,
    encode_bytes,
)

Dialer = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
"""Opens one new connection to where a pod's connection goes (the task's proxy, a grant's
relay)."""
CHUNK = 1 << 16
DIAL_TIMEOUT_S = 10.0
MAX_WINDOW = 1 << 20


class _Conn:
    def __init__(self, window: int) -> None:
        self.task: asyncio.Task[None] | None = None
        self.pending: list[bytes] = []
        self.inbound = 0
        """Bytes the far end sent and this side has not yet written on (and credited)."""
        self.credit = window
        """Bytes of the proxy's this side may still send before the far end's ``W``."""
        self.credit_given = asyncio.Event()
        self.data_ready = asyncio.Event()
        self.eof_in = False
        self.sent = 0
        """Bytes of the dialled side's carried to the far end."""
        self.received = 0
        """Bytes of the far end's written on to the dialled side."""
        self.done: asyncio.Future[tuple[int, int, int]] | None = None
        """An inbound connection's end: (sent, received, errno) for its caller."""


class Tunnels:
    """The relayed connections of one stream (see the module's docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        dialer: Dialer | None,
        write: Callable[[bytes], None],
        send: Callable[[bytes], Awaitable[bool]],
        services: Sequence[Dialer] = (),
        inbound: bool = False,
    ) -> None:
        self._loop = loop
        self._dialer = dialer
        self._takes_inbound = inbound
        """The far end was started with ``--publish-port``: this side asks it for connections."""
        self._inbound: dict[str, tuple[socket.socket, asyncio.Future[tuple[int, int, int]]]] = {}
        """Ref -> (a published port's client, its end) while the far end's O is awaited."""
        self._refs = itertools.count(1)
        self._services = {str(i): d for i, d in enumerate(services)}
        """Listener index (as the mux's ``listener`` field spells it) -> its grant's dialer."""
        self._write = write
        """Queue a frame now (credit, close: small, from a callback)."""
        self._send = send
        """Queue a frame and wait while the stream is backed up; False when it is lost."""
        self.window = 0
        """Per connection and direction, from the mux's hello (clamped: its word is bounded)."""
        self._conns: dict[int, _Conn] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        """Every relay still running (a dropped one too, until its cancellation is done)."""
        self._last = 0
        self.opened = 0

    @property
    def open(self) -> int:
        return len(self._conns)

    def greeted(self, hello: dict[str, str]) -> None:
        """The mux's hello: its window, at once (an ``O`` may follow in the same read).
        Never more credit than it named (it holds that much per connection), nor more than
        this side holds for one (its word is bounded)."""
        carries = self._dialer is not None or self._services or self._takes_inbound
        if carries and hello.get("egress_window", "").isdigit():
            self.window = min(int(hello["egress_window"]), MAX_WINDOW)

    def frame(self, kind: bytes, body: bytes) -> None:
        """One frame of the far end's about a connection."""
        data = b""
        if kind == EGRESS_BYTES:
            tag, sep, data = body.partition(b"\0")
            if not sep:
                raise ProtocolError(f"a B frame without its id: {body[:40]!r}")
        else:
            fields = decode_fields(body)
            tag = fields.get("id", "").encode()
        if not tag.isdigit():
            raise ProtocolError(f"a connection frame without a numeric id: {tag[:20]!r}")
        conn_id = int(tag)
        if kind == EGRESS_OPEN:
            self._open(conn_id, fields.get("listener"), fields.get("inbound"), fields.get("error"))
            return
        if not 0 < conn_id <= self._last:
            raise ProtocolError(f"a frame for connection {conn_id}, never opened")
        conn = self._conns.get(conn_id)
        if conn is None:
            return  # this side ended it and the far end's frame was in flight: dropped
        if kind == EGRESS_CLOSE:
            self._drop(conn_id, conn)
        elif kind == EGRESS_ACK:
            conn.credit += int(fields.get("bytes", "0"))
            conn.credit_given.set()
        elif data:
            if conn.eof_in:
                raise ProtocolError(f"connection {conn_id} sent bytes after its end")
            conn.inbound += len(data)
            if conn.inbound > self.window:
                raise ProtocolError(
                    f"connection {conn_id} sent {conn.inbound} bytes past its credit"
                )
            conn.pending.append(data)
            conn.data_ready.set()
        else:
            conn.eof_in = True
            conn.data_ready.set()

    async def inbound(self, port: int, client: socket.socket) -> tuple[int, int, int]:
        """Carry ``client`` (a connection to a published port, taken over: it is closed here)
        to the pod's 127.0.0.1:``port``; once it ends: the bytes carried each way (towards
        the pod, back) and the connect's errno (0: it connected). Cancelled: the connection
        is dropped."""
        ref = str(next(self._refs))
        done: asyncio.Future[tuple[int, int, int]] = self._loop.create_future()
        if not self.window or not self._takes_inbound:
            client.close()
            return 0, 0, 111  # ECONNREFUSED: the far end carries no published port
        self._inbound[ref] = (client, done)
        self._write(encode(INBOUND_OPEN, [("ref", ref), ("port", str(port))]))
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            pending = self._inbound.pop(ref, None)
            if pending is not None:
                pending[0].close()
            for conn_id, conn in list(self._conns.items()):
                if conn.done is done:
                    self._drop(conn_id, conn)
            raise

    def _open(
        self,
        conn_id: int,
        listener: str | None,
        inbound: str | None = None,
        error: str | None = None,
    ) -> None:
        """``listener``: None for the egress listener, else a service listener's index;
        ``inbound``: the ref of a connection this side asked for (``error``: it failed)."""
        if conn_id != self._last + 1:
            raise ProtocolError(f"connection {conn_id} opened out of order (last {self._last})")
        if len(self._conns) >= MAX_EGRESS_CONNS:
            raise ProtocolError(f"more than {MAX_EGRESS_CONNS} connections at once")
        self._last = conn_id
        if inbound is not None:
            self._open_inbound(conn_id, inbound, error)
            return
        dialer = self._dialer
        if listener is not None:
            # Only a listener this host set up (the grant it dials is the host's, by index).
            dialer = self._services.get(listener)
            if dialer is None:
                raise ProtocolError(
                    f"connection {conn_id} came from listener {listener[:20]!r}, not one of "
                    f"the {len(self._services)} this host set up"
                )
        if dialer is None or not self.window:
            self._write(encode(EGRESS_CLOSE, [("id", str(conn_id))]))  # refused
            return
        conn = _Conn(self.window)
        self._conns[conn_id] = conn
        self.opened += 1
        conn.task = self._loop.create_task(self._relay(conn_id, conn, dialer))
        self._tasks.add(conn.task)
        conn.task.add_done_callback(self._tasks.discard)

    def _open_inbound(self, conn_id: int, ref: str, error: str | None) -> None:
        pending = self._inbound.pop(ref, None)
        if pending is None:
            raise ProtocolError(f"connection {conn_id} answers {ref[:20]!r}, never asked for")
        client, done = pending
        if error is not None:
            client.close()
            if not done.done():
                done.set_result((0, 0, int(error) if error.isdigit() else 111))
            return

        async def taken() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection(sock=client)

        conn = _Conn(self.window)
        conn.done = done
        self._conns[conn_id] = conn
        self.opened += 1
        conn.task = self._loop.create_task(self._relay(conn_id, conn, taken))
        self._tasks.add(conn.task)
        conn.task.add_done_callback(self._tasks.discard)

    def _drop(self, conn_id: int, conn: _Conn) -> None:
        self._conns.pop(conn_id, None)
        if conn.task is not None:
            conn.task.cancel()

    async def _relay(self, conn_id: int, conn: _Conn, dialer: Dialer) -> None:
        writer: asyncio.StreamWriter | None = None
        tell = True
        try:
            reader, dialled = await asyncio.wait_for(dialer(), DIAL_TIMEOUT_S)
            writer = dialled
            both = [
                self._loop.create_task(self._to_proxy(conn_id, conn, dialled)),
                self._loop.create_task(self._from_proxy(conn_id, conn, reader)),
            ]
            try:
                await asyncio.gather(*both)
                tell = False  # both directions ended in order: each side forgets it alone
            finally:
                for task in both:
                    task.cancel()
                await asyncio.gather(*both, return_exceptions=True)
        except asyncio.CancelledError:
            tell = False  # the far end closed it, or the stream is going
            raise
        except (OSError, TimeoutError, EOFError):
            pass  # the proxy refused, reset or was not there: the command sees a reset
        finally:
            if self._conns.pop(conn_id, None) is not None and tell:
                self._write(encode(EGRESS_CLOSE, [("id", str(conn_id))]))
            if writer is not None:
                writer.close()
            if conn.done is not None and not conn.done.done():
                conn.done.set_result((conn.sent, conn.received, 0))

    async def _to_proxy(self, conn_id: int, conn: _Conn, writer: asyncio.StreamWriter) -> None:
        while True:
            while not conn.pending and not conn.eof_in:
                conn.data_ready.clear()
                await conn.data_ready.wait()
            if conn.pending:
                chunks, conn.pending = conn.pending, []
                size = sum(len(c) for c in chunks)
                writer.writelines(chunks)
                await writer.drain()
                # Taken by the proxy's socket: the far end may send that much more.
                conn.inbound -= size
                conn.received += size
                self._write(encode(EGRESS_ACK, [("id", str(conn_id)), ("bytes", str(size))]))
                continue
            if writer.can_write_eof():
                writer.write_eof()  # the command's half-close, passed on
            return

    async def _from_proxy(self, conn_id: int, conn: _Conn, reader: asyncio.StreamReader) -> None:
        while True:
            while conn.credit <= 0:
                conn.credit_given.clear()
                await conn.credit_given.wait()
            data = await reader.read(min(CHUNK, conn.credit))
            conn.credit -= len(data)
            conn.sent += len(data)
            if not await self._send(encode_bytes(conn_id, data)) or not data:
                return  # the proxy's end (an empty B: the far end shuts its writing)

    def stop(self) -> None:
        """The stream is gone: end every connection (the proxy sees each close)."""
        for conn_id, conn in list(self._conns.items()):
            self._drop(conn_id, conn)
            if conn.done is not None and not conn.done.done():
                conn.done.set_result((conn.sent, conn.received, 0))
        for client, done in self._inbound.values():
            client.close()
            if not done.done():
                done.set_result((0, 0, 104))  # ECONNRESET: the stream went first
        self._inbound.clear()

    async def aclose(self) -> None:
        self.stop()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)
