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

Not root (a rootless engine's containers, whose namespaces the engine's user namespace owns):
a thread cannot join that user namespace (a process with more than one thread cannot), so a
one-threaded helper, :mod:`fusion_oci.shims.nssockets`, joins the namespace's owner and then
the namespace, and hands the sockets it makes over a socket pair (``SCM_RIGHTS``).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import os
import socket
import subprocess
import sys
from concurrent.futures import BrokenExecutor, ThreadPoolExecutor

from fusion_oci.shims import NSSOCKETS

CLONE_NEWNET = 0x40000000
NS_GET_USERNS = 0xB701  # _IO(0xb7, 0x1): the user namespace that owns a namespace
HELPER_START_S = 10.0


def _setns(fd: int) -> None:
    # Python 3.11 has no os.setns (3.12 has): libc's, with errno.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into the service's network namespace: {os.strerror(err)}")


class _Helper:
    """The one-threaded helper of the module docstring: it has joined the namespace's owner
    and the namespace, and makes a socket there for each request."""

    def __init__(self, netns_fd: int) -> None:
        import fcntl

        owner = fcntl.ioctl(netns_fd, NS_GET_USERNS)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = (owner, netns_fd, theirs.fileno())
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-S", "-E", "-s", str(NSSOCKETS), *map(str, fds)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=fds,
                start_new_session=True,
            )
        except OSError:
            ours.close()
            raise
        finally:
            os.close(owner)
            theirs.close()
        self.channel = ours
        ours.settimeout(HELPER_START_S)
        try:
            said = ours.recv(4096)
        except OSError as exc:
            self.close()
            raise OSError(errno.EPERM, f"the namespace helper did not answer: {exc}") from exc
        if said != b"R":
            self.close()
            why = said[1:].decode(errors="replace") if said[:1] == b"E" else "it ended"
            raise OSError(errno.EPERM, why or "it ended")
        ours.settimeout(None)

    def make(self, family: int) -> socket.socket:
        self.channel.sendall(b"6" if family == socket.AF_INET6 else b"4")
        _, ancdata, _, _ = self.channel.recvmsg(1, socket.CMSG_SPACE(4))
        fds = [
            int.from_bytes(data[:4], sys.byteorder)
            for level, kind, data in ancdata
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
        ]
        if not fds:
            raise OSError(errno.EIO, "the namespace helper sent no socket")
        sock = socket.socket(fileno=fds[0])
        for extra in fds[1:]:
            os.close(extra)
        sock.set_inheritable(False)  # received without O_CLOEXEC: no command may inherit it
        sock.setblocking(False)
        return sock

    def close(self) -> None:
        self.channel.close()  # its end of file ends the helper
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class NetnsSockets:
    """Sockets in one network namespace (module docstring). Owns ``fd`` (closed by
    :meth:`close`)."""

    def __init__(self, fd: int, name: str = "service") -> None:
        self.fd = fd
        self._helper: _Helper | None = None
        rootless = os.geteuid() != 0
        if rootless:
            try:
                self._helper = _Helper(fd)
            except OSError:
                os.close(fd)
                raise
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"fusion-netns-{name}",
            # root enters the namespace on the pool's one thread; not root, the helper did
            initializer=None if rootless else functools.partial(_setns, fd),
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
        if self._helper is not None:
            return self._helper.make(family)
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
        if self._helper is not None:
            self._helper.close()
        os.close(self.fd)


__all__ = ["NetnsSockets"]
