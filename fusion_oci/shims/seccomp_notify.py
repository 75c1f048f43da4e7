"""What the confined child and the reaper's supervisors agree on: which calls of the command
go to the reaper over a seccomp user notification (:data:`CHMOD_CALLS`, :data:`OPEN_CALLS`,
:data:`CONNECT_CALL`, :data:`LISTEN_CALL`, :data:`BIND_CALL`, by architecture), the ioctls
that receive and answer them, and the socket pair the listener travels over (made before the
fork, sent back by the child: confine.py, received by the reaper: supervisor.py).

Standard library only, C modules where it can (see :mod:`fusion_oci.shims`).
"""

import _socket
import _struct as struct
import ctypes
import os

# (chmod, fchmod, fchmodat, fchmodat2); aarch64 has no plain chmod.
CHMOD_CALLS = {"x86_64": (90, 91, 268, 452), "aarch64": (-1, 52, 53, 452)}
# (open, openat); aarch64 has no plain open. openat2 is left alone (its flags sit in a struct;
# a program that uses it reads its /proc/self as without the supervisor).
OPEN_CALLS = {"x86_64": (2, 257), "aarch64": (-1, 56)}
CONNECT_CALL = {"x86_64": 42, "aarch64": 203}
LISTEN_CALL = {"x86_64": 50, "aarch64": 201}
"""listen() binds an unbound TCP socket to a port on every address (autobind, which
Landlock's bind rule does not see): an inbound way out. Unix sockets may listen, and a TCP
socket the supervisor bound for a published port (connects.py)."""
BIND_CALL = {"x86_64": 49, "aarch64": 200}
"""bind(), handed over only with ``publishPorts``: a TCP bind to a published port becomes the
supervisor's bind of the command's socket to loopback (connects.py)."""
NOTIF_ADDFD, ADDFD_FLAG_SEND, USER_NOTIF_FLAG_CONTINUE = 0x40182103, 1 << 1, 1
NOTIF_RECV, NOTIF_SEND, NOTIF_ID_VALID = 0xC0502100, 0xC0182101, 0x40082102
NOTIF_SET_FLAGS, FD_SYNC_WAKE_UP = 0x40082104, 1
"""``SECCOMP_IOCTL_NOTIF_SET_FLAGS`` and ``SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP`` (Linux 6.6)."""

libc = ctypes.CDLL(None, use_errno=True)


def fail(what: str) -> OSError:
    """The OSError of the libc call ``what`` that just failed (its errno)."""
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def socketpair() -> tuple[_socket.socket, int]:
    """(the reaper's end, the child's end as a bare fd), made before the fork."""
    mine, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    return mine, theirs.detach()


def sync_wake_up(listener: int) -> bool:
    """Ask the kernel to hand the CPU straight from a notifying caller to the supervisor and
    back (``SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP``), instead of waking the supervisor's thread
    wherever it sleeps: every open of the command waits for that round trip, and a cross-CPU
    wake-up (an IPI, a VM exit under a hypervisor) costs more than the answer itself.
    False on a kernel before 6.6 (it changes only speed: the notifications work as before).
    The flags go by value, not through a pointer."""
    import fcntl

    try:
        fcntl.ioctl(listener, NOTIF_SET_FLAGS, FD_SYNC_WAKE_UP)
    except OSError:
        return False
    return True


def fcntl_ioctl(fd: int, request: int, arg: bytes) -> None:
    import fcntl

    fcntl.ioctl(fd, request, arg)


def reply(listener: int, nid: int, error: int) -> None:
    """Answer the notification ``nid``: the call returns 0, or fails with ``error``."""
    try:  # noqa: SIM105 - contextlib costs every command's start-up
        fcntl_ioctl(listener, NOTIF_SEND, struct.pack("=QqiI", nid, 0, -error, 0))
    except OSError:
        pass  # the caller died meanwhile


def reply_continue(listener: int, nid: int) -> None:
    """Let the call ``nid`` go on as the kernel (and Landlock) decide: it re-reads its
    arguments, so only for a call whose every outcome Landlock rules anyway."""
    try:  # noqa: SIM105 - contextlib costs every command's start-up
        fcntl_ioctl(listener, NOTIF_SEND, struct.pack("=QqiI", nid, 0, 0, USER_NOTIF_FLAG_CONTINUE))
    except OSError:
        pass  # the caller died meanwhile


def beneath(path: str, roots: list) -> bool:  # type: ignore[type-arg]
    """Whether ``path`` is one of ``roots`` or lies beneath one (plain strings, resolved)."""
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def tgid(tid: int) -> int:
    """The process (thread group) of the thread ``tid``: what a notification names."""
    with open(f"/proc/{tid}/status", encoding="ascii", errors="replace") as fh:
        for line in fh:
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    raise OSError(3, "no such process")
