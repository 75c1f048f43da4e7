"""The task's egress proxy: HTTP CONNECT, plain HTTP and SOCKS5 on one listener.

This module is the core: the listeners and their limits, deciding, resolving and connecting,
splicing, the intercepted (brokered) connection, the audit events. The first byte of a
connection picks its front (0x05: :mod:`.socks_front`, else :mod:`.http_front`); each reads
and checks its protocol's request and hands the core a :class:`~.wire.Connection`. For every
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
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_oci.egress import http_front, socks_front
from fusion_oci.egress.budget import BudgetedEvents, TaskStamped
from fusion_oci.egress.loop import on_proxy_loop
from fusion_oci.egress.meter import LoopMeter, Metered
from fusion_oci.egress.rules import ALLOW_KEY, DASHBOARD_PORT, Decision, EgressRules
from fusion_oci.egress.splice import Tunnel
from fusion_oci.egress.wire import (
    SOCKS_FAILURE,
    SOCKS_HOST_UNREACHABLE,
    SOCKS_NET_UNREACHABLE,
    SOCKS_NOT_ALLOWED,
    SOCKS_REFUSED,
    SOCKS_TTL_EXPIRED,
    Connection,
    Limits,
    Refused,
)
from fusion_oci.models.hostpattern import normalize_host

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog
    from fusion_oci.egress.credentials import Broker, Brokered
    from fusion_oci.egress.mitm import Exchange

SOCKET_NAME = "egress.sock"
_BACKLOG = 100
"""Connections the kernel holds for a listener while the task's accept rate waits."""

Resolver = Callable[[str, int], Awaitable[list[str]]]


class EgressProxy(TaskStamped):
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
        self.meter = LoopMeter(limits.loop_share)
        """This task's share of the proxy loop every task shares (:mod:`.meter`)."""
        self._closed_at_accept = 0
        """Connections closed at accept (over ``max_connections``) since the last event."""
        self._last_cap_event = 0.0
        self._handlers: set[asyncio.Task[None]] = set()
        self._tunnels: set[Tunnel] = set()
        self._events = BudgetedEvents(audit, self.task_fields, "proxy")
        self._stopped = False

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
        self.meter.register()
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
            loop.create_task(Metered(self._accept_loop(sock), self.meter.charge, None))
        )

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
            wait = self.meter.over_budget()
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
            meter = self.meter
            task = loop.create_task(Metered(self._accepted(sock), meter.charge, meter.step_wait))
            meter.admitted_at = time.monotonic()
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
        self.meter.unregister()
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
        # The cap is applied at accept (_accept_loop), before any read.
        try:
            first = await asyncio.wait_for(reader.readexactly(1), self.limits.handshake_timeout_s)
        except TimeoutError:
            return
        # From its first byte to its end a connection is the task's wanting the loop (a
        # connection that sends nothing is not): what holds a neighbour to its budget.
        self.meter.working += 1
        try:
            if first == b"\x05":
                conn.protocol = "socks5"
                await socks_front.serve_socks(self, reader, writer, conn)
            else:
                conn.protocol = "http"
                await http_front.serve_http(self, first, reader, writer, conn)
        finally:
            self.meter.working -= 1

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

    async def open(self, conn: Connection) -> socket.socket:
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

    async def splice(
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

    async def intercept(
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

    def leak(self, conn: Connection, name: str, where: str) -> None:
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
            self.meter.refused()
        self._events.emit(host=conn.host, port=conn.port, address=conn.address, **fields)


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
