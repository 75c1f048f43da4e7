"""The default seccomp profile (OCI ``linux.seccomp``) and a compiler from it to classic BPF.

One profile for every runtime: runc, podman and docker read the OCI JSON; bubblewrap needs the
compiled filter (``bwrap --seccomp FD``), which :func:`compile_bpf` produces without libseccomp.

The profile allows by default and refuses (EPERM) what an executor command never needs and an
attacker wants: mounting, new namespaces (unshare, setns, clone with CLONE_NEW*; clone3 answers
ENOSYS so libc falls back to clone, whose flags can be inspected), ptrace and cross-process
memory access, the kernel keyring, bpf and perf, module and kexec loading, raw and packet
sockets, clock and swap changes.
"""

from __future__ import annotations

import errno
import struct
from typing import Any

DENIED = (
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "mount_setattr", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
    "ptrace", "process_vm_readv", "process_vm_writev",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "syslog", "vhangup", "acct", "quotactl",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "nfsservctl", "uselib",
    "iopl", "ioperm",
)

AF_PACKET = 17
SOCK_RAW = 3
SOCK_TYPE_MASK = 0xF
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                   0x40000000)

# Syscall numbers (from libseccomp's scmp_sys_resolver; the unit tests cross-check them).
SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272,
        "setns": 308, "mount_setattr": 442, "move_mount": 429, "open_tree": 428,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "ptrace": 101,
        "process_vm_readv": 310, "process_vm_writev": 311, "keyctl": 250, "add_key": 248,
        "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "syslog": 103,
        "vhangup": 153, "acct": 163, "quotactl": 179, "settimeofday": 164,
        "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "lookup_dcookie": 212,
        "nfsservctl": 180, "uselib": 134, "iopl": 172, "ioperm": 173,
        "socket": 41, "clone": 56, "clone3": 435,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64, "semop": 65, "semctl": 66,
        "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semtimedop": 220,
        "mq_open": 240, "mq_unlink": 241,
    },
    "aarch64": {
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "unshare": 97,
        "setns": 268, "mount_setattr": 442, "move_mount": 429, "open_tree": 428,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "ptrace": 117,
        "process_vm_readv": 270, "process_vm_writev": 271, "keyctl": 219, "add_key": 217,
        "request_key": 218, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225, "syslog": 116,
        "vhangup": 58, "acct": 89, "quotactl": 60, "settimeofday": 170,
        "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171,
        "open_by_handle_at": 265, "name_to_handle_at": 264, "lookup_dcookie": 18,
        "nfsservctl": 42, "socket": 198, "clone": 220, "clone3": 435,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "mq_open": 180, "mq_unlink": 181, "msgget": 186, "msgctl": 187, "msgrcv": 188,
        "msgsnd": 189, "semget": 190, "semctl": 191, "semtimedop": 192, "semop": 193,
        "shmget": 194, "shmctl": 195, "shmat": 196,
    },
}

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
OCI_ARCHES = {"x86_64": ["SCMP_ARCH_X86_64"], "aarch64": ["SCMP_ARCH_AARCH64"]}


def default_profile(arch: str = "x86_64") -> dict[str, Any]:
    """The OCI ``linux.seccomp`` object of every bundle."""
    eperm = errno.EPERM
    rules: list[dict[str, Any]] = [
        {"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": eperm},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
        {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": eperm,
         "args": [{"index": 0, "value": AF_PACKET, "op": "SCMP_CMP_EQ"}]},
        {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": eperm,
         "args": [{"index": 1, "value": SOCK_TYPE_MASK, "valueTwo": SOCK_RAW,
                   "op": "SCMP_CMP_MASKED_EQ"}]},
    ]
    rules += [
        {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": eperm,
         "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}]}
        for flag in CLONE_NEW_FLAGS
    ]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": OCI_ARCHES.get(arch, []),
        "syscalls": rules,
    }


# Classic BPF, as seccomp reads it: struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}.
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_AND_K = 0x54
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
_NR, _ARCH, _ARGS = 0, 4, 16
_X32_BIT = 0x40000000


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> tuple[int, int, int, int]:
    return (code, jt, jf, k & 0xFFFFFFFF)


def _rule_block(nr: int, args: list[dict[str, Any]], ret: tuple[int, int, int, int]
                ) -> list[tuple[int, int, int, int]]:
    """``ld nr; jeq nr else END; [ld arg; (and mask); jeq value else END]...; ret; END:``.

    Every block reloads the syscall number first, so a block never depends on what the
    accumulator held when an earlier block fell through.
    """
    # (opcode, k, jumps-to-END-when-false) per instruction; offsets are fixed up below.
    body: list[tuple[int, int, bool]] = [(_LD_W_ABS, _NR, False), (_JEQ_K, nr, True)]
    for arg in args:
        body.append((_LD_W_ABS, _ARGS + 8 * int(arg["index"]), False))  # low 32 bits
        if arg["op"] == "SCMP_CMP_MASKED_EQ":
            body.append((_AND_K, int(arg["value"]), False))
            body.append((_JEQ_K, int(arg["valueTwo"]), True))
        elif arg["op"] == "SCMP_CMP_EQ":
            body.append((_JEQ_K, int(arg["value"]), True))
        else:
            raise ValueError(f"unsupported comparison {arg['op']}")
    end = len(body) + 1  # the ret instruction follows the body
    out = [_ins(code, k, 0, end - i - 1 if to_end else 0) for i, (code, k, to_end) in
           enumerate(body)]
    return [*out, ret]


def compile_bpf(profile: dict[str, Any], arch: str) -> bytes:
    """Compile the OCI profile (the subset :func:`default_profile` uses) for ``arch``.

    Foreign-architecture syscalls (i386, x32 on x86_64) kill the process: their numbers differ,
    so a filter written for the native table would not see them.
    """
    if profile.get("defaultAction") != "SCMP_ACT_ALLOW":
        raise ValueError("only allow-by-default profiles are compiled")
    table = SYSCALLS[arch]
    prog = [
        _ins(_LD_W_ABS, _ARCH),
        _ins(_JEQ_K, AUDIT_ARCH[arch], 1, 0),
        _ins(_RET_K, _RET_KILL_PROCESS),
        _ins(_LD_W_ABS, _NR),
    ]
    if arch == "x86_64":
        prog += [_ins(_JGE_K, _X32_BIT, 0, 1), _ins(_RET_K, _RET_KILL_PROCESS)]
    for rule in profile["syscalls"]:
        if rule["action"] != "SCMP_ACT_ERRNO":
            raise ValueError(f"unsupported action {rule['action']}")
        ret = _ins(_RET_K, _RET_ERRNO | int(rule.get("errnoRet", errno.EPERM)))
        for name in rule["names"]:
            nr = table.get(name)
            if nr is None:
                continue  # not a syscall on this architecture
            prog += _rule_block(nr, rule.get("args", []), ret)
    prog.append(_ins(_RET_K, _RET_ALLOW))
    if len(prog) > 4096:
        raise ValueError("seccomp program too long")
    return b"".join(struct.pack("<HBBI", *ins) for ins in prog)
