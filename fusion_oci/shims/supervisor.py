"""The reaper's side of step 5 of the confinement (confine.py): the supervisor that answers
the confined command's chmod and open calls, from outside the sandbox, in threads of the
reaper (:func:`supervise`); a ``filtered`` command's connects (and, with published ports,
its binds) go on to connects.py.

Why chmod: Landlock (up to ABI 7) governs opening, creating and removing files, not changing
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

import _socket
import _stat as stat
import _struct as struct
import _thread
import ctypes
import os

if __package__:  # fusion_oci.shims.supervisor (see fusion_oci/shims/__init__.py)
    from . import connects
    from . import seccomp_notify as notify
else:  # run by path: the siblings are on sys.path[0]
    import connects  # type: ignore[import-not-found,no-redef]
    import seccomp_notify as notify  # type: ignore[import-not-found,no-redef]

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
AT_FDCWD, AT_SYMLINK_NOFOLLOW, AT_EMPTY_PATH = -100, 0x100, 0x1000


class Supervisor:
    """Answers the command's chmod and open calls (step 5), in threads of the reaper (one
    receives at a time: :meth:`serve`)."""

    def __init__(self, cfg: dict, listener: int) -> None:  # type: ignore[type-arg]
        self.arch = str(cfg["arch"])
        self.writable = [str(p) for p in cfg.get("writable", [])]
        self.listener = listener
        chmod, fchmod, fchmodat, fchmodat2 = notify.CHMOD_CALLS[self.arch]
        self.calls = {
            "chmod": chmod,
            "fchmod": fchmod,
            "fchmodat": fchmodat,
            "fchmodat2": fchmodat2,
        }
        port = int(cfg.get("connect_port", -1))
        self.connects = (
            connects.ConnectSupervisor(
                listener,
                self.arch,
                self.writable,
                port,
                connects.service_table(cfg),
                published=[int(p) for p in cfg.get("publish", [])],
                bind_report_path=cfg.get("publish_report"),
            )
            if port >= 0
            else None
        )
        self.network_calls = (
            notify.CONNECT_CALL[self.arch],
            notify.LISTEN_CALL[self.arch],
            notify.BIND_CALL[self.arch],
        )
        """The calls connects.py answers (bind is handed over only with published ports)."""
        self.opens = {nr: i for i, nr in enumerate(notify.OPEN_CALLS[self.arch]) if nr >= 0}
        self.turn = _thread.allocate_lock()
        """Held by the one thread that receives notifications (:meth:`serve`)."""
        self.count = _thread.allocate_lock()
        self.spares = 0
        """Threads waiting for the turn, under ``count``."""
        self.stopped = False
        """The listener is unusable: every thread ends."""

    def serve(self) -> None:
        """Answer notifications for as long as the listener serves, in whichever thread of
        the reaper holds the turn to receive (:attr:`turn`).

        Opens and chmods are answered by the receiving thread, and so are connects and
        listens: the caller handed its CPU straight to that thread
        (:func:`seccomp_notify.sync_wake_up`), and a thread started for each connect, as
        before, cost about 40 µs of the 0.15 ms a granted connection added
        (benchmarks/bench_services.py). A connect can block, though (a unix listener's full
        backlog, a TCP SYN unanswered), and no chmod or open may wait for it: before its first
        step that can wait, the thread hands the turn to a spare (:meth:`hand_on`), and once
        done it becomes the spare, or ends when one waits already.
        """
        while True:
            with self.count:
                self.spares += 1
            self.turn.acquire()
            with self.count:
                self.spares -= 1
            if self.stopped or not self.receive():
                self.stopped = True
                self.turn.release()  # a spare waiting for it finds out and ends too
                return
            with self.count:
                if self.spares:
                    return  # a spare waits already: one is enough

    def receive(self) -> bool:
        """Receive and answer while holding the turn: True once it was handed on (the
        thread answered a connect meanwhile), False when the listener is unusable."""
        import errno
        import fcntl

        while True:
            buf = bytearray(80)  # struct seccomp_notif, zeroed as the kernel requires
            try:
                fcntl.ioctl(self.listener, notify.NOTIF_RECV, buf, True)
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOENT and not self.hung_up():
                    # A caller killed while its call waited here (a timeout, maxBuffer, an
                    # abort ending the tree) leaves a notification counted and then withdrawn:
                    # this receive finds none. The next ones are for the living.
                    continue
                # The listener itself is unusable, or no process is left under the filter
                # (every receive then fails at once: it would spin): nothing more will come.
                return False
            nid, pid, _flags, nr, _arch, _ip, *args = struct.unpack("=QIIiIQ6Q", bytes(buf))
            if self.connects is not None and nr in self.network_calls:
                if self.connects.serve_one(nid, pid, nr, args, self.hand_on):
                    return True
                continue  # answered without waiting (refused), or no spare could start
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
                fcntl.ioctl(
                    self.listener, notify.NOTIF_SEND, struct.pack("=QqiI", nid, 0, -error, 0)
                )
            except OSError:
                continue  # the caller died meanwhile

    def hung_up(self) -> bool:
        """Whether no process is left under the filter: the listener polls as hung up (no
        process can join it then; a process joins only by forking from one under it)."""
        import select

        poller = select.poll()
        poller.register(self.listener, select.POLLIN)
        events = 0
        for _fd, ev in poller.poll(0):
            events |= ev
        return bool(events & select.POLLHUP) and not events & select.POLLIN

    def hand_on(self) -> bool:
        """Give the turn to receive (held by this thread) to a spare thread, started when
        none waits. False, the turn kept, when none can start (the connect is then answered
        here, blocking or not, rather than not at all)."""
        with self.count:
            waiting = self.spares > 0
        if not waiting:
            try:
                _thread.start_new_thread(self.serve, ())
            except RuntimeError:
                return False
        self.turn.release()
        return True

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
                    notify.NOTIF_ADDFD,
                    struct.pack("=QIIII", nid, notify.ADDFD_FLAG_SEND, fd, 0, flags),
                )
                return  # the caller's open returned that descriptor
            except OSError:
                pass
            finally:
                os.close(fd)
        with contextlib.suppress(OSError):  # the caller died meanwhile
            fcntl.ioctl(
                self.listener,
                notify.NOTIF_SEND,
                struct.pack("=QqiI", nid, 0, 0, notify.USER_NOTIF_FLAG_CONTINUE),
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
        tgid = notify.tgid(tid)
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
            fcntl.ioctl(self.listener, notify.NOTIF_ID_VALID, struct.pack("=Q", nid))
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
        fcntl.ioctl(self.listener, notify.NOTIF_ID_VALID, struct.pack("=Q", nid))
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
            if not notify.beneath(real, self.writable) or st.st_uid != _euid(pid):
                return errno.EPERM
            os.chmod(f"/proc/self/fd/{fd}", mode)  # noqa: PTH101 - on the checked object
            return 0
        finally:
            os.close(fd)


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


def _openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    how = struct.pack("=QQQ", flags, 0, resolve)  # struct open_how
    fd = notify.libc.syscall(
        SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.c_char_p(how), ctypes.c_size_t(len(how))
    )
    if fd < 0:
        raise notify.fail(f"openat2({path})")
    return int(fd)


def _euid(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
        for line in fh:
            if line.startswith("Uid:"):
                return int(line.split()[2])
    raise OSError(3, "no such process")


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
        notify.sync_wake_up(fds[0])
        # A bare thread: the reaper exits without joining it once the command is done.
        _thread.start_new_thread(Supervisor(cfg, fds[0]).serve, ())
