"""How a command ended: the one 128+N rule and the one precedence of end reasons, for every
runtime (they only supply what their cgroup or engine counted). Pure."""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass

from fusion_oci.host.process import ProcessOutcome
from fusion_oci.models import EndReason, RunResult
from fusion_oci.oci.model import ProcessSpec


@dataclass(frozen=True)
class LimitCounters:
    """What a command's cgroup (or engine) counted while it ran; 0: nothing, or not known."""

    oom_kills: int = 0
    """Processes the OOM killer ended."""
    pids_max: int = 0
    """fork/clone calls refused at pidsLimit."""


def status_from_code(code: int | None, signal: str | None = None) -> tuple[int | None, str | None]:
    """The one 128+N rule: a launcher's (bwrap, runc, an engine's exec) status 128+N, N a real
    signal (1..64), is death by that signal, as a shell reports it. Pure.

    A command that itself exits 129..192 reads the same; ``shell_status`` is equal either way.
    """
    if code is not None and 128 < code <= 128 + 64:
        try:
            return None, _signal.Signals(code - 128).name
        except ValueError:
            return code, signal
    return code, signal


def classify(
    outcome: ProcessOutcome, process: ProcessSpec, counters: LimitCounters = LimitCounters()
) -> EndReason:
    """Why a command ended: one precedence for every runtime (they only supply counters). Pure.

    A cgroup limit that fired names the reason whenever the command did not succeed, before
    the timeout: a fork bomb held at pidsLimit until the timeout is ``pids`` (``timed_out``
    stays true), a build the OOM killer took is ``oom``; a command that survived a limit and
    exited 0 ended by its own exit. Then timeout, maxBuffer, CPU time (SIGXCPU, or SIGKILL
    with RLIMIT_CPU on the process), another signal, the command's own exit.
    """
    succeeded = (
        outcome.returncode == 0
        and outcome.signal is None
        and not outcome.timed_out
        and not outcome.truncated
    )
    if not succeeded and counters.oom_kills:
        return "oom"
    if not succeeded and counters.pids_max:
        return "pids"
    if outcome.timed_out:
        return "timeout"
    if outcome.truncated:
        return "max-buffer"
    if outcome.signal is None:
        return "exit"
    has_cpu = process.rlimit("RLIMIT_CPU") is not None
    if outcome.signal == _signal.Signals.SIGXCPU.name or (has_cpu and outcome.signal == "SIGKILL"):
        return "cpu-time"
    return "signal"


def run_result(backend: str, outcome: ProcessOutcome, reason: EndReason) -> RunResult:
    """The caller's :class:`RunResult` of a finished command. Pure."""
    return RunResult(
        stdout=outcome.stdout.decode("utf-8", errors="replace"),
        stderr=outcome.stderr.decode("utf-8", errors="replace"),
        exit_code=outcome.returncode,
        signal=outcome.signal,
        timed_out=outcome.timed_out,
        truncated=outcome.truncated,
        duration_ms=outcome.duration_ms,
        backend=backend,
        reason=reason,
    )
