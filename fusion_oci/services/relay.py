"""A task's host-service relays: one listener per grant, each connecting to exactly its grant.

The sandbox side (the exec agent's listener on the sandbox's own 127.0.0.1:PORT, or the relay's
socket bound at the granted path; on landlock the connect supervisor) hands every connection
to the grant's relay socket, in the task's scratch folder. The relay picks nothing from what
the sandbox sends: it connects to the one address the settings name, by number (no name is
resolved, so no rebinding), or to the granted unix socket by its path resolved at prepare,
walked again at every connect without following a symlink (a path replaced by a symlink
between prepare and a connect is refused, not followed). Every connection is one
``sandbox:egress`` audit event with ``details.service``; a task has at most
:attr:`Limits.max_connections` open at once across its grants (more are closed at once,
audited within the task's audit budget).

What happens to the bytes then depends on who dialled:

- a TCP grant's socket (bound in a sandbox with its own network namespace for the exec
  agent's listener) is dialled by the agent with a first byte. ``P``, once before any
  command runs: its **pool** (:meth:`TaskRelays._pool`), over which the relay keeps
  :data:`POOL` unconnected sockets of the host's network namespace in the agent's hands; the
  agent connects one to the grant for each new connection (no host process between the
  command's connect and the service) and reports each connection's end (:data:`RECORD_FORMAT`)
  for its audit event. ``C``: one connection (the pool is empty), where the relay sends one
  byte first. When the dialer is the sandbox's init,
  the agent (:func:`dialled_by_sandbox_init`), the byte carries the **connected socket**
  (``SCM_RIGHTS``) and the agent moves the bytes itself (``splice(2)``, no host process in
  the data path: the issue's speed target); it answers ``K`` and, when the connection ends,
  sends the byte counts (two u64, big-endian) for the audit event. Anyone else (a command
  that dials the bound socket itself), or an agent whose runtime drops ``SCM_RIGHTS`` on a
  host socket (gVisor), gets the byte alone and answers ``S``: the relay splices, as for
  the next case. Host sockets go only to the agent (a pool asked for by anyone else is
  closed) because a host socket in a sandbox is a way out if a command holds it: an
  unconnected one connects anywhere on the host's loopback, and ``connect(AF_UNSPEC)``
  disconnects a connected one; the agent, a non-dumpable PID 1, connects them to its grant
  only and cannot be made to give them away;
- a command itself (a unix grant's socket; landlock's TCP listener): the relay splices the two
  (:mod:`fusion_oci.egress.splice`).

Relays are served on the egress proxy's thread (:mod:`fusion_oci.egress.loop`): they keep
serving between a :class:`~fusion_oci.sandbox.SyncSandbox`'s calls and die with the owner.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import os
import shutil
import socket
import stat
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from socket import socket as Socket
from typing import TYPE_CHECKING, Any

from fusion_oci.egress.budget import BudgetedEvents, TaskStamped
from fusion_oci.egress.loop import on_proxy_loop
from fusion_oci.egress.splice import Tunnel
from fusion_oci.errors import SandboxSetupError, SettingsError
from fusion_oci.host.scratch import make_scratch
from fusion_oci.models.hostservice import DASHBOARD_PORT, HostService, hands_over
from fusion_oci.services.handover import (
    GIVE_AT_ONCE,
    POOL,
    Record,
    dialled_by_sandbox_init,
    hand_over,
    read_records,
)
from fusion_oci.services.netns import NetnsSockets

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog

_TASK_ID_IN_PATH = 24
STOP_DRAIN_S = 0.5
GREETING_MAX = 64
"""Connections to a task's relay sockets still to say their first byte, at once; more are
closed as they come. The agent says it as it connects; a command can dial the bound socket
too, and must not make the owner hold a descriptor for each silent connection it opens."""
GREETING_S = 5.0
"""How long a connection to a relay socket may take to say its first byte."""
"""At stop, how long connections may take to end by themselves (their last records read)."""
_CREDS = struct.Struct("3i")
"""``struct ucred``: pid, uid, gid."""
_CREDS_SPACE = socket.CMSG_SPACE(_CREDS.size)


@dataclass(frozen=True)
class Limits:
    """Bounds per task, across its grants."""

    max_connections: int = 128
    """Open connections at once; more are closed as they come (and audited)."""
    connect_timeout_s: float = 5.0
    idle_timeout_s: float = 3600.0
    """A connection with no byte either way this long is closed (a database pool's idle
    connections live long; a test run rarely idles an hour)."""


@dataclass(frozen=True)
class ContainerUpstream:
    """Where a service container's relay connects: 127.0.0.1 of the container's own
    network namespace (fusion_oci.sidecars starts it)."""

    sockets: NetnsSockets
    rule: str
    """What the audit names as the rule (``policy.services[0] 'db'``)."""
    target: str
    """What the audit names as the address (``db (container NAME)``)."""


@dataclass
class Relay:
    """One grant's listener."""

    index: int
    grant: HostService
    socket: Path
    """The relay's unix socket on the host (bound into the sandbox, or dialled by its agent)."""
    target: str
    """What the relay connects to: the address, or the unix path resolved at prepare."""
    report: Path | None = None
    """landlock, TCP grants: the relay's datagram socket, on which the connect supervisor
    (the task's shim, :attr:`TaskRelays.reporter_pid`) reports each connect it made to the
    grant for the command; None elsewhere."""
    report_socket: Socket | None = None
    tcp_port: int | None = None
    """landlock, a service container's TCP endpoint: the relay's host loopback port the
    connect supervisor redirects the command's connect to (the service is in the container's
    network namespace, not on the host's loopback); None elsewhere."""
    servers: list[asyncio.Future[None]] = field(default_factory=list)
    """The accept loops."""
    upstream: ContainerUpstream | None = None
    """A service container's (``policy.services``): connect inside its network namespace
    instead of to the host; None: a host service."""
    listeners: list[Socket] = field(default_factory=list)
    audited: _GrantFields | None = None
    """The fields every audit event of this grant carries, once made."""


