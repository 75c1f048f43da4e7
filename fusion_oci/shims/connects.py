"""The reaper's answers to a confined command's ``connect()``, ``listen()`` and ``bind()``
calls, for ``network: filtered``, granted host services and published ports (step 5 of
confine.py; the chmod and open calls of the same notifications are supervisor.py's, which
hands these on): every connect and every TCP bind is decided on the supervisor's own copy of
the address and made by the supervisor on the command's socket. The verdicts and the service
table are pure, tested without a kernel.
"""

import _socket
import _stat as stat
import _struct as struct
import ctypes
import os

if __package__:  # fusion_oci.shims.connects (see fusion_oci/shims/__init__.py)
    from . import seccomp_notify as notify
else:  # run by path: the siblings are on sys.path[0]
    import seccomp_notify as notify  # type: ignore[import-not-found,no-redef]

SOL_SOCKET, SO_DOMAIN = 1, 39
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438  # the generic numbers, on both architectures
PIDFD_THREAD = 0o200  # pidfd_open's flag for a thread (O_EXCL; Linux 6.9)
AF_UNSPEC, AF_UNIX, AF_INET, AF_INET6 = 0, 1, 2, 10
LOOPBACK4 = bytes([127, 0, 0, 1])
LOOPBACK4_MAPPED = bytes(10) + b"\xff\xff" + LOOPBACK4
LOOPBACK6 = bytes(15) + b"\x01"
PUBLISH_ADDRESSES = {
    AF_INET: (LOOPBACK4, bytes(4)),
    AF_INET6: (LOOPBACK6, bytes(16), LOOPBACK4_MAPPED, bytes(10) + b"\xff\xff" + bytes(4)),
}
"""The addresses a bind to a published port may name, by family: loopback and the wildcard
(and their v4-mapped forms). Whichever it names, the supervisor binds loopback."""
MAX_BOUND = 4096
"""The sockets :meth:`ConnectSupervisor.bind` remembers (the latest): each listens right after
its bind, so only a command that binds thousands before listening loses one (EACCES)."""
CONTINUE = -1
""":meth:`ConnectSupervisor.bind`'s answer for a call that goes on as the kernel decides."""


def connect_verdict(addr: bytes, port: int) -> str:
    """What a ``filtered`` command's connect to the sockaddr ``addr`` gets. Pure.

    ``proxy``: the task's egress proxy (127.0.0.1:PORT, or its v4-mapped IPv6 form);
    ``unix``: a named unix socket (allowed when it lies beneath a writable path);
    ``unspec``: AF_UNSPEC (a disconnect); ``deny``: anything else (every other address, the
    host's loopback included, and abstract unix sockets: the host's are not the command's).
    """
    if len(addr) < 2:
        return "deny"
    family = struct.unpack("=H", addr[:2])[0]
    if family == AF_UNSPEC:
        return "unspec"
    if family == AF_INET and len(addr) >= 8:
        to_port = struct.unpack("!H", addr[2:4])[0]
        return "proxy" if port > 0 and to_port == port and addr[4:8] == LOOPBACK4 else "deny"
    if family == AF_INET6 and len(addr) >= 24:
        to_port = struct.unpack("!H", addr[2:4])[0]
        ok = port > 0 and to_port == port and addr[8:24] == LOOPBACK4_MAPPED
        return "proxy" if ok else "deny"
    if family == AF_UNIX and len(addr) > 2 and addr[2] != 0:
        return "unix"
    return "deny"


