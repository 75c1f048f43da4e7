"""Egress rules (pure): which host, port and address a ``filtered`` sandbox may reach.

Patterns (``allowedDomains`` / ``deniedDomains``):

- ``example.com``: that name only (not its subdomains);
- ``*.example.com``: any name below ``example.com`` (not the apex itself);
- ``10.0.0.7``, ``[fd00::1]``, ``10.0.0.0/24``, ``fd00::/64``: an address or a range; in
  ``allowedDomains`` it also lifts the private-address refusal for exactly that range;
- any of those but a range with ``:PORT`` (``example.com:443``): only that port.

Deny wins over allow. A name is checked first (:meth:`EgressRules.decide`); then every address
it resolves to (:meth:`EgressRules.check_address`): loopback, link-local (with the metadata
address 169.254.169.254), RFC 1918, CGNAT (100.64/10), ULA (fc00::/7), multicast, the
unspecified address and the v4-mapped / NAT64 forms of those are refused unless an allowed
range names them. Port 4040 (the dashboard's) is refused on every address: the host's own
addresses are not a fixed list (every interface, v4 and v6, mapped forms, a public address
that NATs back to the host, interfaces added later), so no destination may have it.

A requested name that is not plain ASCII letters, digits, '-', '_' and dots
(:func:`fusion_oci.models.hostpattern.name_problem`) is refused before any pattern is compared: a
resolver would fold it into another name than the one decided on.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, field_validator

from fusion_oci.errors import SettingsError
from fusion_oci.models.hostpattern import (
    IPAddress,
    IPNetwork,
    Pattern,
    name_problem,
    normalize_host,
    parse_pattern,
    unmap,
)

if TYPE_CHECKING:
    from fusion_oci.models import SandboxPolicy


ALLOW_KEY = "sandbox.policy.allowedDomains"
DENY_KEY = "sandbox.policy.deniedDomains"
DASHBOARD_PORT = 4040

_FORBIDDEN: tuple[tuple[str, IPNetwork], ...] = tuple(
    (why, ipaddress.ip_network(net))
    for why, net in (
        ("the metadata address", "169.254.169.254/32"),
        ("unspecified", "0.0.0.0/8"),
        ("loopback", "127.0.0.0/8"),
        ("link-local", "169.254.0.0/16"),
        ("private (RFC 1918)", "10.0.0.0/8"),
        ("private (RFC 1918)", "172.16.0.0/12"),
        ("private (RFC 1918)", "192.168.0.0/16"),
        ("shared (CGNAT)", "100.64.0.0/10"),
        ("multicast", "224.0.0.0/4"),
        ("reserved", "240.0.0.0/4"),
        ("unspecified", "::/128"),
        ("loopback", "::1/128"),
        ("link-local", "fe80::/10"),
        ("unique-local (ULA)", "fc00::/7"),
        ("multicast", "ff00::/8"),
    )
)


class PatternError(SettingsError):
    """An allowedDomains / deniedDomains entry that is not a pattern."""

    def __init__(self, key: str, index: int, value: str, why: str) -> None:
        super().__init__(
            f"settings error at {key}[{index}]: '{value}' is not a host pattern",
            why,
            "write an exact name (registry.npmjs.org), a wildcard (*.example.com), an address "
            "or range (10.0.0.0/24), each optionally with :PORT (github.com:22)",
        )


def validate_patterns(values: Sequence[str], key: str) -> list[str]:
    """Check every entry; the first bad one raises :class:`PatternError` naming ``key[i]``."""
    for i, value in enumerate(values):
        try:
            parse_pattern(value)
        except ValueError as exc:
            raise PatternError(key, i, value, str(exc)) from None
    return list(values)


def address_class(addr: IPAddress) -> str | None:
    """Why ``addr`` is refused by default (``'loopback'``...), or None for a public one."""
    plain = unmap(addr)
    for why, net in _FORBIDDEN:
        if plain.version == net.version and plain in net:
            return why
    return None


@dataclass(frozen=True)
class Decision:
    """A rule's verdict: ``rule`` says which rule decided, ``settings_key`` where to change it."""

    allowed: bool
    rule: str
    settings_key: str
    text: str | None = None
    """The whole denial line when no setting would change it (a malformed name); None: the
    line names the rule and the settings key."""

    def denial_text(self, host: str, port: int) -> str:
        """The one line a denied program reads (403 body, audit reason)."""
        if self.text is not None:
            return self.text
        change = "remove it from" if self.settings_key == DENY_KEY else "add it to"
        return (
            f"fusion-oci egress: {host}:{port} denied by {self.rule}; to allow it, "
            f"{change} {self.settings_key}"
        )


