"""What differs for runsc (gVisor), beside the launch builder's flags and egress script."""

from __future__ import annotations

from pathlib import Path

from fusion_oci.runtimes.requirements import Requirement


def gvisor_details(rootless: bool, limits: frozenset[Requirement]) -> dict[str, str]:
    """What runsc (gVisor) enforces, for doctor."""
    kvm = Path("/dev/kvm").exists()
    return {
        "kernel": "gVisor: the command's system calls are served by a userspace kernel (the "
        "Sentry), not the host's",
        "platform": "ptrace (runsc's default; /dev/kvm is "
        + ("present" if kvm else "absent")
        + ", --platform=kvm is not used)",
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
    }