def bind_verdict(addr: bytes, published: frozenset[int] | set[int]) -> tuple[str, int, int]:
    """What a command's bind to the sockaddr ``addr`` gets, with ``published`` the task's
    published sandbox ports: ``("publish", family, port)`` for a published port on loopback
    or the wildcard (the supervisor binds the socket to loopback instead: :meth:`bind`);
    ``("unix", 0, 0)`` for a unix address (the call goes on: Landlock rules its path);
    ``("deny", 0, 0)`` for anything else (every other TCP port or address; Landlock denies
    every TCP bind of the command anyway). Pure."""
    if len(addr) < 2:
        return "deny", 0, 0
    family = struct.unpack("=H", addr[:2])[0]
    if family == AF_UNIX:
        return "unix", 0, 0
    at = {AF_INET: (4, 8), AF_INET6: (8, 24)}.get(family)
    if at is None or len(addr) < at[1]:
        return "deny", 0, 0
    port = struct.unpack("!H", addr[2:4])[0]
    if port in published and addr[at[0] : at[1]] in PUBLISH_ADDRESSES[family]:
        return "publish", family, port
    return "deny", 0, 0


def own_server(addr: bytes, servers: dict) -> tuple | None:  # type: ignore[type-arg]
    """Where a command's connect to the sockaddr ``addr`` goes when it names its own server of
    a published port (``servers``: sandbox port → (family, ephemeral port, inode), the
    supervisor's binds): ``(sockaddr, family, ephemeral port, inode)``, the server's loopback
    port in the caller's address form, or None. Only loopback forms the server's own socket
    answers: 127.0.0.1 (and its v4-mapped form) for an IPv4 server, ::1 for an IPv6 one (as
    on a network of its own, an IPv4 client does not reach a server bound to ::1). Pure."""
    if not servers or len(addr) < 8:
        return None
    family = struct.unpack("=H", addr[:2])[0]
    port = struct.unpack("!H", addr[2:4])[0]
    found = servers.get(port)
    if found is None:
        return None
    server_family, bound, inode = found
    if family == AF_INET and addr[4:8] == LOOPBACK4 and server_family == AF_INET:
        return _sockaddr(AF_INET, LOOPBACK4, bound), server_family, bound, inode
    if family == AF_INET6 and len(addr) >= 24:
        ip6 = addr[8:24]
        if ip6 == LOOPBACK4_MAPPED and server_family == AF_INET:
            return _sockaddr(AF_INET6, LOOPBACK4_MAPPED, bound), server_family, bound, inode
        if ip6 == LOOPBACK6 and server_family == AF_INET6:
            return _sockaddr(AF_INET6, LOOPBACK6, bound), server_family, bound, inode
    return None


def published_loopback(addr: bytes, published: frozenset | set) -> bool:  # type: ignore[type-arg]
    """Whether the sockaddr ``addr`` names one of the ``published`` ports on loopback
    (127.0.0.1, ::1, the v4-mapped 127.0.0.1). Pure."""
    if not published or len(addr) < 8:
        return False
    family = struct.unpack("=H", addr[:2])[0]
    if struct.unpack("!H", addr[2:4])[0] not in published:
        return False
    if family == AF_INET:
        return addr[4:8] == LOOPBACK4
    return family == AF_INET6 and len(addr) >= 24 and addr[8:24] in (LOOPBACK6, LOOPBACK4_MAPPED)


def listening_inodes(table: str, port: int) -> set:  # type: ignore[type-arg]
    """The inodes of the sockets listening on ``port`` in a ``/proc/net/tcp`` (``tcp6``)
    table's text (state 0A). Pure."""
    found = set()
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or ":" not in fields[1]:
            continue
        try:
            if int(fields[1].rsplit(":", 1)[1], 16) == port and int(fields[3], 16) == 0x0A:
                found.add(int(fields[9]))
        except ValueError:
            continue
    return found


NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLMSG_ERROR, NLMSG_DONE = 4, 20, 2, 3
NLM_F_REQUEST, NLM_F_DUMP, TCP_LISTEN, IPPROTO_TCP = 1, 0x300, 10, 6


