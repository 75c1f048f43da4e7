"""The default seccomp profile (OCI ``linux.seccomp``) and its compilation to classic BPF.

One profile for every runtime: runc, podman and docker read the OCI JSON; bubblewrap and the
landlock runtime need the compiled filter (``bwrap --seccomp FD``), which :func:`compile_bpf`
gets from libseccomp (``seccomp_export_bpf``, through the ``pyseccomp`` binding over the
system's ``libseccomp.so.2``), as runc does from the same JSON.

The profile allows by default and refuses (EPERM) what an executor command never needs and an
attacker wants: mounting, new namespaces (unshare, setns, clone with CLONE_NEW*; clone3 answers
ENOSYS so libc falls back to clone, whose flags can be inspected), ptrace and cross-process
memory access, the kernel keyring, bpf and perf, module and kexec loading, raw and packet
sockets, clock and swap changes.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import ModuleType

DENIED = (
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "mount_setattr",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "syslog",
    "vhangup",
    "acct",
    "quotactl",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "open_by_handle_at",
    "name_to_handle_at",
    "lookup_dcookie",
    "nfsservctl",
    "uselib",
    "iopl",
    "ioperm",
)

AF_PACKET = 17
SOCK_RAW = 3
SOCK_TYPE_MASK = 0xF
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE_NEW_FLAGS = (
    0x00020000,
    0x02000000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
OCI_ARCHES = {"x86_64": ["SCMP_ARCH_X86_64"], "aarch64": ["SCMP_ARCH_AARCH64"]}
"""The OCI architecture names of a host architecture (``uname -m``)."""


def default_profile(arch: str = "x86_64") -> dict[str, Any]:
    """The OCI ``linux.seccomp`` object of every bundle."""
    eperm = errno.EPERM
    rules: list[dict[str, Any]] = [
        {"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": eperm},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
        {
            "names": ["socket"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": eperm,
            "args": [{"index": 0, "value": AF_PACKET, "op": "SCMP_CMP_EQ"}],
        },
        {
            "names": ["socket"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": eperm,
            "args": [
                {
                    "index": 1,
                    "value": SOCK_TYPE_MASK,
                    "valueTwo": SOCK_RAW,
                    "op": "SCMP_CMP_MASKED_EQ",
                }
            ],
        },
    ]
    rules += [
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": eperm,
            "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        }
        for flag in CLONE_NEW_FLAGS
    ]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": OCI_ARCHES.get(arch, []),
        "syscalls": rules,
    }


def without_errno_ret(profile: Mapping[str, Any]) -> dict[str, Any]:
    """``profile`` for a runtime that ignores ``errnoRet`` and answers every SCMP_ACT_ERRNO
    with EPERM: gVisor's ``--oci-seccomp`` does (runsc 20221219: ``convertAction`` maps the
    action to a fixed EPERM). Pure.

    There the clone3 rule broke every thread: glibc falls back to clone only on ENOSYS, and on
    EPERM gives up (``can't start new thread``, node's ``uv_thread_create`` abort). A rule
    whose errno is ENOSYS becomes SCMP_ACT_TRACE, which the kernel (gVisor's too) answers
    with ENOSYS when no tracer is attached, and none can be: the profile denies ptrace.
    EPERM rules stay; any other errno cannot be said there (ValueError).
    """
    out = {**profile, "syscalls": []}
    for rule in profile.get("syscalls", []):
        if rule.get("action") != "SCMP_ACT_ERRNO":
            out["syscalls"].append(dict(rule))
            continue
        code = rule.get("errnoRet", errno.EPERM)
        if code == errno.EPERM:
            out["syscalls"].append(dict(rule))
        elif code == errno.ENOSYS:
            trace = {k: v for k, v in rule.items() if k != "errnoRet"}
            out["syscalls"].append({**trace, "action": "SCMP_ACT_TRACE"})
        else:
            raise ValueError(
                f"errno {code} of {rule.get('names')} cannot be returned by a "
                "runtime that ignores errnoRet"
            )
    return out


LIBSECCOMP_HINT = (
    "install libseccomp (apt-get install libseccomp2, dnf install libseccomp) and "
    "the pyseccomp binding (pip install pyseccomp)"
)
# OCI architecture names as pyseccomp's Arch attributes.
_ARCH_ATTRS = {
    "SCMP_ARCH_X86": "X86",
    "SCMP_ARCH_X86_64": "X86_64",
    "SCMP_ARCH_X32": "X32",
    "SCMP_ARCH_ARM": "ARM",
    "SCMP_ARCH_AARCH64": "AARCH64",
    "SCMP_ARCH_PPC64LE": "PPC64LE",
    "SCMP_ARCH_S390X": "S390X",
    "SCMP_ARCH_RISCV64": "RISCV64",
}
_OPS = {
    "SCMP_CMP_NE": "NE",
    "SCMP_CMP_LT": "LT",
    "SCMP_CMP_LE": "LE",
    "SCMP_CMP_EQ": "EQ",
    "SCMP_CMP_GE": "GE",
    "SCMP_CMP_GT": "GT",
    "SCMP_CMP_MASKED_EQ": "MASKED_EQ",
}
_PERMISSIVE = ("SCMP_ACT_ALLOW", "SCMP_ACT_LOG")
_LOW32 = 0xFFFFFFFF
_NR_SCMP_ERROR = -1


_SONAMES = {"c": "libc.so.6", "seccomp": "libseccomp.so.2"}
"""The libraries pyseccomp looks up at import, by the sonames the dynamic loader finds."""
_IMPORT_LOCK = threading.Lock()


def libseccomp() -> ModuleType:
    """The libseccomp binding; RuntimeError (with the fix) where the library is missing."""
    try:
        module = _import_binding()
    except (ImportError, RuntimeError, OSError) as exc:
        # pyseccomp raises RuntimeError at import when libseccomp.so.2 is not found.
        raise RuntimeError(f"libseccomp is not usable here ({exc}); {LIBSECCOMP_HINT}") from exc
    return module


def _import_binding() -> ModuleType:
    """``import pyseccomp``, without its ``ctypes.util.find_library`` calls for the libraries
    that load by soname here. Each call runs ``ldconfig -p`` (and more) in a subprocess: ~15 ms
    of every one-shot bubblewrap or landlock run (measured; the import took 17 ms, 2 ms
    without them), to find names the dynamic loader resolves itself. A library that does not
    load by its soname (another libc) is looked up as pyseccomp would."""
    import ctypes
    import ctypes.util

    with _IMPORT_LOCK:
        if "pyseccomp" in sys.modules:
            return sys.modules["pyseccomp"]
        known: dict[str, str] = {}
        for name, soname in _SONAMES.items():
            try:
                ctypes.CDLL(soname)
            except OSError:
                continue
            known[name] = soname
        real = ctypes.util.find_library

        def find_library(name: str) -> str | None:
            return known.get(name) or real(name)

        # Only for the import, under the lock: nothing else of this package calls it.
        ctypes.util.find_library = find_library
        try:
            import pyseccomp
        finally:
            ctypes.util.find_library = real
        module: ModuleType = pyseccomp
        return module


def libseccomp_problem() -> str | None:
    """Why seccomp filters cannot be compiled here, or None. Cheap: it loads the library but
    does not import the binding (whose import runs ``ldconfig -p`` to find it)."""
    import ctypes
    import importlib.util

    try:
        ctypes.CDLL("libseccomp.so.2")
    except OSError as exc:
        return f"libseccomp is not usable here ({exc}); {LIBSECCOMP_HINT}"
    if importlib.util.find_spec("pyseccomp") is None:
        return f"the pyseccomp binding is not installed; {LIBSECCOMP_HINT}"
    return None


def _action(sc: ModuleType, name: str, errno_ret: int | None) -> int:
    code = errno.EPERM if errno_ret is None else int(errno_ret)
    actions: dict[str, int] = {
        "SCMP_ACT_ALLOW": sc.ALLOW,
        "SCMP_ACT_LOG": sc.LOG,
        "SCMP_ACT_TRAP": sc.TRAP,
        "SCMP_ACT_KILL": sc.KILL_THREAD,
        "SCMP_ACT_KILL_THREAD": sc.KILL_THREAD,
        "SCMP_ACT_KILL_PROCESS": sc.KILL_PROCESS,
    }
    if name == "SCMP_ACT_ERRNO":
        return int(sc.ERRNO(code))
    if name == "SCMP_ACT_TRACE":
        return int(sc.TRACE(code))
    if name not in actions:
        raise ValueError(f"seccomp action {name} is not supported here (no notify listener)")
    return actions[name]


def _condition(sc: ModuleType, arg: Mapping[str, Any], *, deny: bool) -> Any:
    op = arg.get("op", "")
    if op not in _OPS:
        raise ValueError(f"unsupported comparison {op}")
    index, value, two = int(arg["index"]), int(arg.get("value", 0)), int(arg.get("valueTwo", 0))
    if deny and op == "SCMP_CMP_EQ" and 0 <= value <= _LOW32:
        # The kernel truncates an int argument to its low 32 bits, so a deny rule on a 32-bit
        # value must not be dodged by setting the high bits (socket(0x100000011, ...) is an
        # AF_PACKET socket): it matches on the low 32 bits, as a masked compare.
        return sc.Arg(index, sc.MASKED_EQ, _LOW32, value)
    return sc.Arg(index, getattr(sc, _OPS[op]), value, two)


def compile_bpf(profile: Mapping[str, Any], arch: str) -> bytes:
    """The OCI seccomp ``profile`` as the classic BPF program the kernel loads, for a host of
    architecture ``arch`` (``uname -m``), compiled by libseccomp.

    As runc reads it: each rule's action for its syscalls when all of its ``args`` hold (args
    on the same index are alternatives); names this libseccomp does not know are skipped.
    Syscalls of an architecture the profile does not list (i386 or x32 on x86_64) kill the
    process. ValueError for what a filter cannot say; RuntimeError without libseccomp.

    Memoized by the profile's content (compiling one takes ~20 ms, on every prepare of a
    bubblewrap or landlock task; the resident server compiles each profile once).
    """
    key = (json.dumps(profile, sort_keys=True, separators=(",", ":")), arch)
    program = _COMPILED.get(key)
    if program is None:
        program = _compile_bpf(profile, arch)
        if len(_COMPILED) >= _COMPILED_MAX:
            _COMPILED.pop(next(iter(_COMPILED)))  # the oldest: a bound, not an LRU
        _COMPILED[key] = program
    return program


_COMPILED: dict[tuple[str, str], bytes] = {}
_COMPILED_MAX = 32
"""Profiles kept compiled (a task's profile varies with its network mode and ports)."""


def _compile_bpf(profile: Mapping[str, Any], arch: str) -> bytes:
    sc = libseccomp()
    if profile.get("flags") or profile.get("listenerPath"):
        raise ValueError("seccomp flags and listenerPath are not supported by a bare filter")
    if arch not in OCI_ARCHES:
        raise ValueError(f"no seccomp architecture for host architecture {arch}")
    default = _action(sc, profile.get("defaultAction", ""), profile.get("defaultErrnoRet"))
    flt = sc.SyscallFilter(default)
    flt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)
    wanted = [*OCI_ARCHES[arch], *profile.get("architectures", [])]
    tokens = [getattr(sc.Arch, _ARCH_ATTRS[a]) for a in dict.fromkeys(wanted) if a in _ARCH_ATTRS]
    for token in tokens:
        if not flt.exist_arch(token):
            flt.add_arch(token)
    if sc.system_arch() not in tokens:
        flt.remove_arch(sc.Arch.NATIVE)  # compiling for another host (tests do)
    for rule in profile.get("syscalls", []):
        action = _action(sc, rule["action"], rule.get("errnoRet"))
        if action == default:
            continue  # libseccomp refuses a rule that changes nothing
        deny = rule["action"] not in _PERMISSIVE
        args = rule.get("args") or []
        conds = [_condition(sc, a, deny=deny) for a in args]
        same_index = len({int(a["index"]) for a in args}) < len(args)
        groups = [[c] for c in conds] if same_index else [conds]
        for name in rule.get("names", []):
            if sc.resolve_syscall(sc.Arch.NATIVE, name) == _NR_SCMP_ERROR:
                continue  # not a syscall this libseccomp knows
            for group in groups:
                flt.add_rule(action, name, *group)
    return _export(flt)


def _export(flt: Any) -> bytes:
    """seccomp_export_bpf into an anonymous memory file, read back."""
    fd = os.memfd_create("fusion-oci-seccomp", os.MFD_CLOEXEC)
    try:
        with open(fd, "wb", closefd=False) as out:
            flt.export_bpf(out)
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    program = b"".join(chunks)
    if not program or len(program) % 8:
        raise ValueError("libseccomp exported no filter")
    return program
