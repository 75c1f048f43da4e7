"""The proxy thread: one event loop per owner process that serves every task's proxy.

A task's proxy must keep serving while its owner is between calls (a :class:`SyncSandbox`
runs its loop only inside each call), so proxies do not live on the caller's loop but on this
one, a daemon thread's: it dies with the owner process, which is what ``kill -9`` cleanup
(gc of the socket's scratch folder) relies on. Coroutines are handed over with
:func:`on_proxy_loop`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid: int | None = None


def proxy_loop() -> asyncio.AbstractEventLoop:
    """The process's proxy loop, started on first use (again in a forked child, where the
    parent's thread does not exist)."""
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=serve, name="fusion-oci-egress", daemon=True).start()
            ready.wait()
            _loop, _pid = loop, os.getpid()
        return _loop


async def on_proxy_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the proxy loop and wait for it from the caller's loop."""
    loop = proxy_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


def call_on_proxy_loop(coro: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
    """The same from synchronous code (never from the proxy thread itself)."""
    return asyncio.run_coroutine_threadsafe(coro, proxy_loop()).result(timeout_s)
