"""What this host's kernel gives the landlock runtime: its Landlock ABI, whether user
namespaces work (why landlock is the runtime left), and the network a real project gets here.
Probed once per process."""

from __future__ import annotations

import os
import shutil
import sys
from typing import TYPE_CHECKING

from fusion_oci.host.process import probe
from fusion_oci.models import NetworkMode
from fusion_oci.runtimes.landlock.rules import MIN_NET_ABI

if TYPE_CHECKING:
    pass

_ABI: int | None = None
_USERNS: str | None = None


def host_abi() -> int:
    global _ABI
    if _ABI is None:
        if not sys.platform.startswith("linux"):
            _ABI = 0
        else:
            from fusion_oci.shims import confine

            _ABI = confine.abi_version()
    return _ABI


def userns_problem() -> str:
    """Why user namespaces are unusable here ('' when they work), probed once per process."""
    global _USERNS
    if _USERNS is None:
        from fusion_oci.runtimes.linux.userns import diagnose_sysctls, read_sysctls

        known = diagnose_sysctls(read_sysctls(), uid=os.geteuid())
        if known is not None:
            _USERNS = known.reason
        else:
            unshare = shutil.which("unshare")
            _USERNS = ""
            if unshare is not None:
                done = probe([unshare, "--user", "true"])
                if done.returncode is not None and done.returncode != 0:
                    why = done.text("stderr").strip().splitlines()[-1:]
                    _USERNS = (
                        "creating a user namespace fails ("
                        + (why[0] if why else f"exit {done.returncode}")
                        + ")"
                    )
    return _USERNS


def workload_network(abi: int) -> NetworkMode:
    """The network in which a command here reaches a package registry: ``egress`` without the
    host's loopback needs a network namespace, so it is refused; ``filtered`` (the task's
    proxy) needs Landlock's TCP rules; below ABI 4 only ``host`` is left."""
    return NetworkMode.FILTERED if abi >= MIN_NET_ABI else NetworkMode.HOST


def workload_note(abi: int) -> str:
    """What ``fusion-oci doctor`` says about real projects (package installs) here."""
    if workload_network(abi) is NetworkMode.FILTERED:
        return (
            "a real project (an install from a package registry) runs under network: "
            "filtered (the task's proxy, the built-in git/npm hosts or allowedDomains); "
            "egress is refused (no network namespace)"
        )
    return (
        "a real project (an install from a package registry) runs only under network: "
        f"host (filtered needs ABI {MIN_NET_ABI}), where the host's loopback (every port) "
        "is reachable too"
    )
