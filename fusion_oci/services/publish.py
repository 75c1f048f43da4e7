"""A task's published ports (``policy.publishPorts``): the host side.

For each entry the task's owner listens on the host at ``ADDRESS:HOSTPORT`` (the host's
127.0.0.1 unless the settings' mapping names another address; a free port when the entry
names none, never 4040) from prepare to dispose, and binds a unix socket, the port's
**relay**, into the sandbox (``/run/fusion-oci/publish/N.sock``). Before any command runs the
sandbox's exec agent dials it and sends ``I`` (agent.c, ``--publish PORT=PATH``); the relay
keeps that connection only when the dialer is the sandbox's init
(:func:`~fusion_oci.services.handover.dialled_by_sandbox_init`: a command never is). Then each
connection a host client makes to the published port is **handed to the agent** (``a`` +
``SCM_RIGHTS``, the accepted socket itself), which connects to ``127.0.0.1:PORT`` in the
sandbox's own network namespace and splices the two with ``splice(2)`` in C: no host process
in the data path, no privilege needed (no ``setns``). The agent reports each connection on
the same connection (records ``O``: taken, ``D``: its end, the bytes each way, the connect's
errno; :data:`~fusion_oci.services.handover.RECORD` bytes, as a host service's pool), and each
is one ``sandbox:inbound`` audit event, within the task's audit budget.

So only the named ports are reachable: the agent connects the published port's own
``PORT`` (its argv), nothing a client sends picks another; and nothing of the host reaches a
command: it only accepts a connection on its own loopback (the peer it sees is its own
127.0.0.1), the host's socket stays in the agent, a non-dumpable PID 1.

Works wherever the agent is the sandbox's init with a network namespace of its own
(bubblewrap, oci/runc, podman and docker warm, rootful and rootless alike).

gVisor drops ``SCM_RIGHTS`` from the host: there (its runtime sets
:attr:`TaskPorts.dial_back` at prepare) the relay **dials back** instead. For each client it
sends the agent ``c`` and a fresh random token on the agent's connection; the agent dials
the relay's socket again, sends ``A`` and that token, connects ``127.0.0.1:PORT`` in the
sandbox and moves the bytes; the relay moves them on between its client and that connection
(a host process in the data path, as for a host service under gVisor). Nothing of the host's
is handed in, so a command that took the agent's place would be given only what the
published port gives a server inside anyway; and it cannot: the agent dials before any
command exists (one agent connection a port), and a command that dials the relay cannot name
a waiting client (it never sees a token: the agent is not dumpable). Under gVisor every
dialer is gVisor's own process to the host (the sentry or its gofer, the init of its own pid
namespace: ``dialled_by_sandbox_init`` cannot tell the agent from a command there), so the
relay's rule that the first ``I`` is the agent's is what holds.

A sandbox that descriptors cannot reach takes its ports another way: its runtime gives
:meth:`TaskPorts.carry` a carrier, and each connection is handed to that instead, with the
same limits and the same audit events. kubernetes (a pod on a cluster node) carries it over
the agent's stream to the pod's loopback (mux.py ``--publish-port``). landlock (no network
namespace: the command is on the host's own) has the reaper's supervisor bind the command's
server socket to host loopback at an ephemeral port when it binds a published port, and
carries each client there, after checking that the port's listener is still the command's
socket (fusion_oci/runtimes/landlock/published.py).

Served on the egress proxy's thread (:mod:`fusion_oci.egress.loop`), as the relays are: they
keep serving between a :class:`~fusion_oci.sandbox.SyncSandbox`'s calls and die with the
owner (listeners are sockets of this process; the scratch folder carries its owner for
``gc``).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import errno
import os
import shutil
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_oci.egress.budget import BudgetedEvents, TaskStamped
from fusion_oci.egress.loop import on_proxy_loop, proxy_loop
from fusion_oci.errors import SandboxSetupError
from fusion_oci.host.scratch import make_scratch
from fusion_oci.models.hostservice import DASHBOARD_PORT
from fusion_oci.models.publishport import PublishedPort
from fusion_oci.services.handover import (
    agent_records,
    dialled_by_sandbox_init,
)

if TYPE_CHECKING:
    import concurrent.futures
    from collections.abc import Callable, Coroutine

    from fusion_oci.audit import AuditLog

    Carrier = Callable[[int, socket.socket], Coroutine[Any, Any, tuple[int, int, int]]]
    """Carries one connection (taken over) to the sandbox's 127.0.0.1:PORT: (bytes towards
    the sandbox, bytes back, the connect's errno) once it ends."""

