"""Host patterns (pure, standard library only): the one parser of an ``allowedDomains`` /
``deniedDomains`` entry, which the policy's validation (fusion_oci.models) and the egress
rules (fusion_oci.egress.rules) both use, so a pattern the proxy would reject never gets past
the settings. A leaf module: it imports nothing of fusion_oci.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class Pattern:
    """One parsed pattern: a name (``wildcard``: below it), or an address range."""

    text: str
    name: str | None = None
    wildcard: bool = False
    network: IPNetwork | None = None
    port: int | None = None

    def matches(self, host: str, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.network is not None:
            addr = as_address(host)
            return addr is not None and unmap(addr) in self.network
        assert self.name is not None
        if self.wildcard:
            return host.endswith("." + self.name)
        return host == self.name


def as_address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def unmap(addr: IPAddress) -> IPAddress:
    """The IPv4 address a v4-mapped (::ffff:a.b.c.d), 6to4 or NAT64 form carries."""
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return addr.ipv4_mapped
        if addr in _NAT64:
            return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
        if addr.sixtofour is not None:
            return addr.sixtofour
    return addr


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def normalize_host(host: str) -> str:
    """The form rules compare: lower case, no trailing dot, IPv6 without brackets. Only
    ASCII is lowered: ``str.lower`` folds some other letters into ASCII (the Kelvin sign
    into ``k``), and a name that is not plain ASCII must stay visibly so for
    :func:`name_problem`."""
    host = host.strip()
    if host.isascii():
        host = host.lower()
    host = host.rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    addr = as_address(host)
    return str(addr) if addr is not None else host


NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-.")
"""What a host name may be made of, in a pattern and in a request alike: the bytes every
resolver on the path (glibc's files and DNS backends; Python's getaddrinfo is given bytes,
so no IDNA step) passes through unchanged, and no more: a host name's own alphabet (RFC 1123:
letters, digits, hyphens, dots). '_' is refused too: no host name carries it (``_acme-
challenge`` names a record, not a host), and one rule with no exception is easier to trust."""


def shown(host: str) -> str:
    """``host`` printable on one line whatever it holds (soft hyphens, newlines, escapes)."""
    return host.encode("unicode_escape").decode("ascii")


def name_problem(host: str) -> str | None:
    """Why the proxy must not decide on (nor resolve) the requested ``host``, or None.

    The proxy decides on a name and then resolves it; a resolver folds some spellings into
    another name (IDNA nameprep drops a soft hyphen and maps 'º' to 'o'; glibc's DNS
    backend reads ``\\100`` and ``\\n`` as escapes), so a name that is not plain ASCII
    letters, digits, '-' and dots, in DNS labels, would be decided as one name and
    resolved as another. An IP literal (any form ``ipaddress`` reads) is not a name: None.
    """
    name = host[:-1] if host.endswith(".") else host
    # ASCII first: ipaddress reads any text after an IPv6 '%' as a scope.
    if name.isascii() and as_address(name) is not None:
        return None
    if not name.isascii() or not set(name) <= NAME_CHARS:
        return (
            f"'{shown(host)}' is not a plain host name (only ASCII letters, digits, '-' "
            "and '.'; a resolver would fold other characters and escapes into another name); "
            "write an international name in its ASCII form (xn--...)"
        )
    why = _check_name(name.lower())
    return f"'{shown(host)}' is not a host name: {why}" if why else None


def _check_name(name: str) -> str | None:
    if not name or len(name) > 253:
        return "a host name is 1 to 253 characters"
    for label in name.split("."):
        if not _LABEL.fullmatch(label):
            return (
                f"the label '{label}' is not a DNS label (letters, digits, '-'; "
                "1 to 63 characters; no leading or trailing '-')"
            )
    return None


def parse_pattern(text: str) -> Pattern:
    """One pattern; ValueError with the reason when it is not one."""
    raw = text.strip().lower()
    if not raw:
        raise ValueError("the entry is empty")
    if "://" in raw:
        raise ValueError(
            "write the host only, without a scheme or path (example.com:443, "
            "not https://example.com/)"
        )
    if "/" in raw:
        try:
            net = ipaddress.ip_network(raw, strict=False)
        except ValueError as exc:
            raise ValueError(f"'{raw}' is not an address range ({exc})") from None
        return Pattern(text=raw, network=net)
    port: int | None = None
    host = raw
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0:
            raise ValueError("an IPv6 address in brackets needs its closing ']'")
        host, rest = raw[1:end], raw[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ValueError("only ':PORT' may follow ']'")
            port = _port(rest[1:])
        if as_address(host) is None:
            raise ValueError(f"'{host}' in brackets is not an IPv6 address")
    elif raw.count(":") == 1:
        host, port_text = raw.split(":")
        port = _port(port_text)
    elif raw.count(":") > 1 and as_address(raw) is None:
        raise ValueError("write an IPv6 address with a port as [ADDRESS]:PORT")
    addr = as_address(host)
    if addr is not None:
        net = ipaddress.ip_network(addr)
        return Pattern(text=raw, network=net, port=port)
    wildcard = host.startswith("*.")
    name = host[2:] if wildcard else host
    if "*" in name:
        raise ValueError("'*' is allowed only as the whole first label ('*.example.com')")
    name = name.rstrip(".")
    why = _check_name(name)
    if why:
        raise ValueError(why)
    if wildcard and "." not in name:
        raise ValueError(
            "a wildcard needs at least two labels after '*.' ('*.example.com'), "
            "not a whole top-level domain"
        )
    return Pattern(text=raw, name=name, wildcard=wildcard, port=port)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"':{text}' is not a port (1 to 65535)")
    return int(text)
