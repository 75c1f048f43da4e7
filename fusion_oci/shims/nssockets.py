"""Sockets made in a rootless engine's container network namespace, for a caller that is not
root (:class:`fusion_oci.services.netns.NetnsSockets` starts it).

Entering a network namespace takes ``CAP_SYS_ADMIN`` in the user namespace that owns it. A
rootless engine's containers have their network namespaces owned by the engine's user
namespace, which the caller's user made: that user holds every capability there, but only
from inside it, and a process can join a user namespace only while it has one thread. A
Python server has many; this program has one. Its arguments are three inherited descriptors:
the owner, the network namespace, its channel (a socket pair's end). It joins the owner, then
the network namespace, says ``R`` on its channel, and for each byte it reads there (``4``:
IPv4, ``6``: IPv6) sends back one new, unconnected TCP socket of that namespace by
``SCM_RIGHTS``. The caller connects it: a socket stays in the namespace it was made in,
whoever uses it. It makes sockets and nothing else: no connect, no listen, no path, and it
reads nothing but those bytes. It ends when the channel does: end of file once its owner
closes its end or dies (no parent-death signal: that follows the thread that started it,
and joining the user namespace clears it anyway).

A failure to enter is ``E`` and the reason, then exit 1.
"""

import _socket
import ctypes
import os
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
FAMILIES = {b"4": _socket.AF_INET, b"6": _socket.AF_INET6}


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    userns_fd, netns_fd, channel_fd = (int(a) for a in sys.argv[1:4])
    channel = _socket.socket(fileno=channel_fd)
    for fd, kind, what in ((userns_fd, CLONE_NEWUSER, "user"), (netns_fd, CLONE_NEWNET, "network")):
        if libc.setns(fd, kind) != 0:
            err = ctypes.get_errno()
            channel.sendall(f"Esetns into the {what} namespace: {os.strerror(err)}".encode())
            return 1
        os.close(fd)
    channel.sendall(b"R")
    while True:
        ask = channel.recv(1)
        if not ask:
            return 0
        family = FAMILIES.get(ask)
        if family is None:
            return 2  # not our caller: stop
        sock = _socket.socket(family, _socket.SOCK_STREAM)
        try:
            channel.sendmsg(
                [b"S"],
                [
                    (
                        _socket.SOL_SOCKET,
                        _socket.SCM_RIGHTS,
                        sock.fileno().to_bytes(4, sys.byteorder),
                    )
                ],
            )
        finally:
            sock.close()


if __name__ == "__main__":
    sys.exit(main())