def resolve_unix(grant: HostService, dangerous: bool) -> str:
    """A unix grant's path as it resolves on the host now (symlinks followed once, here),
    refused when that target hands over the host and the grant does not say ``dangerous``."""
    resolved = os.path.realpath(grant.path)
    what = hands_over(grant, resolved)
    if what is not None and not dangerous:
        raise SettingsError(
            "settings error at sandbox.policy.hostServices",
            f"'{grant}' resolves to {resolved}, which hands over the host ({what})",
            f"grant the service's own socket, or write {{address: '{grant}', dangerous: true}}",
        )
    return resolved


def open_unix_target(path: str) -> int:
    """An ``O_PATH`` fd of the socket at ``path`` (absolute, resolved at prepare), walked one
    component at a time without following any symlink: a component replaced by a symlink
    since prepare is refused (ELOOP/ENOTDIR), never followed. Connect through
    ``/proc/self/fd/N``: the name cannot change between this check and the connect."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise OSError(errno.EINVAL, "no socket name", path)
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nxt = os.open(
                part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
            os.close(fd)
            fd = nxt
        last = os.open(parts[-1], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    mode = os.fstat(last).st_mode
    if not stat.S_ISSOCK(mode):
        os.close(last)
        raise OSError(
            errno.ELOOP if stat.S_ISLNK(mode) else errno.ECONNREFUSED,
            "not a socket (a symlink is never followed)",
            path,
        )
    return last


class TaskRelays(TaskStamped):
    """Every relay of one task (module docstring)."""

    def __init__(
        self,
        *,
        task_id: str,
        state_dir: Path,
        grants: list[tuple[HostService, bool]],
        audit: AuditLog | None,
        tcp: bool,
        backend: str,
        policy_hash: str | None,
        limits: Limits | None = None,
        upstreams: Mapping[str, ContainerUpstream] | None = None,
    ) -> None:
        """``upstreams``: canonical endpoint → the service container a relay of that
        endpoint connects into (its grant is then one of ``grants``, never dangerous)."""
        self.task_id = task_id
        self.state_dir = state_dir
        self.audit = audit
        self.backend = backend
        self.policy_hash = policy_hash
        self.limits = limits or Limits()
        self.run_id: str | None = None
        self.reporter_pid: int | None = None
        """landlock: the pid of the task's shim, whose connect supervisor reports the TCP
        grants' connects (:meth:`_report_socket`); set once it started."""
        self.hand_sockets = True
        """Whether host sockets go to the sandbox's agent (a pool, a connected grant). A runtime
        whose sandbox cannot take them (gVisor drops ``SCM_RIGHTS`` from the host, and every
        dialer there looks like its init) sets False at prepare: nothing of the host's is
        sent in, and the relay splices every connection itself."""
        self._tcp = tcp
        self.relays = [
            Relay(
                i,
                grant,
                state_dir / f"{i}.sock",
                resolve_unix(grant, dangerous) if grant.kind == "unix" else grant.address,
            )
            for i, (grant, dangerous) in enumerate(grants)
        ]
        for relay in self.relays:
            relay.upstream = (upstreams or {}).get(str(relay.grant))
        self._open = 0
        self._handlers: set[asyncio.Future[None]] = set()
        self._greeting = 0
        """Connections whose first byte is awaited (:data:`GREETING_MAX`)."""
        self._tunnels: set[Tunnel] = set()
        self._events = BudgetedEvents(
            audit, self.task_fields, "service relays", summary={"service": "*"}
        )
        self._stopped = False

    @property
    def open_connections(self) -> int:
        return self._open

    def sockets(self) -> dict[str, str]:
        """Canonical grant → host path of its relay socket."""
        return {str(r.grant): str(r.socket) for r in self.relays}

    # -- life -----------------------------------------------------------------------------

    async def _start(self) -> None:
        for relay in self.relays:
            with contextlib.suppress(FileNotFoundError):
                relay.socket.unlink()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(str(relay.socket))
                # The folder is private (0700, the host's); the file is bound into the
                # sandbox, whose user may be any uid of its user namespace.
                relay.socket.chmod(0o666)
                # A TCP grant's socket is dialled by the agent only (the sandbox's own
                # loopback listener); a unix grant's by the command itself.
                self._serve(relay, listener, handoff=relay.grant.kind == "tcp")
            except BaseException:
                listener.close()
                raise
            if self._tcp and relay.grant.kind == "tcp":
                if relay.upstream is not None:
                    relay.tcp_port = self._tcp_listener(relay)
                else:
                    self._report_socket(relay)

    def _serve(self, relay: Relay, listener: socket.socket, handoff: bool = False) -> None:
        """Accept on ``listener`` (a raw socket: no stream reads a byte before the splice).
        ``handoff``: its only client is the exec agent, to which the connected socket goes
        (module docstring)."""
        listener.listen(128)
        listener.setblocking(False)
        relay.listeners.append(listener)
        relay.servers.append(asyncio.ensure_future(self._accept_loop(relay, listener, handoff)))

    async def _accept_loop(self, relay: Relay, listener: socket.socket, handoff: bool) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError:
                await asyncio.sleep(0.05)  # EMFILE and kin: let connections end first
                continue
            task = asyncio.ensure_future(self._accept(relay, conn, handoff))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    def _tcp_listener(self, relay: Relay) -> int:
        for _ in range(8):
            # The grant's own family: the command's socket is of it (an AF_INET6 one to ::1).
            v6 = relay.grant.family == 10
            listener = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET)
            listener.bind(("::1" if v6 else "127.0.0.1", 0))
            port = int(listener.getsockname()[1])
            if port != DASHBOARD_PORT:  # never listen there
                self._serve(relay, listener)
                return port
            listener.close()
        raise OSError(errno.EADDRINUSE, "no port for the relay's TCP listener")

    def _report_socket(self, relay: Relay) -> None:
        """landlock: the command's socket is connected to the grant by the connect supervisor
        itself (the command is on the host's network: no hop), which reports each connect
        here; each report is the connection's audit event (no byte counts: the bytes never
        pass through fusion-oci)."""
        path = self.state_dir / f"{relay.index}.report"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(str(path))
            path.chmod(0o600)  # the owner's processes only: the shim is one
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.setblocking(False)
            asyncio.get_running_loop().add_reader(sock.fileno(), self._reported, relay, sock)
        except BaseException:
            sock.close()
            raise
        relay.report, relay.report_socket = path, sock

    def _reported(self, relay: Relay, sock: socket.socket) -> None:
        # One report per wake-up, not a loop until EAGAIN: the command's connects come one
        # at a time, and the failed recvmsg (and its exception) after each was a third of
        # this call; more queued wake the loop again at once (level-triggered).
        try:
            data, ancillary, _, _ = sock.recvmsg(32, _CREDS_SPACE)
        except OSError:  # drained (or closed at stop)
            return
        pid = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = _CREDS.unpack_from(payload)[0]
        # The kernel vouches for the sender's pid: only the task's supervisor reports.
        if pid is None or pid != self.reporter_pid or data[:1] not in (b"O", b"E"):
            return
        err = int(data[1:]) if data[:1] == b"E" and data[1:].isdigit() else 0
        self._audit(
            relay,
            time.monotonic(),
            via="command",
            allowed=not err,
            reason=(
                f"fusion-oci services: {relay.grant} refused the connection ({os.strerror(err)})"
                if err
                else None
            ),
        )

    async def stop(self) -> None:
        """Close the listeners and every open connection; remove the sockets. Idempotent."""
        await on_proxy_loop(self._stop())

    async def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for relay in self.relays:
            for server in relay.servers:
                server.cancel()
            for listener in relay.listeners:
                listener.close()
            if relay.report_socket is not None:
                asyncio.get_running_loop().remove_reader(relay.report_socket.fileno())
                relay.report_socket.close()
        for tunnel in list(self._tunnels):
            tunnel.close()
        if self._handlers:
            # The sandbox is gone by now (the runtime is disposed first): its agent's pool and
            # handed-over connections are at EOF, and the records the agent wrote before it
            # ended are read to the end (their audit events keep their byte counts).
            await asyncio.wait(list(self._handlers), timeout=STOP_DRAIN_S)
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._events.drain()

    # -- one connection -------------------------------------------------------------------

    async def _accept(self, relay: Relay, down: socket.socket, handoff: bool = False) -> None:
        started = time.monotonic()
        down.setblocking(False)
        if self._stopped:
            down.close()
            return
        if handoff:
            # The agent says its byte as it connects: only a dialer that has not yet takes one
            # of the few waiting places, and silent ones hold no more of the owner's
            # descriptors.
            try:
                waits = not down.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except OSError:
                waits = True
            if waits and self._greeting >= GREETING_MAX:
                down.close()
                return
            # The agent says which: 'C' one connection now, 'P' its pool connection.
            self._greeting += waits
            try:
                first = await asyncio.wait_for(
                    asyncio.get_running_loop().sock_recv(down, 1), GREETING_S
                )
            except (OSError, TimeoutError, asyncio.CancelledError):
                first = b""
            finally:
                self._greeting -= waits
            # A service container's pool would be of sockets in its network namespace, which
            # this relay makes only on its helper thread: its connections are handed over
            # connected (the agent dials 'C' once the pool connection is closed).
            if (
                first == b"P"
                and relay.upstream is None
                and self.hand_sockets
                and dialled_by_sandbox_init(down)
            ):
                await self._pool(relay, down)
                return
            if first != b"C":
                down.close()
                return
        if self._open >= self.limits.max_connections:
            down.close()
            self._audit(
                relay,
                started,
                allowed=False,
                reason=(
                    f"fusion-oci services: too many connections for this task "
                    f"({self.limits.max_connections} open at once)"
                ),
            )
            return
        self._open += 1
        moved = {"up": 0, "down": 0}
        via = "relay"
        reason: str | None = None
        connected = False
        try:
            up = await self._connect(relay)
            connected = True
            if handoff:
                handed = await hand_over(down, up, give=self.hand_sockets)
                if handed is not None:
                    moved = handed
                    via = "agent"
                    return
            tunnel = Tunnel(asyncio.get_running_loop(), self.limits.idle_timeout_s, down, up)
            self._tunnels.add(tunnel)
            tunnel.start()
            try:
                await tunnel.done
            finally:
                self._tunnels.discard(tunnel)
                moved = tunnel.bytes
        except asyncio.CancelledError:
            reason = "the relay stopped"
            down.close()
        except (OSError, TimeoutError) as exc:
            reason = f"fusion-oci services: {relay.grant} refused the connection ({_why(exc)})"
            down.close()
        except Exception as exc:  # a bug here must end this connection, never the relay
            reason = f"fusion-oci services: internal error ({exc!r})"
            down.close()
        finally:
            self._open -= 1
            self._audit(
                relay,
                started,
                allowed=connected,
                reason=None if connected else reason,
                bytes_up=moved["up"],
                bytes_down=moved["down"],
                via=via,
            )

    async def _pool(self, relay: Relay, down: socket.socket) -> None:
        """The agent's pool connection (module docstring): keep :data:`POOL` unconnected
        sockets of the grant's family in its hands, one more for each it takes while the
        task's bound allows, and audit each connection from its records."""
        family = socket.AF_INET6 if relay.grant.family == 10 else socket.AF_INET
        opened: dict[int, float] = {}
        owed = 0

        def give(count: int = 1) -> int:
            """``count`` fresh sockets (at most GIVE_AT_ONCE) in one message; how many went."""
            fresh = [socket.socket(family, socket.SOCK_STREAM) for _ in range(count)]
            try:
                for sock in fresh:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                rights = array.array("i", [sock.fileno() for sock in fresh])
                down.sendmsg([b"p"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
                return count
            except OSError:
                return 0
            finally:
                for sock in fresh:
                    sock.close()

        for _ in range(0, POOL, GIVE_AT_ONCE):
            owed += GIVE_AT_ONCE - give(GIVE_AT_ONCE)

        def arrived(records: list[Record]) -> None:
            """Every record one read brought: the pool refilled first (the next connections
            wait for it, not for their audit), in one message where the agent sent its
            records at once, then each connection audited."""
            nonlocal owed
            now = time.monotonic()
            audits: list[tuple[float, int, int | None, int | None, str]] = []
            for kind, ident, up, dn, err in records:
                if kind == b"O":
                    opened[ident] = now
                    self._open += 1
                    owed += 1
                elif kind == b"H":
                    # Taken and handed to the command (its connect answered with this socket,
                    # in its own place): the bytes never pass through the agent, and the
                    # connection is the command's, bound by its own descriptors from here on.
                    owed += 1
                    audits.append((now, 0, None, None, "command"))
                elif kind == b"D" and ident in opened:
                    self._open -= 1
                    audits.append((opened.pop(ident), err, up, dn, "agent"))
            # The pool counts against the task's bound: the agent holds at most
            # max_connections sockets, connected or not.
            while owed and self._open + POOL <= self.limits.max_connections:
                count = min(owed, GIVE_AT_ONCE)
                if not give(count):
                    break
                owed -= count
            for since, error, sent, got, via in audits:
                self._audit(
                    relay,
                    since,
                    allowed=not error,
                    reason=(
                        f"fusion-oci services: {relay.grant} refused the connection "
                        f"({os.strerror(error)})"
                        if error
                        else None
                    ),
                    bytes_up=sent,
                    bytes_down=got,
                    via=via,
                )

        try:
            await read_records(down, arrived)
        except (OSError, asyncio.CancelledError):
            return
        finally:
            down.close()  # the agent closes every connection of this pool
            for since in opened.values():
                self._open -= 1
                self._audit(
                    relay,
                    since,
                    allowed=True,
                    reason=None,
                    bytes_up=None,
                    bytes_down=None,
                    via="agent",
                )
            opened.clear()

    async def _connected(self, sock: socket.socket, address: Any) -> None:
        """Connect the non-blocking ``sock`` within the connect timeout. Spelled out rather
        than ``wait_for(sock_connect())``: a loopback connect is done at the first writable
        wake-up, and the wrapper's task per connection was a measurable part of what a
        granted connection adds (docs/performance.md)."""
        err = sock.connect_ex(address)
        if err == errno.EINPROGRESS:
            loop = asyncio.get_running_loop()
            ready: asyncio.Future[None] = loop.create_future()

            def settle(exc: BaseException | None) -> None:
                if ready.done():
                    return
                if exc is None:
                    ready.set_result(None)
                else:
                    ready.set_exception(exc)

            loop.add_writer(sock.fileno(), settle, None)
            timer = loop.call_later(
                self.limits.connect_timeout_s, settle, TimeoutError("no answer in time")
            )
            try:
                await ready
            finally:
                loop.remove_writer(sock.fileno())
                timer.cancel()
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))

    async def _connect(self, relay: Relay) -> socket.socket:
        grant = relay.grant
        if relay.upstream is not None:
            return await relay.upstream.sockets.connect(grant.port, self.limits.connect_timeout_s)
        if grant.kind == "unix":
            fd = open_unix_target(relay.target)
            try:
                up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                up.setblocking(False)
                try:
                    await self._connected(up, f"/proc/self/fd/{fd}")
                except BaseException:
                    up.close()
                    raise
            finally:
                os.close(fd)
            return up
        family = socket.AF_INET6 if grant.family == 10 else socket.AF_INET
        up = socket.socket(family, socket.SOCK_STREAM)
        up.setblocking(False)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await self._connected(up, (grant.address, grant.port))
        except BaseException:
            up.close()
            raise
        return up

    # -- audit ----------------------------------------------------------------------------

    def _audit(self, relay: Relay, started: float, via: str = "relay", **fields: Any) -> None:
        """``via``: who moved the bytes, ``agent`` (it holds the connected socket),
        ``relay`` (this process spliced them) or ``command`` (landlock: its own socket,
        connected to the grant by the connect supervisor)."""
        if self.audit is None:
            return
        if relay.audited is None:
            relay.audited = _GrantFields.of(relay)
        same = relay.audited
        self._events.emit(
            **same.fields,
            duration_ms=int((time.monotonic() - started) * 1000),
            details={**same.details, "via": via, **same.container},
            **fields,
        )


