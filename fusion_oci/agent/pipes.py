"""A command's pipes on the host's side of the exec agent: its output read into captures
without a task per pipe (:class:`CommandPipes`), its stdin written without blocking the loop
(:class:`StdinFeeder`). The agent hands the pipes' host ends over with ``SCM_RIGHTS``."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import AsyncIterable, Callable

from fusion_oci.host.process import Capture


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def wait_writable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    fut: asyncio.Future[None] = loop.create_future()
    loop.add_writer(fd, _wake, fut)
    try:
        await fut
    finally:
        loop.remove_writer(fd)


class CommandPipes:
    """One run's state on the host's side: its output pipes read by loop callbacks (no task per
    pipe: a short command costs few turns of the loop), its exit and drain futures."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pid: int | None = None
        self.exited: asyncio.Future[int] = loop.create_future()
        self.drained: asyncio.Future[None] = loop.create_future()
        self.ending: asyncio.Task[None] | None = None
        self.timed_out = False
        self.error: BaseException | None = None
        """What an on_output callback raised: the run is ended and run() raises it."""
        self.on_error: Callable[[], None] = lambda: None
        self._open: dict[int, Capture] = {}

    def watch(self, fd: int, capture: Capture) -> None:
        os.set_blocking(fd, False)
        self._open[fd] = capture
        self.loop.add_reader(fd, self._readable, fd)

    def _readable(self, fd: int) -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(fd)
            return
        try:
            wait = self._open[fd].feed(chunk)
        except Exception as exc:  # the caller's on_output: end the run, raise it from run()
            self._failed(fd, exc)
            return
        if wait is not None:
            # The consumer is behind (a slow client of serve): stop reading this pipe until it
            # catches up, so the command blocks on a full pipe instead of us buffering.
            self.loop.remove_reader(fd)
            asyncio.ensure_future(wait).add_done_callback(functools.partial(self._resume, fd))

    def _resume(self, fd: int, done: asyncio.Future[object]) -> None:
        if fd not in self._open:
            return
        if not done.cancelled() and (exc := done.exception()) is not None:
            self._failed(fd, exc)
            return
        self.loop.add_reader(fd, self._readable, fd)

    def _failed(self, fd: int, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.on_error()
        self._close(fd)

    def _close(self, fd: int) -> None:
        if self._open.pop(fd, None) is not None:
            self.loop.remove_reader(fd)  # False (no error) when paused for backpressure
            os.close(fd)
        if not self._open and not self.drained.done():
            self.drained.set_result(None)

    def close_all(self) -> None:
        """Stop reading (a grandchild may keep a pipe open past the bound)."""
        for fd in list(self._open):
            self._close(fd)


class StdinFeeder:
    """Writes stdin without blocking the loop, then closes it (EOF for the command)."""

    def __init__(self, fd: int, source: bytes | AsyncIterable[bytes]) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.task = asyncio.ensure_future(self._feed(source))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.close()  # even when the task never got to run

    async def _write(self, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        fd = self.fd
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                await wait_writable(loop, fd)

    async def _feed(self, source: bytes | AsyncIterable[bytes]) -> None:
        try:
            if isinstance(source, bytes | bytearray | memoryview):
                await self._write(bytes(source))
            else:
                async for chunk in source:
                    await self._write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            self.close()
