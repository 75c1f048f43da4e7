"""The task's egress proxy: HTTP CONNECT, plain HTTP and SOCKS5 on one listener.

The first byte of a connection picks the protocol (0x05: SOCKS5, else HTTP). For every
request the proxy decides on the name (:meth:`EgressRules.decide`), resolves it itself
(getaddrinfo in a thread, or the tests' ``resolve_override``), checks each address it got
(:meth:`EgressRules.check_address`) and connects to exactly one checked address: it never
resolves again (no DNS rebinding between check and connect). Listeners: the unix socket
``state_dir/egress.sock`` (bound into the sandbox), and 127.0.0.1 on a random port only when
``tcp=True`` (landlock); never 4040. Every connection, let through or not, is one
``sandbox:egress`` audit event.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import ssl
import time
import urllib.parse
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_oci.egress.budget import BudgetedEvents
from fusion_oci.egress.loop import on_proxy_loop
from fusion_oci.egress.rules import ALLOW_KEY, DASHBOARD_PORT, Decision, EgressRules
from fusion_oci.egress.splice import Tunnel
from fusion_oci.hostpattern import name_problem, normalize_host

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog
    from fusion_oci.egress.credentials import Broker, Brokered
    from fusion_oci.egress.mitm import Exchange

SOCKET_NAME = "egress.sock"
_BACKLOG = 100
"""Connections the kernel holds for a listener while the task's accept rate waits."""

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

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
    }
)
"""Headers that belong to one hop (RFC 9110 7.6.1); Transfer-Encoding stays: the body is
forwarded as the client framed it."""

Resolver = Callable[[str, int], Awaitable[list[str]]]


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


class Refused(Exception):
    """A request the proxy will not carry: HTTP status, SOCKS code, the line a program reads."""

    def __init__(self, status: int, socks: int, text: str, rule: str | None = None) -> None:
        super().__init__(text)
        self.status = status
        self.socks = socks
        self.text = text
        self.rule = rule


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


_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def http_response(status: int, text: str) -> bytes:
    body = (text + "\n").encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        "X-Fusion-OCI-Egress: refused\r\n\r\n"
    )
    return head.encode() + body


