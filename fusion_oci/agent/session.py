"""One session with an exec agent, whatever carries it: the run contract written once.

:class:`AgentSession` holds what does not depend on the transport: the hello and its checks,
the run ids, ``run``'s skeleton (spawn frame, captures, timeout, maxBuffer, cancellation, the
bounded drain, the outcome), the whole-tree kill with its backstop, and the lost state that
fails every run instead of hanging. A transport (:class:`~fusion_oci.agent.client.Agent`: a
socket, the pipes passed; :class:`~fusion_oci.agent.streamed.StreamedAgent`: a byte stream,
the output relayed) says how a run's I/O starts and stops (``_new_run``, ``_begin``) and how a
frame is sent (``_send``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from fusion_oci.agent.outcome import Failed, Stdin, Trigger, outcome_of
from fusion_oci.agent.protocol import (
    EXITED,
    FAILED,
    HELLO,
    PROTOCOL_VERSION,
    STARTED,
    Spawn,
    encode_kill,
    encode_spawn,
)
from fusion_oci.errors import AgentLostError, SandboxSetupError
from fusion_oci.host.process import DRAIN_LIMIT_S, Capture, ProcessOutcome

if TYPE_CHECKING:
    from fusion_oci.models import OutputCallback, RunOptions

BINARY_NAME = "fusion-oci-agent"
BUILD_HINT = (
    "build it with `python hatch_build.py` in the checkout (needs gcc and libc6-dev, "
    "see scripts/install.sh), or reinstall the fusion-oci wheel"
)
KILL_BACKSTOP_S = 12.0
"""Past the grace, how long the keeper may take to SIGKILL a tree (its loop stops at 10 s)."""


class RunState(Protocol):
    """What the skeleton needs of a transport's per-run state."""

    pid: int | None
    exited: asyncio.Future[int]
    """The raw wait status of ``X``; ``Failed`` for ``F``; AgentLostError when lost."""
    drained: asyncio.Future[None]
    """All the output is in the captures."""
    ending: asyncio.Task[None] | None
    timed_out: bool
    error: BaseException | None
    """What an on_output callback raised: the run is ended and run() raises it."""
    on_error: Callable[[], None]


RunT = TypeVar("RunT", bound=RunState)


class AgentSession(Generic[RunT]):
    """The transport-free half of a connection to one agent (see the module's docstring)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.agent_pid: int | None = None
        """The agent's pid as it sees itself (1 as a container's init)."""
        self._runs: dict[str, RunT] = {}
        self._ids = itertools.count(1)
        self._lost: AgentLostError | None = None
        self._closed = False
        self._hello: asyncio.Future[dict[str, str]] = self._loop.create_future()

    # --- what a transport provides -------------------------------------------------------

    def _new_run(self, out: Capture, err: Capture) -> RunT:
        raise NotImplementedError

    async def _begin(
        self, run_id: str, run: RunT, frame: bytes, stdin: Stdin, out: Capture, err: Capture
    ) -> Callable[[], Awaitable[None]]:
        """Send the spawn frame and start the run's I/O; return what stops it. The run is in
        ``self._runs`` before; on an exception nothing of it may be left open."""
        raise NotImplementedError

    async def _send(self, data: bytes) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    def _setup_detail(self) -> str:
        """More to say when the agent did not start (a far end's stderr)."""
        return ""

    # --- the hello and the lost state ----------------------------------------------------

    async def _greeted(self, timeout_s: float) -> dict[str, str]:
        try:
            hello = await asyncio.wait_for(asyncio.shield(self._hello), timeout_s)
        except (TimeoutError, AgentLostError) as exc:
            await self.close()
            raise SandboxSetupError(
                "the fusion-oci exec agent did not start",
                (str(exc) or f"no hello within {timeout_s:g} s") + self._setup_detail(),
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
        return hello

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

    def _agent_frame(self, kind: bytes, fields: dict[str, str]) -> RunT | None:
        """The agent's own frames (H, T, X, F); the run a T, X or F was about."""
        if kind == HELLO:
            if not self._hello.done():
                self._hello.set_result(fields)
            return None
        run = self._runs.get(fields.get("id", ""))
        if run is None or run.exited.done():
            return None
        if kind == STARTED:
            run.pid = int(fields["pid"])
        elif kind == EXITED:
            run.exited.set_result(int(fields["status"]))
        elif kind == FAILED:
            run.exited.set_exception(Failed(int(fields.get("errno", "0")), fields.get("what", "")))
        return run

    # --- running -------------------------------------------------------------------------

    async def run_command(
        self, spawn: Spawn, opts: RunOptions, *, grace_s: float = 2.0
    ) -> ProcessOutcome:
        """Run one command's spawn frame with the caller's I/O options (stdin, output
        callbacks, timeout, maxBuffer): what every runtime on the agent does per command."""
        return await self.run(
            spawn.argv,
            env=spawn.env,
            cwd=spawn.cwd,
            rlimits=spawn.rlimits,
            uid=spawn.uid,
            gid=spawn.gid,
            groups=spawn.groups,
            stdin=opts.stdin,
            timeout_s=opts.timeout_ms / 1000,
            max_buffer=opts.max_buffer,
            grace_s=grace_s,
            on_output=opts.on_output,
            keep_output=opts.keep_output,
        )

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

        def end() -> None:
            if run.ending is None and not run.exited.done():
                run.ending = self._loop.create_task(self._end(run_id, run, grace_s))

        def expire() -> None:
            run.timed_out = not run.exited.done()
            end()

        overflow = Trigger(end)
        out = Capture(max_buffer, overflow, "stdout", on_output, keep_output)
        err = Capture(max_buffer, overflow, "stderr", on_output, keep_output)
        run = self._new_run(out, err)
        run.on_error = end
        self._runs[run_id] = run
        try:
            stop = await self._begin(run_id, run, frame, stdin, out, err)
        except BaseException:
            self._runs.pop(run_id, None)
            raise
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
                # The tree is gone when `exited` comes; output still missing is held by
                # something outside it, or by a slow consumer (bounded, like run_process).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(run.drained), DRAIN_LIMIT_S)
        finally:
            if timer is not None:
                timer.cancel()
            if run.ending is not None and not run.ending.done():
                run.ending.cancel()
            await stop()
            self._runs.pop(run_id, None)
            if run.exited.done() and not run.exited.cancelled():
                run.exited.exception()  # retrieved, even when we leave by a cancellation
        if run.error is not None:
            raise run.error
        return outcome_of(argv, run.exited, out, err, run.timed_out, start)

    async def _end(self, run_id: str, run: RunT, grace_s: float) -> None:
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
