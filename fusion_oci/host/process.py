"""The one subprocess helper of the package.

argv lists only; stdin closed unless given; the child in its own session (so it has no
controlling terminal and is its own process group); a timeout, a maxBuffer overflow or a
cancellation ends the group with SIGTERM, a grace period, then SIGKILL; the pipes are drained
with a bound, so a grandchild that keeps them open cannot hang us.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fusion_oci.shims import REAPER

if TYPE_CHECKING:
    import subprocess

    from fusion_oci.models import OutputCallback, OutputStream
    from fusion_oci.models.stdin import StdinStream

DRAIN_LIMIT_S = 2.0


@dataclass(frozen=True)
class ProcessOutcome:
    stdout: bytes
    stderr: bytes
    returncode: int | None
    """Exit status, or None when a signal ended the process."""
    signal: str | None
    timed_out: bool
    truncated: bool
    duration_ms: int


def reaper_argv(
    argv: Sequence[str], rlimits: Sequence[tuple[str, int, int]] = (), grace_s: float = 2.0
) -> list[str]:
    """Wrap argv in the subreaper shim so that the whole tree can be ended."""
    limits = [f"{name}={soft}:{hard}" for name, soft, hard in rlimits]
    return [
        sys.executable,
        "-S",
        "-E",
        "-s",
        str(REAPER),
        str(grace_s),
        str(os.getpid()),
        *limits,
        "--",
        *argv,
    ]


PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ProbeOutcome:
    """What a short probe (:func:`probe`) gave: its exit status and output, or why it gave
    none."""

    argv: tuple[str, ...]
    returncode: int | None
    """Exit status (-N: signal N ended it); None: it could not be started, or timed out."""
    stdout: bytes = b""
    stderr: bytes = b""
    error: str | None = None
    """Why there is no exit status ("timed out after 10 s", the OSError); None: there is."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def text(self, stream: str = "stdout") -> str:
        """The stream decoded (invalid UTF-8 replaced)."""
        data = self.stdout if stream == "stdout" else self.stderr
        return data.decode("utf-8", errors="replace")


def probe(
    argv: Sequence[str], *, timeout_s: float = PROBE_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> ProbeOutcome:
    """Run a short synchronous probe (``tool --version``, ``unshare --user true``, a read-only
    ``git status``): argv list, stdin closed, output captured, its own session. A timeout
    SIGKILLs its whole group and drains the pipes with a bound, so a grandchild holding them
    cannot hang the caller (plain ``subprocess.run(timeout=)`` would). Never raises for the
    child's sake: a failure to start or a timeout is in :attr:`ProbeOutcome.error`."""
    import subprocess

    args = tuple(argv)
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=None if env is None else dict(env),
        )
    except OSError as exc:
        return ProbeOutcome(args, None, error=f"{args[0]} could not be run: {exc}")
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=DRAIN_LIMIT_S)
        except subprocess.TimeoutExpired:  # a child that left the group holds the pipes
            out, err = b"", b""
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()
        return ProbeOutcome(args, None, out, err, f"timed out after {timeout_s:g} s")
    return ProbeOutcome(args, proc.returncode, out, err)


def start_piped(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    """Start a child that talks over its pipes (stdin, stdout, stderr), in its own session,
    from ``/``: the caller bounds its reads and ends the group (fusion_oci/store/namespace.py)."""
    import subprocess

    return subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        cwd="/",
    )


def signal_name(returncode: int) -> str:
    """SIGTERM for -15 (a returncode that says a signal ended the process)."""
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"SIG{-returncode}"


class Flag(Protocol):
    """What a Capture sets past maxBuffer (an asyncio.Event, or a callback's trigger)."""

    def set(self) -> None: ...


class Capture:
    def __init__(
        self,
        limit: int,
        overflow: Flag,
        name: OutputStream = "stdout",
        on_output: OutputCallback | None = None,
        keep: bool = True,
    ) -> None:
        self.keep = keep
        self.name: OutputStream = name
        self.on_output = on_output
        self.limit = limit
        self.chunks: list[bytes] = []
        self.size = 0
        self.truncated = False
        self.overflow = overflow

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            wait = self.feed(chunk)
            if wait is not None:
                await wait  # the consumer is behind: read no more until it catches up

    def feed(self, chunk: bytes) -> Awaitable[object] | None:
        """Keep ``chunk`` (up to maxBuffer) and pass it on; returns what the output callback
        returned: an awaitable means the consumer is behind and the reader should wait."""
        wait = self.on_output(self.name, chunk) if self.on_output is not None else None
        if self.keep:
            room = self.limit - self.size
            if room > 0:
                self.chunks.append(chunk[:room])
                self.size += min(room, len(chunk))
            if len(chunk) > room:
                # Like Node's exec: past maxBuffer the command is ended.
                self.truncated = True
                self.overflow.set()
        return wait

    def data(self) -> bytes:
        return b"".join(self.chunks)


