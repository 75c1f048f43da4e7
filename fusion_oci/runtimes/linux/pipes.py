"""Reading a launcher's status pipes without blocking the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import Any


async def read_json(fd: int, timeout_s: float | None = None) -> dict[str, Any] | None:
    """Read one JSON object from ``fd`` (e.g. bwrap's ``--info-fd``); None at EOF.

    Parsing is tried after every chunk rather than waiting for EOF: the caller may still hold
    the write end (it had to exist before the launcher was spawned).
    """
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    buf = bytearray()
    done: asyncio.Future[dict[str, Any] | None] = loop.create_future()

    def on_readable() -> None:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError as exc:
            if not done.done():
                done.set_exception(exc)
            return
        if not chunk:
            if not done.done():
                done.set_result(None)
            return
        buf.extend(chunk)
        with contextlib.suppress(ValueError):
            value = json.loads(buf.decode("utf-8", errors="replace"))
            if isinstance(value, dict) and not done.done():
                done.set_result(value)

    loop.add_reader(fd, on_readable)
    try:
        return await asyncio.wait_for(done, timeout_s)
    finally:
        loop.remove_reader(fd)


async def read_byte(fd: int, timeout_s: float) -> bytes:
    """One byte from ``fd`` (a readiness pipe), b"" at EOF; TimeoutError past the timeout."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    done: asyncio.Future[bytes] = loop.create_future()

    def on_readable() -> None:
        try:
            data = os.read(fd, 1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not done.done():
            done.set_result(data)

    loop.add_reader(fd, on_readable)
    try:
        return await asyncio.wait_for(done, timeout_s)
    finally:
        loop.remove_reader(fd)


def close_all(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None and fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
