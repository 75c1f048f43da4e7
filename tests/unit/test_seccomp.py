"""The default seccomp profile and its BPF compilation (libseccomp), checked by interpreting
the program."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import tests.bpf
from fusion_oci.oci.seccomp import (
    AUDIT_ARCH,
    DENIED,
    compile_bpf,
    default_profile,
    libseccomp,
    without_errno_ret,
)

EPERM, ENOSYS = 1, 38
ALLOW = "allow"
KILL = "kill"
TRACE = "trace"
"""SECCOMP_RET_TRACE: with no tracer attached the kernel answers ENOSYS."""
ARCHES = sorted(AUDIT_ARCH)


def run_bpf(prog: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> Any:
    """The filter's verdict: ALLOW, KILL, or the errno it returns."""
    k = tests.bpf.run_bpf(prog, nr, arch, args)
    if k == 0x7FFF0000:
        return ALLOW
    if k == 0x80000000:
        return KILL
    if k & 0xFFFF0000 == 0x7FF00000:
        return TRACE
    assert k & 0xFFFF0000 == 0x00050000
    return k & 0xFFFF


def table(arch: str) -> dict[str, int]:
    """Syscall numbers of ``arch`` as libseccomp resolves them (only the real ones)."""
    sc = libseccomp()
    token = getattr(sc.Arch, {"x86_64": "X86_64", "aarch64": "AARCH64"}[arch])
    names = [
        *DENIED,
        "clone3",
        "socket",
        "clone",
        "read",
        "write",
        "openat",
        "execve",
        "exit_group",
        "mmap",
    ]
    nrs = {name: sc.resolve_syscall(token, name) for name in names}
    return {name: nr for name, nr in nrs.items() if nr >= 0}


@pytest.mark.parametrize("arch", ARCHES)
def test_denied_and_allowed(arch: str) -> None:
    prog = compile_bpf(default_profile(arch), arch)
    nrs, audit = table(arch), AUDIT_ARCH[arch]
    for name in DENIED:
        if name in nrs:
            assert run_bpf(prog, nrs[name], audit) == EPERM, name
    assert run_bpf(prog, nrs["clone3"], audit) == ENOSYS
    for name in ("read", "write", "openat", "execve", "exit_group", "mmap"):
        assert run_bpf(prog, nrs[name], audit) == ALLOW, name
    sock, clone = nrs["socket"], nrs["clone"]
    assert run_bpf(prog, sock, audit, (2, 1)) == ALLOW  # AF_INET, SOCK_STREAM
    assert run_bpf(prog, sock, audit, (10, 2 | 0x80000)) == ALLOW  # AF_INET6, DGRAM|CLOEXEC
    assert run_bpf(prog, sock, audit, (1, 1)) == ALLOW  # AF_UNIX
    assert run_bpf(prog, sock, audit, (17, 2)) == EPERM  # AF_PACKET
    assert run_bpf(prog, sock, audit, (2, 3 | 0x800)) == EPERM  # SOCK_RAW|NONBLOCK
    assert run_bpf(prog, clone, audit, (0x01200011,)) == ALLOW  # fork-like clone
    assert run_bpf(prog, clone, audit, (0x10000000 | 17,)) == EPERM
    assert run_bpf(prog, clone, audit, (0x40000000 | 0x100,)) == EPERM


@pytest.mark.parametrize("arch", ARCHES)
def test_high_bits_do_not_dodge_a_deny_rule(arch: str) -> None:
    """The kernel reads socket()'s family as an int: 0x1_00000011 is AF_PACKET."""
    prog = compile_bpf(default_profile(arch), arch)
    sock = table(arch)["socket"]
    assert run_bpf(prog, sock, AUDIT_ARCH[arch], (0x1_00000011, 2)) == EPERM
    assert run_bpf(prog, sock, AUDIT_ARCH[arch], (0xFFFFFFFF_00000002, 0x1_00000003)) == EPERM


def test_foreign_arch_and_x32_are_killed() -> None:
    prog = compile_bpf(default_profile("x86_64"), "x86_64")
    assert run_bpf(prog, 0, 0x40000003) == KILL  # i386
    assert run_bpf(prog, 0x40000000 | 165, AUDIT_ARCH["x86_64"]) == KILL  # x32 mount


def test_profile_features_beyond_the_default() -> None:
    """Deny-by-default with allowed syscalls, kill actions, argument alternatives."""
    profile = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 38,
        "architectures": ["SCMP_ARCH_X86_64"],
        "syscalls": [
            {"names": ["read", "write", "no_such_syscall"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["ptrace"], "action": "SCMP_ACT_KILL_PROCESS"},
            {
                "names": ["socket"],
                "action": "SCMP_ACT_ALLOW",
                "args": [
                    {"index": 0, "value": 1, "op": "SCMP_CMP_EQ"},
                    {"index": 0, "value": 2, "op": "SCMP_CMP_EQ"},
                ],
            },
        ],
    }
    prog = compile_bpf(profile, "x86_64")
    nrs, audit = table("x86_64"), AUDIT_ARCH["x86_64"]
    assert run_bpf(prog, nrs["read"], audit) == ALLOW
    assert run_bpf(prog, nrs["openat"], audit) == ENOSYS
    assert run_bpf(prog, nrs["ptrace"], audit) == KILL
    assert run_bpf(prog, nrs["socket"], audit, (1,)) == ALLOW
    assert run_bpf(prog, nrs["socket"], audit, (2,)) == ALLOW
    assert run_bpf(prog, nrs["socket"], audit, (10,)) == ENOSYS
    # an allow rule keeps libseccomp's full 64-bit comparison: high bits do not widen it
    assert run_bpf(prog, nrs["socket"], audit, (0x1_00000001,)) == ENOSYS


