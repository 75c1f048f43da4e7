"""Spec → a Seatbelt (SBPL) profile for macOS ``sandbox-exec``, plus its parameters. Pure.

No path ever enters the profile text. Every host path is a parameter, referenced in the text as
``(param "RW_3")`` and passed as ``sandbox-exec -D RW_3=/private/var/...``; the text depends only
on how many mounts of which kind the spec has. So a path holding quotes, parentheses, ``;``,
spaces or newlines is data, and cannot change what the profile says.

Shape of the profile (SBPL: the last matching rule wins):

1. ``(deny default)``, then what a shell, node, pnpm and git need from the system: exec and
   fork, signals and process info within the sandbox, sysctl reads, the Mach services of
   libinfo, logging, notifications and preferences, ``/dev/null``-style devices, the system
   and developer-tool directories read-only (with the dyld cache under ``/System``).
   ``stat()`` is allowed anywhere (path resolution of the worktree needs its ancestors);
   reading contents and listing directories is not.
2. The caller's home: contents unreadable (``CALLER_HOME``).
3. The spec's mounts, in the spec's order, so that the order means what it means for mounts
   (a later, read-only bind of ``.git/hooks`` inside the writable worktree wins): read-only
   binds allow reading and deny writing, writable binds allow both, the ``/tmp`` and
   ``/home/sandbox`` tmpfs become the task's private scratch directories. This is where the
   worktree, writablePaths, allowedPaths, the named caches, the CA bundle and the git
   directories (hooks and config read-only, last) come from.
4. The network mode: ``none`` denies every socket; ``egress`` allows outbound IP connections
   except to localhost, and no bind or inbound; ``host`` allows the network as it is.

Paths are canonicalised first (``/var``, ``/tmp``, ``/etc`` → ``/private/...``: Seatbelt
matches the resolved path, and those three are symlinks on macOS).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass

from fusion_oci.errors import BundleError
from fusion_oci.models import NetworkMode
from fusion_oci.oci.environment import SANDBOX_HOME
from fusion_oci.oci.model import TaskSpec

SANDBOX_EXEC = "/usr/bin/sandbox-exec"
"""Absolute, so a ``sandbox-exec`` earlier on PATH cannot stand in for it."""

PRIVATE_SYMLINKS = ("/var", "/tmp", "/etc")
"""Top-level macOS symlinks into /private; Seatbelt sees the target path."""

READ_OPS = "file-read* file-map-executable"
"""Reading a file includes mapping it executable (dylibs, node's native addons)."""
WRITE_OPS = "file-write*"

BASE = """\
(version 1)
(deny default)

;; processes: the command and its children, and only them
(allow process-exec)
(allow process-fork)
(allow signal (target same-sandbox))
(allow process-info* (target same-sandbox))
(allow sysctl-read)
(allow mach-host*)
(allow user-preference-read)
(allow ipc-posix-sem)
(allow ipc-posix-shm-read* (ipc-posix-name "apple.shm.notification_center"))
(allow iokit-open (iokit-registry-entry-class "RootDomainUserClient"))
(allow mach-lookup
  (global-name "com.apple.system.opendirectoryd.libinfo")
  (global-name "com.apple.system.opendirectoryd.membership")
  (global-name "com.apple.system.DirectoryService.libinfo_v1")
  (global-name "com.apple.system.logger")
  (global-name "com.apple.system.notification_center")
  (global-name "com.apple.logd")
  (global-name "com.apple.diagnosticd")
  (global-name "com.apple.cfprefsd.daemon")
  (global-name "com.apple.cfprefsd.agent")
  (global-name "com.apple.bsd.dirhelper")
  (global-name "com.apple.PowerManagement.control"))

;; stat() anywhere: resolving the worktree's path needs its ancestors. Contents and
;; directory listings stay closed unless a rule below opens them.
(allow file-read-metadata)

;; devices a shell and node use
(allow file-read* file-write-data file-ioctl
  (literal "/dev/null")
  (literal "/dev/zero")
  (literal "/dev/tty")
  (literal "/dev/dtracehelper"))
(allow file-read*
  (literal "/dev/random")
  (literal "/dev/urandom")
  (literal "/dev/autofs_nowait"))
(allow file-read-data file-write-data (subpath "/dev/fd"))

;; the system, read-only: binaries, libraries, frameworks and the dyld shared cache
;; (under /System), configuration, time zones, developer tools and package managers
(allow file-read* file-map-executable
  (literal "/")
  (subpath "/System")
  (subpath "/usr")
  (subpath "/bin")
  (subpath "/sbin")
  (subpath "/Library/Apple")
  (subpath "/Library/Preferences")
  (subpath "/Library/Developer/CommandLineTools")
  (subpath "/Applications/Xcode.app")
  (subpath "/opt/homebrew")
  (subpath "/opt/local")
  (subpath "/private/etc")
  (subpath "/private/var/db/timezone")
  (subpath "/private/var/db/dyld")
  (subpath "/private/var/select")
  (literal "/private/var/db/xcode_select_link"))
"""

NETWORK_SERVICES = """\
;; name resolution and TLS trust go through these system services
(allow network-outbound (literal "/private/var/run/mDNSResponder"))
(allow mach-lookup
  (global-name "com.apple.dnssd.service")
  (global-name "com.apple.mDNSResponder")
  (global-name "com.apple.SystemConfiguration.DNSConfiguration")
  (global-name "com.apple.SystemConfiguration.configd")
  (global-name "com.apple.networkd")
  (global-name "com.apple.trustd")
  (global-name "com.apple.trustd.agent")
  (global-name "com.apple.SecurityServer")
  (global-name "com.apple.ocspd"))
(allow system-socket)
"""

NETWORK = {
    NetworkMode.NONE: """\
;; network none: no socket reaches anything, the host's loopback services included
(deny network*)
""",
    NetworkMode.EGRESS: """\
;; network egress: outbound IP connections only. Nothing on localhost (the host's own
;; services, such as a dashboard on 127.0.0.1:4040), no listening, no inbound, no unix
;; sockets but the resolver's.
(allow network-outbound (remote ip "*:*"))
(deny network-outbound (remote ip "localhost:*"))
(deny network-bind network-inbound)
"""
    + NETWORK_SERVICES,
    NetworkMode.HOST: """\
;; network host: the host's network as it is (chosen explicitly)
(allow network*)
"""
    + NETWORK_SERVICES,
}


@dataclass(frozen=True)
class SeatbeltProfile:
    """The profile text (constant apart from the counts of mounts) and its parameters."""

    text: str
    params: tuple[tuple[str, str], ...]
    """``(NAME, VALUE)`` in the order they are passed; every ``(param "NAME")`` is here."""

    def parameter_args(self) -> list[str]:
        """``["-D", "NAME=VALUE", ...]`` for sandbox-exec (one argv word per value)."""
        out: list[str] = []
        for name, value in self.params:
            out += ["-D", f"{name}={value}"]
        return out

    def argv(self, command: list[str]) -> list[str]:
        return [SANDBOX_EXEC, "-p", self.text, *self.parameter_args(), *command]

    def resolved(self) -> SeatbeltProfile:
        """The same profile with every parameter's symlinks resolved on this host (Seatbelt
        matches resolved paths). Reads the filesystem; the text does not change."""
        return SeatbeltProfile(self.text, tuple((k, os.path.realpath(v)) for k, v in self.params))


def canonical_path(path: str) -> str:
    """Absolute, normalised, with macOS's /var, /tmp and /etc symlinks resolved. Pure.

    A plan's ``<placeholder>`` (a directory not made yet) passes unchanged.
    """
    if path.startswith("<") and path.endswith(">"):
        return path
    if not path.startswith("/"):
        raise BundleError(
            f"sandbox-exec needs absolute paths, got {path!r}",
            "a relative path would be resolved against an unknown directory",
            "write the path as an absolute host path",
        )
    if "\0" in path:
        raise BundleError(f"path {path!r} contains a NUL byte", "no file can have that name")
    norm = posixpath.normpath(path)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    for link in PRIVATE_SYMLINKS:
        if norm == link or norm.startswith(link + "/"):
            return "/private" + norm
    return norm


@dataclass(frozen=True)
class _Rule:
    writable: bool
    path: str
    what: str


def _mount_rules(spec: TaskSpec, scratch_home: str, scratch_tmp: str) -> Iterator[_Rule]:
    """The spec's mounts as path rules, in order. Proc, sys and /dev mounts have no
    counterpart: without a mount namespace the base section covers those."""
    for mount in spec.mounts:
        kind, dest = mount.type, mount.destination
        if kind == "bind" and mount.source is not None:
            options = mount.options or []
            writable = "rw" in options and "ro" not in options
            what = "read-write bind" if writable else "read-only bind"
            if dest != mount.source:
                what += " (shown inside the container elsewhere)"
            yield _Rule(writable, mount.source, what)
        elif kind == "tmpfs" and dest == "/tmp":
            yield _Rule(True, scratch_tmp, "the task's private TMPDIR")
        elif kind == "tmpfs" and dest == SANDBOX_HOME:
            yield _Rule(True, scratch_home, "the task's private HOME")


def seatbelt_profile(
    spec: TaskSpec, *, caller_home: str | None, scratch_home: str, scratch_tmp: str
) -> SeatbeltProfile:
    """The profile and parameters for a task spec. Pure.

    ``caller_home``: the caller's home directory, made unreadable (None: not known, no rule);
    ``scratch_home`` / ``scratch_tmp``: the host directories standing in for the spec's
    private ``/home/sandbox`` and ``/tmp``.
    """
    lines = [BASE]
    params: list[tuple[str, str]] = []
    if caller_home:
        params.append(("CALLER_HOME", canonical_path(caller_home)))
        lines.append(
            ";; the caller's home: not readable, except where a mount below opens it\n"
            '(deny file-read-data file-read-xattr (subpath (param "CALLER_HOME")))\n'
        )
    lines.append(";; the spec's mounts, in order: a later rule wins, as a later mount does")
    for index, rule in enumerate(_mount_rules(spec, scratch_home, scratch_tmp)):
        name = f"{'RW' if rule.writable else 'RO'}_{index}"
        params.append((name, canonical_path(rule.path)))
        ref = f'(subpath (param "{name}"))'
        if rule.writable:
            lines.append(f"; {index}: {rule.what}\n(allow {READ_OPS} {WRITE_OPS} {ref})")
        else:
            lines.append(
                f"; {index}: {rule.what}\n(allow {READ_OPS} {ref})\n(deny {WRITE_OPS} {ref})"
            )
    lines.append("")
    lines.append(NETWORK[spec.network])
    return SeatbeltProfile("\n".join(lines), tuple(params))
