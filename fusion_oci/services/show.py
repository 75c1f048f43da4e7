"""What ``settings show``, ``plan`` and ``doctor`` say about a task's host-service grants:
each grant, what it gives the task, and, for one that hands over the host, what."""

from __future__ import annotations

from fusion_oci.models import SandboxPolicy
from fusion_oci.models.hostservice import describe, hands_over

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


PUBLISH_KEY = "sandbox.policy.publishPorts"


def publish_summary(policy: SandboxPolicy) -> list[dict[str, object]]:
    """One entry a published port: ``port`` (inside), ``hostPort`` (None: a free one, chosen
    at prepare), ``address`` (the host's), ``loopback`` (False: reachable from other hosts
    too), ``gives``. Pure."""
    out: list[dict[str, object]] = []
    for entry in policy.published():
        reach = (
            "this host's processes"
            if entry.loopback
            else "EVERY HOST THAT CAN REACH THIS ONE (not the loopback)"
        )
        out.append(
            {
                "port": entry.port,
                "hostPort": entry.host_port or None,
                "address": entry.address,
                "loopback": entry.loopback,
                "gives": (
                    f"{reach} a connection to what a command listens on at the sandbox's "
                    f"127.0.0.1:{entry.port}, on {entry.host()}"
                    + ("" if entry.host_port else " (a free port, reported at prepare)")
                ),
            }
        )
    return out


def publish_lines(summary: list[dict[str, object]]) -> list[str]:
    """``plan``'s and ``doctor``'s lines, one a published port."""
    return [f"publishPorts {e['port']}: gives {e['gives']}" for e in summary]


def publish_rows(policy: SandboxPolicy) -> list[dict[str, object]]:
    """Rows ``{"key", "value", "source"}`` for ``settings show``, one a published port. Pure."""
    return [
        {
            "key": f"ports.published[{i}]",
            "value": f"{e['address']}:{e['hostPort'] or '*'} -> {e['port']}",
            "source": f"{PUBLISH_KEY}[{i}]: gives {e['gives']}",
        }
        for i, e in enumerate(publish_summary(policy))
    ]
