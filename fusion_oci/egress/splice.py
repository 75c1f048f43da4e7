"""Byte-for-byte forwarding between two transports once a tunnel is open.

Protocols, not streams: each chunk is handed from one transport to the other in
``data_received`` (no coroutine per chunk), and a full write buffer on one side pauses reading
on the other (flow control both ways), so a tunnel costs two small objects and keeps up with a
direct connection. Half-close is passed on (an EOF from one side is a ``write_eof`` to the
other); the tunnel ends when both sides are done, either side is lost, it is idle past its
timeout, or :meth:`Tunnel.close` is called (the proxy's stop).
"""

from __future__ import annotations

import asyncio
import contextlib


class Tunnel:
    """Two transports spliced together; ``done`` resolves when the tunnel is over."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_timeout_s: float) -> None:
        self.loop = loop
        self.idle_timeout_s = idle_timeout_s
        self.sides: dict[str, asyncio.Transport | None] = {"up": None, "down": None}
        """``up``: the transport towards the destination; ``down``: towards the sandbox."""
        self.bytes = {"up": 0, "down": 0}
        """Bytes written towards each side (``up``: sandbox -> destination)."""
        self.eof = {"up": False, "down": False}
        self.done: asyncio.Future[None] = loop.create_future()
        self.last = loop.time()
        self._timer: asyncio.TimerHandle | None = None

    def attach(self, side: str, transport: asyncio.Transport) -> None:
        self.sides[side] = transport
        if self._timer is None:
            self._timer = self.loop.call_later(self.idle_timeout_s, self._check_idle)

    def other(self, side: str) -> str:
        return "down" if side == "up" else "up"

    def forward(self, from_side: str, data: bytes) -> None:
        """Data read from ``from_side`` goes to the other side."""
        to = self.other(from_side)
        target = self.sides[to]
        self.last = self.loop.time()
        if target is None or target.is_closing():
            return
        target.write(data)
        self.bytes[to] += len(data)

    def read_eof(self, from_side: str) -> None:
        to = self.other(from_side)
        self.eof[from_side] = True
        target = self.sides[to]
        if target is not None and not target.is_closing():
            if target.can_write_eof():
                target.write_eof()
            else:
                target.close()
        if all(self.eof.values()):
            self.close()

    def close(self) -> None:
        """End both sides now (idempotent)."""
        if self._timer is not None:
            self._timer.cancel()
        for transport in self.sides.values():
            if transport is not None:
                transport.close()
        if not self.done.done():
            self.done.set_result(None)

    def _check_idle(self) -> None:
        idle = self.loop.time() - self.last
        if idle >= self.idle_timeout_s:
            self.close()
            return
        self._timer = self.loop.call_later(self.idle_timeout_s - idle, self._check_idle)


class Side(asyncio.Protocol):
    """One side of a :class:`Tunnel` (the transport's protocol)."""

    def __init__(self, tunnel: Tunnel, side: str) -> None:
        self.tunnel = tunnel
        self.side = side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.tunnel.attach(self.side, transport)

    def data_received(self, data: bytes) -> None:
        self.tunnel.forward(self.side, data)

    def eof_received(self) -> bool:
        self.tunnel.read_eof(self.side)
        return True  # keep our write side open: the other direction may still be sending

    def connection_lost(self, exc: Exception | None) -> None:
        self.tunnel.close()

    def pause_writing(self) -> None:
        # Our write buffer is full: stop reading from the other side until it drains.
        peer = self.tunnel.sides[self.tunnel.other(self.side)]
        if peer is not None and not peer.is_closing():
            with contextlib.suppress(RuntimeError):
                peer.pause_reading()

    def resume_writing(self) -> None:
        peer = self.tunnel.sides[self.tunnel.other(self.side)]
        if peer is not None and not peer.is_closing():
            with contextlib.suppress(RuntimeError):
                peer.resume_reading()
