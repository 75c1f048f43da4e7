"""stdin fed to a command as it comes (``fusion-oci run -i``, the resident server's runs).

A :class:`StdinStream` is what ``RunOptions.stdin`` holds instead of bytes when the input is
not all there yet: runtimes that start the command as a host process write each chunk to its
stdin as it arrives (``fusion_oci.host.process.run_process``); the others read it to its end first
(``Sandbox.run``). It holds at most a few chunks: whoever feeds it waits until the command has
taken them (backpressure), so a fast producer and a slow command cost no memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import AsyncIterator, Callable

CHUNK = 1 << 16


class StdinStream:
    def __init__(self, max_chunks: int = 4) -> None:
        self._max = max_chunks
        self._queue: asyncio.Queue[bytes | None] | None = None
        self._digest = hashlib.sha256()
        self._size = 0
        self._closing: asyncio.Future[None] | None = None
        self.on_take: Callable[[], None] | None = None
        """Called as the command takes each chunk (the server's flow control)."""

    def _q(self) -> asyncio.Queue[bytes | None]:
        if self._queue is None:
            self._queue = asyncio.Queue(self._max)
        return self._queue

    async def put(self, chunk: bytes) -> None:
        """Feed a chunk (waits while the stream is full)."""
        if chunk:
            await self._q().put(chunk)

    def put_nowait(self, chunk: bytes) -> bool:
        """Feed a chunk if there is room (False: full, try again after a take)."""
        if not chunk:
            return True
        try:
            self._q().put_nowait(chunk)
        except asyncio.QueueFull:
            return False
        return True

    def close(self) -> None:
        """End of input: the command's stdin is closed after what was fed."""
        self._closing = asyncio.ensure_future(self._q().put(None))  # after what is queued

    async def __aiter__(self) -> AsyncIterator[bytes]:
        queue = self._q()
        while True:
            chunk = await queue.get()
            if chunk is None:
                return
            self._digest.update(chunk)
            self._size += len(chunk)
            if self.on_take is not None:
                self.on_take()
            yield chunk

    async def read_all(self) -> bytes:
        """Everything to the end (for runtimes that take stdin as one value)."""
        return b"".join([chunk async for chunk in self])

    def sha256(self) -> str:
        """Digest of what the command was fed so far."""
        return "sha256:" + self._digest.hexdigest()

    @classmethod
    def from_fd(cls, fd: int) -> StdinStream:
        """A stream of what arrives on ``fd`` (this process's stdin), read by a daemon thread
        one chunk ahead of the command: blocking reads of a terminal or pipe never hold up
        the event loop, and a reader still blocked when the run ends does not hold up exit."""
        stream = cls(max_chunks=1)
        loop = asyncio.get_running_loop()
        queue = stream._q()

        def reader() -> None:
            while True:
                try:
                    chunk = os.read(fd, CHUNK)
                except OSError:
                    chunk = b""
                try:
                    asyncio.run_coroutine_threadsafe(queue.put(chunk or None), loop).result()
                except Exception:  # the loop has gone: nobody reads any more
                    return
                if not chunk:
                    return

        threading.Thread(target=reader, name="fusion-oci-stdin", daemon=True).start()
        return stream
