"""The host side of the exec agent: one :class:`Agent` per sandbox, many runs through it.

The agent is started once (:meth:`Agent.start_local` for native, a socketpair; or, for a
container whose init is the agent, :meth:`Agent.accept` on a listening socket in a task-private
folder). Each :meth:`Agent.run` makes the command's pipes here and hands their ends to the agent
with the ``spawn`` frame (SCM_RIGHTS), so output comes straight into this process; the outcome
contract is :func:`fusion_oci.process.run_process`'s: timeout, maxBuffer, streamed output,
stdin, whole-tree kill with a grace period, duration.

If the agent dies or the connection breaks, the run in flight and every later run raise
:class:`~fusion_oci.errors.AgentLostError`: never a hang. Standard library and asyncio only.

Why one module of ~600 lines: the connection reader, the per-run state it completes and the
run function share one set of invariants (which frames may arrive for which run, when a run's
pipes are done, what a lost agent fails); the wire format is apart, in protocol.py.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import os
import signal
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_oci.agent.outcome import Failed, RunsCommands, Stdin, Trigger, outcome_of
from fusion_oci.agent.pipes import CommandPipes, StdinFeeder, wait_writable
from fusion_oci.agent.protocol import (
    EXITED,
    FAILED,
    HELLO,
    PROTOCOL_VERSION,
    STARTED,
    Decoder,
    ProtocolError,
    Spawn,
    encode_kill,
    encode_spawn,
)
from fusion_oci.errors import AgentLostError, SandboxSetupError
from fusion_oci.process import DRAIN_LIMIT_S, Capture, ProcessOutcome
from fusion_oci.shims.proctree import descendants  # one /proc walk, shared with the reaper

if TYPE_CHECKING:
    from fusion_oci.models import OutputCallback

BINARY_NAME = "fusion-oci-agent"
BUILD_HINT = (
    "build it with `python hatch_build.py` in the checkout (needs gcc and libc6-dev, "
    "see scripts/install.sh), or reinstall the fusion-oci wheel"
)
KILL_BACKSTOP_S = 12.0
"""Past the grace, how long the keeper may take to SIGKILL a tree (its loop stops at 10 s)."""
CLOSE_WAIT_S = 15.0


def agent_binary() -> Path:
    """The agent executable shipped beside this module; a clear setup error when missing."""
    path = Path(__file__).with_name(BINARY_NAME)
    if not os.access(path, os.X_OK):
        raise SandboxSetupError(
            "the fusion-oci exec agent is missing",
            f"{path} does not exist or is not executable",
            BUILD_HINT,
        )
    return path


def listen_socket(path: str | os.PathLike[str], mode: int = 0o600) -> socket.socket:
    """A listening unix socket at ``path`` (in a task-private folder) for one agent to reach."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        Path(path).chmod(mode)
        sock.listen(1)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _unlink(path: str) -> None:
    """Gone from the folder: nothing can connect to the agent's socket afterwards."""
    with contextlib.suppress(OSError):
        Path(path).unlink()


