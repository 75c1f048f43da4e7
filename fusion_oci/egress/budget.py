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
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fusion_oci.audit.events import event_time

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


WRITE_AFTER_S = 0.002
"""How long the writer lets a task's events queue up before it appends them."""


class _AuditQueue:
    """The events made on the proxy loop and not yet written, in the order they were made
    (every task's of this process): :data:`AUDIT_WRITER` writes whatever has queued up since
    it last looked, a batch per audit log (:meth:`AuditLog.emit_many
    <fusion_oci.audit.AuditLog.emit_many>`). One job at a time, handed to it only when none
    is running, and nothing handed back to the loop per event: a job and an asyncio future
    per event, each waking the loop when it was done, cost a busy task's relay about as much
    as the event itself (benchmarks/bench_services.py)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[AuditLog, str, dict[str, Any]]] = []
        self._job: Future[None] | None = None

    def put(self, audit: AuditLog, kind: str, fields: dict[str, Any]) -> Future[None]:
        """Queue one event (``kind``: its type, ``fields``: the model's); the job that will
        have written it when it is done."""
        with self._lock:
            self._items.append((audit, kind, fields))
            if self._job is None:
                self._job = AUDIT_WRITER.submit(self._write_all)
            return self._job

    def _write_all(self) -> None:
        # A moment for the events that follow this one (a command's connections come in
        # runs): one append for the lot, not an open, lock, read and write per event.
        time.sleep(WRITE_AFTER_S)
        while True:
            # Taken and, when empty, the job ended under one lock: whatever put() queued while
            # it saw this job is written by this job.
            with self._lock:
                items, self._items = self._items, []
                if not items:
                    self._job = None
                    return
            _write_batch(items)


def _write_batch(items: list[tuple[AuditLog, str, dict[str, Any]]]) -> None:
    """``items`` in order, one append per run of consecutive events of one log. A run that
    fails (its disk, a subscriber) loses no other run's events, as one job per event did."""
    from fusion_oci.audit import CONNECTION_EVENTS

    start = 0
    while start < len(items):
        audit = items[start][0]
        end = start + 1
        while end < len(items) and items[end][0] is audit:
            end += 1
        events = []
        for _, kind, fields in items[start:end]:
            # A bug's fields (refused by the model) cost that event, never the others', and
            # never the writer: a job that raised would leave the queue without one.
            with contextlib.suppress(Exception):
                events.append(CONNECTION_EVENTS[kind](**fields))
        with contextlib.suppress(Exception):  # as the per-event jobs' errors were: dropped
            audit.emit_many(events)
        start = end


_QUEUE = _AuditQueue()


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
        self._written: Future[None] | None = None
        """The writer's job that will have written every event made so far."""

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
        if self._written is not None and not self._written.done():
            await asyncio.wrap_future(self._written)

    def _write(self, **fields: Any) -> None:
        assert self.audit is not None
        kind = fields.pop("type")
        # Stamped now, built (validated) and written by the writer: off the loop.
        fields = {**self._base(), "ts": event_time(), **fields}
        self._written = _QUEUE.put(self.audit, kind, fields)


__all__ = [
    "AUDIT_WRITER",
    "BURST",
    "RATE_PER_S",
    "SUMMARY_EVERY_S",
    "AuditBudget",
    "BudgetedEvents",
]