def split_host_port(target: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` -> (host, port); ValueError when it is not one."""
    if target.startswith("["):
        end = target.find("]")
        if end < 0:
            raise ValueError(target)
        host, rest = target[1:end], target[end + 1 :]
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port_text = target.rpartition(":")
        if not sep:
            host, port_text = target, ""
    if not port_text:
        if default_port is None:
            raise ValueError(target)
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(target)
    return host, int(port_text)


def rewrite_request(lines: list[str], path: str, netloc: str) -> bytes:
    """A request head for the origin: origin-form target, hop-by-hop headers dropped (also
    those ``Connection`` names), ``Host`` set, one request per connection."""
    method, _, version = lines[0].split(" ", 2)
    named: set[str] = set()
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
        if name.strip().lower() in ("connection", "proxy-connection"):
            named.update(v.strip().lower() for v in value.split(","))
    out = [f"{method} {path} {version}", f"Host: {netloc}"]
    for name, value in headers:
        low = name.lower()
        if low in HOP_BY_HOP or low in named or low == "host":
            continue
        out.append(f"{name}: {value}")
    out.append("Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")


class EgressProxy:
    """One task's proxy. Made by :func:`start_proxy`; serves on the proxy thread's loop."""

    def __init__(
        self,
        *,
        task_id: str,
        rules: EgressRules,
        state_dir: Path,
        audit: AuditLog | None,
        tcp: bool,
        resolve_override: Mapping[str, list[str]] | None,
        limits: Limits,
        backend: str,
        policy_hash: str | None,
        broker: Broker | None = None,
    ) -> None:
        self.task_id = task_id
        self.broker = broker
        """The task's brokered credentials (None: nothing is intercepted)."""
        self.rules = rules
        self.audit = audit
        self.limits = limits
        self.backend = backend
        self.policy_hash = policy_hash
        self.unix_socket = state_dir / SOCKET_NAME
        """Host path of the unix socket (bind it into the sandbox)."""
        self.tcp_port: int | None = None
        """The 127.0.0.1 port when started with ``tcp=True``; None otherwise."""
        self.run_id: str | None = None
        self._tcp = tcp
        self._override = (
            {normalize_host(k): list(v) for k, v in resolve_override.items()}
            if resolve_override is not None
            else None
        )
        self._listeners: list[socket.socket] = []
        self._acceptors: list[asyncio.Task[None]] = []
        self.loop_seconds = 0.0
        """Time on the proxy loop this task's connections have used in all (measured)."""
        self._working = 0
        """Connections past their first byte and not yet over."""
        self._recent = 0.0
        """Loop seconds used lately: each charge added, the sum decaying with
        :data:`_SHARE_WINDOW_S` (its share of the loop: this over the window)."""
        self._recent_at = time.monotonic()
        self._refusals = 0.0
        """Refusals lately (connections, requests, pushes), decaying like ``_recent``: a task
        that keeps being refused gets no more than ``loop_share`` (see :meth:`_fair_share`)."""
        self._refusals_at = time.monotonic()
        self._admitted_at = 0.0
        self._closed_at_accept = 0
        """Connections closed at accept (over ``max_connections``) since the last event."""
        self._last_cap_event = 0.0
        self._handlers: set[asyncio.Task[None]] = set()
        self._tunnels: set[Tunnel] = set()
        self._events = BudgetedEvents(audit, self._task_fields, "proxy")
        self._stopped = False

    def set_run(self, run_id: str | None) -> None:
        """Connections from now on are audited with this run id."""
        self.run_id = run_id

    @property
    def open_connections(self) -> int:
        """Connections being served (handshakes and open tunnels)."""
        return len(self._handlers)

    async def _start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.unix_socket.unlink()  # a stale socket of a dead owner in a reused folder
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            unix.bind(str(self.unix_socket))
            # The socket's folder is private (0700, the host's); the file itself is bound
            # into the sandbox, whose user may be any uid of its user namespace.
            self.unix_socket.chmod(0o666)
        except BaseException:
            unix.close()
            raise
        self._listen(unix)
        _PROXIES.add(self)
        if self._tcp:
            for _ in range(8):
                tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                tcp.bind(("127.0.0.1", 0))
                port = tcp.getsockname()[1]
                if port != DASHBOARD_PORT:  # never listen there (a random port could be it)
                    self._listen(tcp)
                    self.tcp_port = port
                    break
                tcp.close()

    def _listen(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.listen(_BACKLOG)
        self._listeners.append(sock)
        loop = asyncio.get_running_loop()
        self._acceptors.append(
            loop.create_task(_Metered(self._accept_loop(sock), self._charge, None))
        )

    def _charge(self, seconds: float) -> None:
        self._recent_share()  # decayed up to now, then this step added
        self._recent += seconds
        self.loop_seconds += seconds

    def _recent_share(self) -> float:
        now = time.monotonic()
        self._recent *= math.exp(-(now - self._recent_at) / _SHARE_WINDOW_S)
        self._recent_at = now
        return self._recent / _SHARE_WINDOW_S

    def _step_wait(self) -> float:
        """Seconds a step of this task's handlers waits before it runs: while the task is
        over its share and another has work under way (0 otherwise). Connections admitted
        before the share showed their cost are held here, not only new ones at accept."""
        share, budget = self._recent_share(), self._fair_share()
        if share <= budget or not any(p is not self and p._working for p in _PROXIES):
            return 0.0
        return min(_SHARE_WINDOW_S * math.log(share / budget), _SHARE_WINDOW_S)

    def _fair_share(self) -> float:
        """The loop share this task may use now: an equal part among the tasks with work
        under way, and never less than ``loop_share``. A task that needs much of the loop
        (TLS of a brokered registry) is held back only as far as others need it too; one
        that keeps being refused (a flood of denied CONNECTs, push bombs: work nobody asked
        for) is held to ``loop_share``."""
        if self._refusal_rate() > _REFUSALS_PER_S:
            return self.limits.loop_share
        working = sum(1 for p in _PROXIES if p._working or p is self)
        return max(self.limits.loop_share, 1.0 / max(working, 1))

    def _refused(self) -> None:
        self._refusal_rate()  # decayed up to now, then this one added
        self._refusals += 1.0

    def _refusal_rate(self) -> float:
        now = time.monotonic()
        self._refusals *= math.exp(-(now - self._refusals_at) / _SHARE_WINDOW_S)
        self._refusals_at = now
        return self._refusals / _SHARE_WINDOW_S

    def _over_budget(self) -> float:
        """Seconds to wait before the task's loop share is back within ``loop_share`` (0: it
        is, or no other task has a connection under way: then nobody is held up)."""
        share, budget = self._recent_share(), self._fair_share()
        if share <= budget / 2:
            return 0.0
        # Demand, not use: a neighbour this task starves uses little of the loop.
        if not any(p is not self and p._working for p in _PROXIES):
            return 0.0
        if share > budget:
            return _SHARE_WINDOW_S * math.log(share / budget)
        # Near the budget, one connection per _NEAR_BUDGET_GAP_S: a connection's cost shows
        # in the share only as it runs, and many admitted at once overshoot it.
        return max(0.0, self._admitted_at + _NEAR_BUDGET_GAP_S - time.monotonic())

    async def _accept_loop(self, listener: socket.socket) -> None:
        """Accept for one listener, the task's limits applied before a byte is read: the
        rate first (waiting here leaves connections in the kernel's backlog, costing the
        loop nothing), then the cap (one over it is closed at once)."""
        loop = asyncio.get_running_loop()
        rate, burst = self.limits.accept_rate_per_s, float(self.limits.accept_burst)
        tokens, last = burst, time.monotonic()
        while True:
            now = time.monotonic()
            tokens = min(burst, tokens + (now - last) * rate)
            last = now
            if tokens < 1:
                await asyncio.sleep((1 - tokens) / rate)
                continue
            wait = self._over_budget()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError:
                # EMFILE / ENFILE / ENOBUFS: the process is out of something; the backlog
                # keeps the connection until it is back (asyncio's own server does the same).
                await asyncio.sleep(0.1)
                continue
            tokens -= 1
            if self._stopped or len(self._handlers) >= self.limits.max_connections:
                sock.close()
                self._note_closed_at_accept()
                continue
            task = loop.create_task(_Metered(self._accepted(sock), self._charge, self._step_wait))
            self._admitted_at = time.monotonic()
            # Counted now, not when the task first runs: a burst of accepts sees every one.
            self._handlers.add(task)

    def _note_closed_at_accept(self) -> None:
        """One audit event per second at most for connections closed at accept: a flood of
        them must not become a flood of events (each costs the loop and the audit writer)."""
        self._closed_at_accept += 1
        now = time.monotonic()
        if now - self._last_cap_event >= 1.0:
            self._audit(
                Connection(
                    protocol="?",
                    reason=f"fusion-oci egress: {self._closed_at_accept} connection(s) closed "
                    f"at accept: this task already has {self.limits.max_connections} open "
                    "(Limits.max_connections)",
                )
            )
            self._closed_at_accept, self._last_cap_event = 0, now

    async def _accepted(self, sock: socket.socket) -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        try:
            # A server-side stream, as asyncio.start_server makes it: the protocol has a
            # connected callback, which is what StreamWriter.start_tls reads as "server
            # side" (the intercepted connection's TLS).
            reader = asyncio.StreamReader(limit=self.limits.max_header_bytes, loop=loop)
            made: asyncio.Future[asyncio.StreamWriter] = loop.create_future()
            protocol = asyncio.StreamReaderProtocol(
                reader, lambda _, w: made.set_result(w), loop=loop
            )
            await loop.connect_accepted_socket(lambda: protocol, sock)
            writer = await made
        except BaseException:
            sock.close()
            self._handlers.discard(task)
            raise
        await self._accept(reader, writer)

    async def stop(self) -> None:
        """Close the listeners and every open connection; remove the socket. Idempotent."""
        await on_proxy_loop(self._stop())

    async def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        _PROXIES.discard(self)
        for acceptor in self._acceptors:
            acceptor.cancel()
        await asyncio.gather(*self._acceptors, return_exceptions=True)
        for listener in self._listeners:
            listener.close()
        for tunnel in list(self._tunnels):
            tunnel.close()
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._events.drain()
        with contextlib.suppress(FileNotFoundError):
            self.unix_socket.unlink()

    # -- one connection ---------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._stopped:
            writer.close()
            return
        self._handlers.add(task)
        conn = Connection(protocol="?")
        try:
            await self._serve(reader, writer, conn)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            conn.reason = conn.reason or "the sandbox side closed the connection"
        except asyncio.CancelledError:
            conn.reason = conn.reason or "the proxy stopped"
        except Exception as exc:  # a bug here must end this connection, never the proxy
            conn.reason = f"fusion-oci egress: internal error ({exc!r})"
        finally:
            self._handlers.discard(task)
            writer.close()
            if conn.host is not None or conn.reason is not None:
                self._audit(conn)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection
    ) -> None:
        over = False  # the cap is applied at accept (_accept_loop), before any read
        try:
            first = await asyncio.wait_for(reader.readexactly(1), self.limits.handshake_timeout_s)
        except TimeoutError:
            return
        # From its first byte to its end a connection is the task's wanting the loop (a
        # connection that sends nothing is not): what holds a neighbour to its budget.
        self._working += 1
        try:
            if first == b"\x05":
                conn.protocol = "socks5"
                await self._socks(reader, writer, conn, over)
            else:
                conn.protocol = "http"
                await self._http(first, reader, writer, conn, over)
        finally:
            self._working -= 1

    async def _http(
        self,
        first: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: Connection,
        over: bool,
    ) -> None:
        try:
            rest = await asyncio.wait_for(
                reader.readuntil(b"\r\n\r\n"), self.limits.handshake_timeout_s
            )
        except asyncio.LimitOverrunError:
            return await self._http_refuse(
                writer,
                conn,
                Refused(
                    431,
                    0,
                    "fusion-oci egress: request head larger than "
                    f"{self.limits.max_header_bytes} bytes",
                ),
            )
        except TimeoutError:
            return await self._http_refuse(
                writer, conn, Refused(408, 0, "fusion-oci egress: no complete request head in time")
            )
        head = (first + rest).decode("latin-1")
        lines = head.split("\r\n")[:-2]
        parts = lines[0].split(" ") if lines else []
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return await self._http_refuse(
                writer, conn, Refused(400, 0, "fusion-oci egress: not an HTTP proxy request")
            )
        method, target, _ = parts
        try:
            if method.upper() == "CONNECT":
                conn.host, conn.port = split_host_port(target)
                path = netloc = ""
            else:
                url = urllib.parse.urlsplit(target)
                if url.scheme.lower() != "http" or not url.hostname:
                    raise ValueError(target)
                path = (url.path or "/") + (f"?{url.query}" if url.query else "")
                netloc = url.netloc.rpartition("@")[2]
                # The host as written (urlsplit's hostname is str.lower()ed, which folds
                # the Kelvin sign into 'k'): the name check below sees what came.
                conn.host, conn.port = split_host_port(netloc, 80)
        except ValueError:
            return await self._http_refuse(
                writer,
                conn,
                Refused(
                    400,
                    0,
                    f"fusion-oci egress: '{target}' is not host:port (CONNECT) or an "
                    "http:// absolute URI",
                ),
            )
        problem = name_problem(conn.host)
        if problem is not None:
            return await self._http_refuse(writer, conn, _bad_name(problem))
        if over:
            return await self._http_refuse(
                writer,
                conn,
                Refused(503, 0, "fusion-oci egress: too many open connections for this task"),
            )
        cred = None
        if self.broker is not None:
            leaked = self.broker.find_sentinel(head.encode("latin-1"))
            cred = self.broker.for_host(normalize_host(conn.host))
            if leaked is not None:
                # A sentinel in a head the proxy forwards as is (plain HTTP, a CONNECT's own
                # headers): never swapped there, and the attempt is on record.
                self._leak(conn, leaked.spec.name, "in a request the proxy does not swap in")
                return await self._http_refuse(
                    writer,
                    conn,
                    Refused(
                        403,
                        0,
                        f"fusion-oci egress: request to {conn.host} denied: it carries "
                        f"the sentinel of {leaked.spec.name}, which is swapped only in the "
                        "Authorization header of HTTPS requests to its hosts",
                    ),
                )
        try:
            up = await self._open(conn)
        except Refused as refused:
            return await self._http_refuse(writer, conn, refused)
        if cred is not None and method.upper() == "CONNECT":
            return await self._intercept(up, reader, writer, conn, cred)
        if method.upper() == "CONNECT":
            await self._splice(
                up, reader, writer, conn, answer=b"HTTP/1.1 200 Connection established\r\n\r\n"
            )
        elif self.broker is None:
            await self._splice(up, reader, writer, conn, first=rewrite_request(lines, path, netloc))
        else:
            await self._plain(up, reader, writer, conn, lines, path, netloc)

    async def _plain(
        self,
        up: socket.socket,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: Connection,
        lines: list[str],
        path: str,
        netloc: str,
    ) -> None:
        """Plain HTTP when the task has a broker: the request checked whole, its body scanned
        as it streams (a sentinel there: 403 and a leak event, the request never completes
        upstream), the answer sent back with ``Connection: close``; then each request the
        client sent after it on the connection (pipelined) is read and checked the same way,
        refused if it carries a sentinel, else dropped (the client sends it again on a new
        connection, as it must after ``Connection: close``). Never spliced: what passes is
        what was read."""
        from fusion_oci.egress.mitm import Head, Scanner, body_chunks, sentinel_in_head

        assert self.broker is not None
        head = Head(lines[0], [_header(line) for line in lines[1:]])
        ureader, uwriter = await asyncio.open_connection(
            sock=up, limit=self.limits.max_header_bytes
        )
        try:
            leaked = sentinel_in_head(head, self.broker)
            if leaked is None:
                dropped = set()
                if "100-continue" in head.tokens("expect"):
                    # Answered here: the body is read (and scanned) before the host answers.
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    dropped.add("expect")
                chunked = "chunked" in head.tokens("transfer-encoding")
                if chunked:
                    dropped.add("content-length")  # beside chunked framing: never both on
                lines = [x for x in lines if _header(x)[0].lower() not in dropped]
                rewritten = rewrite_request(lines, path, netloc)
                uwriter.write(rewritten)
                conn.bytes_up += len(rewritten)
                scanner = Scanner([n for n, _ in self.broker.sentinel_bytes()])
                idle = self.limits.idle_timeout_s
                async for data in _idle(body_chunks(reader, head, response=False), idle):
                    safe, found = scanner.feed(data)
                    if found is not None:
                        leaked = self.broker.find_sentinel(found)
                        break
                    _send_piece(uwriter, safe, chunked, conn, "up")
                    await uwriter.drain()
                else:
                    _send_piece(uwriter, scanner.flush(), chunked, conn, "up")
                    if chunked:
                        uwriter.write(b"0\r\n\r\n")
                    await uwriter.drain()
            if leaked is not None:
                return await self._plain_leak(writer, conn, leaked, "request")
            method = lines[0].split(" ", 1)[0].upper()
            await self._plain_answer(ureader, writer, conn, method)
        finally:
            uwriter.close()
        await self._plain_pipelined(reader, writer, conn)

    async def _plain_answer(
        self,
        ureader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: Connection,
        method: str,
    ) -> None:
        """The destination's answer to a plain request, with ``Connection: close``."""
        from fusion_oci.egress.mitm import Head, body_chunks, read_head

        idle = self.limits.idle_timeout_s
        while True:
            head = await asyncio.wait_for(read_head(ureader), idle)
            if head is None:
                raise ConnectionError(f"{conn.host} closed the connection without an answer")
            status = int(head.first.split(" ")[1])
            if not 100 <= status < 200:  # (a 100 was answered here already)
                break
        chunked = "chunked" in head.tokens("transfer-encoding")
        headers = [(k, v) for k, v in head.headers if k.lower() not in HOP_BY_HOP]
        headers.append(("Connection", "close"))
        writer.write(Head(head.first, headers).encode())
        body = body_chunks(ureader, head, response=True, status=status, method=method)
        async for data in _idle(body, idle):
            _send_piece(writer, data, chunked, conn, "down")
            await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def _plain_pipelined(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection
    ) -> None:
        """Requests the client sent after the one answered (see :meth:`_plain`): each
        checked, head and body, until the client closes or sends nothing more."""
        from fusion_oci.egress.mitm import Scanner, body_chunks, read_head, sentinel_in_head

        assert self.broker is not None
        for _ in range(PIPELINED_CHECKED):
            try:
                head = await asyncio.wait_for(read_head(reader), PIPELINED_WAIT_S)
                if head is None:
                    return
                leaked = sentinel_in_head(head, self.broker)
                scanner = Scanner([n for n, _ in self.broker.sentinel_bytes()])
                if leaked is None:
                    async with asyncio.timeout(self.limits.handshake_timeout_s):
                        async for data in body_chunks(reader, head, response=False):
                            found = scanner.feed(data)[1]
                            if found is not None:
                                leaked = self.broker.find_sentinel(found)
                                break
            except (
                TimeoutError,
                ValueError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
            ):
                return
            if leaked is not None:
                return await self._plain_leak(
                    writer, conn, leaked, "request pipelined after another"
                )

    async def _plain_leak(
        self, writer: asyncio.StreamWriter, conn: Connection, leaked: Brokered, what: str
    ) -> None:
        self._leak(conn, leaked.spec.name, f"in a plain HTTP {what} (its body or head)")
        await self._http_refuse(
            writer,
            conn,
            Refused(
                403,
                0,
                f"fusion-oci egress: request to {conn.host} denied: a plain HTTP {what} "
                f"carries the sentinel of {leaked.spec.name}, which is swapped only in the "
                "Authorization header of HTTPS requests to its hosts",
            ),
        )

    async def _http_refuse(
        self, writer: asyncio.StreamWriter, conn: Connection, refused: Refused
    ) -> None:
        conn.reason = refused.text
        conn.rule = conn.rule or refused.rule
        writer.write(http_response(refused.status, refused.text))
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    async def _socks(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: Connection,
        over: bool,
    ) -> None:
        try:
            refusal = await asyncio.wait_for(
                self._socks_request(reader, writer, conn), self.limits.handshake_timeout_s
            )
        except TimeoutError:
            conn.reason = "fusion-oci egress: no complete SOCKS5 request in time"
            return
        if refusal is not None:
            return self._socks_refuse(writer, conn, refusal)
        if conn.host is None:
            return  # negotiation failed; the reason is set
        if over:
            return self._socks_refuse(
                writer,
                conn,
                Refused(
                    0, SOCKS_FAILURE, "fusion-oci egress: too many open connections for this task"
                ),
            )
        try:
            up = await self._open(conn)
        except Refused as refused:
            return self._socks_refuse(writer, conn, refused)
        await self._splice(
            up, reader, writer, conn, answer=bytes([5, SOCKS_OK, 0, 1, 0, 0, 0, 0, 0, 0])
        )

    async def _socks_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection
    ) -> Refused | None:
        """The method negotiation and the request (RFC 1928 sections 3 and 4): sets
        ``conn.host``/``conn.port``, or returns the refusal for a request we do not serve."""
        count = (await reader.readexactly(1))[0]
        methods = await reader.readexactly(count)
        if 0x00 not in methods:
            writer.write(b"\x05\xff")  # only "no authentication" is offered
            conn.reason = "fusion-oci egress: SOCKS5 client offered no 'no auth' method"
            return None
        writer.write(b"\x05\x00")
        ver, cmd, _, atyp = await reader.readexactly(4)
        if ver != 5:
            conn.reason = "fusion-oci egress: not a SOCKS5 request"
            return None
        if atyp == 0x01:
            host = socket.inet_ntop(socket.AF_INET, await reader.readexactly(4))
        elif atyp == 0x04:
            host = socket.inet_ntop(socket.AF_INET6, await reader.readexactly(16))
        elif atyp == 0x03:
            size = (await reader.readexactly(1))[0]
            # latin-1: every byte stays itself (and visible to the name check below).
            host = (await reader.readexactly(size)).decode("latin-1")
        else:
            conn.host = "?"
            return Refused(
                0, SOCKS_BAD_ADDRESS, f"fusion-oci egress: SOCKS address type {atyp} unknown"
            )
        conn.host, conn.port = host, int.from_bytes(await reader.readexactly(2), "big")
        problem = name_problem(host)
        if problem is not None:
            return _bad_name(problem)
        if cmd != 0x01:
            return Refused(
                0,
                SOCKS_BAD_COMMAND,
                f"fusion-oci egress: SOCKS command {cmd} not supported (only CONNECT)",
            )
        return None

    def _socks_refuse(
        self, writer: asyncio.StreamWriter, conn: Connection, refused: Refused
    ) -> None:
        conn.reason = refused.text
        conn.rule = conn.rule or refused.rule
        writer.write(bytes([5, refused.socks, 0, 1, 0, 0, 0, 0, 0, 0]))

    # -- decide, resolve, connect -------------------------------------------------------------

    async def _resolve(self, host: str, port: int) -> list[str]:
        if self._override is not None:
            return list(self._override.get(host, []))
        # Bytes: a str host is IDNA-encoded by getaddrinfo first (a second spelling of the
        # name); the resolver gets exactly the string that was decided on (plain ASCII,
        # checked by name_problem before the decision).
        infos = await asyncio.get_running_loop().getaddrinfo(
            host.encode("ascii"), port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
        return list(dict.fromkeys(str(info[4][0]) for info in infos))

    async def _open(self, conn: Connection) -> socket.socket:
        """Decide, resolve, check, connect: the destination's side of a new tunnel."""
        assert conn.host is not None and conn.port is not None
        host = normalize_host(conn.host)
        decision = self.rules.decide(host, conn.port)
        conn.rule = decision.rule
        if not decision.allowed:
            raise Refused(
                403, SOCKS_NOT_ALLOWED, decision.denial_text(host, conn.port), decision.rule
            )
        if _is_address(host):
            addresses = [host]
        else:
            try:
                addresses = await asyncio.wait_for(
                    self._resolve(host, conn.port), self.limits.connect_timeout_s
                )
            except (OSError, TimeoutError) as exc:
                raise Refused(
                    502,
                    SOCKS_HOST_UNREACHABLE,
                    f"fusion-oci egress: {host} could not be resolved ({exc})",
                    decision.rule,
                ) from None
            if not addresses:
                raise Refused(
                    502,
                    SOCKS_HOST_UNREACHABLE,
                    f"fusion-oci egress: {host} could not be resolved",
                    decision.rule,
                )
        checked: list[str] = []
        refusal: Decision | None = None
        for address in addresses:
            verdict = self.rules.check_address(address, conn.port)
            if verdict.allowed:
                checked.append(address)
            elif refusal is None:
                refusal = verdict
        if not checked:
            assert refusal is not None
            conn.rule = refusal.rule
            conn.address = addresses[0]
            raise Refused(
                403, SOCKS_NOT_ALLOWED, refusal.denial_text(host, conn.port), refusal.rule
            )
        loop = asyncio.get_running_loop()
        last: BaseException | None = None
        for address in checked:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                # The checked address itself: nothing is resolved again (no rebinding window).
                await asyncio.wait_for(
                    loop.sock_connect(sock, (address, conn.port)), self.limits.connect_timeout_s
                )
            except (OSError, TimeoutError) as exc:
                sock.close()
                last = exc
                continue
            except BaseException:
                sock.close()
                raise
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.address = address
            conn.allowed = True
            return sock
        code = SOCKS_HOST_UNREACHABLE
        if isinstance(last, ConnectionRefusedError):
            code = SOCKS_REFUSED
        elif isinstance(last, OSError) and last.errno == 101:  # ENETUNREACH
            code = SOCKS_NET_UNREACHABLE
        elif isinstance(last, TimeoutError):
            code = SOCKS_TTL_EXPIRED
        conn.address = checked[-1]
        raise Refused(
            502,
            code,
            f"fusion-oci egress: {host}:{conn.port} could not be reached ({last or 'no address'})",
            decision.rule,
        )

    async def _splice(
        self,
        up: socket.socket,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: Connection,
        *,
        answer: bytes = b"",
        first: bytes = b"",
    ) -> None:
        """Take the sandbox's socket over from its stream, answer the handshake, and splice
        it to ``up`` until the tunnel is over. ``first``: bytes the destination gets first
        (a plain HTTP request's rewritten head)."""
        loop = asyncio.get_running_loop()
        transport = writer.transport
        assert isinstance(transport, asyncio.Transport)
        try:
            await writer.drain()
            if transport.get_write_buffer_size():
                # The SOCKS method reply is still queued: a client that reads nothing.
                raise ConnectionError("the sandbox side does not read")
            transport.pause_reading()
            # Bytes the sandbox sent after its request head (a TLS hello sent early) are in the
            # stream's buffer already: they go first.
            pending = bytes(getattr(reader, "_buffer", b""))
            raw = transport.get_extra_info("socket")
            down = socket.socket(fileno=os.dup(raw.fileno()))
        except BaseException:
            up.close()
            raise
        # The stream's transport closes its own descriptor only (close(2) on one of two
        # descriptors of the connection ends nothing): the tunnel owns the duplicate.
        transport.abort()
        down.setblocking(False)
        try:
            tunnel = Tunnel(loop, self.limits.idle_timeout_s, down, up)
        except OSError:
            raise Refused(503, SOCKS_FAILURE, "fusion-oci egress: out of descriptors") from None
        self._tunnels.add(tunnel)
        try:
            if answer:
                await loop.sock_sendall(down, answer)
            if first or pending:
                await loop.sock_sendall(up, first + pending)
                tunnel.bytes["up"] += len(first) + len(pending)
            tunnel.start()
            await asyncio.shield(tunnel.done)
        except OSError:
            pass
        finally:
            tunnel.close()
            self._tunnels.discard(tunnel)
            conn.bytes_up, conn.bytes_down = tunnel.bytes["up"], tunnel.bytes["down"]

    # -- credentials: the intercepted connection (fusion_oci/egress/mitm.py) --------------------

    async def _intercept(
        self,
        up: socket.socket,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: Connection,
        cred: Brokered,
    ) -> None:
        from fusion_oci.egress.mitm import Session, http_text

        assert self.broker is not None and conn.host is not None
        host = normalize_host(conn.host)
        conn.protocol = "https-brokered"
        timeout = self.limits.handshake_timeout_s
        uwriter: asyncio.StreamWriter | None = None
        ureader: asyncio.StreamReader
        session = Session(
            self.broker,
            cred,
            host,
            lambda ex: self._exchange(conn, cred, ex),
            self.limits.idle_timeout_s,
            port=conn.port or 443,
        )
        try:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await asyncio.wait_for(writer.start_tls(self.broker.server_context(host)), timeout)
            try:
                ureader, opened = await asyncio.wait_for(
                    asyncio.open_connection(
                        sock=up,
                        ssl=self.broker.client_context(cred),
                        server_hostname=host,
                        limit=self.limits.max_header_bytes,
                    ),
                    timeout,
                )
                uwriter = opened
            except (OSError, TimeoutError, ssl.SSLError) as exc:
                up.close()
                conn.reason = (
                    f"fusion-oci egress: TLS to {host} failed ({exc}); the real "
                    "host's certificate is checked against the machine's trust "
                    "store (or the credential's caFile)"
                )
                writer.write(http_text(502, conn.reason, "Bad Gateway"))
                await writer.drain()
                return
            await session.run(reader, writer, ureader, opened)
        except (
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ssl.SSLError,
            ValueError,
            TimeoutError,
        ) as exc:
            conn.reason = conn.reason or f"fusion-oci egress: intercepted connection ended ({exc})"
        finally:
            if uwriter is not None:
                uwriter.close()
            else:
                up.close()
            conn.bytes_up, conn.bytes_down = session.bytes_up, session.bytes_down

    def _exchange(self, conn: Connection, cred: Brokered, ex: Exchange) -> None:
        """One request of an intercepted connection: a ``sandbox:credential`` event."""
        ok = ex.leak is None and ex.refused is None
        reason = ex.refused or (f"leak attempt: {ex.leak}" if ex.leak else None)
        self._credential_event(
            conn,
            cred.spec.name,
            allowed=ok,
            reason=reason,
            details={
                "method": ex.method,
                "path": ex.path,
                "status": ex.status,
                "swapped": ex.swapped,
                "leak": ex.leak is not None,
                **({"refs": ex.refs} if ex.refs else {}),
            },
        )

    def _leak(self, conn: Connection, name: str, where: str) -> None:
        self._credential_event(
            conn,
            name,
            allowed=False,
            reason=f"leak attempt: the sentinel of {name} {where}",
            details={"leak": True, "protocol": conn.protocol},
        )

    def _credential_event(
        self,
        conn: Connection,
        name: str,
        *,
        allowed: bool,
        reason: str | None,
        details: dict[str, object],
    ) -> None:
        self._emit(
            conn,
            type="sandbox:credential",
            allowed=allowed,
            rule=f"sandbox.credentials {name}",
            reason=reason,
            details={"credential": name, **details},
        )

    # -- audit -----------------------------------------------------------------------------

    def _audit(self, conn: Connection) -> None:
        self._emit(
            conn,
            type="sandbox:egress",
            allowed=conn.allowed,
            rule=conn.rule,
            reason=None if conn.allowed else conn.reason,
            bytes_up=conn.bytes_up,
            bytes_down=conn.bytes_down,
            duration_ms=int((time.monotonic() - conn.started) * 1000),
            details={"protocol": conn.protocol},
        )

    def _emit(self, conn: Connection, **fields: Any) -> None:
        """One event about ``conn`` (the task's and the connection's own fields, plus
        ``fields``), within the task's audit budget (:class:`BudgetedEvents`)."""
        if not fields.get("allowed"):
            self._refused()
        self._events.emit(host=conn.host, port=conn.port, address=conn.address, **fields)

    def _task_fields(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "run_id": self.run_id or "-",
            "backend": self.backend,
            "policy_hash": self.policy_hash,
        }


_SHARE_WINDOW_S = 1.0
_REFUSALS_PER_S = 5.0
"""Refusals a second above which a task's loop share is the floor: a build that meets a
denied host now and then stays far below it."""
"""The time constant of a task's measured loop share."""
_NEAR_BUDGET_GAP_S = 0.01
"""Between two connections a task admits while its share is past half its budget and
another task has work under way."""

_PROXIES: weakref.WeakSet[EgressProxy] = weakref.WeakSet()
"""Every proxy started in this process (all on the one proxy loop): whom a task over its
loop budget would hold up."""


PIPELINED_CHECKED = 16
"""Requests read and checked after a plain request's answer, at most (then the connection
ends)."""
PIPELINED_WAIT_S = 1.0
"""How long a plain connection waits for a pipelined request after its answer: the client
was told ``Connection: close``, so it closes at once or sends nothing more."""


def _header(line: str) -> tuple[str, str]:
    name, _, value = line.partition(":")
    return name.strip(), value.strip()


async def _idle(pieces: AsyncIterator[bytes], timeout_s: float) -> AsyncIterator[bytes]:
    """``pieces``, ended by TimeoutError when none comes for ``timeout_s`` (a tunnel's idle
    limit: a long transfer that keeps moving is never cut)."""
    it = aiter(pieces)
    while True:
        try:
            piece = await asyncio.wait_for(anext(it), timeout_s)
        except StopAsyncIteration:
            return
        yield piece


def _send_piece(
    writer: asyncio.StreamWriter, data: bytes, chunked: bool, conn: Connection, way: str
) -> None:
    """Body bytes on, framed as they came (chunked: one chunk), counted for the audit."""
    if not data:
        return
    if way == "up":
        conn.bytes_up += len(data)
    else:
        conn.bytes_down += len(data)
    writer.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)


class _Metered(Coroutine[Any, Any, None]):
    """A coroutine whose every step's time on the loop is charged (``charge(seconds)``): a
    task's share of the loop every task shares is measured, not guessed
    (:attr:`Limits.loop_share`). With ``gate``, a step waits first while ``gate()`` says so
    (a future handed to the Task, as an ``await`` would): the task's steps, not only its new
    connections, are held back while it is over its share."""

    __slots__ = ("_charge", "_coro", "_gate", "_held")

    def __init__(
        self,
        coro: Coroutine[Any, Any, None],
        charge: Callable[[float], None],
        gate: Callable[[], float] | None,
    ) -> None:
        self._coro = coro
        self._charge = charge
        self._gate = gate
        self._held: list[Any] = []
        """The value a held step was to be resumed with (one at most)."""

    def send(self, value: Any) -> Any:
        if self._held:
            value = self._held.pop()
        elif self._gate is not None:
            wait = self._gate()
            if wait > 0:
                self._held.append(value)
                loop = asyncio.get_running_loop()
                later: asyncio.Future[None] = loop.create_future()
                later._asyncio_future_blocking = True  # what a Task waits on

                def wake() -> None:
                    if not later.done():
                        later.set_result(None)

                loop.call_later(wait, wake)
                return later
        start = time.perf_counter()
        try:
            return self._coro.send(value)
        finally:
            self._charge(time.perf_counter() - start)

    def throw(self, *args: Any) -> Any:
        self._held.clear()  # a held step is not resumed: the exception goes in instead
        start = time.perf_counter()
        try:
            return self._coro.throw(*args)
        finally:
            self._charge(time.perf_counter() - start)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, None]:
        return self._coro.__await__()


def _bad_name(problem: str) -> Refused:
    """The refusal of a name the proxy will not decide on (HTTP 403, SOCKS 0x02)."""
    return Refused(
        403, SOCKS_NOT_ALLOWED, f"fusion-oci egress: refused: {problem}", "the host name check"
    )


def _is_address(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True


async def start_proxy(
    *,
    task_id: str,
    rules: EgressRules,
    state_dir: Path,
    audit: AuditLog | None,
    tcp: bool = False,
    resolve_override: Mapping[str, list[str]] | None = None,
    limits: Limits | None = None,
    backend: str = "egress",
    policy_hash: str | None = None,
    broker: Broker | None = None,
) -> EgressProxy:
    """Start a task's proxy on the proxy thread (module docstring); listening when it returns.

    ``resolve_override``: names -> addresses, for tests only (a name it lacks does not
    resolve); None: the host's resolver. ``backend`` / ``policy_hash`` go into the audit.
    """
    proxy = EgressProxy(
        task_id=task_id,
        rules=rules,
        state_dir=state_dir,
        audit=audit,
        tcp=tcp,
        resolve_override=resolve_override,
        limits=limits or Limits(),
        backend=backend,
        policy_hash=policy_hash,
        broker=broker,
    )
    await on_proxy_loop(proxy._start())
    return proxy


__all__ = ["ALLOW_KEY", "EgressProxy", "Limits", "start_proxy"]
