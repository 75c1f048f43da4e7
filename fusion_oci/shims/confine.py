"""The child side of the ``landlock`` runtime: confine this process, then the reaper execs.

Imported by the reaper (reaper.py, a sibling: standard library only, nothing from the package)
before its fork, and run in the forked child after the rlimits and before ``execvp``, when the
reaper got ``SANDBOX=FILE``. FILE is the launch file (:func:`parse`) that
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
   ``fchmodat2``) and every ``open``/``openat`` (and, for ``network: filtered``, granted
   host services or published ports, every ``connect``/``listen``; with published ports
   every ``bind`` too) to the reaper, over a seccomp user-notification fd passed back on a
   socket pair made before the fork (seccomp_notify.py); the reaper answers them
   (supervisor.py, connects.py, where the reasons are).
"""

import _socket  # C modules (like the reaper's): no start-up cost worth naming
import _stat as stat
import _struct as struct
import ctypes
import os

# os.execvp imports warnings lazily; after step 3 the interpreter's own library may be out of
# reach (a pyenv or venv Python outside the granted paths), so it is imported now.
import warnings  # noqa: F401

if __package__:  # fusion_oci.shims.confine (see fusion_oci/shims/__init__.py)
    from . import seccomp_notify as notify
else:  # run by path: the siblings are on sys.path[0]
    import seccomp_notify as notify  # type: ignore[import-not-found,no-redef]

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


def abi_version() -> int:
    """The Landlock ABI this kernel offers; 0 without Landlock (ENOSYS) or disabled at boot."""
    rc = notify.libc.syscall(
        SYS_LANDLOCK[0], None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION)
    )
    return int(rc) if rc > 0 else 0


def drop_capabilities() -> None:
    for cap in range(CAP_LAST + 1):
        # EINVAL past the kernel's last capability; EPERM when we never had CAP_SETPCAP
        # (an unprivileged caller, whose bounding set cannot give anything back anyway).
        notify.libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    notify.libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = struct.pack("=Ii", LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} u32 triples, all zero
    if notify.libc.capset(ctypes.c_char_p(header), ctypes.c_char_p(data)) != 0:
        raise notify.fail("capset")


def no_new_privs() -> None:
    if notify.libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise notify.fail("prctl(PR_SET_NO_NEW_PRIVS)")


def restrict(cfg: dict) -> None:  # type: ignore[type-arg]
    """Create the ruleset, add the path rules, and restrict this process to it."""
    abi = int(cfg["abi"])
    fields = [int(cfg["handled_fs"])]
    if abi >= 4:
        fields.append(int(cfg["handled_net"]))
    if abi >= 6:
        fields.append(int(cfg["scoped"]))
    attr = struct.pack(f"={len(fields)}Q", *fields)
    ruleset = notify.libc.syscall(
        SYS_LANDLOCK[0], ctypes.c_char_p(attr), ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)
    )
    if ruleset < 0:
        raise notify.fail("landlock_create_ruleset")
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
                    notify.libc.syscall(
                        SYS_LANDLOCK[1],
                        ruleset,
                        LANDLOCK_RULE_PATH_BENEATH,
                        ctypes.c_char_p(rule),
                        ctypes.c_uint32(0),
                    )
                    != 0
                ):
                    raise notify.fail(f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        for port, access in cfg.get("ports", []):
            # struct landlock_net_port_attr is packed: u64 allowed_access, u64 port.
            rule = struct.pack("=QQ", int(access), int(port))
            if (
                notify.libc.syscall(
                    SYS_LANDLOCK[1],
                    ruleset,
                    LANDLOCK_RULE_NET_PORT,
                    ctypes.c_char_p(rule),
                    ctypes.c_uint32(0),
                )
                != 0
            ):
                raise notify.fail(f"landlock_add_rule(port {port})")
        if notify.libc.syscall(SYS_LANDLOCK[2], ruleset, ctypes.c_uint32(0)) != 0:
            raise notify.fail("landlock_restrict_self")
    finally:
        os.close(ruleset)


def install_seccomp(program: bytes) -> None:
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = SockFprog(len(program) // 8, program)
    if notify.libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise notify.fail("prctl(PR_SET_SECCOMP)")


# --- step 5: the notify filter, whose listener goes to the reaper ---------------------------

SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
RET_ALLOW, RET_USER_NOTIF = 0x7FFF0000, 0x7FC00000


def notify_program(arch: str, connect: bool = False, bind: bool = False) -> bytes:
    """``chmod`` family and opens (``connect`` and ``listen`` when asked, ``bind`` too with
    published ports) → USER_NOTIF, everything else → ALLOW (the main filter still runs)."""
    calls = [nr for nr in (*notify.CHMOD_CALLS[arch], *notify.OPEN_CALLS[arch]) if nr >= 0]
    if connect:
        calls += [notify.CONNECT_CALL[arch], notify.LISTEN_CALL[arch]]
    if bind:
        calls.append(notify.BIND_CALL[arch])
    prog = [(0x20, 0, 0, 4), (0x15, 0, len(calls) + 1, AUDIT_ARCH[arch]), (0x20, 0, 0, 0)]
    for i, nr in enumerate(calls):
        prog.append((0x15, len(calls) - i, 0, nr))  # jump to the USER_NOTIF return
    prog += [(0x06, 0, 0, RET_ALLOW), (0x06, 0, 0, RET_USER_NOTIF)]
    return b"".join(struct.pack("<HBBI", *ins) for ins in prog)


def install_chmod_listener(
    arch: str, channel: int, connect: bool = False, bind: bool = False
) -> None:
    """Install the notify filter and send its listener fd to the reaper over ``channel``."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    program = notify_program(arch, connect, bind)
    prog = SockFprog(len(program) // 8, program)
    listener = notify.libc.syscall(
        SYS_SECCOMP[arch],
        SECCOMP_SET_MODE_FILTER,
        SECCOMP_FILTER_FLAG_NEW_LISTENER,
        ctypes.byref(prog),
    )
    if listener < 0:
        raise notify.fail("seccomp(SECCOMP_FILTER_FLAG_NEW_LISTENER)")
    sock = _socket.socket(fileno=channel)
    try:
        sock.sendmsg([b"L"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("i", listener))])
    finally:
        sock.close()
        os.close(listener)


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
        elif key == "publish":
            cfg.setdefault("publish", []).append(int(value))
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
        install_chmod_listener(
            str(cfg["arch"]),
            channel,
            int(cfg.get("connect_port", -1)) >= 0,
            bool(cfg.get("publish")),
        )
