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

import time
from collections import Counter
from dataclasses import dataclass, field

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


__all__ = ["BURST", "RATE_PER_S", "SUMMARY_EVERY_S", "AuditBudget"]
