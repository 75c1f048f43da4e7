"""Each task's share of the one proxy loop every task's proxy runs on: measured, not guessed.

A task's handlers run as :class:`Metered` coroutines, whose every step's time is charged to the
task's :class:`LoopMeter`. The meter says how long a new connection waits at accept
(:meth:`LoopMeter.over_budget`) and how long a step of an admitted one waits
(:meth:`LoopMeter.step_wait`): only while another task has work under way, and only past the
task's fair share (:meth:`LoopMeter.fair_share`). See ``Limits.loop_share`` (:mod:`.proxy`).
"""

from __future__ import annotations

import asyncio
import math
import time
import weakref
from collections.abc import Callable, Coroutine, Generator
from typing import Any

SHARE_WINDOW_S = 1.0
"""The time constant of a task's measured loop share (and of its refusal rate)."""
REFUSALS_PER_S = 5.0
"""Refusals a second above which a task's loop share is the floor: a build that meets a
denied host now and then stays far below it."""
NEAR_BUDGET_GAP_S = 0.01
"""Between two connections a task admits while its share is past half its budget and
another task has work under way."""

_METERS: weakref.WeakSet[LoopMeter] = weakref.WeakSet()
"""The meters of every proxy serving in this process (all on the one proxy loop): whom a task
over its loop budget would hold up."""


class LoopMeter:
    """One task's use of the proxy loop, and what it may use now."""

    def __init__(self, floor: float) -> None:
        self.floor = floor
        """The least share a task may use while another has work (``Limits.loop_share``)."""
        self.loop_seconds = 0.0
        """Time on the proxy loop this task's connections have used in all (measured)."""
        self.working = 0
        """Connections past their first byte and not yet over."""
        self.admitted_at = 0.0
        """When the task last admitted a connection."""
        self._recent = 0.0
        """Loop seconds used lately: each charge added, the sum decaying with
        :data:`SHARE_WINDOW_S` (its share of the loop: this over the window)."""
        self._recent_at = time.monotonic()
        self._refusals = 0.0
        """Refusals lately (connections, requests, pushes), decaying like ``_recent``: a task
        that keeps being refused gets no more than the floor (see :meth:`fair_share`)."""
        self._refusals_at = time.monotonic()

    def register(self) -> None:
        """Count this task among those sharing the loop (while it serves)."""
        _METERS.add(self)

    def unregister(self) -> None:
        _METERS.discard(self)

    def charge(self, seconds: float) -> None:
        self.recent_share()  # decayed up to now, then this step added
        self._recent += seconds
        self.loop_seconds += seconds

    def refused(self) -> None:
        self.refusal_rate()  # decayed up to now, then this one added
        self._refusals += 1.0

    def recent_share(self) -> float:
        now = time.monotonic()
        self._recent *= math.exp(-(now - self._recent_at) / SHARE_WINDOW_S)
        self._recent_at = now
        return self._recent / SHARE_WINDOW_S

    def refusal_rate(self) -> float:
        now = time.monotonic()
        self._refusals *= math.exp(-(now - self._refusals_at) / SHARE_WINDOW_S)
        self._refusals_at = now
        return self._refusals / SHARE_WINDOW_S

    def fair_share(self) -> float:
        """The loop share this task may use now: an equal part among the tasks with work
        under way, and never less than the floor. A task that needs much of the loop (TLS of
        a brokered registry) is held back only as far as others need it too; one that keeps
        being refused (a flood of denied CONNECTs, push bombs: work nobody asked for) is held
        to the floor."""
        if self.refusal_rate() > REFUSALS_PER_S:
            return self.floor
        working = sum(1 for m in _METERS if m.working or m is self)
        return max(self.floor, 1.0 / max(working, 1))

    def _others_working(self) -> bool:
        # Demand, not use: a neighbour this task starves uses little of the loop.
        return any(m is not self and m.working for m in _METERS)

    def step_wait(self) -> float:
        """Seconds a step of this task's handlers waits before it runs: while the task is
        over its share and another has work under way (0 otherwise). Connections admitted
        before the share showed their cost are held here, not only new ones at accept."""
        share, budget = self.recent_share(), self.fair_share()
        if share <= budget or not self._others_working():
            return 0.0
        return min(SHARE_WINDOW_S * math.log(share / budget), SHARE_WINDOW_S)

    def over_budget(self) -> float:
        """Seconds a new connection waits at accept before the task's share is back within
        its fair share (0: it is, or no other task has a connection under way: then nobody is
        held up)."""
        share, budget = self.recent_share(), self.fair_share()
        if share <= budget / 2 or not self._others_working():
            return 0.0
        if share > budget:
            return SHARE_WINDOW_S * math.log(share / budget)
        # Near the budget, one connection per NEAR_BUDGET_GAP_S: a connection's cost shows
        # in the share only as it runs, and many admitted at once overshoot it.
        return max(0.0, self.admitted_at + NEAR_BUDGET_GAP_S - time.monotonic())


class Metered(Coroutine[Any, Any, None]):
    """A coroutine whose every step's time on the loop is charged (``charge(seconds)``): a
    task's share of the loop every task shares is measured, not guessed. With ``gate``, a
    step waits first while ``gate()`` says so (a future handed to the Task, as an ``await``
    would): the task's steps, not only its new connections, are held back while it is over
    its share."""

    __slots__ = ("_charge", "_coro", "_gate", "_held")

    def __init__(
        self,
        coro: Coroutine[Any, Any, None],
        charge: Callable[[float], None],
        gate: Callable[[], float] | None,
    ) -> None:
        self._coro = coro
        self._charge = charge
        self._gate = gate
        self._held: list[Any] = []
        """The value a held step was to be resumed with (one at most)."""

    def send(self, value: Any) -> Any:
        if self._held:
            value = self._held.pop()
        elif self._gate is not None:
            wait = self._gate()
            if wait > 0:
                self._held.append(value)
                loop = asyncio.get_running_loop()
                later: asyncio.Future[None] = loop.create_future()
                later._asyncio_future_blocking = True  # what a Task waits on

                def wake() -> None:
                    if not later.done():
                        later.set_result(None)

                loop.call_later(wait, wake)
                return later
        start = time.perf_counter()
        try:
            return self._coro.send(value)
        finally:
            self._charge(time.perf_counter() - start)

    def throw(self, *args: Any) -> Any:
        self._held.clear()  # a held step is not resumed: the exception goes in instead
        start = time.perf_counter()
        try:
            return self._coro.throw(*args)
        finally:
            self._charge(time.perf_counter() - start)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, None]:
        return self._coro.__await__()
