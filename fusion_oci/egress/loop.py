"""The proxy thread: one event loop per owner process that serves every task's proxy.

A task's proxy must keep serving while its owner is between calls (a :class:`SyncSandbox`
runs its loop only inside each call), so proxies do not live on the caller's loop but on this
one, a daemon thread's: it dies with the owner process, which is what ``kill -9`` cleanup
(gc of the socket's scratch folder) relies on. Coroutines are handed over with
:func:`on_proxy_loop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
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

            _raise_descriptor_limit()
            threading.Thread(target=serve, name="fusion-oci-egress", daemon=True).start()
            ready.wait()
            _loop, _pid = loop, os.getpid()
        return _loop


def _raise_descriptor_limit() -> None:
    """The soft RLIMIT_NOFILE up to the hard one (at most 65,536): every task's proxy lives in
    this process, each may hold up to six descriptors per connection (two sockets, two
    pipes of splice) times ``Limits.max_connections``, and the usual soft 1,024 would be met
    by a few busy tasks long before the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        # Refused: kept as it is (the per-task caps still hold).
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


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
