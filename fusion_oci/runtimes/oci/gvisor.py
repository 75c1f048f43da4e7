"""What differs for runsc (gVisor), beside the launch builder's flags and egress script."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from fusion_oci.runtimes.requirements import Requirement


@dataclass(frozen=True)
class GvisorFlags:
    """What this runsc build offers, from its ``runsc flags`` listing (:func:`parse_flags`)."""

    directfs: bool
    """It has ``--directfs`` (releases since 2023, on by default): the Sentry opens the
    host's files itself instead of asking the gofer. fusion-oci turns it off
    (``--directfs=false``): with it, release 20240729 truncates a file under a read-only bind
    when the command opens it with O_TRUNC (even O_RDONLY|O_TRUNC, and the shell's ``>``,
    which is refused with EROFS only after the truncation), so a task could empty its
    protected ``.fusion/`` settings or git hooks. Through the gofer every such open is EROFS."""
    platform: str
    """The platform runsc runs on when none is given: ptrace (20221219) or systrap (since
    2023); "" when the listing does not say."""


UNKNOWN_FLAGS = GvisorFlags(directfs=True, platform="")
"""When ``runsc flags`` cannot be read: assume the newer build, so ``--directfs=false`` is
passed (an older runsc then refuses the flag and the task does not start: fail closed)."""


def parse_flags(listing: str) -> GvisorFlags:
    """The facts of a ``runsc flags`` listing (it prints to stderr). Pure."""
    default = re.search(r"specifies which platform to use:.*?\(default \"(\w+)\"\)", listing)
    return GvisorFlags(
        directfs=re.search(r"^\s*-directfs\b", listing, re.M) is not None,
        platform=default.group(1) if default else "",
    )


def gvisor_details(
    rootless: bool, limits: frozenset[Requirement], flags: GvisorFlags
) -> dict[str, str]:
    """What runsc (gVisor) enforces, for doctor."""
    kvm = Path("/dev/kvm").exists()
    # The platform stays runsc's default: on this project's 2-core VM neither 20221219's
    # ptrace nor 20240729's systrap ran the workload faster than the other (docs/performance.md),
    # and kvm hangs there although /dev/kvm exists (nested virtualisation).
    return {
        "kernel": "gVisor: the command's system calls are served by a userspace kernel (the "
        "Sentry), not the host's",
        "platform": (flags.platform or "unknown")
        + " (runsc's default; /dev/kvm is "
        + ("present" if kvm else "absent")
        + ", --platform=kvm is not used)",
        "files": "through the gofer: --directfs=false (directfs truncates files under "
        "read-only binds on O_TRUNC)"
        if flags.directfs
        else "through the gofer (this runsc has no directfs)",
        "network": "none: gVisor's own netstack, loopback only; host: --network=host; egress: "
        "a fresh network namespace with slirp4netns --disable-host-loopback, "
        "runsc --network=host inside it",
        "limits": ", ".join(sorted(r.value for r in limits)) + " (cgroups of the sandbox); "
        "pidsLimit: not enforced (gVisor's processes are not host processes)"
        if limits
        else "none: " + ("rootless, no cgroup delegation" if rootless else "no cgroup controllers"),
        "seccomp": "the bundle's profile, applied inside gVisor (--oci-seccomp), which answers "
        "every errno rule with EPERM: clone3's ENOSYS (so that libc falls back to "
        "clone) is said as SCMP_ACT_TRACE there",
        "tmpSizeMb": "not enforced: gVisor's tmpfs ignores size=",
        "cpuLimit.maxMs": "RLIMIT_CPU set by the agent (the sandbox's init) inside gVisor on "
        "each command (a spec rlimit alone never fires there)",
        "memoryLimitMb": "the sandbox's cgroup: an OOM kill ends the whole sandbox (the "
        "command reads oom; the task's later commands cannot run)",
        "rootless": "unavailable (see reason)" if rootless else "rootful",
        "kubernetes": kubernetes_runtime_class(),
    }


SHIM = "containerd-shim-runsc-v1"


def kubernetes_runtime_class() -> str:
    """Whether a Kubernetes node on this machine could offer gVisor as a RuntimeClass."""
    import shutil

    if shutil.which(SHIM) is None:
        return (
            f"no RuntimeClass: this runsc comes without {SHIM}, which containerd needs for "
            "gVisor pods (Debian's package ships none; docs/kubernetes-cluster.md)"
        )
    if not _has_sys_resource():
        return (
            f"no RuntimeClass: {SHIM} is there, but it sets its own OOM score to -999, which "
            "needs CAP_SYS_RESOURCE, and this machine's root lacks it: every gVisor pod fails "
            "(docs/kubernetes-cluster.md)"
        )
    return f"a RuntimeClass can use {SHIM} (handler runsc)"


def _has_sys_resource() -> bool:
    """CAP_SYS_RESOURCE (24) in this process's effective set."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 24 & 1)
    except OSError:
        pass
    return False
