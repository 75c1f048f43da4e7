"""One task's proxy writes a burst of audit events, then a few a second, and counts the rest."""

from __future__ import annotations

from fusion_oci.audit import EgressEvent
from fusion_oci.dashboard.summary import SummaryBuilder
from fusion_oci.egress.budget import AuditBudget


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
