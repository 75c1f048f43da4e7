"""The host side of the exec agent: one :class:`Agent` per sandbox, many runs through it.

The agent is started once (:meth:`Agent.start_local` for native, a socketpair; or, for a
container whose init is the agent, :meth:`Agent.accept` on a listening socket in a task-private
folder). Each :meth:`Agent.run` makes the command's pipes here and hands their ends to the agent
with the ``spawn`` frame (SCM_RIGHTS), so output comes straight into this process; the outcome
contract is :func:`fusion_oci.host.process.run_process`'s: timeout, maxBuffer, streamed output,
stdin, whole-tree kill with a grace period, duration.

If the agent dies or the connection breaks, the run in flight and every later run raise
:class:`~fusion_oci.errors.AgentLostError`: never a hang. Standard library and asyncio only.

What does not depend on the socket (the hello, ``run``'s skeleton, the kill, the lost state) is
:class:`~fusion_oci.agent.session.AgentSession`'s, shared with the agent over a byte stream
(streamed.py); this module is how a socket starts it, sends to it, and hands the pipes over.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import signal
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from fusion_oci.agent.outcome import Stdin
from fusion_oci.agent.pipes import CommandPipes, StdinFeeder, wait_writable
from fusion_oci.agent.protocol import Decoder, ProtocolError
from fusion_oci.agent.session import BINARY_NAME, BUILD_HINT, AgentSession
from fusion_oci.errors import SandboxSetupError
from fusion_oci.host.process import Capture
from fusion_oci.shims.proctree import descendants  # one /proc walk, shared with the reaper

__all__ = ["BINARY_NAME", "BUILD_HINT", "Agent", "agent_binary", "listen_socket"]
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


class Agent(AgentSession[CommandPipes]):
    """One connection to one running agent. Create with :meth:`start_local` or :meth:`accept`."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        peer_pid: int | None = None,
        proc: asyncio.subprocess.Process | None = None,
    ) -> None:
        super().__init__()
        sock.setblocking(False)
        self._sock = sock
        self._proc = proc
        self.peer_pid = peer_pid if peer_pid is not None else (proc.pid if proc else None)
        """The agent's pid as this host sees it."""
        self._send_lock = asyncio.Lock()
        self._null = -1
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

    # --- the connection ------------------------------------------------------------------

    async def _read_loop(self) -> None:
        decoder = Decoder()
        why = "the agent closed the connection (it died or was killed)"
        try:
            while True:
                data = await self._loop.sock_recv(self._sock, 65536)
                if not data:
                    break
                for kind, fields in decoder.feed(data):
                    self._agent_frame(kind, fields)
        except asyncio.CancelledError:
            why = "the connection was closed"
        except (OSError, ProtocolError, KeyError, ValueError) as exc:
            # A frame we cannot read means the stream cannot be trusted: lost, never a hang.
            why = f"the connection broke: {exc!r}"
        self._mark_lost(why)

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

    def _new_run(self, out: Capture, err: Capture) -> CommandPipes:
        return CommandPipes(self._loop)

    async def _begin(
        self,
        run_id: str,
        run: CommandPipes,
        frame: bytes,
        stdin: Stdin,
        out: Capture,
        err: Capture,
    ) -> Callable[[], Awaitable[None]]:
        """Make the command's pipes here and hand their far ends over with the spawn frame:
        the output comes straight into this process, never through the agent."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        if stdin is None:
            in_r, in_w = self._devnull(), -1
        else:
            in_r, in_w = os.pipe()
        try:
            await self._send(frame, [in_r, out_w, err_w])
        except BaseException:
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                if fd != self._null:
                    os.close(fd)
        run.watch(out_r, out)
        run.watch(err_r, err)
        feeder = StdinFeeder(in_w, stdin) if stdin is not None else None

        async def stop() -> None:
            run.close_all()
            if feeder is not None:
                await feeder.stop()

        return stop

    def _devnull(self) -> int:
        """/dev/null for a command without stdin, opened once (the agent gets its own copy)."""
        if self._null < 0:
            self._null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        return self._null

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
