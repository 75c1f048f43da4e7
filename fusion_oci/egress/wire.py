"""What the proxy's two fronts (HTTP, SOCKS5) and its connect-and-audit core share: one
connection's record and a refusal spelled for both protocols."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# SOCKS5 reply codes (RFC 1928 section 6).
SOCKS_OK = 0x00
SOCKS_FAILURE = 0x01
SOCKS_NOT_ALLOWED = 0x02
SOCKS_NET_UNREACHABLE = 0x03
SOCKS_HOST_UNREACHABLE = 0x04
SOCKS_REFUSED = 0x05
SOCKS_TTL_EXPIRED = 0x06
SOCKS_BAD_COMMAND = 0x07
SOCKS_BAD_ADDRESS = 0x08


class Refused(Exception):
    """A request the proxy will not carry: HTTP status, SOCKS code, the line a program reads."""

    def __init__(self, status: int, socks: int, text: str, rule: str | None = None) -> None:
        super().__init__(text)
        self.status = status
        self.socks = socks
        self.text = text
        self.rule = rule


def bad_name(problem: str) -> Refused:
    """The refusal of a name the proxy will not decide on (HTTP 403, SOCKS 0x02)."""
    return Refused(
        403, SOCKS_NOT_ALLOWED, f"fusion-oci egress: refused: {problem}", "the host name check"
    )


@dataclass
class Connection:
    """What one connection did (its audit event)."""

    protocol: str
    host: str | None = None
    port: int | None = None
    address: str | None = None
    allowed: bool = False
    rule: str | None = None
    reason: str | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    started: float = field(default_factory=time.monotonic)
