"""The one outcome classifier and the one 128+N rule every runtime uses (runtimes/outcome.py)."""

from __future__ import annotations

import pytest

from fusion_oci.host.process import ProcessOutcome
from fusion_oci.oci.model import ProcessSpec, Rlimit, User
from fusion_oci.runtimes.outcome import LimitCounters, classify, status_from_code

SPEC = ProcessSpec(user=User(uid=0, gid=0), args=["true"], cwd="/")
CPU_SPEC = SPEC.model_copy(update={"rlimits": [Rlimit(type="RLIMIT_CPU", soft=1, hard=2)]})


def outcome(
    code: int | None = None,
    signal: str | None = None,
    *,
    timed_out: bool = False,
    truncated: bool = False,
) -> ProcessOutcome:
    return ProcessOutcome(b"", b"", code, signal, timed_out, truncated, 1)


@pytest.mark.parametrize(
    ("out", "counters", "spec", "reason"),
    [
        (outcome(0), LimitCounters(pids_max=3), SPEC, "exit"),  # survived a limit, then exit 0
        (outcome(None, "SIGKILL"), LimitCounters(oom_kills=1), SPEC, "oom"),
        # A fork bomb held at pidsLimit until the timeout: the limit is the reason, everywhere.
        (outcome(None, "SIGTERM", timed_out=True), LimitCounters(pids_max=10), SPEC, "pids"),
        (outcome(None, "SIGTERM", timed_out=True), LimitCounters(), SPEC, "timeout"),
        (outcome(2, truncated=True), LimitCounters(), SPEC, "max-buffer"),
        (outcome(2, truncated=True), LimitCounters(oom_kills=1), SPEC, "oom"),
        (outcome(None, "SIGXCPU"), LimitCounters(), SPEC, "cpu-time"),
        (outcome(None, "SIGKILL"), LimitCounters(), CPU_SPEC, "cpu-time"),
        (outcome(None, "SIGKILL"), LimitCounters(), SPEC, "signal"),
        (outcome(3), LimitCounters(), SPEC, "exit"),
    ],
)
def test_one_precedence(
    out: ProcessOutcome, counters: LimitCounters, spec: ProcessSpec, reason: str
) -> None:
    assert classify(out, spec, counters) == reason


@pytest.mark.parametrize(
    ("code", "read"),
    [
        (0, (0, None)),
        (1, (1, None)),
        (128, (128, None)),
        (129, (None, "SIGHUP")),
        (137, (None, "SIGKILL")),
        (143, (None, "SIGTERM")),
        (152, (None, "SIGXCPU")),
        (255, (255, None)),
        (None, (None, None)),
    ],
)
def test_one_128_plus_n_rule(code: int | None, read: tuple[int | None, str | None]) -> None:
    assert status_from_code(code) == read


def test_every_runtime_reads_statuses_through_the_one_rule() -> None:
    from fusion_oci.runtimes.oci import exit_status as oci_status

    for code in (0, 1, 129, 137, 152, 192, 193, 255):
        want = status_from_code(code)
        assert oci_status(code, None) == want
