"""What several export formats share: the notes on what no format expresses, the header
comment, tmpfs options, and the limits as engine CLI flags."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from fusion_oci.export.source import ExportSource, Mount


def common_unexpressed(src: ExportSource) -> list[str]:
    out = list(src.notes)
    out += [
        f"tmpfs {m.target} owner {m.uid}:{m.gid} (mode {m.mode}): tmpfs flags cannot set "
        "an owner; it is mode 1777 instead"
        for m in src.mounts
        if m.kind == "tmpfs" and m.uid not in (None, "0")
    ]
    if src.image_digest:
        out.append(
            f"image pinning by id: the file names {src.image}; the recorded image id "
            f"is {src.image_digest} (check with `podman image inspect` / "
            "`docker image inspect` before trusting a rebuilt tag)"
        )
    if src.masked_paths or src.readonly_paths:
        out.append(
            "maskedPaths/readonlyPaths: not settable here; the engine's own defaults "
            "(the same /proc and /sys protections for docker and podman) apply"
        )
    return out


def seccomp_note(src: ExportSource) -> list[str]:
    if not src.seccomp:
        return []
    n = sum(len(s.get("names", [])) for s in src.seccomp.get("syscalls", []))
    return [
        f"seccomp: the recorded profile ({n} syscall rules) is not embedded; the engine's "
        "default profile applies"
    ]


def header(lines: Sequence[str], fmt: str, src: ExportSource, prefix: str) -> str:
    head = [
        f"{prefix} fusion-oci export ({fmt}) of {src.name}: image {src.image}",
        f"{prefix} command: {shlex.join(src.argv)}",
    ]
    if lines:
        head.append(
            f"{prefix} NOT EXPRESSED in {fmt} (what the sandbox enforced but this file cannot):"
        )
        head += [f"{prefix}   - {line}" for line in lines]
    else:
        head.append(f"{prefix} every part of the sandbox's spec is expressed")
    return "\n".join(head) + "\n"


def tmpfs_opt(m: Mount) -> str:
    opts = ["rw"]
    if m.size:
        opts.append(f"size={m.size}")
    mode = m.mode
    if m.uid not in (None, "0") and mode:
        mode = "1777"  # the engines' tmpfs flags cannot set an owner: open it (sticky) instead
    if mode:
        opts.append(f"mode={mode}")
    return ",".join(opts)


def loopback_note(src: ExportSource, fmt: str) -> list[str]:
    if src.network == "egress":
        return [
            f"network egress without host loopback: {fmt}'s default network can reach "
            "the host's published ports and the bridge gateway (fusion-oci runs "
            "slirp4netns with --disable-host-loopback, or an isolated network)"
        ]
    return []


def limit_flags(src: ExportSource) -> list[str]:
    """The spec's memory, CPU, pids and rlimits as docker/podman CLI flags (both exports that
    write a `podman run` use them). Pure."""
    flags: list[str] = []
    if src.memory_bytes:
        flags += [f"--memory={src.memory_bytes}", f"--memory-swap={src.memory_bytes}"]
    if src.cpus:
        flags.append(f"--cpus={src.cpus}")
    if src.pids:
        flags.append(f"--pids-limit={src.pids}")
    for key, (soft, hard) in src.rlimits.items():
        flags.append(
            f"--ulimit={key}={soft}:{hard}" if soft >= 0 and hard >= 0 else f"--ulimit={key}=-1"
        )
    return flags
