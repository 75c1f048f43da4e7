"""A ``policy.hostServices`` entry: one service on the host a task may use, parsed and judged.

Pure: the settings' validation (:mod:`fusion_oci.models`), the relays that serve a grant
(:mod:`fusion_oci.services`) and the runtimes' translations all read a grant through
:func:`parse_grant`, so an entry the relay could not serve never gets past the settings.

Three forms, written as programs name the service:

- ``127.0.0.1:5432`` — TCP to that loopback address (any of 127.0.0.0/8) and port;
- ``[::1]:6379`` — TCP to the host's IPv6 loopback;
- ``unix:/var/run/postgresql/.s.PGSQL.5432`` — a unix stream socket, by absolute path.

Refused with the fix in the message: names (``localhost:5432``: a name can resolve elsewhere,
write the address), the unspecified address (``0.0.0.0``, ``[::]``: every address), IPv4-mapped
and other IPv6 spellings of IPv4 (``[::ffff:127.0.0.1]``), addresses off the host's loopback
(those are egress: ``network: filtered`` with ``allowedDomains``), a relative path or one with
``.``/``..`` segments or ``//``.

A grant that **hands over the host** (:func:`hands_over`) — a container engine's API socket,
fusion-oci's own resident server, an ssh or gpg agent, the dashboard's port 4040 — is refused
unless its entry says ``dangerous: true``.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Literal

DASHBOARD_PORT = 4040
UNIX_PATH_MAX = 107
"""A ``sockaddr_un`` path holds 108 bytes with its NUL."""


@dataclass(frozen=True)
class HostService:
    """One parsed grant. ``kind`` ``tcp``: ``address`` (the literal, no brackets) and
    ``port``; ``unix``: ``path``."""

    kind: Literal["tcp", "unix"]
    address: str = ""
    port: int = 0
    path: str = ""

    @property
    def family(self) -> int:
        """``socket.AF_INET6`` (10) for an IPv6 grant, else ``AF_INET`` (2) or ``AF_UNIX``
        (1)."""
        if self.kind == "unix":
            return 1
        return 10 if ":" in self.address else 2

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        if ":" in self.address:
            return f"[{self.address}]:{self.port}"
        return f"{self.address}:{self.port}"


_PORT = re.compile(r"[0-9]{1,5}")


def parse_grant(text: str) -> HostService:
    """``text`` as a :class:`HostService`, or ValueError saying what is wrong and what to
    write instead. Pure."""
    if not isinstance(text, str) or not text or text != text.strip():
        raise ValueError("an empty or space-padded entry; write 127.0.0.1:PORT or unix:/PATH")
    if text.startswith("unix:"):
        return HostService("unix", path=_unix_path(text[5:]))
    if "://" in text:
        raise ValueError("write the address only, without a scheme: 127.0.0.1:5432")
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError("an IPv6 grant is written [::1]:PORT")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or ":" in host:
            raise ValueError("write ADDRESS:PORT (127.0.0.1:5432), [::1]:PORT or unix:/PATH")
    if not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise ValueError(f"'{port}' is not a port (1-65535)")
    return HostService("tcp", address=_loopback(host), port=int(port))


def _loopback(host: str) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"'{host}' is not an address: write the host's loopback address (127.0.0.1 or "
            "[::1]), not a name, which could resolve elsewhere"
        ) from None
    if ip.is_unspecified:
        raise ValueError(
            f"{host} is the unspecified address (every address of the host); write the "
            "loopback address the service listens on: 127.0.0.1 or [::1]"
        )
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        raise ValueError(
            f"{host} is an IPv4 address in IPv6 form; write it as {ip.ipv4_mapped}:PORT"
        )
    if isinstance(ip, ipaddress.IPv6Address) and (
        ip.sixtofour is not None or ip.teredo is not None or ip in _NAT64
    ):
        raise ValueError(f"{host} is an IPv4 address in an IPv6 form; write the IPv4 one")
    if not ip.is_loopback:
        raise ValueError(
            f"{host} is not the host's loopback: host services are services on this machine "
            "(127.0.0.0/8, ::1); to reach another host use network: filtered with "
            "allowedDomains"
        )
    return str(ip)


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def _unix_path(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError(
            f"'{path}' is not an absolute path; write unix:/ABSOLUTE/PATH of the socket"
        )
    if "\0" in path or "//" in path or path.endswith("/"):
        raise ValueError(
            f"'{path}' is not a plain socket path; write it without '//' or a '/' at the end"
        )
    parts = path.split("/")[1:]
    if any(p in (".", "..") for p in parts):
        raise ValueError(
            f"'{path}' has '.' or '..' segments; write the socket's own path (a grant names "
            "one socket, not a way to another)"
        )
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ValueError(
            f"'{path}' is longer than a unix socket path can be ({UNIX_PATH_MAX} bytes)"
        )
    return path


HANDS_OVER: tuple[tuple[str, str], ...] = (
    ("*/docker.sock", "a Docker API socket: root on the host (any container, any mount)"),
    ("*/docker/*.sock", "a Docker daemon socket: root on the host"),
    ("*/dockershim.sock", "a container runtime socket: root on the host"),
    ("*/podman/*.sock", "a Podman API socket: every container and mount its user may make"),
    ("*/podman.sock", "a Podman API socket: every container and mount its user may make"),
    ("*/containerd*.sock", "containerd's socket: root on the host"),
    ("*/containerd/*", "containerd's socket: root on the host"),
    ("*/crio.sock", "CRI-O's socket: root on the host"),
    ("*/buildkitd.sock", "BuildKit's socket: builds that run as root"),
    ("*/libvirt/*sock*", "libvirt's socket: virtual machines and their disks"),
    ("*/systemd/private", "systemd's private socket: starts anything as its user"),
    ("*/dbus/*bus_socket", "the D-Bus system bus: services that act as root"),
    ("*/bus", "a D-Bus bus: services that run commands as its user"),
    ("*/fusion-oci/*.sock", "fusion-oci's own resident server: commands run unsandboxed"),
    ("*/fusion-oci.[0-9]*/*.sock", "fusion-oci's own resident server: commands run unsandboxed"),
    ("*/fusion-oci-egress-*", "another task's egress proxy"),
    ("*/fusion-oci-services-*", "another task's host-service relay"),
    ("*/fusion-oci-publish-*", "a task's published-port relay (host clients' connections)"),
    ("*/fusion-oci-bwrap-*", "a task's sandbox scratch (its agent's socket)"),
    ("*/fusion-oci-podman-*", "a fusion-oci podman service socket: every container it may make"),
    ("*/ssh-*/agent.*", "an ssh agent: signs as the user for every host their keys open"),
    ("*ssh-agent*", "an ssh agent: signs as the user for every host their keys open"),
    ("*/keyring/ssh", "an ssh agent: signs as the user for every host their keys open"),
    ("*/S.gpg-agent*", "a gpg agent: signs and decrypts as the user"),
    ("*/.ssh/*", "an ssh control socket: a shell on another host as the user"),
)
"""Glob over a unix grant's path (as written, and as it resolves on the host) → what it hands
over. Matched case-sensitively, ``*`` across ``/``."""


def hands_over(grant: HostService, resolved: str | None = None) -> str | None:
    """What ``grant`` gives away beyond one service, or None. ``resolved``: the path's target
    on the host, when known (a symlink to ``/run/docker.sock`` is the Docker socket). Pure."""
    if grant.kind == "tcp":
        if grant.port == DASHBOARD_PORT:
            return "port 4040, fusion-oci's dashboard: every task's audit and output"
        return None
    for path in (grant.path, resolved):
        if path is None:
            continue
        for pattern, what in HANDS_OVER:
            if fnmatch.fnmatchcase(path, pattern):
                return what
    return None


def describe(grant: HostService) -> str:
    """What a grant gives, in one line, for ``settings show``, ``plan`` and ``check``. Pure."""
    if grant.kind == "unix":
        return (
            f"every request {grant.path} answers, as the user fusion-oci runs as (the service "
            "sees the relay, not the sandbox)"
        )
    return (
        f"every request the service on {grant} answers (any protocol; the service sees a "
        "connection from the host's loopback)"
    )


def no_proxy(grants: list[HostService]) -> str:
    """``NO_PROXY`` of a ``filtered`` sandbox with TCP grants: their addresses (and
    ``localhost`` with 127.0.0.1), so an HTTP client that honours the proxy variables talks to
    a granted service directly instead of asking the proxy, which refuses loopback. Nothing
    else is reachable there either way: the sandbox's loopback holds only the grants'
    listeners and the forwarder. Empty without TCP grants. Pure."""
    addresses = list(dict.fromkeys(g.address for g in grants if g.kind == "tcp"))
    if "127.0.0.1" in addresses:
        addresses.append("localhost")
    return ",".join(addresses)


__all__ = [
    "DASHBOARD_PORT",
    "HANDS_OVER",
    "HostService",
    "describe",
    "hands_over",
    "no_proxy",
    "parse_grant",
]
