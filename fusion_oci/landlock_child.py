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
4. the seccomp filter last, so that it cannot refuse the calls of steps 1-3.
"""

import ctypes
import json
import os
import platform
import stat
import struct

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
    rc = _libc.syscall(SYS_LANDLOCK[0], None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
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
    ruleset = _libc.syscall(SYS_LANDLOCK[0], ctypes.c_char_p(attr), ctypes.c_size_t(len(attr)),
                            ctypes.c_uint32(0))
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
                if _libc.syscall(SYS_LANDLOCK[1], ruleset, LANDLOCK_RULE_PATH_BENEATH,
                                 ctypes.c_char_p(rule), ctypes.c_uint32(0)) != 0:
                    raise _fail(f"landlock_add_rule({path})")
            finally:
                os.close(fd)
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


def load(path: str) -> dict:  # type: ignore[type-arg]
    with open(path, encoding="utf-8") as fh:
        cfg: dict = json.load(fh)  # type: ignore[type-arg]
    if cfg.get("arch") != platform.machine():
        raise OSError(0, f"launch config is for {cfg.get('arch')}, not {platform.machine()}")
    return cfg


def apply(cfg: dict) -> None:  # type: ignore[type-arg]
    """Steps 1-4 of the module docstring, in order."""
    if cfg.get("drop_capabilities", True):
        drop_capabilities()
    no_new_privs()
    if int(cfg["abi"]) < 1:
        raise OSError(0, "this kernel offers no Landlock ABI")
    restrict(cfg)
    install_seccomp(bytes.fromhex(cfg["seccomp"]))