def diag_request(family: int) -> bytes:
    """A sock_diag dump request for the TCP listeners of ``family`` (``inet_diag_req_v2``:
    the kernel walks its listening hash only, not the thousands of connections and
    TIME_WAIT entries ``/proc/net/tcp`` prints). Pure."""
    body = struct.pack("=BBBBI", family, IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN) + bytes(48)
    return (
        struct.pack("=IHHII", 16 + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
        + body
    )


def diag_listeners(data: bytes, port: int) -> tuple[set, bool]:  # type: ignore[type-arg]
    """The inodes of the listeners on ``port`` in one read of a sock_diag dump's answer
    (``inet_diag_msg``: sport at 4, inode at 68), and whether the dump ended in it. Pure;
    OSError for the kernel's error message."""
    found, at, done = set(), 0, False
    while at + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, at)
        if length < 16:
            break
        if kind == NLMSG_DONE:
            done = True
        elif kind == NLMSG_ERROR:
            error = -struct.unpack_from("=i", data, at + 16)[0]
            raise OSError(error, "sock_diag")
        elif kind == SOCK_DIAG_BY_FAMILY and length >= 16 + 72:
            sport = struct.unpack_from("!H", data, at + 16 + 4)[0]
            if sport == port:
                found.add(struct.unpack_from("=I", data, at + 16 + 68)[0])
        at += (length + 3) & ~3
    return found, done


