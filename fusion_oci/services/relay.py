"""A task's host-service relays: one listener per grant, each connecting to exactly its grant.

The sandbox side (the exec agent's listener on the sandbox's own 127.0.0.1:PORT, or the relay's
socket bound at the granted path; on landlock the connect supervisor) hands every connection
to the grant's relay socket, in the task's scratch folder. The relay picks nothing from what
the sandbox sends: it connects to the one address the settings name, by number (no name is
resolved, so no rebinding), or to the granted unix socket by its path resolved at prepare,
walked again at every connect without following a symlink (a path replaced by a symlink
between prepare and a connect is refused, not followed), and splices the two
(:mod:`fusion_oci.egress.splice`). Every connection is one ``sandbox:egress`` audit event with
``details.service``; a task has at most :attr:`Limits.max_connections` open at once across its
grants (more are closed at once, audited within the task's audit budget).

Relays are served on the egress proxy's thread (:mod:`fusion_oci.egress.loop`): they keep
serving between a :class:`~fusion_oci.sandbox.SyncSandbox`'s calls and die with the owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import socket
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from socket import socket as Socket
from typing import TYPE_CHECKING, Any

from fusion_oci.egress.budget import BudgetedEvents
from fusion_oci.egress.loop import on_proxy_loop
from fusion_oci.egress.splice import Tunnel
from fusion_oci.errors import SandboxSetupError, SettingsError
from fusion_oci.hostservice import DASHBOARD_PORT, HostService, hands_over
from fusion_oci.scratch import make_scratch
from fusion_oci.services.netns import NetnsSockets

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog

_TASK_ID_IN_PATH = 24


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
    tcp_port: int | None = None
    """landlock, TCP grants: the relay's host 127.0.0.1 port the connect supervisor redirects
    the command's connect to; None elsewhere."""
    servers: list[asyncio.Future[None]] = field(default_factory=list)
    """The accept loops."""
    upstream: ContainerUpstream | None = None
    """A service container's (``policy.services``): connect inside its network namespace
    instead of to the host; None: a host service."""
    listeners: list[Socket] = field(default_factory=list)


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


class TaskRelays:
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
        self._tunnels: set[Tunnel] = set()
        self._events = BudgetedEvents(
            audit, self._task_fields, "service relays", summary={"service": "*"}
        )
        self._stopped = False

    def set_run(self, run_id: str | None) -> None:
        self.run_id = run_id

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
                self._serve(relay, listener)
            except BaseException:
                listener.close()
                raise
            if self._tcp and relay.grant.kind == "tcp":
                relay.tcp_port = self._tcp_listener(relay)

    def _serve(self, relay: Relay, listener: socket.socket) -> None:
        """Accept on ``listener`` (a raw socket: no stream reads a byte before the splice)."""
        listener.listen(128)
        listener.setblocking(False)
        relay.listeners.append(listener)
        relay.servers.append(asyncio.ensure_future(self._accept_loop(relay, listener)))

    async def _accept_loop(self, relay: Relay, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError:
                await asyncio.sleep(0.05)  # EMFILE and kin: let connections end first
                continue
            task = asyncio.ensure_future(self._accept(relay, conn))
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
        for tunnel in list(self._tunnels):
            tunnel.close()
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._events.drain()

    # -- one connection -------------------------------------------------------------------

    async def _accept(self, relay: Relay, down: socket.socket) -> None:
        started = time.monotonic()
        down.setblocking(False)
        if self._stopped:
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
        reason: str | None = None
        connected = False
        try:
            up = await self._connect(relay)
            connected = True
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
            )

    async def _connect(self, relay: Relay) -> socket.socket:
        loop = asyncio.get_running_loop()
        grant = relay.grant
        if relay.upstream is not None:
            return await relay.upstream.sockets.connect(grant.port, self.limits.connect_timeout_s)
        if grant.kind == "unix":
            fd = open_unix_target(relay.target)
            try:
                up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                up.setblocking(False)
                try:
                    await asyncio.wait_for(
                        loop.sock_connect(up, f"/proc/self/fd/{fd}"),
                        self.limits.connect_timeout_s,
                    )
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
            await asyncio.wait_for(
                loop.sock_connect(up, (grant.address, grant.port)), self.limits.connect_timeout_s
            )
        except BaseException:
            up.close()
            raise
        return up

    # -- audit ----------------------------------------------------------------------------

    def _audit(self, relay: Relay, started: float, **fields: Any) -> None:
        if self.audit is None:
            return
        grant = relay.grant
        event = {
            "type": "sandbox:egress",
            "host": grant.path if grant.kind == "unix" else grant.address,
            "port": grant.port if grant.kind == "tcp" else None,
            "address": relay.upstream.target if relay.upstream else relay.target,
            "rule": (
                relay.upstream.rule
                if relay.upstream
                else f"policy.hostServices[{relay.index}] '{grant}'"
            ),
            "duration_ms": int((time.monotonic() - started) * 1000),
            "details": {
                "service": str(grant),
                "protocol": grant.kind,
                **({"container": relay.upstream.target} if relay.upstream else {}),
            },
            **fields,
        }
        self._events.emit(**event)

    def _task_fields(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "run_id": self.run_id or "-",
            "backend": self.backend,
            "policy_hash": self.policy_hash,
        }


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
