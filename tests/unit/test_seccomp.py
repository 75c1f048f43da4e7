"""The default seccomp profile and its BPF compilation, checked by interpreting the program."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest

import tests.bpf
from fusion_oci.oci.seccomp import (
    AUDIT_ARCH,
    DENIED,
    SYSCALLS,
    compile_bpf,
    default_profile,
)

EPERM, ENOSYS = 1, 38
ALLOW = "allow"
KILL = "kill"


def run_bpf(prog: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> Any:
    """The filter's verdict: ALLOW, KILL, or the errno it returns."""
    k = tests.bpf.run_bpf(prog, nr, arch, args)
    if k == 0x7FFF0000:
        return ALLOW
    if k == 0x80000000:
        return KILL
    assert k & 0xFFFF0000 == 0x00050000
    return k & 0xFFFF


@pytest.mark.parametrize("arch", sorted(SYSCALLS))
def test_denied_and_allowed(arch: str) -> None:
    prog = compile_bpf(default_profile(arch), arch)
    table, audit = SYSCALLS[arch], AUDIT_ARCH[arch]
    for name in DENIED:
        if name in table:
            assert run_bpf(prog, table[name], audit) == EPERM, name
    assert run_bpf(prog, table["clone3"], audit) == ENOSYS
    for nr in (0, 1, 2, 3, 9, 57, 59, 60, 61, 231, 257):  # read/write/open/.../openat
        if nr not in table.values():
            assert run_bpf(prog, nr, audit) == ALLOW, nr
    sock, clone = table["socket"], table["clone"]
    assert run_bpf(prog, sock, audit, (2, 1)) == ALLOW            # AF_INET, SOCK_STREAM
    assert run_bpf(prog, sock, audit, (10, 2 | 0x80000)) == ALLOW  # AF_INET6, DGRAM|CLOEXEC
    assert run_bpf(prog, sock, audit, (1, 1)) == ALLOW            # AF_UNIX
    assert run_bpf(prog, sock, audit, (17, 2)) == EPERM           # AF_PACKET
    assert run_bpf(prog, sock, audit, (2, 3 | 0x800)) == EPERM    # SOCK_RAW|NONBLOCK
    assert run_bpf(prog, clone, audit, (0x01200011,)) == ALLOW    # fork-like clone
    assert run_bpf(prog, clone, audit, (0x10000000 | 17,)) == EPERM
    assert run_bpf(prog, clone, audit, (0x40000000 | 0x100,)) == EPERM


def test_foreign_arch_and_x32_are_killed() -> None:
    prog = compile_bpf(default_profile("x86_64"), "x86_64")
    assert run_bpf(prog, 0, 0x40000003) == KILL        # i386
    assert run_bpf(prog, 0x40000000 | 165, AUDIT_ARCH["x86_64"]) == KILL  # x32 mount


@pytest.mark.parametrize("arch", sorted(SYSCALLS))
def test_syscall_table_matches_libseccomp(arch: str) -> None:
    from tests.backends import require

    require("libseccomp", shutil.which("scmp_sys_resolver") is not None,
            "scmp_sys_resolver is missing: apt-get install seccomp")
    for name, nr in SYSCALLS[arch].items():
        out = subprocess.run(["scmp_sys_resolver", "-a", arch, name], capture_output=True,
                             text=True, check=True).stdout.strip()
        assert int(out) == nr, (arch, name)


def test_profile_in_every_bundle_is_schema_valid(oci_validator: Any) -> None:
    from fusion_oci.models import PrepareContext, RunOptions
    from fusion_oci.oci.host import HostInfo
    from fusion_oci.oci.spec import compile_spec
    from fusion_oci.policy.layout import TaskLayout

    spec = compile_spec(PrepareContext(task_id="t", run_id="r", worktree_path="/w"),
                        TaskLayout("/w", None, (), None), HostInfo(), "true", RunOptions(), {})
    assert spec["linux"]["seccomp"]["defaultAction"] == "SCMP_ACT_ALLOW"
    oci_validator.validate(spec)