@dataclass(frozen=True)
class _GrantFields:
    """What every audit event of one relay's connections says the same: made once per relay,
    not per connection (``details`` is made anew for each event, with its ``via``)."""

    fields: dict[str, Any]
    details: dict[str, str]
    container: dict[str, str]

    @staticmethod
    def of(relay: Relay) -> _GrantFields:
        grant, upstream = relay.grant, relay.upstream
        return _GrantFields(
            fields={
                "type": "sandbox:egress",
                "host": grant.path if grant.kind == "unix" else grant.address,
                "port": grant.port if grant.kind == "tcp" else None,
                "address": upstream.target if upstream else relay.target,
                "rule": (
                    upstream.rule if upstream else f"policy.hostServices[{relay.index}] '{grant}'"
                ),
            },
            details={"service": str(grant), "protocol": grant.kind},
            container={"container": upstream.target} if upstream else {},
        )


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, OSError) and exc.errno is not None:
        return os.strerror(exc.errno)
    return str(exc) or type(exc).__name__


async def start_relays(
    *,
    task_id: str,
    grants: list[tuple[HostService, bool]],
    audit: AuditLog | None,
    tcp: bool,
    backend: str,
    policy_hash: str | None,
    run_id: str | None = None,
    limits: Limits | None = None,
    upstreams: Mapping[str, ContainerUpstream] | None = None,
) -> TaskRelays:
    """Make the task's scratch folder and start one relay per grant on the proxy thread;
    listening when it returns."""
    state_dir = make_scratch("services", task_id[:_TASK_ID_IN_PATH])
    try:
        relays = TaskRelays(
            task_id=task_id,
            state_dir=state_dir,
            grants=grants,
            audit=audit,
            tcp=tcp,
            backend=backend,
            policy_hash=policy_hash,
            limits=limits,
            upstreams=upstreams,
        )
        relays.set_run(run_id)
        await on_proxy_loop(relays._start())
    except OSError as exc:
        shutil.rmtree(state_dir, ignore_errors=True)
        raise SandboxSetupError(
            "the task's host-service relays could not start",
            f"{state_dir}: {exc}",
            "a unix socket path has at most 107 bytes: set TMPDIR to a short folder (e.g. /tmp)",
        ) from exc
    except BaseException:
        shutil.rmtree(state_dir, ignore_errors=True)
        raise
    return relays


async def stop_relays(relays: TaskRelays) -> None:
    """Stop every relay (open connections closed) and remove the folder."""
    try:
        await relays.stop()
    finally:
        shutil.rmtree(relays.state_dir, ignore_errors=True)
