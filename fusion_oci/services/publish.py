"""A task's published ports (``policy.publishPorts``): the host side.

For each entry the task's owner listens on the host at ``ADDRESS:HOSTPORT`` (the host's
127.0.0.1 unless the settings' mapping names another address; a free port when the entry
names none, never 4040) from prepare to dispose. Each accepted connection is connected to
``127.0.0.1:PORT`` **inside the sandbox's own network namespace** — the socket is made by a
thread that entered it (:class:`~fusion_oci.services.netns.NetnsSockets`, ``setns(2)`` on the
``/proc/PID/ns/net`` of the sandbox's init, held open from prepare) — and the two are spliced
in the kernel (:class:`~fusion_oci.egress.splice.Tunnel`). So:

- only the named ports are reachable: the owner connects to ``PORT`` of the entry its
  listener serves, nothing the client sends picks another; nothing inside the sandbox gets
  any socket or address of the host (the command sees a connection from its own
  127.0.0.1);
- it works wherever the sandbox has a network namespace the owner may enter (bubblewrap,
  oci/runc, podman, docker: a container engine's ``-p`` could not reach a server bound to
  the container's own loopback, which is where dev servers listen); gVisor's loopback is in
  its sentry, not in a namespace of the host, and landlock has no namespace of its own:
  their checks refuse ``publishPorts`` with the reason (docs/security.md);
- every connection is one ``sandbox:inbound`` audit event (the peer, the published port,
  the bytes each way), within the task's audit budget.

Served on the egress proxy's thread (:mod:`fusion_oci.egress.loop`), as the relays are: they
keep serving between a :class:`~fusion_oci.sandbox.SyncSandbox`'s calls and die with the
owner (a listener is a socket of this process: nothing is left after a crash).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_oci.egress.budget import BudgetedEvents
from fusion_oci.egress.loop import on_proxy_loop
from fusion_oci.egress.splice import Tunnel
from fusion_oci.errors import SandboxSetupError
from fusion_oci.hostservice import DASHBOARD_PORT
from fusion_oci.publishport import PublishedPort
from fusion_oci.services.netns import NetnsSockets

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog

SPARE = 8
"""Unconnected sockets made in the sandbox's namespace ahead of need: a connection takes one
instead of waiting for the namespace's thread (measured: that hop was most of what a
connection added, docs/performance.md)."""
MAX_CONNECTIONS = 128
"""Open inbound connections per task at once; more are closed as they come (and audited)."""
CONNECT_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 3600.0


@dataclass
class Published:
    """One entry's listener on the host."""

    index: int
    entry: PublishedPort
    host_port: int
    """The port it listens on (the named one, or the free one chosen)."""
    listener: socket.socket
    server: asyncio.Future[None] | None = None

    @property
    def where(self) -> str:
        return self.entry.host(self.host_port)

    def report(self) -> dict[str, Any]:
        """What the prepare result, the audit and ``fusion-oci`` show of it."""
        return {
            "port": self.entry.port,
            "hostPort": self.host_port,
            "address": self.entry.address,
            "url": f"http://{self.where}/",
        }


@dataclass
class _Open:
    tunnels: set[Tunnel] = field(default_factory=set)
    handlers: set[asyncio.Future[None]] = field(default_factory=set)
    count: int = 0


def _listen(entry: PublishedPort) -> tuple[socket.socket, int]:
    family = socket.AF_INET6 if entry.family == 10 else socket.AF_INET
    for _ in range(8):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            # No SO_REUSEADDR: a port another process holds is an error, never shared.
            sock.bind((entry.address, entry.host_port))
            port = int(sock.getsockname()[1])
            if port == DASHBOARD_PORT:  # a free port the kernel chose: never the dashboard's
                sock.close()
                continue
            sock.listen(128)
            sock.setblocking(False)
            return sock, port
        except BaseException:
            sock.close()
            raise
    raise OSError(errno.EADDRINUSE, "no free port")


