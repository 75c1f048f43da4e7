"""The host side of the exec agent over any byte stream (PROTOCOL.md, "Over a byte stream").

A pod's exec stream (the stdin and stdout of one exec'd process) carries no descriptors, so the
command's pipes are made at the far end by ``mux.py``, which relays their bytes as ``D`` frames.
:class:`StreamedAgent` keeps :class:`~fusion_oci.agent.client.Agent`'s ``run`` contract
(timeout, maxBuffer, streamed output with backpressure, stdin, whole-tree kill, cancellation,
exit statuses, ``F``, concurrent runs, ``AgentLostError`` instead of a hang) over anything
that offers a :class:`~fusion_oci.agent.bytestream.ByteStream`: a process's pipes (the mux run
here, ``kubectl exec -i``) or a pods/exec WebSocket (``ExecStream``).

Flow control both ways: a run's output is acknowledged (``A``) only once the caller's
``on_output`` took it, so a slow consumer stops the mux reading that command's pipes; stdin is
sent only within the credit the mux gives back as it writes into the command's pipe.

Egress (``network: filtered`` in a pod): given a dialer, each connection the mux accepted on
the pod's 127.0.0.1:3128 (``O``) is relayed to what the dialer connects to, the task's egress
proxy on this host, byte for byte and windowed both ways (:mod:`.tunnel`). Host services
(a TCP grant): given one dialer per ``--service-listen`` of the mux, in order, each
connection of that listener is relayed the same way to what its dialer connects to.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_oci.agent.bytestream import ByteStream, ProcessStream
from fusion_oci.agent.client import CLOSE_WAIT_S, agent_binary
from fusion_oci.agent.outcome import Stdin
from fusion_oci.agent.protocol import (
    ACK,
    DATA,
    EGRESS_ACK,
    EGRESS_BYTES,
    EGRESS_CLOSE,
    EGRESS_OPEN,
    EXITED,
    FAILED,
    HELLO,
    SPAWN,
    SPAWN_PIPED,
    STDERR,
    STDIN,
    STDOUT,
    Framer,
    ProtocolError,
    decode_data,
    decode_fields,
    encode,
    encode_data,
)
from fusion_oci.agent.session import AgentSession
from fusion_oci.agent.tunnel import Dialer, Tunnels
from fusion_oci.errors import AgentLostError, SandboxSetupError
from fusion_oci.host.process import Capture

MUX = Path(__file__).with_name("mux.py")
"""The far end: a stdlib-only script, copied into a pod and run by path."""
READ_SIZE = 1 << 18
MAX_WINDOW = 4 << 20
"""The most output per run the host takes on credit, whatever window the far end names."""
TAIL = 1 << 20
"""After the agent's X the mux reads what the pipes still hold past the window, up to this
(mux.py's TAIL): output the host may get beyond its credit, and no more."""
STDIN_CHUNK = 1 << 16
WRITE_HIGH = 1 << 20
"""Bytes queued for the stream past which a sender (a spawn, stdin) waits."""
WRITE_BATCH = 1 << 18


def mux_argv(
    agent: str | os.PathLike[str] | None = None,
    agent_args: Sequence[str] = (),
    *,
    python: str = "python3",
    mux: str | os.PathLike[str] = MUX,
    egress_listen: int | None = None,
    service_listen: Sequence[str] = (),
    publish_ports: Sequence[int] = (),
) -> list[str]:
    """How the far end is started (in a pod: after ``kubectl exec -i POD --``); with
    ``egress_listen`` it carries that port's connections back (``network: filtered``), with
    ``service_listen`` (``ADDR:PORT`` or ``unix:/PATH`` each, listener 0, 1, ...) those of
    its loopback's addresses and of those paths (host services), with ``publish_ports`` the
    ports of its loopback the host may connect to (published ports). Pure."""
    path = os.fspath(agent) if agent is not None else str(agent_binary())
    listen = [] if egress_listen is None else ["--egress-listen", str(egress_listen)]
    for where in service_listen:
        listen += ["--service-listen", where]
    for port in publish_ports:
        listen += ["--publish-port", str(port)]
    return [python, "-S", "-E", "-s", os.fspath(mux), *listen, "--agent", path, *agent_args]


class _Run:
    """One run's state on the host: its captures fed in order from the ``D`` frames (never a
    chunk to ``on_output`` before the last one's awaitable is done), its stdin credit."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out: Capture, err: Capture) -> None:
        self.exited: asyncio.Future[int] = loop.create_future()
        self.drained: asyncio.Future[None] = loop.create_future()
        self.captures = {STDOUT: out, STDERR: err}
        self.queue: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self.waiting = False
        self.unacked = 0
        self.outstanding = 0
        """Output received and not yet credited back: at most the window, or the far end
        broke the protocol (a hostile mux could otherwise fill the host's memory)."""
        self.credit = 0
        self.credit_given = asyncio.Event()
        self.stdin_closed = False
        self.ending: asyncio.Task[None] | None = None
        self.timed_out = False
        self.pid: int | None = None
        self.error: BaseException | None = None
        self.on_error: Callable[[], None] = lambda: None

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.on_error()


class StreamedAgent(AgentSession[_Run]):
    """One agent behind ``mux.py`` at the far end of a byte stream. Create with
    :meth:`start` (a process whose stdin/stdout is the stream) or :meth:`over`."""

    def __init__(
        self,
        stream: ByteStream,
        *,
        peer_pid: int | None = None,
        egress: Dialer | None = None,
        services: Sequence[Dialer] = (),
        published: int = 0,
    ) -> None:
        super().__init__()
        self._stream = stream
        self._egress = egress
        self._services = len(services)
        self._published = published
        self._tunnels = Tunnels(
            self._loop, egress, self._write, self._send_frame, services, inbound=published > 0
        )
        self.peer_pid = peer_pid
        """The stream's process as this host sees it (the mux, or ``kubectl``), if any."""
        self._window = 0
        # One writer: a frame larger than a stream's own frames (a WebSocket sends 64 KiB
        # pieces) must not have an ack land inside it.
        self._out: collections.deque[bytes] = collections.deque()
        self._out_size = 0
        self._out_ready = asyncio.Event()
        self._out_room = asyncio.Event()
        self._out_room.set()
        self._reader = self._loop.create_task(self._read_loop())
        self._writer = self._loop.create_task(self._write_loop())

    # --- starting ------------------------------------------------------------------------

    @classmethod
    async def start(
        cls,
        argv: Sequence[str] | None = None,
        *,
        timeout_s: float = 10.0,
        egress: Dialer | None = None,
        services: Sequence[Dialer] = (),
        published: int = 0,
    ) -> StreamedAgent:
        """Start ``argv`` (default: :func:`mux_argv` here, with this Python) in a session of its
        own, its stdin and stdout the stream: ``kubectl exec -i POD -- python3 ... mux.py``
        is the same thing one hop further. ``egress``, ``services``, ``published``: see
        :meth:`over`."""
        command = list(argv) if argv is not None else mux_argv(python=sys.executable)
        stream = await ProcessStream.start(command, CLOSE_WAIT_S)
        agent = cls(
            stream,
            peer_pid=stream.proc.pid,
            egress=egress,
            services=services,
            published=published,
        )
        await agent._greeted(timeout_s)
        return agent

    @classmethod
    async def over(
        cls,
        stream: ByteStream,
        timeout_s: float,
        egress: Dialer | None = None,
        services: Sequence[Dialer] = (),
        published: int = 0,
    ) -> StreamedAgent:
        """An agent behind a mux already started at the far end of ``stream``. ``egress``
        (the mux started with ``--egress-listen``): what each of its connections is relayed
        to, a coroutine opening a new connection (the task's egress proxy); without it every
        connection is refused (closed at once). ``services`` (the mux started with as many
        ``--service-listen``, in the same order): listener N's connections go to the N-th.
        ``published``: how many ``--publish-port`` it was started with (:meth:`inbound`)."""
        agent = cls(stream, egress=egress, services=services, published=published)
        await agent._greeted(timeout_s)
        return agent

    async def _greeted(self, timeout_s: float) -> dict[str, str]:
        hello = await super()._greeted(timeout_s)
        if not hello.get("window", "").isdigit():
            await self.close()
            raise SandboxSetupError(
                "the far end of the agent's stream is not mux.py",
                f"its hello has no window: {sorted(hello)}",
                f"start the far end as {' '.join(mux_argv('AGENT'))}",
            )
        # The far end is the sandbox's: its word is bounded (a window it names is also how much
        # output the host holds per run before it must have taken some).
        self._window = min(max(int(hello["window"]), 64 << 10), MAX_WINDOW)
        counted = (
            ("services", self._services, "host services", "--service-listen",
             mux_argv("AGENT", service_listen=["127.0.0.1:5432"])),
            ("publish", self._published, "published ports", "--publish-port",
             mux_argv("AGENT", publish_ports=[3000])),
        )  # fmt: skip
        for field, wanted, what, option, example in counted:
            if wanted and hello.get(field) != str(wanted):
                await self.close()
                raise SandboxSetupError(
                    f"the far end of the agent's stream does not carry the task's {what}",
                    f"this host set up {wanted}, its hello says {hello.get(field, 'none')}: "
                    f"mux.py was started without as many {option}, or is older",
                    "start it as " + " ".join(example),
                )
        carries = self._egress or self._services or self._published
        if carries and not self._tunnels.window:  # from the hello
            await self.close()
            raise SandboxSetupError(
                "the far end of the agent's stream does not carry egress",
                "its hello has no egress_window: mux.py was not started with "
                "--egress-listen, or is older",
                "start it as " + " ".join(mux_argv("AGENT", egress_listen=3128)),
            )
        return hello

    async def inbound(self, port: int, client: socket.socket) -> tuple[int, int, int]:
        """Carry ``client``, a connection to a published port on this host (taken over), to
        the far end's 127.0.0.1:``port``: (bytes towards it, bytes back, the connect's errno)
        once it ends (:meth:`.tunnel.Tunnels.inbound`)."""
        return await self._tunnels.inbound(port, client)

    def _setup_detail(self) -> str:
        described = self._stream.describe()
        return f"; {described}" if described else ""

    # --- the stream ----------------------------------------------------------------------

    async def _read_loop(self) -> None:
        framer = Framer()
        why = "the agent's stream ended (the far end died or the stream was cut)"
        try:
            while data := await self._stream.read(READ_SIZE):
                for kind, body in framer.feed(data):
                    self._dispatch(kind, body)
        except asyncio.CancelledError:
            why = "the stream was closed"
        except Exception as exc:
            # Whatever a stream raises (a websocket has errors of its own) or a frame we cannot
            # read: the stream cannot be trusted, the agent is lost, never a hang.
            why = f"the stream broke: {exc!r}"
        self._mark_lost(why + self._setup_detail())

    def _mark_lost(self, why: str) -> None:
        super()._mark_lost(why)
        self._tunnels.stop()  # every relayed connection ends with the stream
        self._out_room.set()  # a sender waiting for room sees the loss
        for run in self._runs.values():
            run.credit_given.set()  # a sender waiting for credit sees the loss
            if not run.drained.done():
                run.drained.set_result(None)  # nothing more comes

    def _dispatch(self, kind: bytes, body: bytes) -> None:
        if kind in (EGRESS_OPEN, EGRESS_BYTES, EGRESS_ACK, EGRESS_CLOSE):
            self._tunnels.frame(kind, body)  # ProtocolError: the stream is not trusted
            return
        if kind == DATA:
            run_id, stream, data = decode_data(body)
            if (run := self._runs.get(run_id)) is not None and stream in run.captures:
                run.outstanding += len(data)
                if run.outstanding > self._window + TAIL:
                    raise ProtocolError(
                        f"run {run_id!r} got {run.outstanding} bytes of output past its credit"
                    )
                run.queue.append((stream, data))
                self._consume(run_id, run)
            return
        fields = decode_fields(body)
        if kind == HELLO:
            self._tunnels.greeted(fields)
        if kind == ACK:
            if (run := self._runs.get(fields.get("id", ""))) is not None:
                run.credit += int(fields["bytes"])
                run.stdin_closed = run.stdin_closed or fields.get("closed") == "1"
                run.credit_given.set()
        elif (run := self._agent_frame(kind, fields)) is not None and kind in (EXITED, FAILED):
            self._consume(fields["id"], run)  # drained once the queue is empty

    def _consume(self, run_id: str, run: _Run) -> None:
        """Feed the queued chunks to their captures in order; stop at a consumer that asked to
        wait; give the mux its credit back for what was taken."""
        while run.queue and not run.waiting:
            stream, data = run.queue.popleft()
            run.unacked += len(data)
            if run.error is not None:
                continue  # the run is being ended: take the rest, keep nothing
            try:
                wait = run.captures[stream].feed(data)
            except Exception as exc:  # the caller's on_output: end the run, raise it from run()
                run.fail(exc)
                continue
            if wait is not None:
                run.waiting = True
                done = asyncio.ensure_future(wait)
                done.add_done_callback(functools.partial(self._resumed, run_id, run))
        # Credit back in quarters of the window: the mux never runs dry (it keeps at least
        # three quarters) and a megabyte costs four small frames, not one per chunk.
        if run.unacked >= self._window // 4:
            self._write(encode(ACK, [("id", run_id), ("bytes", str(run.unacked))]))
            run.outstanding -= run.unacked
            run.unacked = 0
        if not run.queue and not run.waiting and run.exited.done() and not run.drained.done():
            run.drained.set_result(None)

    def _resumed(self, run_id: str, run: _Run, done: asyncio.Future[object]) -> None:
        run.waiting = False
        if not done.cancelled() and (exc := done.exception()) is not None:
            run.fail(exc)
        self._consume(run_id, run)

    def _write(self, data: bytes) -> None:
        """Queue one whole frame for the writer (from a callback too: acks)."""
        if self._lost is not None:
            return
        self._out.append(data)
        self._out_size += len(data)
        self._out_ready.set()
        if self._out_size > WRITE_HIGH:
            self._out_room.clear()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._out_ready.wait()
                self._out_ready.clear()
                while self._out:
                    batch = [self._out.popleft()]
                    size = len(batch[0])
                    while self._out and size < WRITE_BATCH:
                        batch.append(self._out.popleft())
                        size += len(batch[-1])
                    await self._stream.write(b"".join(batch) if len(batch) > 1 else batch[0])
                    self._out_size -= size
                    if self._out_size <= WRITE_HIGH:
                        self._out_room.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any stream's own error: lost, as in _read_loop
            self._mark_lost(f"writing to the agent's stream failed: {exc!r}")

    async def _send(self, data: bytes) -> None:
        self._check()
        self._write(data)
        await self._out_room.wait()
        self._check()

    async def _send_frame(self, data: bytes) -> bool:
        """A relayed connection's frame, waiting for room; False once the stream is lost."""
        if self._lost is not None or self._closed:
            return False
        self._write(data)
        await self._out_room.wait()
        return self._lost is None

    # --- running -------------------------------------------------------------------------

    def _new_run(self, out: Capture, err: Capture) -> _Run:
        run = _Run(self._loop, out, err)
        run.credit = self._window
        return run

    async def _begin(
        self, run_id: str, run: _Run, frame: bytes, stdin: Stdin, out: Capture, err: Capture
    ) -> Callable[[], Awaitable[None]]:
        """Send the spawn frame (typed P when the host streams stdin: the mux makes a pipe
        for it, else /dev/null); the output comes as D frames."""
        assert frame[4:5] == SPAWN
        if stdin is not None:
            frame = frame[:4] + SPAWN_PIPED + frame[5:]
        await self._send(frame)
        feeder = None if stdin is None else self._loop.create_task(self._feed(run_id, run, stdin))

        async def stop() -> None:
            if feeder is not None:
                feeder.cancel()
                await asyncio.gather(feeder, return_exceptions=True)

        return stop

    async def _feed(self, run_id: str, run: _Run, source: Stdin) -> None:
        """Send stdin within the credit the mux gives back, then its end (an empty ``D``)."""
        try:
            if isinstance(source, bytes | bytearray | memoryview):
                await self._feed_chunk(run_id, run, bytes(source))
            elif source is not None:
                async for chunk in source:
                    await self._feed_chunk(run_id, run, chunk)
            if not run.stdin_closed:
                await self._send(encode_data(run_id, STDIN, b""))
        except (AgentLostError, _StdinClosed):
            pass

    async def _feed_chunk(self, run_id: str, run: _Run, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            while run.credit <= 0 and not run.stdin_closed and self._lost is None:
                run.credit_given.clear()
                await run.credit_given.wait()
            self._check()
            if run.stdin_closed:
                raise _StdinClosed
            n = min(len(view), run.credit, STDIN_CHUNK)
            run.credit -= n
            await self._send(encode_data(run_id, STDIN, bytes(view[:n])))
            view = view[n:]

    # --- closing -------------------------------------------------------------------------

    async def close(self) -> None:
        """Close the stream: the mux closes the agent's socket, the agent ends every tree and
        exits, then the mux. Idempotent; a process of ours is waited for (bounded)."""
        if self._closed:
            return
        self._closed = True
        await self._tunnels.aclose()
        for task in (self._reader, self._writer):
            task.cancel()
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)
        with contextlib.suppress(Exception):  # closing a broken stream may fail its own way
            await self._stream.close()


class _StdinClosed(Exception):
    """The command closed its stdin: nothing more is sent."""


if TYPE_CHECKING:
    from fusion_oci.agent.client import Agent
    from fusion_oci.agent.outcome import AgentLike

    def _one_interface(local: Agent, streamed: StreamedAgent) -> tuple[AgentLike, AgentLike]:
        """mypy's proof that runtimes need not care which transport they hold."""
        return local, streamed
