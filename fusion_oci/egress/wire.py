"""What the proxy's two fronts (HTTP, SOCKS5) and its connect-and-audit core share: one
connection's record, a refusal spelled for both protocols, the task's limits, and what a front
may ask of the core (:class:`Core`, which :class:`fusion_oci.egress.proxy.EgressProxy` is): the
fronts depend on this module only, never on the core's."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fusion_oci.egress.credentials import Broker, Brokered

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


@dataclass(frozen=True)
class Limits:
    """What one task's proxy allows itself."""

    max_connections: int = 64
    """Connections open at once (tunnels and handshakes). Counted at accept: one more is
    closed at once, before a byte of it is read, so a task holds at most this many
    connections (two descriptors each once a tunnel is open) whatever it sends or withholds."""
    accept_rate_per_s: float = 500.0
    """New connections accepted per second, sustained (a token bucket of ``accept_burst``).
    Beyond it the listener waits and the kernel's backlog holds the rest. A bound on what
    ``loop_share`` does not time: each connection's audit event, written on the one audit
    thread every task shares."""
    accept_burst: int = 500
    """Connections accepted at once before ``accept_rate_per_s`` applies."""
    loop_share: float = 0.10
    """The least share of the proxy loop's time a task may use while another task has a
    connection under way (past its first byte); its fair share is an equal part among the
    tasks with work under way, if larger (two busy tasks: half each), except for a task that
    keeps being refused, which gets this and no more. Every step of its
    handlers (head parsing, decisions, audit events, TLS of brokered hosts, push checks) is
    timed, and a task whose recent share (over about a second) is above it waits, at accept
    and before each step of its handlers, until it is back under (near it: one new
    connection per 10 ms).
    Work-conserving: alone, or beside tasks with nothing under way (idle connections
    included), a task is never held back. Tunnels already open are not slowed (their bytes
    move in the kernel: splice)."""
    idle_timeout_s: float = 600.0
    """A tunnel with no byte either way for this long is closed."""
    handshake_timeout_s: float = 30.0
    """Time for a request's head (or a SOCKS greeting) to arrive."""
    connect_timeout_s: float = 15.0
    """Time for the connection to the destination."""
    max_header_bytes: int = 64 * 1024
    """Largest request head; more gets 431."""


class Core(Protocol):
    """What a front asks of the proxy's core: its limits and broker, and to decide and connect
    (:meth:`open`), tunnel (:meth:`splice`), intercept a credential's host (:meth:`intercept`)
    and record a leak attempt (:meth:`leak`)."""

    limits: Limits
    broker: Broker | None

    async def open(self, conn: Connection) -> socket.socket: ...

    async def splice(
        self,
        up: socket.socket,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: Connection,
        *,
        answer: bytes = b"",
        first: bytes = b"",
    ) -> None: ...

    async def intercept(
        self,
        up: socket.socket,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: Connection,
        cred: Brokered,
    ) -> None: ...

    def leak(self, conn: Connection, name: str, where: str) -> None: ...
