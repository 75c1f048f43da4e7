"""Sockets made inside another network namespace: how a relay reaches a service container
that has no network but its own loopback.

A socket belongs to the network namespace of the thread that creates it, for its whole life,
whatever thread uses it later. :class:`NetnsSockets` keeps one thread that has entered the
container's namespace (``setns(2)`` changes only the calling thread's network namespace) and
makes sockets there on request; the relay then connects them to ``127.0.0.1:PORT`` on its own
event loop. The rest of the process, the relay's listeners included, stays in the host's
namespace. Nothing in the host's network reaches the container: it has no interface but ``lo``.

The namespace is held by an open ``/proc/PID/ns/net`` descriptor taken at prepare: a container
that dies leaves a namespace with nothing listening (connections refused), never another
process's namespace.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import socket
from concurrent.futures import BrokenExecutor, ThreadPoolExecutor

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    # Python 3.11 has no os.setns (3.12 has): libc's, with errno.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into the service's network namespace: {os.strerror(err)}")


class NetnsSockets:
    """Sockets in one network namespace (module docstring). Owns ``fd`` (closed by
    :meth:`close`)."""

    def __init__(self, fd: int, name: str = "service") -> None:
        self.fd = fd
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"fusion-netns-{name}",
            initializer=_setns,
            initargs=(fd,),
        )
        self._closed = False
        # The thread (and its setns) starts with the first job: start it now, so that a
        # namespace that cannot be entered is an error here, not at the first connection.
        try:
            self._pool.submit(int).result(timeout=10)
        except BrokenExecutor as exc:
            self.close()
            raise OSError(errno.EPERM, "cannot enter the network namespace (setns)") from exc

    @classmethod
    def of_pid(cls, pid: int, name: str = "service") -> NetnsSockets:
        """The network namespace process ``pid`` is in now (the caller checks, after this,
        that ``pid`` is still the container's)."""
        if pid <= 0:
            raise OSError(errno.ESRCH, "the service container has no process")
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        return cls(fd, name)

    def _make(self, family: int) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        return sock

    async def new_socket(self, family: int = socket.AF_INET) -> socket.socket:
        """A non-blocking stream socket in the namespace (made on the helper thread)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._make, family)

    async def connect(
        self, port: int, within_s: float, address: str = "127.0.0.1"
    ) -> socket.socket:
        """A socket connected to ``address:port`` inside the namespace."""
        loop = asyncio.get_running_loop()
        sock = await self.new_socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.wait_for(loop.sock_connect(sock, (address, port)), within_s)
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        """Stop the helper thread and let go of the namespace. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        os.close(self.fd)


__all__ = ["NetnsSockets"]
