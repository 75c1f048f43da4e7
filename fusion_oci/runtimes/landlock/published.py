"""The landlock runtime's side of ``policy.publishPorts``: the carrier the task's published
ports (fusion_oci/services/publish.py) hand each host client to.

The command shares the host's network, so its server cannot listen on the published port
itself (Landlock denies it every TCP bind). Its bind to a published port, on loopback or the
wildcard, is the reaper's supervisor's instead (shims/connects.py): the command's own socket
bound to loopback at an ephemeral port, reported here as ``(sandbox port, family, ephemeral
port, socket inode)`` over a datagram socket in the task's scratch (only the task's shim,
whose pid the kernel vouches for, is heard). Each host client of the published port is then
connected to that loopback port and spliced to it (egress/splice.py: both ways, half-closes
passed on), on the proxy loop, so connections are served between a SyncSandbox's calls too.

A report can go stale (the server closed; another host process took the ephemeral port): a
client is carried only while every TCP listener on that port (asked of the kernel's sock_diag:
shims/connects.py ``still_listening``; ``/proc/net/tcp`` costs milliseconds on a busy host) is
the reported socket, checked before the connect and again once it is made; else the client
is refused (ECONNREFUSED, audited by the task's ports), and no byte of it reaches anyone.
Nothing bound yet: refused the same way. A report is read by a pure function
(:func:`parse_report`), tested without a kernel, as is the listener check's reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from pathlib import Path

from fusion_oci.egress.splice import Tunnel
from fusion_oci.shims.connects import still_listening

IDLE_TIMEOUT_S = 24 * 3600.0
"""A carried connection with no byte either way for this long is closed (a dev server's
event stream may be quiet for a long time; the agent's splice on other runtimes has none)."""
_CREDS = 12  # struct ucred: pid, uid, gid
AF_INET, AF_INET6 = 2, 10
FAMILIES = (AF_INET, AF_INET6)
"""The families a report may name."""
LOOPBACK: dict[int, str] = {AF_INET: "127.0.0.1", AF_INET6: "::1"}


def parse_report(data: bytes) -> tuple[int, int, int, int] | None:
    """``(sandbox port, family, ephemeral port, inode)`` of a supervisor's bind report
    (connects.bind_report), None for anything else. Pure."""
    parts = data.split(b" ")
    if len(parts) != 5 or parts[0] != b"B" or not all(p.isdigit() for p in parts[1:]):
        return None
    port, family, bound, inode = (int(p) for p in parts[1:])
    if family not in FAMILIES or not 0 < port < 65536 or not 0 < bound < 65536:
        return None
    return port, family, bound, inode


class BoundPorts:
    """The supervisor's bind reports and the carrier of the task's published ports."""

    def __init__(self, path: Path) -> None:
        self.path = path
        """The report socket (in the task's scratch, which no command is granted)."""
        self.reporter_pid: int | None = None
        """The task's shim, the only sender heard; set once it started."""
        self.bound: dict[int, tuple[int, int, int]] = {}
        """Sandbox port → (family, ephemeral port, inode): the latest report of each."""
        self._sock: socket.socket | None = None
        self._tunnels: set[Tunnel] = set()

    async def start(self) -> None:
        """Bind the report socket and read it (on the proxy loop, as the carrier runs)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(self.path))
            self.path.chmod(0o600)  # the owner's processes only: the shim is one
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.setblocking(False)
            asyncio.get_running_loop().add_reader(sock.fileno(), self._reported, sock)
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    def _reported(self, sock: socket.socket) -> None:
        try:
            data, ancillary, _, _ = sock.recvmsg(64, socket.CMSG_SPACE(_CREDS))
        except OSError:  # drained (or closed at stop)
            return
        pid = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = int.from_bytes(payload[:4], "little", signed=True)
        report = parse_report(data)
        # The kernel vouches for the sender's pid: only the task's supervisor reports.
        if report is None or pid is None or pid != self.reporter_pid:
            return
        port, family, bound, inode = report
        self.bound[port] = (family, bound, inode)

    async def carry(self, port: int, client: socket.socket) -> tuple[int, int, int]:
        """Carry ``client`` (taken over: closed here) to the command's server of the sandbox
        ``port``: (bytes towards it, bytes back, the connect's errno)."""
        found = self.bound.get(port)
        try:
            # Nothing bound yet (or not the command's any more): refused, the client closed.
            upstream = await self._connect(*found) if found is not None else None
        except OSError as exc:
            client.close()
            return 0, 0, exc.errno or errno.ECONNREFUSED
        except BaseException:
            client.close()
            raise
        if upstream is None:
            client.close()
            return 0, 0, errno.ECONNREFUSED
        return await self._splice(client, upstream)

    async def _connect(self, family: int, bound: int, inode: int) -> socket.socket | None:
        """A socket connected to the command's listener at loopback ``bound``, or None when
        that port is not (or no longer) the command's socket ``inode``."""
        if not still_listening(family, bound, inode):
            return None
        upstream = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            upstream.setblocking(False)
            await asyncio.get_running_loop().sock_connect(upstream, (LOOPBACK[family], bound))
            # Again once connected: the command's socket listened before and after, so no
            # other listener took the port meanwhile (it would be seen here). No byte of the
            # client has been sent yet.
            if not still_listening(family, bound, inode):
                upstream.close()
                return None
            with contextlib.suppress(OSError):
                upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            upstream.close()
            raise
        return upstream

    async def _splice(self, client: socket.socket, upstream: socket.socket) -> tuple[int, int, int]:
        try:
            client.setblocking(False)
            tunnel = Tunnel(asyncio.get_running_loop(), IDLE_TIMEOUT_S, client, upstream)
        except BaseException:
            client.close()
            upstream.close()
            raise
        self._tunnels.add(tunnel)
        try:
            tunnel.start()
            await asyncio.shield(tunnel.done)
        finally:
            tunnel.close()  # both sockets: the tunnel owns them
            self._tunnels.discard(tunnel)
        return tunnel.bytes["up"], tunnel.bytes["down"], 0

    async def stop(self) -> None:
        """Close the report socket and every carried connection (on the proxy loop)."""
        for tunnel in list(self._tunnels):
            tunnel.close()
        sock, self._sock = self._sock, None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
        self.path.unlink(missing_ok=True)