class EgressRules(BaseModel):
    """What one task's proxy allows. Patterns as in the module docstring."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    allowed: tuple[str, ...]
    """Patterns that may be reached. Empty: nothing is."""
    denied: tuple[str, ...] = ()
    """Patterns never reached, whatever allows them (deny wins)."""
    allow_addresses: tuple[str, ...] = ()
    """Address ranges (CIDR) reached although private, loopback or link-local. The policy names
    them as addresses or ranges in ``allowedDomains``. Empty: every such address is refused."""

    @field_validator("allowed", "denied")
    @classmethod
    def _patterns(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            parse_pattern(value)
        return tuple(normalize_pattern(v) for v in values)

    @field_validator("allow_addresses")
    @classmethod
    def _ranges(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(str(ipaddress.ip_network(v.strip("[]"), strict=False)) for v in values)

    @classmethod
    def from_policy(cls, policy: SandboxPolicy, profile_hosts: Sequence[str]) -> EgressRules:
        """The rules of a policy: the built-in profile's hosts plus ``allowedDomains``, minus
        ``deniedDomains``; address entries of ``allowedDomains`` also lift the refusal of
        their range."""
        allowed = tuple(dict.fromkeys([*profile_hosts, *policy.allowed_domains]))
        ranges = [
            p.network for p in map(parse_pattern, policy.allowed_domains) if p.network is not None
        ]
        return cls(
            allowed=allowed,
            denied=tuple(policy.denied_domains),
            allow_addresses=tuple(str(n) for n in ranges),
        )

    @cached_property
    def _denied(self) -> list[Pattern]:
        return [parse_pattern(v) for v in self.denied]

    @cached_property
    def _allowed(self) -> list[Pattern]:
        return [parse_pattern(v) for v in self.allowed]

    @cached_property
    def _ranges_parsed(self) -> list[IPNetwork]:
        return [ipaddress.ip_network(v) for v in self.allow_addresses]

    def decide(self, host: str, port: int) -> Decision:
        """Whether the *name* (or address literal) ``host`` may be reached on ``port``."""
        host = normalize_host(host)
        problem = name_problem(host)
        if problem is not None:
            # Decided before any pattern: a folded spelling must not slip past a deny entry.
            return Decision(
                False,
                "the host name check",
                ALLOW_KEY,
                text=f"fusion-oci egress: refused: {problem}",
            )
        for pattern in self._denied:
            if pattern.matches(host, port):
                return Decision(False, f"deniedDomains entry '{pattern.text}'", DENY_KEY)
        for pattern in self._allowed:
            if pattern.matches(host, port):
                return Decision(True, f"allowedDomains entry '{pattern.text}'", ALLOW_KEY)
        return Decision(
            False, "no allowedDomains entry (or built-in profile host) matching it", ALLOW_KEY
        )

    def check_address(self, address: str, port: int) -> Decision:
        """Whether the proxy may connect to ``address`` (what a name resolved to)."""
        try:
            # A scoped IPv6 answer (fe80::1%eth0) is classified by its address part.
            addr = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return Decision(False, f"'{address}' is not an IP address", ALLOW_KEY)
        plain = unmap(addr)
        why = address_class(addr)
        if port == DASHBOARD_PORT:
            where = f"[{address}]:4040" if ":" in address else f"{address}:4040"
            # Every address, not only loopback: the host answers on each of its interfaces
            # (and 0.0.0.0, and a public address NATed back to it), a set no pure rule knows.
            return Decision(
                False,
                f"port 4040 is the dashboard's and is never reached, on any address "
                f"({address} included)",
                ALLOW_KEY,
                text=f"fusion-oci egress: {where} refused: port 4040 (the dashboard's) "
                "is never reached through the proxy, on any address; no setting changes this",
            )
        if why is None:
            return Decision(True, f"address {address} is public", ALLOW_KEY)
        for net in self._ranges_parsed:
            if plain.version == net.version and plain in net:
                return Decision(True, f"allowed address range '{net}'", ALLOW_KEY)
        return Decision(
            False,
            f"address {address} is {why} (refused unless the policy names its range)",
            ALLOW_KEY,
        )


def normalize_pattern(text: str) -> str:
    return parse_pattern(text).text
