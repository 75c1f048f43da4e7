"""What a run through the exec agent ends as, whatever carried it (a local socket with the pipes
passed, or a byte stream with the output relayed): the agent's ``F`` and ``X`` read as a
:class:`~fusion_oci.host.process.ProcessOutcome`, the maxBuffer trigger, and :class:`AgentLike`,
what a runtime holds (PROTOCOL.md, "Frames" and "Over a byte stream")."""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import time
from collections.abc import AsyncIterable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from fusion_oci.errors import SandboxSetupError
from fusion_oci.host.process import Capture, ProcessOutcome, signal_name

if TYPE_CHECKING:
    from fusion_oci.agent.protocol import Spawn
    from fusion_oci.models import OutputCallback, RunOptions

Stdin = bytes | AsyncIterable[bytes] | None
"""None: /dev/null; bytes: fed then closed; an async iterable: streamed then closed."""

RLIMIT_NAMES = {
    str(getattr(resource, name)): name
    for name in dir(resource)
    if name.startswith("RLIMIT_") and name != "RLIMIT_OFILE"
}  # NOFILE's alias


class Failed(Exception):
    """The agent's ``F``: the command never ran."""

    def __init__(self, err: int, what: str) -> None:
        super().__init__(what)
        self.err = err
        self.what = what


class Trigger:
    """What a Capture sets past maxBuffer: it starts ending the run's tree."""

    def __init__(self, fire: Callable[[], None]) -> None:
        self.fire = fire
        self.fired = False

    def set(self) -> None:
        if not self.fired:
            self.fired = True
            self.fire()


def exec_failure(argv: Sequence[str], failed: Failed, err: Capture) -> int:
    """``F what=execve`` as a shell says it (127 not found, 126 otherwise, the reason on
    stderr); any other ``F`` is a setup error naming what failed."""
    reason = os.strerror(failed.err) if failed.err else "failed"
    if failed.what == "execve":
        code = 127 if failed.err == errno.ENOENT else 126
        text = "command not found" if code == 127 else reason
        err.feed(f"fusion-oci: {argv[0]}: {text}\n".encode())
        return code
    what = failed.what
    if what.startswith("setrlimit "):  # "setrlimit 7": name the limit as the spec does
        number = what.split(" ", 1)[1]
        what = "setrlimit " + RLIMIT_NAMES.get(number, number)
    raise SandboxSetupError(
        f"the exec agent could not start {argv[0]!r}",
        f"{what}: {reason}",
        "check the working directory, user and rlimits of the command",
    )


def outcome_of(
    argv: Sequence[str],
    exited: asyncio.Future[int],
    out: Capture,
    err: Capture,
    timed_out: bool,
    start: float,
) -> ProcessOutcome:
    """The outcome of a run whose ``exited`` is done: the raw wait status of ``X`` decoded
    (death by a signal stays that signal), or ``F`` read by :func:`exec_failure`."""
    try:
        status = exited.result()
    except Failed as failed:
        code = exec_failure(argv, failed, err)
        return ProcessOutcome(
            stdout=out.data(),
            stderr=err.data(),
            returncode=code,
            signal=None,
            timed_out=timed_out,
            truncated=False,
            duration_ms=int((time.monotonic() - start) * 1000),
        )
    rc = os.waitstatus_to_exitcode(status)
    return ProcessOutcome(
        stdout=out.data(),
        stderr=err.data(),
        returncode=rc if rc >= 0 else None,
        signal=signal_name(rc) if rc < 0 else None,
        timed_out=timed_out,
        truncated=out.truncated or err.truncated,
        duration_ms=int((time.monotonic() - start) * 1000),
    )


class AgentLike(Protocol):
    """What a runtime needs of its sandbox's agent, whatever carries it: the local
    :class:`~fusion_oci.agent.client.Agent` (a socket, the pipes passed) and the
    :class:`~fusion_oci.agent.streamed.StreamedAgent` (any byte stream) both are one."""

    peer_pid: int | None
    """The process at this host's end (the agent, a launcher, the mux or kubectl), if any."""
    agent_pid: int | None
    """The agent's pid as it sees itself (1 as a container's init)."""

    @property
    def lost(self) -> bool: ...

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
    ) -> ProcessOutcome: ...

    async def run_command(
        self, spawn: Spawn, opts: RunOptions, *, grace_s: float = 2.0
    ) -> ProcessOutcome: ...

    async def close(self) -> None: ...
