"""The child side of the ``landlock`` runtime: confine this process, then the reaper execs.

Imported by :mod:`fusion_oci.reaper` (as a sibling script module, so: standard library only,
nothing from the package) in the forked child, after the rlimits and before ``execvp``, when the
reaper got ``SANDBOX=FILE``. FILE is the launch configuration that
:func:`fusion_oci.runtimes.landlock.launch_config` computed in the parent: plain integers, so
nothing here interprets policy.

Order matters, and every step fails closed (the reaper turns an exception into exit 125):

1. capabilities: the bounding set emptied (so an exec by uid 0 regains nothing), ambient
   cleared, effective/permitted/inheritable zeroed;
2. ``PR_SET_NO_NEW_PRIVS`` (setuid and file capabilities stop working; Landlock and seccomp
   need it without CAP_SYS_ADMIN);
3. the Landlock ruleset: every access right the kernel's ABI knows is handled, and only the
   listed paths get any (a path that does not exist gets nothing: less access, never more);
4. the seccomp filter last, so that it cannot refuse the calls of steps 1-3;
5. a second filter that hands every chmod (``chmod``, ``fchmod``, ``fchmodat``,
   ``fchmodat2``) and every ``open``/``openat`` to the reaper, over a seccomp
   user-notification fd passed back on a socket pair made before the fork (see
   :class:`Supervisor`).

Why step 5: Landlock (up to ABI 7) governs opening, creating and removing files, not changing
their metadata, so without it the command could ``chmod 666`` any file of the caller's on the
host (as root: any file) without being able to open it. The supervisor, outside the sandbox,
does the chmod itself on the object the path names, only when that object lies beneath a
writable path of the bundle, is owned by the command's user, and no setuid/setgid bit is asked
for; anything else is EPERM. It acts on an O_PATH descriptor it opened and checked, so a path
changed in the command's memory or a symlink swapped afterwards changes nothing.

Why the opens: Landlock rules bind to inodes, and a process's ``/proc/<pid>`` is a new inode
for every pid, so no rule can grant each process of the tree its own ``/proc/self`` short of
granting all of ``/proc`` (other processes' cmdline and status, ``/proc/keys``,
``/proc/timer_list``, the sysctls). The supervisor lets every open go on untouched
(``SECCOMP_USER_NOTIF_FLAG_CONTINUE``: the kernel and Landlock decide, as without it) except a
read-only open of an entry among :data:`OWN_PROC` of the caller's own ``/proc/self``,
``/proc/thread-self`` or ``/proc/<its pid>``, of :data:`SANDBOX_PROC` of a process descending
from the reaper, or of the ``/proc`` listing (pid numbers, so that ``ps`` shows the sandbox's
processes as in a pid namespace): that one it opens itself, beneath ``/proc/<pid>`` with no
magic link followed (``openat2`` ``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS``, so ``fd/N``,
``cwd``, ``root`` and ``exe`` lead nowhere), and hands the descriptor over
(``SECCOMP_IOCTL_NOTIF_ADDFD``). It only ever adds that access; it never opens anything else.
"""

import _socket  # C modules (like the reaper's): no start-up cost worth naming
import _stat as stat
import _struct as struct
import _thread
import ctypes
import os

# os.execvp imports warnings lazily; after step 3 the interpreter's own library may be out of
# reach (a pyenv or venv Python outside the granted paths), so it is imported now.
import warnings  # noqa: F401

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
CAP_LAST = 63
LINUX_CAPABILITY_VERSION_3 = 0x20080522
LANDLOCK_RULE_PATH_BENEATH = 1
LANDLOCK_RULE_NET_PORT = 2
LANDLOCK_CREATE_RULESET_VERSION = 1

# landlock_create_ruleset, landlock_add_rule, landlock_restrict_self: one number on every
# architecture (the generic syscall table).
SYS_LANDLOCK = (444, 445, 446)

