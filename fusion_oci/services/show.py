"""What ``settings show``, ``plan`` and ``doctor`` say about a task's host-service grants:
each grant, what it gives the task, and, for one that hands over the host, what."""

from __future__ import annotations

from fusion_oci.hostservice import describe, hands_over
from fusion_oci.models import SandboxPolicy

KEY = "sandbox.policy.hostServices"


def grant_summary(policy: SandboxPolicy) -> list[dict[str, object]]:
    """One entry a grant: ``grant``, ``gives``, ``handsOver`` (None, or what it hands over:
    granted only with ``dangerous: true``), ``dangerous``. Pure."""
    return [
        {
            "grant": str(grant),
            "gives": describe(grant),
            "handsOver": hands_over(grant),
            "dangerous": dangerous,
        }
        for grant, dangerous in policy.grants()
    ]


def grant_rows(policy: SandboxPolicy) -> list[dict[str, object]]:
    """Rows ``{"key", "value", "source"}`` (the settings table's shape), one a grant. Pure."""
    rows: list[dict[str, object]] = []
    for i, entry in enumerate(grant_summary(policy)):
        source = f"{KEY}[{i}]: gives {entry['gives']}"
        if entry["handsOver"]:
            source += f"; HANDS OVER THE HOST: {entry['handsOver']} (dangerous: true)"
        rows.append({"key": f"services.granted[{i}]", "value": entry["grant"], "source": source})
    return rows