def _listeners_now(family: int, port: int) -> set:  # type: ignore[type-arg]
    """The inodes of the TCP sockets of ``family`` listening on ``port``, from the kernel's
    sock_diag (netlink); where that is refused, from ``/proc/net/tcp`` (``tcp6``), which
    costs milliseconds on a host with many connections."""
    try:
        sock = _socket.socket(16, _socket.SOCK_RAW | _socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
    except OSError:
        sock = None
    if sock is not None:
        try:
            sock.sendall(diag_request(family))
            found = set()
            while True:
                part, done = diag_listeners(sock.recv(65536), port)
                found |= part
                if done:
                    return found
        except OSError:
            pass
        finally:
            sock.close()
    name = "/proc/net/tcp6" if family == AF_INET6 else "/proc/net/tcp"
    with open(name, encoding="ascii", errors="replace") as fh:
        return listening_inodes(fh.read(), port)


def still_listening(family: int, port: int, inode: int) -> bool:
    """Whether every listener on loopback ``port`` is the command's socket ``inode``: a
    server that is gone, its port taken by a host process, is never connected to."""
    return _listeners_now(family, port) == {inode}


DASHBOARD_PORT = 4040
"""The product's dashboard's port: never given to a command's server (models/hostservice.py)."""


def local_port_range(text: str) -> tuple[int, int]:
    """``net.ipv4.ip_local_port_range`` (``"32768\t60999"``); the kernel's default when it
    does not parse. Pure."""
    try:
        low, high = (int(x) for x in text.split())
    except ValueError:
        return 32768, 60999
    return (low, high) if 0 < low <= high < 65536 else (32768, 60999)


def ephemeral_choices(port_range: tuple[int, int], tries: int = 16) -> list[int]:
    """The ports a published port's bind tries, in order: 0 (the kernel picks one of its
    ephemeral range) where that range cannot yield the dashboard's port; else random ports of
    the range that are not it (a taken one is tried again, ``tries`` times). Pure but for the
    random choice."""
    low, high = port_range
    if not low <= DASHBOARD_PORT <= high:
        return [0]
    out: list[int] = []
    while len(out) < tries:
        port = low + int.from_bytes(os.urandom(2), "big") % (high - low + 1)
        if port != DASHBOARD_PORT:
            out.append(port)
    return out


def bind_report(port: int, family: int, bound: int, inode: int) -> bytes:
    """The datagram that tells the host a published ``port`` is now the command's socket
    (``inode``) bound to loopback of ``family`` at the ephemeral port ``bound`` (the host
    side: fusion_oci/runtimes/landlock/published.py). Pure."""
    return b"B %d %d %d %d" % (port, family, bound, inode)


def service_table(cfg: dict) -> dict:  # type: ignore[type-arg]
    """The launch file's granted host services: ``(family, address bytes, port)`` → the
    relay's report socket (TCP: a host grant) or its loopback port (TCP: a service container's
    endpoint), and an absolute path → the relay's socket path (unix)."""
    out: dict = {}  # type: ignore[type-arg]
    for line in cfg.get("svctcp", []):
        family, address, port, report = line.split(" ", 3)
        fam = AF_INET6 if family == "6" else AF_INET
        packed = _socket.inet_pton(fam, address)
        # A port: a service container's endpoint, redirected to the relay's loopback listener.
        out[(fam, packed, int(port))] = int(report) if report.isdigit() else ("report", report)
    for granted, relay in cfg.get("svcunix", []):
        out[granted] = relay
    return out


def _sockaddr(family: int, address: bytes, port: int) -> bytes:
    if family == AF_INET:
        return struct.pack("=H", AF_INET) + struct.pack("!H", port) + address + bytes(8)
    return struct.pack("=H", AF_INET6) + struct.pack("!H", port) + bytes(4) + address + bytes(4)


def _cwd(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/cwd")  # noqa: PTH115 - pathlib costs start-up


def service_redirect(addr: bytes, services: dict, cwd) -> tuple | bytes | str | None:  # type: ignore[type-arg,no-untyped-def]
    """Where a connect to the sockaddr ``addr`` goes when it names a granted host service:
    TCP, ``(sockaddr, report)``: the grant itself, the address made of the grant's own bytes
    (an IPv4 grant asked for by its v4-mapped form: the mapped grant), and the relay's report
    socket; a service container's endpoint: the relay's loopback sockaddr (bytes, in the
    caller's family); unix: the relay's socket path. None when ``addr`` names no grant.
    ``cwd()``: the caller's working directory (a relative unix path). Pure but for ``cwd``."""
    if not services or len(addr) < 2:
        return None
    family = struct.unpack("=H", addr[:2])[0]
    if family == AF_INET and len(addr) >= 8:
        port = struct.unpack("!H", addr[2:4])[0]
        found = services.get((AF_INET, addr[4:8], port))
        if found is None:
            return None
        if isinstance(found, int):
            return _sockaddr(AF_INET, LOOPBACK4, found)
        return _sockaddr(AF_INET, addr[4:8], port), found[1]
    if family == AF_INET6 and len(addr) >= 24:
        port = struct.unpack("!H", addr[2:4])[0]
        ip6 = addr[8:24]
        mapped = ip6[:12] == LOOPBACK4_MAPPED[:12]
        found = services.get((AF_INET, ip6[12:], port) if mapped else (AF_INET6, ip6, port))
        if found is None:
            return None
        if isinstance(found, int):  # the relay's listener, in the caller's family
            return _sockaddr(AF_INET6, LOOPBACK4_MAPPED if mapped else LOOPBACK6, found)
        # Rebuilt from the matched bytes: no flow label or scope id of the caller's passes.
        return _sockaddr(AF_INET6, ip6, port), found[1]
    if family == AF_UNIX and len(addr) > 2 and addr[2] != 0:
        path = os.fsdecode(addr[2:].split(b"\0", 1)[0])
        if not path.startswith("/"):
            path = cwd().rstrip("/") + "/" + path
        relay = services.get(os.path.normpath(path))
        return relay if isinstance(relay, str) else None
    return None


def report_connect(sock, path: str, error: int) -> None:  # type: ignore[no-untyped-def]
    """Tell the grant's relay (its datagram socket at ``path``) of a connect made to the grant
    for the command (``error``: the connect's errno, 0 or EINPROGRESS when it connected or
    goes on): the relay writes the audit event. The socket blocks: when the relay's queue is
    full (the kernel keeps ``net.unix.max_dgram_qlen`` datagrams, 10 by default) the answer
    to the command's connect waits until the relay reads, so a busy relay slows connects and
    loses no event; a relay that is gone loses it, never the connect."""
    import errno

    message = b"O" if error in (0, errno.EINPROGRESS) else b"E%d" % error
    try:  # noqa: SIM105 - contextlib costs every command's start-up
        sock.sendto(message, path)
    except OSError:
        pass


class ConnectSupervisor:
    """Answers a ``filtered`` command's connect() and listen() calls (and bind(), with
    published ports), in threads of the reaper, each in the thread that received it, which
    hands the receiving on before a step that can wait (:meth:`serve_one`; listen: unix
    sockets and the sockets :meth:`bind` bound, see :data:`seccomp_notify.LISTEN_CALL`).

    The supervisor reads the address once, decides on its own copy, and makes the connect
    itself on the command's socket (the same open file, taken with ``pidfd_getfd``), so a
    thread changing the address after the check changes nothing (the kernel warns against
    letting the call continue: ``SECCOMP_USER_NOTIF_FLAG_CONTINUE`` re-reads user memory).
    Landlock's port rule (ABI 4) still holds for any connect made without us.
    """

    def __init__(
        self,
        listener: int,
        arch: str,
        writable: list[str],
        port: int,
        services: dict | None = None,  # type: ignore[type-arg]
        published: list[int] | None = None,
        bind_report_path: str | None = None,
    ) -> None:
        self.listener = listener
        """The seccomp listener the notifications came from (the reply goes back on it)."""
        self.arch = arch
        self.writable = writable
        """Where a unix socket the command connects to may lie (its writable paths)."""
        self.port = port
        self.services = services or {}
        """Granted host services (:func:`service_table`): a connect to one goes to the grant
        (TCP, reported to its relay) or to its relay (unix), whatever else the verdict would
        say."""
        self.reporter = (
            _socket.socket(AF_UNIX, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC)
            if any(isinstance(v, tuple) for v in self.services.values())
            else None
        )
        """The socket the TCP grants' connects are reported from (to each relay)."""
        self.published = frozenset(published or ())
        """The task's published sandbox ports (``publishPorts``): a bind to one of them on
        loopback or the wildcard is made to loopback at an ephemeral port (:meth:`bind`)."""
        self.bind_report_path = bind_report_path
        """Where the host reads each such bind (the landlock runtime's report socket)."""
        self.bind_reporter = (
            _socket.socket(AF_UNIX, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC)
            if bind_report_path
            else None
        )
        self.servers: dict[int, tuple[int, int, int]] = {}
        """Published sandbox port → (family, ephemeral port, inode) of the latest socket
        :meth:`bind` bound for it: where the command's own connects to that port go
        (:func:`own_server`)."""
        self.port_range = (32768, 60999)
        """The kernel's ephemeral range (:func:`ephemeral_choices`), read when ports are
        published."""
        if self.published:
            try:
                with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
                    self.port_range = local_port_range(fh.read())
            except OSError:
                pass
        self.bound: dict[tuple[int, int], tuple[int, int]] = {}
        """The sockets this supervisor bound for a published port, (st_dev, st_ino) → (family,
        ephemeral port): the only TCP sockets the command may listen on (:meth:`listen`)."""
        self.thread_pidfd = _thread_pidfd()
        """Whether pidfd_open takes ``PIDFD_THREAD`` here."""

    def serve_one(self, nid: int, pid: int, nr: int, args: list, hand_on=None) -> bool:  # type: ignore[type-arg,no-untyped-def]
        """Answer one connect or listen; whether ``hand_on`` handed the receiving on.

        ``hand_on()`` (supervisor.py: True when another thread receives from then on) is
        called at most once, before the first step that can wait on something outside the
        reaper (a path looked up, the connect itself), in the thread that received the call.
        Without it the caller runs this in a thread of its own."""
        import errno

        handed = False

        def before_waiting() -> None:
            nonlocal handed
            handed = hand_on is not None and bool(hand_on())

        try:
            if nr == notify.LISTEN_CALL[self.arch]:
                before_waiting()
                error = self.listen(nid, pid, args)
            elif nr == notify.BIND_CALL[self.arch]:
                error = self.bind(nid, pid, args, before_waiting)
            else:
                error = self.answer(nid, pid, args, before_waiting)
        except OSError as exc:
            error = exc.errno or errno.EACCES
        except Exception:  # never let the command's call hang
            error = errno.EACCES
        if error == CONTINUE:
            notify.reply_continue(self.listener, nid)
        else:
            notify.reply(self.listener, nid, error)
        return handed

    def answer(self, nid: int, pid: int, args: list, before_waiting=None) -> int:  # type: ignore[type-arg,no-untyped-def]
        """0 when connected (or in progress: EINPROGRESS), else the errno the call returns.
        ``before_waiting()``: called once before a step that can wait (:meth:`serve_one`)."""
        import errno

        fd, addr_ptr, length = int(args[0]) & 0xFFFFFFFF, args[1], int(args[2]) & 0xFFFFFFFF
        if fd >= 1 << 31 or length > 128:
            return errno.EINVAL if fd < 1 << 31 else errno.EBADF
        addr = self._bytes(pid, addr_ptr, length)
        redirect = service_redirect(addr, self.services, lambda: _cwd(pid))
        own = own_server(addr, self.servers) if redirect is None else None
        if own is not None:
            # The command's own server of a published port (a test that starts the dev server
            # and talks to it): its loopback port, while that is still the command's socket.
            if not still_listening(*own[1:]):
                return errno.ECONNREFUSED
            redirect = own[0]
        elif redirect is None and published_loopback(addr, self.published):
            # A published port nothing of the command's listens on (yet): refused, as on a
            # loopback of its own (a test waiting for its dev server retries on that).
            return errno.ECONNREFUSED
        verdict = "service" if redirect is not None else connect_verdict(addr, self.port)
        if verdict == "deny":
            return errno.EACCES
        # What follows can wait: a unix path's lookup (any mount beneath a writable path),
        # the connect (a unix listener's full backlog; a TCP SYN unanswered, up to minutes).
        if before_waiting is not None:
            before_waiting()
        target = addr
        opened = -1
        report = None
        if isinstance(redirect, tuple):
            # A TCP grant: the command's own socket connected to the grant itself (no hop:
            # the command is on the host's network already), the connect reported to the
            # grant's relay for the audit.
            target, report = redirect
        elif isinstance(redirect, bytes):  # a service container's: the relay's listener
            target = redirect
        elif isinstance(redirect, str):  # a unix grant: its relay's socket (ours, by O_PATH)
            try:
                opened = os.open(redirect, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError as exc:
                return exc.errno or errno.ECONNREFUSED
            target = struct.pack("=H", AF_UNIX) + f"/proc/self/fd/{opened}".encode() + b"\0"
        elif verdict == "unix":
            path = addr[2:].split(b"\0", 1)[0]
            opened = self._unix_socket(pid, os.fsdecode(path))
            if opened < 0:
                return -opened
            target = struct.pack("=H", AF_UNIX) + f"/proc/self/fd/{opened}".encode() + b"\0"
        try:
            theirs = self._their_fd(nid, pid, fd)
            try:
                if notify.libc.connect(theirs, ctypes.c_char_p(target), len(target)) == 0:
                    error = 0
                else:
                    error = ctypes.get_errno() or errno.EACCES
                if (
                    own is not None
                    and error in (0, errno.EINPROGRESS)
                    and not still_listening(*own[1:])
                ):
                    # Another listener came meanwhile: undone before any byte is sent.
                    unspec = struct.pack("=H", AF_UNSPEC) + bytes(14)
                    notify.libc.connect(theirs, ctypes.c_char_p(unspec), len(unspec))
                    error = errno.ECONNREFUSED
                if report is not None and self.reporter is not None:
                    report_connect(self.reporter, report, error)
                return error
            finally:
                os.close(theirs)
        finally:
            if opened >= 0:
                os.close(opened)

    def bind(self, nid: int, pid: int, args: list, before_waiting=None) -> int:  # type: ignore[type-arg,no-untyped-def]
        """0 when the command's socket is bound for a published port, :data:`CONTINUE` for a
        unix address, else the errno the call returns (:func:`bind_verdict`).

        A unix bind goes on as the kernel decides (``SECCOMP_USER_NOTIF_FLAG_CONTINUE``, which
        re-reads the address): Landlock rules the path it creates (``make_sock`` beneath
        writable paths only) and denies every TCP bind of the command, so whatever a thread
        swaps in meanwhile (another address, another socket at that fd) gains nothing. Made
        by the supervisor instead, the socket file would be created with its rights, past
        Landlock.

        A published port's bind is the supervisor's, on its own copy of the command's socket
        (``pidfd_getfd``): to loopback of the address's family at port 0, an ephemeral port,
        whatever loopback or wildcard address the command named, never another address. So
        the command's ``getsockname`` shows 127.0.0.1 (or ::1) and the ephemeral port, not
        the port it asked for, and other processes of the host can reach that port on
        loopback as they could the published one. The host learns of it (:func:`bind_report`)
        before the call returns; the host's clients of the published port are carried there
        (fusion_oci/runtimes/landlock/published.py)."""
        import errno

        fd, addr_ptr, length = int(args[0]) & 0xFFFFFFFF, args[1], int(args[2]) & 0xFFFFFFFF
        if fd >= 1 << 31 or length > 128:
            return errno.EINVAL if fd < 1 << 31 else errno.EBADF
        verdict, family, port = bind_verdict(self._bytes(pid, addr_ptr, length), self.published)
        if verdict == "unix":
            return CONTINUE
        if verdict != "publish":
            return errno.EACCES
        if before_waiting is not None:  # the report below waits when the host's queue is full
            before_waiting()
        theirs = self._their_fd(nid, pid, fd)
        try:
            loopback = LOOPBACK4 if family == AF_INET else LOOPBACK6
            error = 0
            for port_now in ephemeral_choices(self.port_range):
                target = _sockaddr(family, loopback, port_now)
                if notify.libc.bind(theirs, ctypes.c_char_p(target), len(target)) == 0:
                    error = 0
                    break
                error = ctypes.get_errno() or errno.EACCES
                if error != errno.EADDRINUSE:
                    break
            if error:
                return error
            bound = _local_port(theirs)
            st = os.fstat(theirs)
            if len(self.bound) >= MAX_BOUND:  # a bind loop must not grow the reaper
                del self.bound[next(iter(self.bound))]  # the oldest: long listened on, or gone
            self.bound[(st.st_dev, st.st_ino)] = (family, bound)
            self.servers[port] = (family, bound, st.st_ino)
            if self.bind_reporter is not None and self.bind_report_path:
                try:  # noqa: SIM105 - contextlib costs every command's start-up
                    self.bind_reporter.sendto(
                        bind_report(port, family, bound, st.st_ino), self.bind_report_path
                    )
                except OSError:
                    pass  # the host is gone: nothing will be carried, the bind stands
            return 0
        finally:
            os.close(theirs)

    def published_listener(self, theirs: int, family: int) -> bool:
        """Whether the TCP socket ``theirs`` (our copy) is one :meth:`bind` bound, still at
        that loopback port: an inode number freed and reused by a new socket is refused, as
        a new socket is unbound (its listen would autobind on every address)."""
        st = os.fstat(theirs)
        found = self.bound.get((st.st_dev, st.st_ino))
        if found is None or found[0] != family:
            return False
        name = _local_name(theirs)
        loopback = LOOPBACK4 if family == AF_INET else LOOPBACK6
        at = 4 if family == AF_INET else 8
        return name[at : at + len(loopback)] == loopback and _port_of(name) == found[1]

    def listen(self, nid: int, pid: int, args: list) -> int:  # type: ignore[type-arg]
        """A unix socket's listen, or a TCP socket's that :meth:`bind` bound for a published
        port, made on the caller's socket; any other is EACCES. The family is read from the
        socket object itself, which the listen then acts on."""
        import errno

        fd, backlog = int(args[0]) & 0xFFFFFFFF, int(args[1]) & 0xFFFFFFFF
        if fd >= 1 << 31:
            return errno.EBADF
        theirs = self._their_fd(nid, pid, fd)
        try:
            domain = ctypes.c_int(0)
            size = ctypes.c_uint32(ctypes.sizeof(domain))
            if (
                notify.libc.getsockopt(
                    theirs, SOL_SOCKET, SO_DOMAIN, ctypes.byref(domain), ctypes.byref(size)
                )
                != 0
            ):
                return ctypes.get_errno() or errno.ENOTSOCK
            if domain.value != AF_UNIX and not (
                domain.value in (AF_INET, AF_INET6)
                and self.published_listener(theirs, domain.value)
            ):
                return errno.EACCES
            backlog = backlog - (1 << 32) if backlog >= 1 << 31 else backlog
            if notify.libc.listen(theirs, backlog) == 0:
                return 0
            return ctypes.get_errno() or errno.EACCES
        finally:
            os.close(theirs)

    def _bytes(self, pid: int, addr: int, length: int) -> bytes:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, length, addr)
        finally:
            os.close(fd)
        if len(data) != length:
            raise OSError(14, "bad address")
        return data

    def _unix_socket(self, pid: int, path: str) -> int:
        """An O_PATH fd of the socket ``path`` names (from the command's cwd), or -errno:
        only a socket beneath a writable path (the command's own), never a host one such as
        an engine's socket under /run."""
        import errno

        dfd = os.open(f"/proc/{pid}/cwd", os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY)
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as exc:
            return -(exc.errno or errno.ENOENT)
        finally:
            os.close(dfd)
        real = os.readlink(f"/proc/self/fd/{fd}")  # noqa: PTH115 - pathlib costs start-up
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            os.close(fd)
            return -errno.ECONNREFUSED
        if not notify.beneath(real, self.writable):
            os.close(fd)
            return -errno.EACCES
        return fd

    def _their_fd(self, nid: int, tid: int, fd: int) -> int:
        """Our copy of the caller's ``fd`` (the same socket), taken from the calling thread
        itself (``PIDFD_THREAD``, Linux 6.9: its own descriptor table, and no /proc read to
        find its process), else from its process (whose fd table threads share), the
        notification checked still live after the pidfd names it, so the thread id was not
        reused meanwhile."""
        if self.thread_pidfd:
            pidfd = notify.libc.syscall(SYS_PIDFD_OPEN, tid, PIDFD_THREAD)
        else:
            pidfd = notify.libc.syscall(SYS_PIDFD_OPEN, notify.tgid(tid), 0)
        if pidfd < 0:
            raise notify.fail("pidfd_open")
        try:
            notify.fcntl_ioctl(self.listener, notify.NOTIF_ID_VALID, struct.pack("=Q", nid))
            theirs = notify.libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
            if theirs < 0:
                raise notify.fail("pidfd_getfd")
            return int(theirs)
        finally:
            os.close(pidfd)


def _local_name(fd: int) -> bytes:
    """The socket's own address (getsockname), as the kernel wrote it."""
    buf = ctypes.create_string_buffer(128)
    size = ctypes.c_uint32(128)
    if notify.libc.getsockname(fd, buf, ctypes.byref(size)) != 0:
        raise notify.fail("getsockname")
    return buf.raw[: size.value]


def _port_of(name: bytes) -> int:
    return int(struct.unpack("!H", name[2:4])[0]) if len(name) >= 4 else 0


def _local_port(fd: int) -> int:
    return _port_of(_local_name(fd))


def _thread_pidfd() -> bool:
    """Whether this kernel's pidfd_open takes ``PIDFD_THREAD`` (an older one: EINVAL)."""
    pidfd = notify.libc.syscall(SYS_PIDFD_OPEN, os.getpid(), PIDFD_THREAD)
    if pidfd < 0:
        return False
    os.close(pidfd)
    return True
