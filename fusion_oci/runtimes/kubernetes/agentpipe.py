"""The exec agent's stream over a ``pods/exec`` stream: the agent client's byte-stream shape
(``write`` that never blocks, ``drain`` that waits) on an :class:`ExecStream` (``write`` that
waits).

Frames must leave in the order they were written, also those written from a callback that
cannot wait (a kill frame when a run is cancelled), so one pump task sends everything in
order and ``drain`` waits until what was written before it has gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol


class _Exec(Protocol):
    async def read(self, n: int = 65536) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class AgentPipe:
    def __init__(self, stream: _Exec) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._ready = asyncio.Event()
        self._sent = asyncio.Event()
        self._sent.set()
        self._error: BaseException | None = None
        self._pump = asyncio.ensure_future(self._run())

    async def read(self, n: int) -> bytes:
        return await self._stream.read(n)

    def write(self, data: bytes) -> None:
        if self._error is not None:
            raise ConnectionError(f"the agent's stream is lost: {self._error}")
        if data:
            self._buf += data
            self._sent.clear()
            self._ready.set()

    async def drain(self) -> None:
        await self._sent.wait()
        if self._error is not None:
            raise ConnectionError(f"the agent's stream is lost: {self._error}")

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._buf:
                data = bytes(self._buf)
                self._buf.clear()
                try:
                    await self._stream.write(data)
                except Exception as exc:  # the stream is gone: every later write says so
                    self._error = exc
                    self._sent.set()
                    return
            self._sent.set()

    async def close(self) -> None:
        self._pump.cancel()
        with contextlib.suppress(BaseException):
            await self._pump
        await self._stream.close()