class TaskPorts:
    """Every published port of one task (module docstring)."""

    def __init__(
        self,
        *,
        task_id: str,
        entries: list[PublishedPort],
        audit: AuditLog | None,
        backend: str,
        policy_hash: str | None,
        run_id: str | None = None,
    ) -> None:
        self.task_id = task_id
        self.entries = entries
        self.audit = audit
        self.backend = backend
        self.policy_hash = policy_hash
        self.run_id = run_id
        self.ports: list[Published] = []
        self._netns: NetnsSockets | None = None
        self._spare: list[socket.socket] = []
        self._refilling: asyncio.Future[None] | None = None
        self._open = _Open()
        self._events = BudgetedEvents(
            audit, self._task_fields, "published ports", summary={"published": "*"}
        )
        self._stopped = False

    def set_run(self, run_id: str | None) -> None:
        self.run_id = run_id

    def report(self) -> list[dict[str, Any]]:
        """Each published port: ``port`` (inside), ``hostPort``, ``address``, ``url``."""
        return [p.report() for p in self.ports]

    # -- life -----------------------------------------------------------------------------

    def _bind(self) -> None:
        """Listen on every entry's host address and port, or on none (a port taken)."""
        try:
            for i, entry in enumerate(self.entries):
                sock, port = _listen(entry)
                self.ports.append(Published(i, entry, port, sock))
        except OSError:
            for p in self.ports:
                p.listener.close()
            self.ports.clear()
            raise

    async def _attach(self, pid: int) -> None:
        # Accepting starts only with the namespace held: no connection is ever served by
        # anything but the sandbox's own loopback.
        self._netns = NetnsSockets.of_pid(pid, "publish")
        await self._refill()
        for p in self.ports:
            p.server = asyncio.ensure_future(self._accept_loop(p))

    async def stop(self) -> None:
        """Close the listeners and every open connection; let go of the namespace.
        Idempotent."""
        await on_proxy_loop(self._stop())

    async def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for p in self.ports:
            if p.server is not None:
                p.server.cancel()
            p.listener.close()
        for tunnel in list(self._open.tunnels):
            tunnel.close()
        for task in list(self._open.handlers):
            task.cancel()
        if self._open.handlers:
            await asyncio.gather(*self._open.handlers, return_exceptions=True)
        if self._refilling is not None:
            self._refilling.cancel()
            with contextlib.suppress(BaseException):
                await self._refilling
        for sock in self._spare:
            sock.close()
        self._spare.clear()
        if self._netns is not None:
            self._netns.close()
        await self._events.drain()

    async def _refill(self) -> None:
        assert self._netns is not None
        while len(self._spare) < SPARE and not self._stopped:
            fresh = await self._netns.new_socket()
            if self._stopped:
                fresh.close()
                return
            fresh.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spare.append(fresh)

    async def _socket(self) -> socket.socket:
        """An unconnected socket of the sandbox's namespace: a spare one (the spares are
        made again in the background), else one made now."""
        assert self._netns is not None
        if self._refilling is None or self._refilling.done():
            self._refilling = asyncio.ensure_future(self._refill())
        if self._spare:
            return self._spare.pop()
        sock = await self._netns.new_socket()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    async def _connect(self, port: int) -> socket.socket:
        """A socket connected to the sandbox's ``127.0.0.1:port``, within the timeout. A
        loopback connect completes at once or is refused: no task per connection for it."""
        sock = await self._socket()
        try:
            err = sock.connect_ex(("127.0.0.1", port))
            if err == errno.EINPROGRESS:
                loop = asyncio.get_running_loop()
                ready: asyncio.Future[None] = loop.create_future()

                def settle() -> None:
                    if not ready.done():
                        ready.set_result(None)

                loop.add_writer(sock.fileno(), settle)
                try:
                    await asyncio.wait_for(ready, CONNECT_TIMEOUT_S)
                finally:
                    loop.remove_writer(sock.fileno())
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
        except BaseException:
            sock.close()
            raise
        return sock

    # -- one connection -------------------------------------------------------------------

    async def _accept_loop(self, p: Published) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(p.listener)
            except OSError:
                await asyncio.sleep(0.05)  # EMFILE and kin: let connections end first
                continue
            task = asyncio.ensure_future(self._serve(p, conn, peer))
            self._open.handlers.add(task)
            task.add_done_callback(self._open.handlers.discard)

    async def _serve(self, p: Published, down: socket.socket, peer: Any) -> None:
        started = time.monotonic()
        down.setblocking(False)
        peer_text = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self._open.count >= MAX_CONNECTIONS or self._stopped or self._netns is None:
            down.close()
            self._audit(
                p,
                started,
                peer_text,
                allowed=False,
                reason=(
                    "fusion-oci publishPorts: too many inbound connections for this task "
                    f"({MAX_CONNECTIONS} open at once)"
                ),
            )
            return
        self._open.count += 1
        moved = {"up": 0, "down": 0}
        reason: str | None = None
        connected = False
        try:
            up = await self._connect(p.entry.port)
            connected = True
            tunnel = Tunnel(asyncio.get_running_loop(), IDLE_TIMEOUT_S, down, up)
            self._open.tunnels.add(tunnel)
            tunnel.start()
            try:
                await tunnel.done
            finally:
                self._open.tunnels.discard(tunnel)
                moved = tunnel.bytes
        except asyncio.CancelledError:
            reason = "the task's published ports closed"
            down.close()
        except (OSError, TimeoutError) as exc:
            why = (
                "no answer in time"
                if isinstance(exc, TimeoutError)
                else os.strerror(exc.errno)
                if exc.errno
                else str(exc)
            )
            reason = (
                f"fusion-oci publishPorts: nothing accepted the connection at the sandbox's "
                f"127.0.0.1:{p.entry.port} ({why})"
            )
            down.close()
        except Exception as exc:  # a bug here must end this connection, never the listener
            reason = f"fusion-oci publishPorts: internal error ({exc!r})"
            down.close()
        finally:
            self._open.count -= 1
            self._audit(
                p,
                started,
                peer_text,
                allowed=connected,
                reason=None if connected else reason,
                bytes_up=moved["up"],
                bytes_down=moved["down"],
            )

    # -- audit ----------------------------------------------------------------------------

    def _audit(self, p: Published, started: float, peer: str, **fields: Any) -> None:
        """One ``sandbox:inbound`` event: ``host``/``port`` the sandbox's side (its own
        loopback), ``address`` the host's listener, ``bytes_up`` towards the sandbox."""
        if self.audit is None:
            return
        self._events.emit(
            type="sandbox:inbound",
            host="127.0.0.1",
            port=p.entry.port,
            address=p.where,
            rule=f"policy.publishPorts[{p.index}] '{p.entry}'",
            duration_ms=int((time.monotonic() - started) * 1000),
            details={"published": p.where, "peer": peer},
            **fields,
        )

    def _task_fields(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "run_id": self.run_id or "-",
            "backend": self.backend,
            "policy_hash": self.policy_hash,
        }