FS_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)
"""EXECUTE, WRITE_FILE, READ_FILE, TRUNCATE, IOCTL_DEV: the only rights a rule on a file (not
a directory) may carry."""

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def abi_version() -> int:
    """The Landlock ABI this kernel offers; 0 without Landlock (ENOSYS) or disabled at boot."""
    rc = _libc.syscall(
        SYS_LANDLOCK[0], None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION)
    )
    return int(rc) if rc > 0 else 0


def drop_capabilities() -> None:
    for cap in range(CAP_LAST + 1):
        # EINVAL past the kernel's last capability; EPERM when we never had CAP_SETPCAP
        # (an unprivileged caller, whose bounding set cannot give anything back anyway).
        _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = struct.pack("=Ii", LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} u32 triples, all zero
    if _libc.capset(ctypes.c_char_p(header), ctypes.c_char_p(data)) != 0:
        raise _fail("capset")


def no_new_privs() -> None:
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _fail("prctl(PR_SET_NO_NEW_PRIVS)")


def restrict(cfg: dict) -> None:  # type: ignore[type-arg]
    """Create the ruleset, add the path rules, and restrict this process to it."""
    abi = int(cfg["abi"])
    fields = [int(cfg["handled_fs"])]
    if abi >= 4:
        fields.append(int(cfg["handled_net"]))
    if abi >= 6:
        fields.append(int(cfg["scoped"]))
    attr = struct.pack(f"={len(fields)}Q", *fields)
    ruleset = _libc.syscall(
        SYS_LANDLOCK[0], ctypes.c_char_p(attr), ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)
    )
    if ruleset < 0:
        raise _fail("landlock_create_ruleset")
    try:
        for path, access in cfg["paths"]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # absent: it gets no access at all
            try:
                is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
                allowed = int(access) if is_dir else int(access) & FS_FILE_RIGHTS
                if not allowed:
                    continue
                # struct landlock_path_beneath_attr is packed: u64 allowed_access, s32 fd.
                rule = struct.pack("=Qi", allowed, fd)
                if (
                    _libc.syscall(
                        SYS_LANDLOCK[1],
                        ruleset,
                        LANDLOCK_RULE_PATH_BENEATH,
                        ctypes.c_char_p(rule),
                        ctypes.c_uint32(0),
                    )
                    != 0
                ):
                    raise _fail(f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        for port, access in cfg.get("ports", []):
            # struct landlock_net_port_attr is packed: u64 allowed_access, u64 port.
            rule = struct.pack("=QQ", int(access), int(port))
            if (
                _libc.syscall(
                    SYS_LANDLOCK[1],
                    ruleset,
                    LANDLOCK_RULE_NET_PORT,
                    ctypes.c_char_p(rule),
                    ctypes.c_uint32(0),
                )
                != 0
            ):
                raise _fail(f"landlock_add_rule(port {port})")
        if _libc.syscall(SYS_LANDLOCK[2], ruleset, ctypes.c_uint32(0)) != 0:
            raise _fail("landlock_restrict_self")
    finally:
        os.close(ruleset)


def install_seccomp(program: bytes) -> None:
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = SockFprog(len(program) // 8, program)
    if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise _fail("prctl(PR_SET_SECCOMP)")


# --- step 5: chmod through the supervisor -----------------------------------------------------

SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# (chmod, fchmod, fchmodat, fchmodat2); aarch64 has no plain chmod.
CHMOD_CALLS = {"x86_64": (90, 91, 268, 452), "aarch64": (-1, 52, 53, 452)}
# (open, openat); aarch64 has no plain open. openat2 is left alone (its flags sit in a struct;
# a program that uses it reads its /proc/self as without the supervisor).
OPEN_CALLS = {"x86_64": (2, 257), "aarch64": (-1, 56)}
OWN_PROC = frozenset(
    (
        "status",
        "stat",
        "statm",
        "maps",
        "smaps",
        "smaps_rollup",
        "limits",
        "cgroup",
        "cmdline",
        "environ",
        "comm",
        "auxv",
        "io",
        "mountinfo",
        "mounts",
        "oom_score",
        "oom_score_adj",
        "sched",
        "schedstat",
        "wchan",
        "cpuset",
        "loginuid",
        "sessionid",
        "personality",
        "fd",
        "fdinfo",
        "task",
        "attr",
        "ns",
    )
)
"""The entries of its own ``/proc/<pid>`` (and ``task/<tid>``) a command may open, read-only.
Not the ones whose content depends on the opener's capabilities, which the supervisor has
and the command does not: ``pagemap`` (frame numbers), ``stack``, ``syscall``; nor ``mem``;
nor ``net`` (the host's sockets)."""
SANDBOX_PROC = frozenset(
    (
        "status",
        "stat",
        "statm",
        "cmdline",
        "comm",
        "cgroup",
        "limits",
        "sched",
        "schedstat",
        "oom_score",
        "oom_score_adj",
        "cpuset",
        "loginuid",
        "sessionid",
        "task",
    )
)
"""The entries of the sandbox's *other* processes a command may open: those the kernel lets
any process of the same user read (what ``ps`` reads). Not the ones it guards by a ptrace
check (environ, maps, fd, auxv, io, ...), which the supervisor, opening with its own
credentials, would pass where the kernel might not (a process that made itself
non-dumpable)."""
O_ACCMODE, O_CREAT, O_TRUNC, O_PATH, O_CLOEXEC = 0o3, 0o100, 0o1000, 0o10000000, 0o2000000
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS, RESOLVE_BENEATH = 0x02, 0x08
NOTIF_ADDFD, ADDFD_FLAG_SEND, USER_NOTIF_FLAG_CONTINUE = 0x40182103, 1 << 1, 1
RET_ALLOW, RET_USER_NOTIF = 0x7FFF0000, 0x7FC00000
NOTIF_RECV, NOTIF_SEND, NOTIF_ID_VALID = 0xC0502100, 0xC0182101, 0x40082102
NOTIF_SET_FLAGS, FD_SYNC_WAKE_UP = 0x40082104, 1
"""``SECCOMP_IOCTL_NOTIF_SET_FLAGS`` and ``SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP`` (Linux 6.6)."""
AT_FDCWD, AT_SYMLINK_NOFOLLOW, AT_EMPTY_PATH = -100, 0x100, 0x1000


def notify_program(arch: str, connect: bool = False) -> bytes:
    """``chmod`` family and opens (and ``connect`` when asked) → USER_NOTIF, everything else →
    ALLOW (the main filter still runs)."""
    calls = [nr for nr in (*CHMOD_CALLS[arch], *OPEN_CALLS[arch]) if nr >= 0]
    if connect:
        calls += [CONNECT_CALL[arch], LISTEN_CALL[arch]]
    prog = [(0x20, 0, 0, 4), (0x15, 0, len(calls) + 1, AUDIT_ARCH[arch]), (0x20, 0, 0, 0)]
    for i, nr in enumerate(calls):
        prog.append((0x15, len(calls) - i, 0, nr))  # jump to the USER_NOTIF return
    prog += [(0x06, 0, 0, RET_ALLOW), (0x06, 0, 0, RET_USER_NOTIF)]
    return b"".join(struct.pack("<HBBI", *ins) for ins in prog)


def install_chmod_listener(arch: str, channel: int, connect: bool = False) -> None:
    """Install the notify filter and send its listener fd to the reaper over ``channel``."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    program = notify_program(arch, connect)
    prog = SockFprog(len(program) // 8, program)
    listener = _libc.syscall(
        SYS_SECCOMP[arch],
        SECCOMP_SET_MODE_FILTER,
        SECCOMP_FILTER_FLAG_NEW_LISTENER,
        ctypes.byref(prog),
    )
    if listener < 0:
        raise _fail("seccomp(SECCOMP_FILTER_FLAG_NEW_LISTENER)")
    sock = _socket.socket(fileno=channel)
    try:
        sock.sendmsg([b"L"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("i", listener))])
    finally:
        sock.close()
        os.close(listener)


def _beneath(path: str, roots: list) -> bool:  # type: ignore[type-arg]
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


class Supervisor:
    """Answers the command's chmod and open calls (step 5), in a thread of the reaper."""

    def __init__(self, cfg: dict, listener: int) -> None:  # type: ignore[type-arg]
        self.arch = str(cfg["arch"])
        self.writable = [str(p) for p in cfg.get("writable", [])]
        self.listener = listener
        chmod, fchmod, fchmodat, fchmodat2 = CHMOD_CALLS[self.arch]
        self.calls = {
            "chmod": chmod,
            "fchmod": fchmod,
            "fchmodat": fchmodat,
            "fchmodat2": fchmodat2,
        }
        port = int(cfg.get("connect_port", -1))
        self.connects = ConnectSupervisor(self, port, service_table(cfg)) if port >= 0 else None
        self.opens = {nr: i for i, nr in enumerate(OPEN_CALLS[self.arch]) if nr >= 0}

    def serve(self) -> None:
        import fcntl

        while True:
            buf = bytearray(80)  # struct seccomp_notif, zeroed as the kernel requires
            try:
                fcntl.ioctl(self.listener, NOTIF_RECV, buf, True)
            except InterruptedError:
                continue
            except OSError:
                return  # every confined process is gone
            nid, pid, _flags, nr, _arch, _ip, *args = struct.unpack("=QIIiIQ6Q", bytes(buf))
            if self.connects is not None and nr in (
                CONNECT_CALL[self.arch],
                LISTEN_CALL[self.arch],
            ):
                # Its own thread: a unix connect can block (a full backlog), chmod must not.
                _thread.start_new_thread(self.connects.serve_one, (nid, pid, nr, args))
                continue
            if nr in self.opens:
                self.serve_open(nid, pid, nr, args)
                continue
            try:
                error = self.answer(nid, pid, nr, args)
            except OSError as exc:
                error = exc.errno or 1
            except Exception:  # never let the command's call hang
                error = 1
            try:
                fcntl.ioctl(self.listener, NOTIF_SEND, struct.pack("=QqiI", nid, 0, -error, 0))
            except OSError:
                continue  # the caller died meanwhile

    def reply(self, nid: int, error: int) -> None:
        try:  # noqa: SIM105 - contextlib costs every command's start-up
            fcntl_ioctl(self.listener, NOTIF_SEND, struct.pack("=QqiI", nid, 0, -error, 0))
        except OSError:
            pass  # the caller died meanwhile

    def serve_open(self, nid: int, pid: int, nr: int, args: list) -> None:  # type: ignore[type-arg]
        """Hand over the caller's own /proc entry, or let the open go on as it would."""
        import contextlib
        import fcntl

        try:
            fd = self.own_proc(nid, pid, nr, args)
        except Exception:  # never let the command's call hang; never grant on a doubt
            fd = None
        if fd is not None:
            try:
                flags = O_CLOEXEC if args[self.opens[nr] + 1] & O_CLOEXEC else 0
                fcntl.ioctl(
                    self.listener,
                    NOTIF_ADDFD,
                    struct.pack("=QIIII", nid, ADDFD_FLAG_SEND, fd, 0, flags),
                )
                return  # the caller's open returned that descriptor
            except OSError:
                pass
            finally:
                os.close(fd)
        with contextlib.suppress(OSError):  # the caller died meanwhile
            fcntl.ioctl(
                self.listener, NOTIF_SEND, struct.pack("=QqiI", nid, 0, 0, USER_NOTIF_FLAG_CONTINUE)
            )

    def own_proc(self, nid: int, tid: int, nr: int, args: list) -> int | None:  # type: ignore[type-arg]
        """A descriptor of the /proc entry the open names when it is the sandbox's own (the
        caller's, or a process of the tree the reaper runs) or the /proc listing, else None
        (the open goes on untouched: the kernel and Landlock decide)."""
        import fcntl

        at = self.opens[nr]  # 0: open(path, flags); 1: openat(dirfd, path, flags)
        flags = args[at + 1] & 0xFFFFFFFF
        if flags & (O_ACCMODE | O_CREAT | O_TRUNC | O_PATH):
            return None  # only plain read-only opens (O_PATH ones Landlock allows anyway)
        path = self._string(tid, args[at])
        if not path.startswith("/"):
            dirfd = args[0] & 0xFFFFFFFF if at else AT_FDCWD & 0xFFFFFFFF
            base = "cwd" if dirfd == AT_FDCWD & 0xFFFFFFFF else f"fd/{dirfd}"
            path = os.readlink(f"/proc/{tid}/{base}") + "/" + path  # noqa: PTH115
        if path != "/proc" and not path.startswith("/proc/"):
            return None  # the common case, before reading the caller's status
        tgid = _tgid(tid)
        found = proc_entry(path, tid, tgid)
        if found is None:
            return None
        pid, rest = found
        if pid == PROC_LISTING:
            # Pid numbers only (kill(pid, 0) tells them anyway); every entry beneath is
            # asked for again, and refused unless it is the sandbox's.
            fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            top = os.open(f"/proc/{pid}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                # The descriptor is bound to that very process: what is checked is what opens.
                if pid != tgid and not _in_tree(top, os.getpid()):
                    return None
                fd = _openat2(
                    top,
                    rest,
                    (flags & ~O_CLOEXEC) | O_CLOEXEC,
                    RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS,
                )
            finally:
                os.close(top)
        try:
            # The caller still waits in this very open: its pid (so /proc/<tgid>) is its own.
            fcntl.ioctl(self.listener, NOTIF_ID_VALID, struct.pack("=Q", nid))
        except OSError:
            os.close(fd)
            raise
        return fd

    def _string(self, pid: int, addr: int) -> str:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        try:
            out = b""
            while len(out) < 4096:
                chunk = os.pread(fd, 256, addr + len(out))
                if not chunk:
                    raise OSError(14, "bad address")
                if b"\0" in chunk:
                    return os.fsdecode(out + chunk[: chunk.index(b"\0")])
                out += chunk
            raise OSError(36, "file name too long")
        finally:
            os.close(fd)

    def answer(self, nid: int, pid: int, nr: int, args: list) -> int:  # type: ignore[type-arg]
        """0 when done, else the errno the command's call returns."""
        import errno
        import fcntl

        signed = [a - (1 << 64) if a >= 1 << 63 else a for a in args]
        flags = 0
        if nr == self.calls["fchmod"]:
            base, path, mode, flags = f"/proc/{pid}/fd/{signed[0]}", "", args[1], AT_EMPTY_PATH
        elif nr == self.calls["chmod"]:
            base, path, mode = f"/proc/{pid}/cwd", self._string(pid, args[0]), args[1]
        else:
            dirfd = int(signed[0]) & 0xFFFFFFFF
            dirfd = dirfd - (1 << 32) if dirfd >= 1 << 31 else dirfd
            base = f"/proc/{pid}/cwd" if dirfd == AT_FDCWD else f"/proc/{pid}/fd/{dirfd}"
            path, mode = self._string(pid, args[1]), args[2]
            if nr == self.calls["fchmodat2"]:
                flags = args[3]
        # The request is still the same live call (the memory read above was that process's).
        fcntl.ioctl(self.listener, NOTIF_ID_VALID, struct.pack("=Q", nid))
        mode &= 0o7777
        if mode & (stat.S_ISUID | stat.S_ISGID):
            return errno.EPERM
        nofollow = os.O_NOFOLLOW if flags & AT_SYMLINK_NOFOLLOW else 0
        if path == "" and flags & AT_EMPTY_PATH:
            fd = os.open(base, os.O_PATH | os.O_CLOEXEC)
        elif path == "":
            return errno.ENOENT
        else:
            dfd = os.open(base, os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY)
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC | nofollow, dir_fd=dfd)
            finally:
                os.close(dfd)
        try:
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode):
                return errno.EOPNOTSUPP
            real = os.readlink(f"/proc/self/fd/{fd}")  # noqa: PTH115 - pathlib costs start-up
            if not _beneath(real, self.writable) or st.st_uid != _euid(pid):
                return errno.EPERM
            os.chmod(f"/proc/self/fd/{fd}", mode)  # noqa: PTH101 - on the checked object
            return 0
        finally:
            os.close(fd)


# --- network filtered: every connect() through the supervisor ---------------------------------

CONNECT_CALL = {"x86_64": 42, "aarch64": 203}
LISTEN_CALL = {"x86_64": 50, "aarch64": 201}
"""listen() binds an unbound TCP socket to a port on every address (autobind, which
Landlock's bind rule does not see): an inbound way out. Unix sockets may listen."""
SOL_SOCKET, SO_DOMAIN = 1, 39
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438  # the generic numbers, on both architectures
AF_UNSPEC, AF_UNIX, AF_INET, AF_INET6 = 0, 1, 2, 10
LOOPBACK4 = bytes([127, 0, 0, 1])
LOOPBACK4_MAPPED = bytes(10) + b"\xff\xff" + LOOPBACK4
LOOPBACK6 = bytes(15) + b"\x01"


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
    goes on): the relay writes the audit event. Best effort: a full queue loses the event,
    never the connect."""
    import errno

    message = b"O" if error in (0, errno.EINPROGRESS) else b"E%d" % error
    try:  # noqa: SIM105 - contextlib costs every command's start-up
        sock.sendto(message, path)
    except OSError:
        pass


class ConnectSupervisor:
    """Answers a ``filtered`` command's connect() and listen() calls, in threads of the
    reaper (listen: unix sockets only, see :data:`LISTEN_CALL`).

    The supervisor reads the address once, decides on its own copy, and makes the connect
    itself on the command's socket (the same open file, taken with ``pidfd_getfd``), so a
    thread changing the address after the check changes nothing (the kernel warns against
    letting the call continue: ``SECCOMP_USER_NOTIF_FLAG_CONTINUE`` re-reads user memory).
    Landlock's port rule (ABI 4) still holds for any connect made without us.
    """

    def __init__(self, owner: Supervisor, port: int, services: dict | None = None) -> None:  # type: ignore[type-arg]
        self.owner = owner
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

    def serve_one(self, nid: int, pid: int, nr: int, args: list) -> None:  # type: ignore[type-arg]
        import errno

        try:
            if nr == LISTEN_CALL[self.owner.arch]:
                error = self.listen(nid, pid, args)
            else:
                error = self.answer(nid, pid, args)
        except OSError as exc:
            error = exc.errno or errno.EACCES
        except Exception:  # never let the command's call hang
            error = errno.EACCES
        self.owner.reply(nid, error)

    def answer(self, nid: int, pid: int, args: list) -> int:  # type: ignore[type-arg]
        """0 when connected (or in progress: EINPROGRESS), else the errno the call returns."""
        import errno

        fd, addr_ptr, length = int(args[0]) & 0xFFFFFFFF, args[1], int(args[2]) & 0xFFFFFFFF
        if fd >= 1 << 31 or length > 128:
            return errno.EINVAL if fd < 1 << 31 else errno.EBADF
        addr = self._bytes(pid, addr_ptr, length)
        redirect = service_redirect(addr, self.services, lambda: _cwd(pid))
        verdict = "service" if redirect is not None else connect_verdict(addr, self.port)
        if verdict == "deny":
            return errno.EACCES
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
                if _libc.connect(theirs, ctypes.c_char_p(target), len(target)) == 0:
                    error = 0
                else:
                    error = ctypes.get_errno() or errno.EACCES
                if report is not None and self.reporter is not None:
                    report_connect(self.reporter, report, error)
                return error
            finally:
                os.close(theirs)
        finally:
            if opened >= 0:
                os.close(opened)

    def listen(self, nid: int, pid: int, args: list) -> int:  # type: ignore[type-arg]
        """A unix socket's listen, made on the caller's socket; any other is EACCES. The
        family is read from the socket object itself, which the listen then acts on."""
        import errno

        fd, backlog = int(args[0]) & 0xFFFFFFFF, int(args[1]) & 0xFFFFFFFF
        if fd >= 1 << 31:
            return errno.EBADF
        theirs = self._their_fd(nid, pid, fd)
        try:
            domain = ctypes.c_int(0)
            size = ctypes.c_uint32(ctypes.sizeof(domain))
            if (
                _libc.getsockopt(
                    theirs, SOL_SOCKET, SO_DOMAIN, ctypes.byref(domain), ctypes.byref(size)
                )
                != 0
            ):
                return ctypes.get_errno() or errno.ENOTSOCK
            if domain.value != AF_UNIX:
                return errno.EACCES
            backlog = backlog - (1 << 32) if backlog >= 1 << 31 else backlog
            if _libc.listen(theirs, backlog) == 0:
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
        if not _beneath(real, self.owner.writable):
            os.close(fd)
            return -errno.EACCES
        return fd

    def _their_fd(self, nid: int, tid: int, fd: int) -> int:
        """Our copy of the caller's ``fd`` (the same socket). The caller is a thread: its
        process (whose fd table threads share) is taken, and the notification checked still
        live after the pidfd names it, so the thread id was not reused meanwhile."""
        tgid = _tgid(tid)
        pidfd = _libc.syscall(SYS_PIDFD_OPEN, tgid, 0)
        if pidfd < 0:
            raise _fail("pidfd_open")
        try:
            fcntl_ioctl(self.owner.listener, NOTIF_ID_VALID, struct.pack("=Q", nid))
            theirs = _libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
            if theirs < 0:
                raise _fail("pidfd_getfd")
            return int(theirs)
        finally:
            os.close(pidfd)


PROC_LISTING = 0
"""The pid :func:`proc_entry` gives for ``/proc`` itself (its listing: pid numbers only)."""


def proc_entry(path: str, tid: int, tgid: int) -> tuple[int, str] | None:
    """``(pid, where beneath /proc/<pid>)`` when the absolute ``path`` names an entry of
    :data:`OWN_PROC` of the caller (thread ``tid`` of process ``tgid``: ``/proc/self``,
    ``/proc/thread-self``, ``/proc/<tgid>``) or of :data:`SANDBOX_PROC` of another process,
    ``(PROC_LISTING, ".")`` for ``/proc`` itself, else None. Pure: whether that other process
    is the sandbox's is the supervisor's question.

    ``..`` is refused, not resolved.
    """
    parts = [p for p in path.split("/") if p and p != "."]
    if not parts or parts[0] != "proc" or ".." in parts:
        return None
    if len(parts) == 1:
        return PROC_LISTING, "."
    if parts[1] == "self":
        pid, rest = tgid, parts[2:]
    elif parts[1] == "thread-self":
        pid, rest = tgid, ["task", str(tid), *parts[2:]]
    elif parts[1].isdigit() and parts[1] == str(int(parts[1])) and int(parts[1]) > 0:
        pid, rest = int(parts[1]), parts[2:]
    else:
        return None  # not a per-process entry (sysctls, keys, ...)
    if rest[:1] == ["task"]:
        entry = rest[2] if len(rest) > 2 else "task"  # task/<tid>/<entry>: per thread
    else:
        entry = rest[0] if rest else ""
    if entry and entry not in (OWN_PROC if pid == tgid else SANDBOX_PROC):
        return None
    return pid, "/".join(rest) or "."


def _status_field(fd: int, name: str) -> int:
    """An integer field of the ``status`` file beneath the /proc/<pid> descriptor ``fd``."""
    status = _openat2(fd, "status", os.O_RDONLY | O_CLOEXEC, RESOLVE_BENEATH)
    try:
        text = os.read(status, 4096).decode("ascii", "replace")
    finally:
        os.close(status)
    for line in text.split("\n"):
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise OSError(3, "no such process")


def _in_tree(fd: int, reaper: int) -> bool:
    """Whether the process of the /proc/<pid> descriptor ``fd`` descends from ``reaper`` (a
    subreaper: what its command leaves behind is reparented to it, so the chain holds).

    A process that dies meanwhile makes its children the reaper's, and a reused pid on the
    way up leads away from it: both refuse, never grant.
    """
    ppid = _status_field(fd, "PPid")
    for _ in range(64):
        if ppid == reaper:
            return True
        if ppid <= 1:
            return False
        up = os.open(f"/proc/{ppid}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            ppid = _status_field(up, "PPid")
        finally:
            os.close(up)
    return False


def _tgid(tid: int) -> int:
    with open(f"/proc/{tid}/status", encoding="ascii", errors="replace") as fh:
        for line in fh:
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    raise OSError(3, "no such process")


def _openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    how = struct.pack("=QQQ", flags, 0, resolve)  # struct open_how
    fd = _libc.syscall(
        SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.c_char_p(how), ctypes.c_size_t(len(how))
    )
    if fd < 0:
        raise _fail(f"openat2({path})")
    return int(fd)


def _euid(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
        for line in fh:
            if line.startswith("Uid:"):
                return int(line.split()[2])
    raise OSError(3, "no such process")


def socketpair() -> tuple[_socket.socket, int]:
    """(the reaper's end, the child's end as a bare fd), made before the fork."""
    mine, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    return mine, theirs.detach()


def supervise(cfg: dict, channel: _socket.socket) -> None:  # type: ignore[type-arg]
    """In the reaper, after the fork: take the listener fd from the child and serve it."""
    _msg, ancdata, _flags, _addr = channel.recvmsg(1, _socket.CMSG_LEN(4))
    channel.close()
    fds = [
        struct.unpack("i", data[:4])[0]
        for level, kind, data in ancdata
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS
    ]
    if fds:  # none: the child failed before step 5 and exits 125
        sync_wake_up(fds[0])
        # A bare thread: the reaper exits without joining it once the command is done.
        _thread.start_new_thread(Supervisor(cfg, fds[0]).serve, ())


INT_FIELDS = ("abi", "handled_fs", "handled_net", "scoped", "drop_capabilities", "connect_port")


def parse(text: str) -> dict:  # type: ignore[type-arg]
    """The launch file: ``KEY VALUE`` lines, ``path MASK PATH`` and ``writable PATH`` repeated.

    Not JSON: importing json (and re, which it pulls in) would cost every command.
    """
    cfg: dict = {"paths": [], "writable": [], "ports": []}  # type: ignore[type-arg]
    for line in text.split("\n"):
        if not line:
            continue
        key, _, value = line.partition(" ")
        if key == "port":
            mask, _, port = value.partition(" ")
            cfg["ports"].append([int(port), int(mask)])
        elif key == "path":
            mask, _, path = value.partition(" ")
            cfg["paths"].append([path, int(mask)])
        elif key == "writable":
            cfg["writable"].append(value)
        elif key == "svctcp":
            cfg.setdefault("svctcp", []).append(value)
        elif key == "svcunix":
            cfg.setdefault("svcunix", []).append([value, ""])
        elif key == "svcto":
            cfg["svcunix"][-1][1] = value
        elif key in INT_FIELDS:
            cfg[key] = int(value)
        else:
            cfg[key] = value
    return cfg


def load(path: str) -> dict:  # type: ignore[type-arg]
    with open(path, encoding="utf-8") as fh:
        cfg = parse(fh.read())
    machine = os.uname().machine
    if cfg.get("arch") != machine:
        raise OSError(0, f"launch config is for {cfg.get('arch')}, not {machine}")
    return cfg


def apply(cfg: dict, channel: int | None = None) -> None:  # type: ignore[type-arg]
    """Steps 1-5 of the module docstring, in order (5 when the reaper gave a channel)."""
    if cfg.get("drop_capabilities", True):
        drop_capabilities()
    no_new_privs()
    if int(cfg["abi"]) < 1:
        raise OSError(0, "this kernel offers no Landlock ABI")
    restrict(cfg)
    install_seccomp(bytes.fromhex(cfg["seccomp"]))
    if channel is not None:
        install_chmod_listener(str(cfg["arch"]), channel, int(cfg.get("connect_port", -1)) >= 0)
