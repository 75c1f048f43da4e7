"""A classic-BPF interpreter for the seccomp programs the package compiles (tests only)."""

from __future__ import annotations

import struct


def run_bpf(prog: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """The filter's raw return value for syscall ``nr`` on audit arch ``arch``: ld abs
    (seccomp_data), and, jeq, jge, jgt, ret."""
    ins = [struct.unpack("<HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = ins[pc]
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x54:
            acc &= k
        elif code in (0x15, 0x35, 0x25):
            hit = acc == k if code == 0x15 else acc >= k if code == 0x35 else acc > k
            pc += jt if hit else jf
        elif code == 0x06:
            return int(k)
        else:
            raise AssertionError(f"unknown opcode {code:#x}")
        pc += 1
