"""Facts about the host that the pure compiler needs, gathered once by :func:`probe_host`."""

from __future__ import annotations

import os
import platform
import resource
from dataclasses import dataclass, field
from pathlib import Path

# Host directories that make up a usable system when no image is given. Only these are bound
# (read-only); the rest of the host (home directories, /root, /srv, /var, /mnt ...) stays out.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

# The parts of /etc that shells, node, git and TLS need. Not the whole of /etc: it holds
# shadow files, host keys and credentials of system services.
ETC_ENTRIES = (
    "alternatives",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
    "pki",
    "resolv.conf",
    "hosts",
    "nsswitch.conf",
    "host.conf",
    "gai.conf",
    "services",
    "protocols",
    "passwd",
    "group",
    "localtime",
    "timezone",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "os-release",
    "debian_version",
    "mime.types",
    "gitconfig",
    "npmrc",
    "nodejs",
    "inputrc",
    "profile",
    "bash.bashrc",
    "environment",
    "locale.alias",
    "locale.gen",
    "default",
)

# Places where hosts keep a bundle of CA certificates (first existing one wins for `auto`).
CA_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
)

RLIMIT_NAMES = {
    "RLIMIT_NOFILE": resource.RLIMIT_NOFILE,
    "RLIMIT_CPU": resource.RLIMIT_CPU,
    "RLIMIT_NPROC": resource.RLIMIT_NPROC,
    "RLIMIT_CORE": resource.RLIMIT_CORE,
    "RLIMIT_FSIZE": resource.RLIMIT_FSIZE,
}

UNLIMITED = resource.RLIM_INFINITY


@dataclass(frozen=True)
class HostInfo:
    """What the compiler must know about the machine; a plain value, easy to fake in tests."""

    uid: int = 1000
    gid: int = 1000
    rlimits: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Current (soft, hard) of each rlimit the bundle sets; -1 = unlimited."""
    system_mounts: tuple[tuple[str, str], ...] = ()
    """(destination, host source) pairs of system directories, symlinks resolved."""
    etc_entries: tuple[str, ...] = ()
    """Names under /etc that exist on this host and are shared read-only."""
    ca_bundle: str | None = None
    """The host's CA bundle, if one exists."""
    arch: str = "x86_64"
    """Machine architecture (``platform.machine()``), for the seccomp syscall table."""


def _limit(value: int) -> int:
    return -1 if value == UNLIMITED else int(value)


def probe_host(root: Path = Path("/")) -> HostInfo:
    """Read the host facts. The only impure step before a runtime runs."""
    mounts: list[tuple[str, str]] = []
    for d in SYSTEM_DIRS:
        p = root / d.lstrip("/")
        if p.exists():
            mounts.append((d, str(p.resolve())))
    etc = tuple(name for name in ETC_ENTRIES if (root / "etc" / name).exists())
    ca = next((c for c in CA_BUNDLES if (root / c.lstrip("/")).is_file()), None)
    limits = {
        name: (_limit(soft), _limit(hard))
        for name, res in RLIMIT_NAMES.items()
        for soft, hard in [resource.getrlimit(res)]
    }
    return HostInfo(
        uid=os.getuid(),
        gid=os.getgid(),
        rlimits=limits,
        system_mounts=tuple(mounts),
        etc_entries=etc,
        ca_bundle=ca,
        arch=platform.machine(),
    )