class Agent(RunsCommands):
    """One connection to one running agent. Create with :meth:`start_local` or :meth:`accept`."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        peer_pid: int | None = None,
        proc: asyncio.subprocess.Process | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        sock.setblocking(False)
        self._sock = sock
        self._proc = proc
        self.peer_pid = peer_pid if peer_pid is not None else (proc.pid if proc else None)
        """The agent's pid as this host sees it."""
        self.agent_pid: int | None = None
        """The agent's pid as it sees itself (1 as a container's init)."""
        self._send_lock = asyncio.Lock()
        self._runs: dict[str, CommandPipes] = {}
        self._ids = itertools.count(1)
        self._lost: AgentLostError | None = None
        self._closed = False
        self._null = -1
        self._hello: asyncio.Future[dict[str, str]] = self._loop.create_future()
        self._reader = self._loop.create_task(self._read_loop())

    # --- starting ------------------------------------------------------------------------

    @classmethod
    async def start_local(
        cls, binary: str | os.PathLike[str] | None = None, *, timeout_s: float = 5.0
    ) -> Agent:
        """Start the agent as a host process (its own session, so its own process group),
        connected by a socketpair. It ends every run's tree and exits when we close the
        connection or this process dies (``--parent``)."""
        path = os.fspath(binary) if binary is not None else str(agent_binary())
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                path,
                "--fd",
                str(theirs.fileno()),
                "--parent",
                str(os.getpid()),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            raise SandboxSetupError(
                "cannot start the fusion-oci exec agent",
                f"{path}: {exc.strerror or exc}",
                BUILD_HINT,
            ) from exc
        finally:
            theirs.close()
        agent = cls(ours, proc=proc)
        await agent._greeted(timeout_s)
        return agent

    @classmethod
    async def accept(
        cls,
        listen: str | os.PathLike[str] | socket.socket,
        expect_pid: int | None,
        timeout_s: float,
    ) -> Agent:
        """Take exactly one connection on ``listen`` (a path: bound here; or a listening socket
        from :func:`listen_socket`), then close the listener and unlink its path, so nothing
        can reach the agent afterwards. ``expect_pid``: the peer's pid as this host sees it
        (the container's init, checked with SO_PEERCRED); None skips the check."""
        lsock = listen if isinstance(listen, socket.socket) else listen_socket(listen)
        where = lsock.getsockname()
        loop = asyncio.get_running_loop()
        lsock.setblocking(False)
        try:
            conn, _ = await asyncio.wait_for(loop.sock_accept(lsock), timeout_s)
        except TimeoutError:
            raise SandboxSetupError(
                "the exec agent did not connect",
                f"nothing connected to {where} within {timeout_s:g} s",
                f"check that the container's init is the agent (`{BINARY_NAME} --connect PATH`)",
            ) from None
        finally:
            lsock.close()
            if isinstance(where, str) and where:
                _unlink(where)
        pid, _uid, _gid = struct.unpack(
            "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        )
        if expect_pid is not None and pid != expect_pid:
            conn.close()
            raise SandboxSetupError(
                "a process other than the sandbox's agent connected",
                f"peer pid {pid}, expected {expect_pid}",
                "the sandbox is not used; dispose it and prepare again",
            )
        agent = cls(conn, peer_pid=pid)
        await agent._greeted(timeout_s)
        return agent

    @classmethod
    async def over(
        cls, sock: socket.socket, proc: asyncio.subprocess.Process, timeout_s: float
    ) -> Agent:
        """An agent the caller started on the other end of ``sock`` (a socketpair), inside a
        launcher ``proc`` that ends with it (a bwrap sandbox whose PID 1 is the agent):
        :meth:`close` waits for ``proc`` as it does for a local agent."""
        agent = cls(sock, proc=proc)
        await agent._greeted(timeout_s)
        return agent

    @classmethod
    async def connected(cls, sock: socket.socket, peer_pid: int | None, timeout_s: float) -> Agent:
        """An agent on the other end of ``sock`` (a socketpair handed to a launcher that
        detached, as ``runc run --detach`` does), whose pid as this host sees it is
        ``peer_pid``: greeted (version checked, bounded) before it is returned."""
        agent = cls(sock, peer_pid=peer_pid)
        await agent._greeted(timeout_s)
        return agent

    async def _greeted(self, timeout_s: float) -> None:
        try:
            hello = await asyncio.wait_for(asyncio.shield(self._hello), timeout_s)
        except (TimeoutError, AgentLostError) as exc:
            await self.close()
            raise SandboxSetupError(
                "the fusion-oci exec agent did not start",
                str(exc) or f"no hello within {timeout_s:g} s",
                BUILD_HINT,
            ) from exc
        if hello.get("version") != PROTOCOL_VERSION:
            await self.close()
            raise SandboxSetupError(
                "the fusion-oci exec agent speaks another protocol",
                f"agent version {hello.get('version')!r}, host {PROTOCOL_VERSION!r}",
                BUILD_HINT,
            )
        self.agent_pid = int(hello.get("pid", "0")) or None

    # --- the connection ------------------------------------------------------------------

    @property
    def lost(self) -> bool:
        return self._lost is not None

    def _check(self) -> None:
        if self._lost is not None:
            raise self._lost
        if self._closed:
            raise AgentLostError(
                "the exec agent was closed",
                "close() came before run()",
                "prepare the sandbox again",
            )

    async def _read_loop(self) -> None:
        decoder = Decoder()
        why = "the agent closed the connection (it died or was killed)"
        try:
            while True:
                data = await self._loop.sock_recv(self._sock, 65536)
                if not data:
                    break
                for kind, fields in decoder.feed(data):
                    self._dispatch(kind, fields)
        except asyncio.CancelledError:
            why = "the connection was closed"
        except (OSError, ProtocolError, KeyError, ValueError) as exc:
            # A frame we cannot read means the stream cannot be trusted: lost, never a hang.
            why = f"the connection broke: {exc!r}"
        self._mark_lost(why)

    def _mark_lost(self, why: str) -> None:
        if self._lost is None:
            self._lost = AgentLostError(
                "the sandbox's exec agent is gone",
                why,
                "the run's outcome is unknown; dispose the sandbox and prepare it again",
            )
        for run in self._runs.values():
            if not run.exited.done():
                run.exited.set_exception(self._lost)
        if not self._hello.done():
            self._hello.set_exception(self._lost)

    def _dispatch(self, kind: bytes, fields: dict[str, str]) -> None:
        if kind == HELLO:
            if not self._hello.done():
                self._hello.set_result(fields)
            return
        run = self._runs.get(fields.get("id", ""))
        if run is None or run.exited.done():
            return
        if kind == STARTED:
            run.pid = int(fields["pid"])
        elif kind == EXITED:
            run.exited.set_result(int(fields["status"]))
        elif kind == FAILED:
            run.exited.set_exception(Failed(int(fields.get("errno", "0")), fields.get("what", "")))

    async def _send(self, data: bytes, fds: Sequence[int] = ()) -> None:
        async with self._send_lock:
            self._check()
            view = memoryview(data)
            try:
                while view:
                    try:
                        if fds:
                            # The fds ride on the frame's first bytes (PROTOCOL.md).
                            sent = self._sock.sendmsg(
                                [view],
                                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
                            )
                            fds = ()
                        else:
                            sent = self._sock.send(view)
                    except BlockingIOError:
                        await wait_writable(self._loop, self._sock.fileno())
                        continue
                    view = view[sent:]
            except OSError as exc:
                self._mark_lost(f"sending to the agent failed: {exc}")
                assert self._lost is not None
                raise self._lost from exc

    # --- running -------------------------------------------------------------------------

    async def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | None = None,
        rlimits: Sequence[tuple[str, int, int]] = (),
        umask: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        groups: Sequence[int] | None = None,
        stdin: Stdin = None,
        timeout_s: float | None = None,
        max_buffer: int = 10 * 1024 * 1024,
        grace_s: float = 2.0,
        on_output: OutputCallback | None = None,
        keep_output: bool = True,
    ) -> ProcessOutcome:
        """Run argv to completion through the agent (the contract of ``run_process``).

        stdin None: /dev/null; bytes: fed then closed; an async iterable: streamed then
        closed. A timeout, a maxBuffer overflow or a cancellation ends the whole tree (SIGTERM,
        ``grace_s``, SIGKILL). An exec failure is exit 127 (not found) or 126, with the reason
        on stderr, as a shell says it; any other failure to start is a SandboxSetupError.
        """
        self._check()
        if asyncio.get_running_loop() is not self._loop:
            raise SandboxSetupError(
                "the sandbox's exec agent belongs to another event loop",
                "run() was called from a loop other than prepare()'s",
                "prepare, run and dispose a sandbox on one event loop",
            )
        start = time.monotonic()
        run_id = str(next(self._ids))
        frame = encode_spawn(
            Spawn(
                id=run_id,
                argv=list(argv),
                env=dict(env),
                cwd=cwd,
                rlimits=list(rlimits),
                umask=umask,
                uid=uid,
                gid=gid,
                groups=groups,
            )
        )
        run = CommandPipes(self._loop)

        def end() -> None:
            if run.ending is None and not run.exited.done():
                run.ending = self._loop.create_task(self._end(run_id, run, grace_s))

        def expire() -> None:
            run.timed_out = not run.exited.done()
            end()

        run.on_error = end
        overflow = Trigger(end)
        out = Capture(max_buffer, overflow, "stdout", on_output, keep_output)
        err = Capture(max_buffer, overflow, "stderr", on_output, keep_output)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        if stdin is None:
            in_r, in_w = self._devnull(), -1
        else:
            in_r, in_w = os.pipe()
        self._runs[run_id] = run
        try:
            await self._send(frame, [in_r, out_w, err_w])
        except BaseException:
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            self._runs.pop(run_id, None)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                if fd != self._null:
                    os.close(fd)
        run.watch(out_r, out)
        run.watch(err_r, err)
        feeder = StdinFeeder(in_w, stdin) if stdin is not None else None
        timer = self._loop.call_later(timeout_s, expire) if timeout_s is not None else None
        try:
            try:
                await asyncio.shield(run.exited)
            except asyncio.CancelledError:
                end()
                if run.ending is not None:
                    await asyncio.shield(run.ending)
                raise
            except (Failed, AgentLostError):
                pass
            if not run.drained.done():
                # The tree is gone when `exited` comes; a pipe still open is held by something
                # outside it (bounded, like run_process).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(run.drained), DRAIN_LIMIT_S)
        finally:
            if timer is not None:
                timer.cancel()
            if run.ending is not None and not run.ending.done():
                run.ending.cancel()
            run.close_all()
            if feeder is not None:
                await feeder.stop()
            self._runs.pop(run_id, None)
            if run.exited.done() and not run.exited.cancelled():
                run.exited.exception()  # retrieved, even when we leave by a cancellation
        if run.error is not None:
            raise run.error
        return outcome_of(argv, run.exited, out, err, run.timed_out, start)

    def _devnull(self) -> int:
        """/dev/null for a command without stdin, opened once (the agent gets its own copy)."""
        if self._null < 0:
            self._null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        return self._null

    async def _end(self, run_id: str, run: CommandPipes, grace_s: float) -> None:
        """SIGTERM the whole tree, SIGKILL after the grace (the keeper does both); wait."""
        if run.exited.done():
            return
        with contextlib.suppress(AgentLostError):
            await self._send(encode_kill(run_id, signal.SIGTERM, True, int(grace_s * 1000)))
        try:
            await asyncio.wait_for(asyncio.shield(run.exited), grace_s + KILL_BACKSTOP_S)
        except TimeoutError:
            self._mark_lost(f"run {run_id} outlived its kill by {KILL_BACKSTOP_S:g} s")
        except (AgentLostError, Failed):
            pass

    # --- closing -------------------------------------------------------------------------

    async def close(self) -> None:
        """End every run's tree and stop the agent (it exits when the connection closes).
        Idempotent; leaves no process of ours behind."""
        if self._closed:
            return
        self._closed = True
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        self._sock.close()
        if self._null >= 0:
            os.close(self._null)
            self._null = -1
        proc = self._proc
        if proc is None:
            return
        try:
            await asyncio.wait_for(proc.wait(), CLOSE_WAIT_S)
        except TimeoutError:
            # A hung agent: everything below it goes first (the commands are in sessions of
            # their own, out of its process group), then the agent and its keepers.
            for pid in descendants(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
