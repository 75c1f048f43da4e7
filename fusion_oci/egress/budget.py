"""How many audit events one task's proxy writes: a token bucket, and a count of the rest.

Every connection through a task's proxy is an audit event, appended to the project's audit log
with a MAC, under a lock that the project's other tasks share. A command can open connections
as fast as the proxy refuses them (9,000 refused CONNECTs in 5 s, 6 MB of log, measured
before this budget), and so fill the disk and hold the lock that everyone else's events wait
for. The budget lets bursts through whole (``burst`` events, a ``pnpm install`` opens a few
dozen connections) and then ``rate`` a second; what it holds back is counted, by event type and
outcome, and written as one ``suppressed`` summary at most once a second (and when the proxy
stops), so the log says how much it does not show one by one. A flood then costs about ten
lines a second.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog


class TaskStamped:
    """Who a task's events are about: the fields every event of its proxy, service relays and
    published ports carries (:class:`BudgetedEvents` takes :meth:`task_fields`); the run id is
    the one :meth:`set_run` last named."""

    task_id: str
    backend: str
    policy_hash: str | None
    run_id: str | None

    def set_run(self, run_id: str | None) -> None:
        """Events from now on are audited with this run id."""
        self.run_id = run_id

    def task_fields(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "run_id": self.run_id or "-",
            "backend": self.backend,
            "policy_hash": self.policy_hash,
        }


BURST = 256
RATE_PER_S = 8.0
SUMMARY_EVERY_S = 1.0


@dataclass
class AuditBudget:
    """A token bucket over one proxy's events (module docstring). Not thread-safe: the proxy
    uses it on its loop only."""

    burst: int = BURST
    rate: float = RATE_PER_S
    tokens: float = float(BURST)
    stamp: float = field(default_factory=time.monotonic)
    held: Counter[str] = field(default_factory=Counter)
    """Events held back since the last summary, by ``type allowed|refused``."""
    summarized: float = float("-inf")

    def take(self, now: float | None = None) -> bool:
        """Whether one more event may be written now."""
        now = time.monotonic() if now is None else now
        self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def hold(self, kind: str) -> None:
        self.held[kind] += 1

    def summary(self, now: float | None = None, *, force: bool = False) -> dict[str, int] | None:
        """What was held back since the last summary (and forget it), or None when nothing
        was or the last summary is younger than SUMMARY_EVERY_S (unless ``force``)."""
        now = time.monotonic() if now is None else now
        if not self.held or (not force and now - self.summarized < SUMMARY_EVERY_S):
            return None
        out = dict(self.held)
        self.held.clear()
        self.summarized = now
        return out


AUDIT_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusion-oci-egress-audit")
"""Where every proxy's and relay's audit appends run: off the proxy loop (the append takes a
flock, so a slow disk stalls no tunnel), one at a time, in the order they were made. A thread
per event (``asyncio.to_thread``) let a later event land before an earlier one."""


class BudgetedEvents:
    """One task part's audit events (a proxy's, the service relays'), written by
    :data:`AUDIT_WRITER` in the order they were made, within an :class:`AuditBudget`. Used on
    the proxy loop only. ``base``: the task's fields at the time of writing (its run id
    changes); ``what``: who held events back, for the summary's text; ``summary``: details the
    summary carries besides the counts."""

    def __init__(
        self,
        audit: AuditLog | None,
        base: Callable[[], dict[str, Any]],
        what: str,
        summary: dict[str, Any] | None = None,
    ) -> None:
        self.audit = audit
        self.budget = AuditBudget()
        self._base = base
        self._what = what
        self._summary = summary or {}
        self._pending: set[asyncio.Future[None]] = set()

    def emit(self, **fields: Any) -> None:
        """One event, or its count when the budget holds it back (then a summary, at most
        once a second)."""
        if self.audit is None:
            return
        if self.budget.take():
            self._write(**fields)
        else:
            outcome = "allowed" if fields.get("allowed") else "refused"
            self.budget.hold(f"{fields.get('type')} {outcome}")
        self.flush()

    def flush(self, *, force: bool = False) -> None:
        """The summary of what the budget held back, if anything was."""
        held = self.budget.summary(force=force) if self.audit is not None else None
        if held is None:
            return
        self._write(
            type="sandbox:egress",
            allowed=False,
            reason=(
                f"{sum(held.values())} events of this task's {self._what} were not written one "
                f"by one: over the audit budget ({self.budget.burst} at once, then "
                f"{self.budget.rate:g} a second)"
            ),
            details={"suppressed": held, **self._summary},
        )

    async def drain(self) -> None:
        """The last summary, then every append made so far, done."""
        self.flush(force=True)
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    def _write(self, **fields: Any) -> None:
        assert self.audit is not None
        from fusion_oci.audit import CONNECTION_EVENTS

        event = CONNECTION_EVENTS[fields.pop("type")](**self._base(), **fields)
        loop = asyncio.get_running_loop()
        future = asyncio.ensure_future(loop.run_in_executor(AUDIT_WRITER, self.audit.emit, event))
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)


__all__ = [
    "AUDIT_WRITER",
    "BURST",
    "RATE_PER_S",
    "SUMMARY_EVERY_S",
    "AuditBudget",
    "BudgetedEvents",
]
