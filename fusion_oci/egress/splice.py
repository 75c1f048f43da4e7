"""Byte-for-byte forwarding between the sandbox's connection and the destination's, once a
tunnel is open: ``splice(2)`` through a pipe, on the proxy loop.

Zero-copy: the bytes move socket -> pipe -> socket inside the kernel; Python only sees how
many moved (the audit's counts), so a tunnel keeps up with a direct connection and costs two
sockets and two pipes. Flow control both ways: while the destination side cannot take more,
the source side is not read. Half-close is passed on (an EOF read from one side is a
``shutdown(SHUT_WR)`` of the other); the tunnel ends when both directions are done, on any
error, when idle past its timeout, or at :meth:`Tunnel.close` (the proxy's stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket

CHUNK = 1 << 20
_PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_FLAGS = os.SPLICE_F_NONBLOCK | os.SPLICE_F_MOVE


class _Pump:
    """One direction: ``src`` -> pipe -> ``dst``."""

    def __init__(self, tunnel: Tunnel, src: socket.socket, dst: socket.socket, key: str) -> None:
        self.tunnel = tunnel
        self.loop = tunnel.loop
        self.src, self.dst = src.fileno(), dst.fileno()
        self.dst_sock = dst
        self.key = key
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # a bigger pipe: fewer wake-ups on a download
            fcntl.fcntl(self.w, _F_SETPIPE_SZ, _PIPE_SIZE)
        self.pending = 0
        self.eof = False
        self.done = False
        self.reading = False
        self.writing = False

    def start(self) -> None:
        self._read_on()

    def _read_on(self) -> None:
        if not self.reading and not self.eof:
            self.loop.add_reader(self.src, self._readable)
            self.reading = True

    def _read_off(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.src)
            self.reading = False

    def _readable(self) -> None:
        try:
            n = os.splice(self.src, self.w, CHUNK, flags=_FLAGS)
        except BlockingIOError:
            return
        except OSError:
            self.tunnel.close()
            return
        self.tunnel.last = self.loop.time()
        if n == 0:
            self.eof = True
            self._read_off()
        self.pending += n
        self._flush()

    def _writable(self) -> None:
        self._flush()

    def _flush(self) -> None:
        while self.pending:
            try:
                n = os.splice(self.r, self.dst, self.pending, flags=_FLAGS)
            except BlockingIOError:
                # The other side is full: stop reading until it drains.
                self._read_off()
                if not self.writing:
                    self.loop.add_writer(self.dst, self._writable)
                    self.writing = True
                return
            except OSError:
                self.tunnel.close()
                return
            self.pending -= n
            self.tunnel.bytes[self.key] += n
        if self.writing:
            self.loop.remove_writer(self.dst)
            self.writing = False
        if self.eof:
            if not self.done:
                self.done = True
                with contextlib.suppress(OSError):
                    self.dst_sock.shutdown(socket.SHUT_WR)
                self.tunnel.direction_done()
        else:
            self._read_on()

    def stop(self) -> None:
        self._read_off()
        if self.writing:
            self.loop.remove_writer(self.dst)
            self.writing = False
        for fd in (self.r, self.w):
            with contextlib.suppress(OSError):
                os.close(fd)


class Tunnel:
    """The sandbox's socket (``down``) and the destination's (``up``) spliced together; owns
    both. ``done`` resolves when the tunnel is over."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        idle_timeout_s: float,
        down: socket.socket,
        up: socket.socket,
    ) -> None:
        self.loop = loop
        self.idle_timeout_s = idle_timeout_s
        self.socks = (down, up)
        self.bytes = {"up": 0, "down": 0}
        """Bytes moved towards each side (``up``: sandbox -> destination)."""
        self.done: asyncio.Future[None] = loop.create_future()
        self.last = loop.time()
        self._pumps: list[_Pump] = []
        self._finished = 0
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        try:
            self._pumps = [_Pump(self, down, up, "up"), _Pump(self, up, down, "down")]
        except OSError:
            self.close()
            raise

    def start(self) -> None:
        for pump in self._pumps:
            pump.start()
        self._timer = self.loop.call_later(self.idle_timeout_s, self._check_idle)

    def direction_done(self) -> None:
        self._finished += 1
        if self._finished == len(self._pumps):
            self.close()

    def close(self) -> None:
        """End both sides now (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for pump in self._pumps:
            pump.stop()
        for sock in self.socks:
            sock.close()
        if not self.done.done():
            self.done.set_result(None)

    def _check_idle(self) -> None:
        idle = self.loop.time() - self.last
        if idle >= self.idle_timeout_s:
            self.close()
            return
        self._timer = self.loop.call_later(self.idle_timeout_s - idle, self._check_idle)
