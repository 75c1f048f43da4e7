"""One task's proxy writes a burst of audit events, then a few a second, and counts the rest."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fusion_oci.audit import AuditEvent, AuditLog, EgressEvent, read_events, verify_chain
from fusion_oci.dashboard.summary import SummaryBuilder
from fusion_oci.egress.budget import AuditBudget, BudgetedEvents


def test_a_burst_then_the_rate_then_counts() -> None:
    budget = AuditBudget(burst=3, rate=2.0, stamp=0.0, tokens=3.0)
    assert [budget.take(0.0) for _ in range(4)] == [True, True, True, False]
    budget.hold("sandbox:egress refused")
    assert budget.summary(0.5) == {"sandbox:egress refused": 1}  # the first one: at once
    budget.hold("sandbox:egress refused")
    assert budget.summary(1.0) is None  # the next not within a second of the last
    assert budget.take(1.0)  # half a second at 2 a second: one token
    assert budget.summary(1.6) == {"sandbox:egress refused": 1}
    assert budget.summary(9.0, force=True) is None  # nothing held


def test_the_dashboard_counts_what_was_held_back() -> None:
    summary = SummaryBuilder()
    summary.add(
        1,
        EgressEvent(
            task_id="t",
            run_id="r",
            backend="bubblewrap",
            allowed=False,
            details={"suppressed": {"sandbox:egress refused": 40, "sandbox:egress allowed": 2}},
        ),
    )
    egress = summary.result()["egress"]
    assert (egress["allowed"], egress["denied"], egress["topDenied"]) == (2, 40, [])


def test_events_made_in_a_burst_are_all_written_in_order_by_drain(tmp_path: Path) -> None:
    """The writer batches what queued up (fusion_oci.egress.budget._AuditQueue): every event
    still one chained line, in the order made, all of them on the file when drain returns."""
    log = AuditLog(tmp_path / "audit.jsonl", key=b"k" * 32)
    seen: list[int] = []
    log.subscribe(lambda event: seen.append(_port(event)))

    async def burst() -> None:
        events = BudgetedEvents(log, lambda: {"task_id": "t", "run_id": "r", "backend": "b"}, "x")
        for port in range(1, 201):
            events.emit(type="sandbox:egress", allowed=True, host="127.0.0.1", port=port)
            if port % 50 == 0:
                await asyncio.sleep(0)  # let the writer catch some mid-way
        await events.drain()

    asyncio.run(burst())
    ports = [_port(event) for event in read_events(tmp_path / "audit.jsonl")]
    assert ports == list(range(1, 201)) == seen
    assert verify_chain(tmp_path / "audit.jsonl", b"k" * 32).ok


def test_a_subscriber_that_raises_loses_no_other_event(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", key=b"")
    seen: list[int] = []

    def picky(event: AuditEvent) -> None:
        if _port(event) == 2:
            raise RuntimeError("a subscriber's bug")
        seen.append(_port(event))

    log.subscribe(picky)
    events = [
        EgressEvent(task_id="t", run_id="r", backend="b", allowed=True, port=p) for p in (1, 2, 3)
    ]
    with pytest.raises(RuntimeError):
        log.emit_many(events)
    assert [_port(e) for e in read_events(tmp_path / "audit.jsonl")] == [1, 2, 3]
    assert seen == [1, 3]


def _port(event: AuditEvent) -> int:
    assert isinstance(event, EgressEvent) and event.port is not None
    return event.port