MAX_CONNECTIONS = 128
"""Open inbound connections per task at once; more are closed as they come (and audited)."""
AGENT_WAIT_S = 5.0
"""How long prepare waits for the agent to take every published port (it dials before its
hello, so normally it has when the runtime's prepare returns)."""
STOP_DRAIN_S = 1.0
"""At stop: how long the agent's last records are waited for (it answers at once; a sandbox
that is gone has closed its end already)."""
_TASK_ID_IN_PATH = 24
GREETING_MAX = 16
"""Connections to a port's relay socket still to say their first byte, at once; more are
closed as they come (a command can dial the bound socket: its silent connections must not
pile up in the owner)."""
DIALBACK_TOKEN = 16
"""Bytes of a dial-back token (agent.c's DIALBACK_TOKEN)."""
_PUMP_CHUNK = 256 * 1024


def _said_whole(conn: socket.socket) -> bool:
    """Whether the dialer's greeting (a byte; after an ``A`` its token too) is already there
    to read, looked at without taking it."""
    try:
        seen = conn.recv(1 + DIALBACK_TOKEN, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False
    return bool(seen) and (seen[:1] != b"A" or len(seen) == 1 + DIALBACK_TOKEN)


async def _greeting(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bytes:
    """A relay dialer's first byte, and after an ``A`` its dial-back token (short: the
    dialer closed first)."""
    said = await loop.sock_recv(conn, 1)
    want = 1 + DIALBACK_TOKEN if said == b"A" else 1
    while said and len(said) < want:
        part = await loop.sock_recv(conn, want - len(said))
        if not part:
            break
        said += part
    return said


async def _pump(loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket) -> None:
    """``src``'s bytes to ``dst`` until its end, then ``dst``'s write side shut (the other
    direction goes on: a half-close passes through). A broken side ends both."""
    try:
        while part := await loop.sock_recv(src, _PUMP_CHUNK):
            await loop.sock_sendall(dst, part)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        with contextlib.suppress(OSError):
            src.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)


@dataclass
class Published:
    """One entry's listener on the host and its relay."""

    index: int
    entry: PublishedPort
    host_port: int
    """The port it listens on (the named one, or the free one chosen)."""
    listener: socket.socket
    relay: socket.socket
    relay_path: Path
    agent: socket.socket | None = None
    """The agent's connection (``I``), once it dialled; None before."""
    waiting: deque[tuple[float, str, bytes]] = field(default_factory=deque)
    """Connections handed over, not yet taken (``O``), in order: (start, peer, the dial-back
    token or b"")."""
    opened: dict[int, tuple[float, str, bytes]] = field(default_factory=dict)
    dial_back: bool = False
    """The agent is reached by dialling back (gVisor: module docstring), not by handing it
    the client's socket."""
    dialling: dict[bytes, socket.socket] = field(default_factory=dict)
    greeting: int = 0
    """Connections to the relay whose first byte is awaited (:data:`GREETING_MAX`)."""
    """Dial-back token → the host client waiting for the agent's connection."""
    tasks: list[asyncio.Future[None]] = field(default_factory=list)
    records: asyncio.Future[None] | None = None
    """The reader of the agent's records, once it dialled."""
    taken: asyncio.Event = field(default_factory=asyncio.Event)
    carrier: tuple[Carrier, asyncio.AbstractEventLoop] | None = None
    """The runtime's carrier and its loop, when it carries connections itself (:meth:`carry`)."""
    carried: set[concurrent.futures.Future[tuple[int, int, int]]] = field(default_factory=set)
    """Connections given to the carrier, not yet ended."""

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


class TaskPorts(TaskStamped):
    """Every published port of one task (module docstring)."""

    def __init__(
        self,
        *,
        task_id: str,
        entries: list[PublishedPort],
        state_dir: Path,
        audit: AuditLog | None,
        backend: str,
        policy_hash: str | None,
        run_id: str | None = None,
    ) -> None:
        self.task_id = task_id
        self.entries = entries
        self.state_dir = state_dir
        self.audit = audit
        self.backend = backend
        self.policy_hash = policy_hash
        self.run_id = run_id
        self.ports: list[Published] = []
        self._open = 0
        self._events = BudgetedEvents(
            audit, self.task_fields, "published ports", summary={"published": "*"}
        )
        self._stopped = False
        self.dial_back = False
        """Set by a runtime whose sandbox cannot be handed host sockets (gVisor) before its
        agent dials: each client is then dialled back for (module docstring)."""

    def report(self) -> list[dict[str, Any]]:
        """Each published port: ``port`` (inside), ``hostPort``, ``address``, ``url``."""
        return [p.report() for p in self.ports]

    def sockets(self) -> dict[int, str]:
        """Index of each entry → its relay's host socket (bound into the sandbox)."""
        return {p.index: str(p.relay_path) for p in self.ports}

    # -- life -----------------------------------------------------------------------------

    async def _start(self) -> None:
        """Listen on every entry's host address and port and bind its relay, or on none."""
        try:
            for i, entry in enumerate(self.entries):
                sock, port = _listen(entry)
                path = self.state_dir / f"{i}.sock"
                relay = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    relay.bind(str(path))
                    # The folder is private (0700); the file is bound into the sandbox, whose
                    # agent may be any uid of its user namespace.
                    path.chmod(0o666)
                    # The agent's own connection, and under gVisor one per client at once.
                    relay.listen(MAX_CONNECTIONS)
                    relay.setblocking(False)
                except BaseException:
                    sock.close()
                    relay.close()
                    raise
                self.ports.append(Published(i, entry, port, sock, relay, path))
        except OSError:
            for p in self.ports:
                p.listener.close()
                p.relay.close()
            self.ports.clear()
            raise
        for p in self.ports:
            p.tasks += [
                asyncio.ensure_future(self._relay_loop(p)),
                asyncio.ensure_future(self._accept_loop(p)),
            ]

    async def carry(self, carrier: Carrier, *, on_proxy: bool = False) -> None:
        """From the runtime's prepare (on its loop): every connection of every published port
        goes to ``carrier`` (run on that loop) instead of an agent's relay.

        ``on_proxy``: the carrier needs nothing of the runtime's loop (landlock's connects
        to the host's loopback), so it runs on the proxy loop, which serves between a
        :class:`~fusion_oci.sandbox.SyncSandbox`'s calls too; kubernetes' carrier writes to
        the agent's stream, which lives on the runtime's loop (served during calls only)."""
        loop = proxy_loop() if on_proxy else asyncio.get_running_loop()
        await on_proxy_loop(self._carry(carrier, loop))

    async def _carry(self, carrier: Carrier, loop: asyncio.AbstractEventLoop) -> None:
        for p in self.ports:
            p.carrier = (carrier, loop)
            p.taken.set()

    async def _wait_agent(self, within_s: float) -> list[str]:
        """The entries whose relay the agent has not dialled within ``within_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(p.taken.wait() for p in self.ports)), within_s)
        return [
            p.entry.host(p.host_port) for p in self.ports if p.agent is None and p.carrier is None
        ]

    async def stop(self) -> None:
        """Close the listeners and the agent's connections (the agent closes every inbound
        connection then). Idempotent."""
        await on_proxy_loop(self._stop())

    async def _stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        carried: list[asyncio.Future[Any]] = []
        for p in self.ports:
            for task in p.tasks:
                if task is not p.records:
                    task.cancel()
            p.listener.close()
            p.relay.close()
            for one in p.carried:
                one.cancel()  # the carrier drops the connection (its end is audited)
                carried.append(asyncio.wrap_future(one))
            if p.agent is not None:
                # The agent closes every inbound connection at our EOF, then its end: the
                # records it wrote before are read to the end first (their audit events).
                with contextlib.suppress(OSError):
                    p.agent.shutdown(socket.SHUT_WR)
        waits = [*(p.records for p in self.ports if p.records is not None), *carried]
        if waits:
            await asyncio.wait(waits, timeout=STOP_DRAIN_S)
            await asyncio.sleep(0)  # the carried ones' ends, called back onto this loop
        for p in self.ports:
            for task in p.tasks:
                task.cancel()
            if p.tasks:
                await asyncio.gather(*p.tasks, return_exceptions=True)
            if p.agent is not None:
                p.agent.close()
        await self._events.drain()

    # -- the agent's side -----------------------------------------------------------------

    async def _relay_loop(self, p: Published) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(p.relay)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            conn.setblocking(False)
            # Each dialer on its own: one that says nothing delays nobody else's.
            self._track(p, self._dialled(p, conn))

    def _track(self, p: Published, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as one of ``p``'s tasks (cancelled at stop), forgotten once done."""
        task = asyncio.ensure_future(coro)
        p.tasks.append(task)

        def forget(done: asyncio.Future[None]) -> None:
            if done in p.tasks:
                p.tasks.remove(done)

        task.add_done_callback(forget)

    async def _dialled(self, p: Published, conn: socket.socket) -> None:
        """A connection to the relay's socket: the agent's (``I``), once; or, dialling back,
        the agent's for a waiting client (``A`` + its token). Anything else is closed."""
        loop = asyncio.get_running_loop()
        # The agent says all it has to say as it connects: only a dialer that has not yet
        # takes one of the few waiting places.
        waits = not _said_whole(conn)
        if waits and p.greeting >= GREETING_MAX:
            conn.close()
            return
        p.greeting += waits
        try:
            # The first byte, and for an 'A' its token: within one wait.
            said = await asyncio.wait_for(_greeting(loop, conn), AGENT_WAIT_S)
        except (OSError, TimeoutError):
            said = b""
        except BaseException:
            conn.close()
            raise
        finally:
            p.greeting -= waits
        first = said[:1]
        if first == b"A":
            await self._join(p, conn, said[1:])
            return
        # Host sockets go to the sandbox's init only (handover.dialled_by_sandbox_init): a
        # command that dials the bound socket itself is closed.
        if first != b"I" or p.agent is not None or not dialled_by_sandbox_init(conn):
            conn.close()
            return
        p.agent = conn
        p.dial_back = self.dial_back
        p.taken.set()
        p.records = asyncio.ensure_future(self._records(p, conn))
        p.tasks.append(p.records)

    async def _records(self, p: Published, conn: socket.socket) -> None:
        """The agent's records: ``O`` a handed connection taken, ``D`` its end."""
        try:
            async for kind, ident, up, down, err in agent_records(conn):
                if kind == b"O" and p.waiting:
                    p.opened[ident] = p.waiting.popleft()
                elif kind == b"D" and ident in p.opened:
                    started, peer, token = p.opened.pop(ident)
                    client = p.dialling.pop(token, None)
                    if client is not None:  # the agent never dialled back: nothing inside
                        client.close()
                    self._open -= 1
                    self._audit(
                        p,
                        started,
                        peer,
                        allowed=not err,
                        reason=(
                            f"fusion-oci publishPorts: nothing accepted the connection at "
                            f"the sandbox's 127.0.0.1:{p.entry.port} ({os.strerror(err)})"
                            if err
                            else None
                        ),
                        bytes_up=up,
                        bytes_down=down,
                    )
        except (OSError, asyncio.CancelledError):
            return
        finally:
            # The sandbox ended (or the task stops): no connection can be handed any more, and
            # the agent closed those it had.
            if p.agent is conn:
                p.agent = None
            conn.close()
            for started, peer, _ in [*p.waiting, *p.opened.values()]:
                self._open -= 1
                self._audit(p, started, peer, allowed=True, reason="the sandbox or the task ended")
            p.waiting.clear()
            p.opened.clear()
            for client in p.dialling.values():
                client.close()
            p.dialling.clear()

    async def _join(self, p: Published, conn: socket.socket, token: bytes) -> None:
        """The agent's connection for a waiting client (``token``: what followed its ``A``):
        the bytes moved between the two here. A token nobody waits for is closed."""
        loop = asyncio.get_running_loop()
        client = p.dialling.pop(token, None) if len(token) == DIALBACK_TOKEN else None
        if client is None:
            conn.close()
            return
        try:
            await asyncio.gather(_pump(loop, client, conn), _pump(loop, conn, client))
        finally:
            client.close()
            conn.close()

    # -- one connection -------------------------------------------------------------------

    async def _accept_loop(self, p: Published) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(p.listener)
            except OSError:
                await asyncio.sleep(0.05)  # EMFILE and kin: let connections end first
                continue
            self._hand(p, conn, f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer))

    def _hand(self, p: Published, conn: socket.socket, peer: str) -> None:
        started = time.monotonic()
        given = False
        try:
            if self._open >= MAX_CONNECTIONS:
                why = f"too many inbound connections for this task ({MAX_CONNECTIONS} at once)"
            elif p.carrier is not None:
                given = self._give(p, conn, started, peer)
                if given:
                    return  # the carrier's now
                why = "the sandbox's carrier is not there (the sandbox ended)"
            elif p.agent is None:
                why = "the sandbox's agent is not there (the sandbox ended)"
            elif p.dial_back:
                token = os.urandom(DIALBACK_TOKEN)
                try:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    p.agent.send(b"c" + token)  # 17 bytes: the socket's buffer has room
                except OSError as exc:
                    why = f"the sandbox's agent did not take it ({os.strerror(exc.errno or 0)})"
                else:
                    given = True  # waits in p.dialling for the agent's connection
                    p.dialling[token] = conn
                    self._open += 1
                    p.waiting.append((started, peer, token))
                    return
            else:
                try:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    rights = array.array("i", [conn.fileno()])
                    p.agent.sendmsg([b"a"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
                except OSError as exc:
                    why = f"the sandbox's agent did not take it ({os.strerror(exc.errno or 0)})"
                else:
                    self._open += 1
                    p.waiting.append((started, peer, b""))
                    return
        finally:
            if not given:
                conn.close()  # ours: the agent has its own reference now, or nobody does
        self._audit(p, started, peer, allowed=False, reason=f"fusion-oci publishPorts: {why}")

    def _give(self, p: Published, conn: socket.socket, started: float, peer: str) -> bool:
        """Hand ``conn`` to the runtime's carrier (on its loop); its end comes back here and
        is audited. False: the carrier's loop is gone."""
        assert p.carrier is not None
        carrier, loop = p.carrier
        here = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            one = asyncio.run_coroutine_threadsafe(carrier(p.entry.port, conn), loop)
        except RuntimeError:  # the loop is closed
            return False
        self._open += 1
        p.carried.add(one)

        def ended(done: concurrent.futures.Future[tuple[int, int, int]]) -> None:
            with contextlib.suppress(RuntimeError):  # this loop is closed: nothing to audit
                here.call_soon_threadsafe(self._carried, p, done, started, peer)

        one.add_done_callback(ended)
        return True

    def _carried(
        self,
        p: Published,
        done: concurrent.futures.Future[tuple[int, int, int]],
        started: float,
        peer: str,
    ) -> None:
        p.carried.discard(done)
        self._open -= 1
        if done.cancelled() or done.exception() is not None:
            self._audit(p, started, peer, allowed=True, reason="the sandbox or the task ended")
            return
        up, down, err = done.result()
        self._audit(
            p,
            started,
            peer,
            allowed=not err,
            reason=(
                f"fusion-oci publishPorts: nothing accepted the connection at the sandbox's "
                f"127.0.0.1:{p.entry.port} ({os.strerror(err)})"
                if err
                else None
            ),
            bytes_up=up,
            bytes_down=down,
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


async def bind_ports(
    *,
    task_id: str,
    entries: list[PublishedPort],
    audit: AuditLog | None,
    backend: str,
    policy_hash: str | None,
    run_id: str | None = None,
) -> TaskPorts:
    """Listen on every entry's host port and bind its relay (before the sandbox starts: a
    named port another process holds fails prepare before anything is made; the runtime
    binds the relays into the sandbox)."""
    state_dir = make_scratch("publish", task_id[:_TASK_ID_IN_PATH])
    ports = TaskPorts(
        task_id=task_id,
        entries=entries,
        state_dir=state_dir,
        audit=audit,
        backend=backend,
        policy_hash=policy_hash,
        run_id=run_id,
    )
    try:
        await on_proxy_loop(ports._start())
    except OSError as exc:
        shutil.rmtree(state_dir, ignore_errors=True)
        raise SandboxSetupError(
            "the task's published ports could not listen on the host",
            f"{exc}",
            "another process holds the host port: name another one in "
            "sandbox.policy.publishPorts ('8081:80'), or only the sandbox's port ('80') for a "
            "free one",
        ) from exc
    except BaseException:
        shutil.rmtree(state_dir, ignore_errors=True)
        raise
    return ports


async def attach_ports(ports: TaskPorts, within_s: float = AGENT_WAIT_S) -> None:
    """After the runtime's prepare: every published port taken by the sandbox's agent, or a
    setup error (nothing would reach the sandbox)."""
    missing = await on_proxy_loop(ports._wait_agent(within_s))
    if missing:
        raise SandboxSetupError(
            "the sandbox's exec agent did not take the task's published ports",
            f"no agent connection for {', '.join(missing)} within {within_s:g} s",
            "publishPorts needs the agent as the sandbox's init (bubblewrap, oci with runc or "
            "runsc, podman or docker with containerMode: warm)",
        )


async def stop_ports(ports: TaskPorts) -> None:
    """Stop serving (every inbound connection closed) and remove the folder."""
    try:
        await ports.stop()
    finally:
        shutil.rmtree(ports.state_dir, ignore_errors=True)


__all__ = ["Published", "TaskPorts", "attach_ports", "bind_ports", "stop_ports"]
