"""Which provisioning failures are worth another try, and how long to wait between tries.

Whether one engine failure is transient is decided where SDK errors are mapped
(:func:`fusion_oci.engines.errors.classify`); this module adds the rule for failed build steps
and the backoff.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import tenacity

from fusion_oci.engines.errors import EngineOpError, classify

if TYPE_CHECKING:
    from fusion_oci.images.gates import AuditContext

# Failures of a build step that are clearly about the network rather than the Containerfile.
_BUILD_NETWORK = re.compile(
    r"temporary failure resolving|could not resolve|failed to fetch|econnreset|etimedout|"
    r"eai_again|socket hang up|connection reset|connection timed out|"
    r"\b(500|502|503|504|429)\b",
    re.IGNORECASE,
)
_BUILD_SYNTAX = re.compile(
    r"unknown instruction|parse error|requires buildkit|"
    r"no such file or directory|failed to compute cache key",
    re.IGNORECASE,
)


def classify_build(message: str, log_tail: str) -> bool:
    """A failed build is transient only when its failing step's output shows a network blip."""
    if _BUILD_SYNTAX.search(message):
        return False
    return classify(message) or bool(_BUILD_NETWORK.search(log_tail))


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter and a cap. Tests pass ``RetryPolicy.immediate()``."""

    attempts: int = 4
    initial_s: float = 2.0
    max_s: float = 30.0
    jitter_s: float = 1.0
    multiplier: float = 2.0

    @classmethod
    def immediate(cls, attempts: int = 4) -> RetryPolicy:
        return cls(attempts=attempts, initial_s=0.0, max_s=0.0, jitter_s=0.0)

    def wait(self) -> tenacity.wait.wait_base:
        if self.max_s <= 0:
            return tenacity.wait_none()
        return _CappedExponentialJitter(self)

    def delay(self, attempt: int, jitter: float) -> float:
        """Wait after failed attempt ``attempt`` (1-based), ``jitter`` in [0, 1). Pure."""
        raw = self.initial_s * self.multiplier ** (attempt - 1) + jitter * self.jitter_s
        return max(0.0, min(self.max_s, raw))

    def retrying(
        self,
        is_transient: Callable[[BaseException], bool],
        before_sleep: Callable[[tenacity.RetryCallState], Any] | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> tenacity.Retrying:
        """A tenacity loop that retries only what ``is_transient`` accepts, then re-raises."""
        kwargs: dict[str, Any] = {}
        if sleep is not None:
            kwargs["sleep"] = sleep
        return tenacity.Retrying(
            stop=tenacity.stop_after_attempt(max(1, self.attempts)),
            wait=self.wait(),
            retry=tenacity.retry_if_exception(is_transient),
            before_sleep=before_sleep,
            reraise=True,
            **kwargs,
        )


class _CappedExponentialJitter(tenacity.wait.wait_base):
    """initial·multiplierⁿ⁻¹ plus uniform jitter, never above the cap (jitter included).

    Written out rather than tenacity's ``wait_exponential_jitter`` because its parameters
    changed between the tenacity versions our dependency range allows.
    """

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        import random

        jitter = random.random()  # noqa: S311 (spreading retries, not cryptography)
        return self.policy.delay(retry_state.attempt_number, jitter)


def run_attempts(
    fn: Callable[[int], Any],
    *,
    action: str,
    target: str,
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    on_attempt: Callable[[int, str, BaseException | None, float, float | None], None],
    sleep: Callable[[float], None] | None = None,
) -> Any:
    """Call ``fn(attempt)`` under ``policy``; report every attempt through ``on_attempt``.

    ``on_attempt(attempt, outcome, error, seconds, next_wait)`` gets ``outcome`` ok, retry
    (a transient failure with attempts left) or failed. Re-raises the last error.
    """
    import time

    state: dict[str, float] = {}

    def before_sleep(rs: tenacity.RetryCallState) -> None:
        wait = rs.next_action.sleep if rs.next_action else 0.0
        exc = rs.outcome.exception() if rs.outcome else None
        on_attempt(rs.attempt_number, "retry", exc, state["seconds"], wait)

    for attempt in policy.retrying(is_transient, before_sleep, sleep):
        with attempt:
            number = attempt.retry_state.attempt_number
            t0 = time.monotonic()
            try:
                result = fn(number)
            except BaseException as exc:
                state["seconds"] = time.monotonic() - t0
                last = number >= policy.attempts or not is_transient(exc)
                if last:
                    on_attempt(number, "failed", exc, state["seconds"], None)
                raise
            on_attempt(number, "ok", None, time.monotonic() - t0, None)
            return result
    raise AssertionError("unreachable: tenacity re-raises the last error")  # pragma: no cover


def is_transient_error(exc: BaseException) -> bool:
    """Only engine failures classified transient are retried."""
    return isinstance(exc, EngineOpError) and exc.transient


def audit_attempt(
    ctx: AuditContext,
    action: str,
    ref: str,
    engine: str,
    number: int,
    attempts: int,
    outcome: str,
    exc: BaseException | None,
    seconds: float,
    wait: float | None,
    **extra: object,
) -> None:
    """One ``sandbox:provision`` event per attempt: its number, outcome and reason."""
    message = ""
    if exc is not None:
        message = str(getattr(exc, "engine_message", None) or exc)
    transient = is_transient_error(exc) if exc is not None else False
    if outcome == "ok":
        reason = f"{action} attempt {number} succeeded"
    elif outcome == "retry":
        reason = (
            f"{action} attempt {number}/{attempts} failed (transient): "
            f"{message.splitlines()[0] if message else '?'}; retrying in {wait or 0:.1f}s"
        )
    else:
        kind = "transient, attempts exhausted" if transient else "permanent"
        reason = (
            f"{action} attempt {number}/{attempts} failed ({kind}): "
            f"{message.splitlines()[0] if message else '?'}"
        )
    ctx.emit(
        "sandbox:provision",
        reason,
        duration_ms=int(seconds * 1000),
        action=action,
        ref=ref,
        engine=engine,
        attempt=number,
        max_attempts=attempts,
        outcome=outcome,
        transient=transient if exc is not None else None,
        error=message or None,
        next_wait_s=round(wait, 3) if wait is not None else None,
        **extra,
    )