def in_sandbox_netns(root: int) -> int:
    """``root`` or the first of its descendants (breadth first) in another network namespace
    than this process's: the sandbox's (bwrap's child; a container's init is one itself).
    OSError ESRCH when there is none (the sandbox is gone)."""
    ours = Path("/proc/self/ns/net").stat().st_ino
    queue, seen = [root], set()
    while queue:
        pid = queue.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        with contextlib.suppress(OSError, ValueError):
            if Path(f"/proc/{pid}/ns/net").stat().st_ino != ours:
                return pid
            for task in Path(f"/proc/{pid}/task").iterdir():
                queue += [int(c) for c in (task / "children").read_text().split()]
    raise OSError(errno.ESRCH, f"no process of the sandbox under pid {root}")


async def bind_ports(
    *,
    task_id: str,
    entries: list[PublishedPort],
    audit: AuditLog | None,
    backend: str,
    policy_hash: str | None,
    run_id: str | None = None,
) -> TaskPorts:
    """Listen on every entry's host port (before the sandbox starts: a named port another
    process holds fails prepare before anything is made). Nothing is accepted until
    :func:`attach_ports`."""
    ports = TaskPorts(
        task_id=task_id,
        entries=entries,
        audit=audit,
        backend=backend,
        policy_hash=policy_hash,
        run_id=run_id,
    )
    try:
        await on_proxy_loop(_bind_on_loop(ports))
    except OSError as exc:
        raise SandboxSetupError(
            "the task's published ports could not listen on the host",
            f"{exc}",
            "another process holds the host port: name another one in "
            "sandbox.policy.publishPorts ('8081:80'), or only the sandbox's port ('80') for a "
            "free one",
        ) from exc
    return ports


async def _bind_on_loop(ports: TaskPorts) -> None:
    ports._bind()


async def attach_ports(ports: TaskPorts, pid: int) -> None:
    """Start serving: each connection into the sandbox's network namespace (``pid`` or its
    first descendant in one, :func:`in_sandbox_netns`)."""
    try:
        await on_proxy_loop(ports._attach(in_sandbox_netns(pid)))
    except OSError as exc:
        with contextlib.suppress(Exception):
            await ports.stop()
        raise SandboxSetupError(
            "the task's published ports cannot reach the sandbox's network namespace",
            f"/proc/{pid}/ns/net: {exc}",
            "entering a sandbox's network namespace needs CAP_SYS_ADMIN (run fusion-oci as "
            "root), or drop sandbox.policy.publishPorts",
        ) from exc


__all__ = ["Published", "TaskPorts", "attach_ports", "bind_ports", "in_sandbox_netns"]