async def kill_group(proc: asyncio.subprocess.Process | None) -> None:
    """SIGKILL the process group of a child started in a session of its own (a launcher, an
    engine's CLI) and reap it; nothing when it never started or is already reaped. The wait
    is shielded: a cancelled caller still leaves no zombie and no group behind."""
    if proc is None or proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    await asyncio.shield(proc.wait())


async def _terminate(
    proc: asyncio.subprocess.Process,
    grace_s: float,
    group: bool,
    stop: Callable[[], Awaitable[object]] | None = None,
) -> None:
    """SIGTERM (the group, or only the leader when it ends the tree itself, or ``stop``),
    wait out the grace period, then SIGKILL the group."""
    if stop is not None:
        await stop()
    else:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def _feed(pipe: asyncio.StreamWriter, source: StdinStream) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        async for chunk in source:
            pipe.write(chunk)
            await pipe.drain()
    pipe.close()


async def run_process(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdin: bytes | StdinStream | None = None,
    timeout_s: float | None = None,
    max_buffer: int = 10 * 1024 * 1024,
    grace_s: float = 2.0,
    pass_fds: Sequence[int] = (),
    term_group: bool = True,
    stop: Callable[[], Awaitable[object]] | None = None,
    on_output: OutputCallback | None = None,
    keep_output: bool = True,
    on_spawn: Callable[[int], object] | None = None,
) -> ProcessOutcome:
    """Run argv to completion under the rules in the module docstring.

    ``term_group=False`` sends the first SIGTERM to the leader only: for the reaper shim or a
    launcher that ends its own tree (bwrap, an OCI runtime); SIGKILL always goes to the group.
    ``stop`` replaces that first SIGTERM when the tree lives outside the leader's process group
    (an OCI container: ``runc kill --all ID TERM``); grace and SIGKILL still follow.
    ``on_output`` gets each chunk of stdout and stderr as it arrives; ``keep_output=False``
    keeps none of it and lifts ``max_buffer`` (see RunOptions).
    ``on_spawn`` gets the child's pid as soon as it exists (bubblewrap sets rlimits on it and
    then hands it its arguments); if it raises, the group is killed and the error re-raised.
    """
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
    )
    if on_spawn is not None:
        try:
            on_spawn(proc.pid)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
    overflow = asyncio.Event()
    out = Capture(max_buffer, overflow, "stdout", on_output, keep_output)
    err = Capture(max_buffer, overflow, "stderr", on_output, keep_output)
    assert proc.stdout is not None and proc.stderr is not None
    readers = asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr))
    feeder: asyncio.Future[None] | None = None
    # (a StdinStream is told from bytes without importing models/: the store namespace's child
    # imports this module in an interpreter without site-packages, and models/ needs pydantic)
    if stdin is not None and not isinstance(stdin, bytes) and proc.stdin is not None:
        feeder = asyncio.ensure_future(_feed(proc.stdin, stdin))  # as it comes
    elif isinstance(stdin, bytes) and proc.stdin is not None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(stdin)
            await proc.stdin.drain()
        proc.stdin.close()
    waiter = asyncio.ensure_future(proc.wait())
    overflowed = asyncio.ensure_future(overflow.wait())
    timed_out = False
    try:
        done, _ = await asyncio.wait(
            {waiter, overflowed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if waiter not in done:
            timed_out = not done
            # The shim gets its own grace to end the tree; ours is a backstop above it.
            await _terminate(proc, grace_s + 1.0, term_group, stop)
    except asyncio.CancelledError:
        await asyncio.shield(_terminate(proc, grace_s + 1.0, term_group, stop))
        raise
    finally:
        overflowed.cancel()
        if feeder is not None:
            feeder.cancel()
        if not waiter.done():
            waiter.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(readers), DRAIN_LIMIT_S)
        except (TimeoutError, asyncio.CancelledError):
            readers.cancel()
    rc = proc.returncode
    return ProcessOutcome(
        stdout=out.data(),
        stderr=err.data(),
        returncode=rc if rc is not None and rc >= 0 else None,
        signal=signal_name(rc) if rc is not None and rc < 0 else None,
        timed_out=timed_out,
        truncated=out.truncated or err.truncated,
        duration_ms=int((time.monotonic() - start) * 1000),
    )
