"""A ``policy.publishPorts`` entry: a port a command listens on inside the sandbox, published
on the host. Pure: the settings' validation (:mod:`fusion_oci.models`), the task spec's
annotation (:mod:`fusion_oci.oci.spec`) and the host's listeners
(:mod:`fusion_oci.services.publish`) all read an entry through :func:`parse_publish`.

Written as ``docker run -p`` writes it, host before sandbox:

- ``3000`` — the sandbox's port 3000 on a free port of the host's 127.0.0.1 (reported at
  prepare and in the audit);
- ``8080:80`` — the sandbox's port 80 on the host's 127.0.0.1:8080;
- ``127.0.0.1:8080:80``, ``[::1]::80`` — on that loopback address (an empty host port: a free
  one).

The host side listens on the host's loopback only. Another address (every address with
``0.0.0.0``, a LAN address) is written in the mapping form only, ``{port: 80, hostPort: 8080,
address: 0.0.0.0}``, where the ``address`` field says so in as many words. Port 4040 (the
dashboard's) is never a host port.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from fusion_oci.models.hostservice import DASHBOARD_PORT

_PORT = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True)
class PublishedPort:
    """One parsed entry: the sandbox's ``port`` on the host's ``address:host_port``
    (``host_port`` 0: a free port chosen at prepare)."""

    port: int
    host_port: int = 0
    address: str = "127.0.0.1"

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback

    @property
    def family(self) -> int:
        """``socket.AF_INET6`` (10) for an IPv6 address, else ``AF_INET`` (2)."""
        return 10 if ":" in self.address else 2

    def host(self, port: int | None = None) -> str:
        """``ADDRESS:PORT`` of the host side (``port``: the chosen one, else the named one,
        else ``*`` for one not chosen yet)."""
        chosen = port or self.host_port or "*"
        return f"[{self.address}]:{chosen}" if self.family == 10 else f"{self.address}:{chosen}"

    def __str__(self) -> str:
        """The canonical form, as the task spec's annotation keeps it (one word)."""
        address = f"[{self.address}]" if self.family == 10 else self.address
        return f"{address}:{self.host_port or ''}:{self.port}"


def _port(text: str, what: str, free: bool = False) -> int:
    if free and text == "":
        return 0
    if not _PORT.fullmatch(text) or not 0 < int(text) < 65536:
        raise ValueError(f"'{text}' is not a {what} port (1-65535)")
    return int(text)


def _address(text: str, explicit: bool) -> str:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        raise ValueError(
            f"'{text}' is not an address: write the host address to listen on as a literal "
            "(127.0.0.1, [::1]), not a name"
        ) from None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        raise ValueError(f"{text} is an IPv4 address in IPv6 form; write {ip.ipv4_mapped}")
    if not ip.is_loopback and not explicit:
        raise ValueError(
            f"{text} is not the host's loopback: a published port listens on 127.0.0.1 unless "
            "the settings say otherwise in so many words; write the mapping form "
            f"{{port: PORT, hostPort: PORT, address: '{text}'}}"
        )
    return str(ip)


def make_published(
    port: int, host_port: int | None = None, address: str = "127.0.0.1"
) -> PublishedPort:
    """The mapping form's entry (``address`` explicit: any address literal), checked."""
    out = PublishedPort(
        _port(str(port), "sandbox"),
        0 if host_port is None else _port(str(host_port), "host"),
        _address(address, explicit=True),
    )
    _not_dashboard(out)
    return out


def parse_publish(text: str) -> PublishedPort:
    """``text`` (the string form) as a :class:`PublishedPort`, or ValueError saying what is
    wrong and what to write instead. Pure."""
    if not isinstance(text, str) or not text or text != text.strip():
        raise ValueError("an empty or space-padded entry; write PORT or HOSTPORT:PORT")
    if "/" in text:
        raise ValueError(
            "a protocol suffix (/tcp, /udp): published ports are TCP; write PORT or "
            "HOSTPORT:PORT without it"
        )
    if "-" in text:
        raise ValueError("a port range: publish each port on its own (['3000', '3001'])")
    address = "127.0.0.1"
    rest = text
    if text.startswith("["):
        inner, sep, rest = text[1:].partition("]:")
        if not sep:
            raise ValueError("an IPv6 address is written [::1]:HOSTPORT:PORT")
        address = _address(inner, explicit=False)
    elif text.count(":") == 2:
        given, _, rest = text.partition(":")
        address = _address(given, explicit=False)
    elif text.count(":") > 2:
        raise ValueError("write PORT, HOSTPORT:PORT or ADDRESS:HOSTPORT:PORT ([::1] in brackets)")
    host, sep, port = rest.rpartition(":")
    out = PublishedPort(
        _port(port, "sandbox"),
        _port(host, "host", free=True) if sep else 0,
        address,
    )
    _not_dashboard(out)
    return out


def _not_dashboard(entry: PublishedPort) -> None:
    if entry.host_port == DASHBOARD_PORT:
        raise ValueError(
            f"host port {DASHBOARD_PORT} is fusion-oci's dashboard (every task's audit and "
            f"output); publish on another host port ('8080:{entry.port}') or a free one "
            f"('{entry.port}')"
        )


__all__ = ["PublishedPort", "make_published", "parse_publish"]
