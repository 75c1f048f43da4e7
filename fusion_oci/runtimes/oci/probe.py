"""What this host lets the ``oci`` runtime do: refusals with their fix, egress, the version."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from fusion_oci.host.process import probe
from fusion_oci.runtimes.linux.cgroups import Layout
from fusion_oci.runtimes.oci.gvisor import UNKNOWN_FLAGS, GvisorFlags, parse_flags
from fusion_oci.runtimes.oci.launch import is_gvisor
from fusion_oci.runtimes.protocol import Availability


def refusal(name: str, binary: str | None, layout: Layout, rootless: bool) -> Availability | None:
    """Why ``name`` (found at ``binary``) cannot run here, with the fix; None: it can."""
    if not sys.platform.startswith("linux"):
        return Availability(
            False,
            f"OCI runtimes such as {name} run Linux containers on a Linux host only",
            "use backend podman or docker (through their VM) on this platform",
        )
    if binary is None:
        return Availability(
            False,
            f"'{name}' was not found on PATH",
            f"install it (Debian/Ubuntu: apt-get install {Path(name).name}), or set "
            "sandbox.oci.runtime to an installed OCI runtime (runc, crun, runsc, youki)",
        )
    if Path(binary).name == "crun" and layout == "hybrid":
        return Availability(
            False,
            "crun refuses cgroup v1/hybrid hosts ('cgroups in hybrid mode not "
            "supported'), and this host is hybrid",
            "set sandbox.oci.runtime: runc, or boot the host with the unified cgroup v2 "
            "hierarchy (systemd.unified_cgroup_hierarchy=1)",
        )
    if is_gvisor(binary) and rootless:
        return Availability(
            False,
            "runsc (gVisor) cannot start a sandbox for an unprivileged caller here: "
            "with a user namespace its gofer fails ('fork/exec /proc/self/exe: operation "
            "not permitted'), without one the sandbox never starts (seen with runsc "
            "release 20221219)",
            "run fusion-oci as root for runsc, or choose bubblewrap, landlock or rootless podman",
            rootless=True,
        )
    if rootless:
        try:
            userns = Path("/proc/sys/user/max_user_namespaces").read_text().strip()
        except OSError:
            userns = ""
        if userns == "0":
            return Availability(
                False,
                "rootless OCI runtimes need user namespaces, and user.max_user_namespaces is 0",
                "sysctl -w user.max_user_namespaces=15000, or run as root",
            )
    return None


def egress_status(runtime: str, rootless: bool, path: str | None) -> tuple[bool, str]:
    """(True, slirp4netns path) when ``egress`` is enforceable here, else (False, why).

    When it is not, ``enforces()`` leaves egress out and the lifecycle refuses the policy:
    the command never runs offline or on the host's network in its place.
    """
    from fusion_oci.runtimes.linux import egress

    slirp = shutil.which("slirp4netns", path=path)
    if is_gvisor(runtime) and rootless:
        return (
            False,
            "rootless runsc: its network namespace cannot be prepared without "
            "privilege (unshare --net needs root)",
        )
    if is_gvisor(runtime) and not (
        shutil.which("unshare", path=path) and shutil.which("ip", path=path)
    ):
        return (False, "unshare (util-linux) or ip (iproute2) is missing")
    if slirp is None:
        return (False, "slirp4netns is not installed (apt-get install slirp4netns)")
    if not egress.tun_usable():
        return (False, "/dev/net/tun is missing or not read-writable (chmod 666 /dev/net/tun)")
    return (True, slirp)


def runtime_version(binary: str) -> str | None:
    """The first line of ``BINARY --version``."""
    done = probe([binary, "--version"])
    if done.returncode is None:
        return None
    first = done.text().strip().splitlines()[:1]
    return first[0] if first else None


def gvisor_flags(binary: str) -> GvisorFlags:
    """What this runsc build offers (``runsc flags``, printed to stderr); UNKNOWN_FLAGS when
    it cannot be read (fail closed: see there)."""
    done = probe([binary, "flags"])
    listing = done.text("stderr") + done.text()
    if done.returncode is None or "-platform" not in listing:
        return UNKNOWN_FLAGS
    return parse_flags(listing)