@pytest.mark.parametrize("arch", ARCHES)
def test_without_errno_ret_keeps_every_verdict_but_says_enosys_by_trace(arch: str) -> None:
    """For a runtime that answers every errno rule with EPERM (runsc): clone3 must still end
    in ENOSYS, or glibc never falls back to clone and no thread starts."""
    plain = compile_bpf(default_profile(arch), arch)
    blind_profile = without_errno_ret(default_profile(arch))
    assert all("errnoRet" not in r or r["errnoRet"] == EPERM for r in blind_profile["syscalls"])
    blind = compile_bpf(blind_profile, arch)
    audit = AUDIT_ARCH[arch]
    for name, nr in table(arch).items():
        for args in ((), (0x00020000,), (0x3D0F00,), (17, 2), (2, 3)):
            want = run_bpf(plain, nr, audit, args)
            got = run_bpf(blind, nr, audit, args)
            assert got == (TRACE if name == "clone3" else want), (name, args)
    assert run_bpf(plain, table(arch)["clone3"], audit) == ENOSYS


def test_without_errno_ret_refuses_an_errno_it_cannot_say() -> None:
    profile = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ERRNO", "errnoRet": 13}],
    }
    with pytest.raises(ValueError, match="errno 13"):
        without_errno_ret(profile)


def test_what_a_filter_cannot_say_is_refused() -> None:
    with pytest.raises(ValueError, match="not supported"):
        compile_bpf(
            {
                "defaultAction": "SCMP_ACT_ALLOW",
                "syscalls": [{"names": ["read"], "action": "SCMP_ACT_NOTIFY"}],
            },
            "x86_64",
        )
    with pytest.raises(ValueError, match="listenerPath"):
        compile_bpf({"defaultAction": "SCMP_ACT_ALLOW", "listenerPath": "/run/x.sock"}, "x86_64")


def test_profile_in_every_bundle_is_schema_valid(oci_validator: Any) -> None:
    from fusion_oci.models import PrepareContext, RunOptions
    from fusion_oci.oci.host import HostInfo
    from fusion_oci.policy.layout import TaskLayout
    from tests.tasks import config_for

    spec = config_for(
        PrepareContext(task_id="t", run_id="r", worktree_path="/w"),
        TaskLayout("/w", None, (), None),
        HostInfo(),
        "true",
        RunOptions(),
        {},
    )
    assert spec["linux"]["seccomp"]["defaultAction"] == "SCMP_ACT_ALLOW"
    oci_validator.validate(spec)
    spec["linux"]["seccomp"] = without_errno_ret(spec["linux"]["seccomp"])
    oci_validator.validate(spec)


def test_a_profile_is_compiled_once_per_content_and_the_memo_is_bounded() -> None:
    """Every bubblewrap and landlock prepare compiles its profile (~20 ms): the resident server
    compiles each distinct profile once; a changed profile is compiled again."""
    from fusion_oci.oci import seccomp

    profile = default_profile()
    first = seccomp.compile_bpf(profile, "x86_64")
    assert seccomp.compile_bpf(copy.deepcopy(profile), "x86_64") is first
    other = copy.deepcopy(profile)
    other["syscalls"] = other["syscalls"][:-1]
    assert seccomp.compile_bpf(other, "x86_64") != first
    for n in range(seccomp._COMPILED_MAX + 5):
        changed = copy.deepcopy(profile)
        changed["defaultErrnoRet"] = n + 100
        seccomp.compile_bpf(changed, "x86_64")
    assert len(seccomp._COMPILED) <= seccomp._COMPILED_MAX


def test_the_binding_is_imported_without_looking_the_libraries_up() -> None:
    """pyseccomp's import asks ctypes.util.find_library for libc and libseccomp, which runs
    ldconfig in a subprocess (~15 ms of each one-shot bubblewrap run): where both load by
    soname it is not asked, and find_library is as it was afterwards."""
    import subprocess
    import sys

    script = (
        "import ctypes.util, platform\n"
        "asked = []\n"
        "def recorder(name):\n"
        "    asked.append(name)\n"
        "ctypes.util.find_library = recorder\n"
        "from fusion_oci.oci.seccomp import compile_bpf, default_profile\n"
        "assert compile_bpf(default_profile(), platform.machine())\n"
        "assert ctypes.util.find_library is recorder\n"
        "print(asked)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout == "[]\n", done.stderr
