"""sandbox:egress in the summary (dashboard and ``audit --summary``): per task, top denied."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from fusion_oci.audit import AuditEvent, AuditLog, EgressEvent, InboundEvent
from fusion_oci.cli.audit import render_egress
from fusion_oci.dashboard.report import full_summary
from fusion_oci.dashboard.summary import SummaryBuilder


def egress(task: str, host: str, allowed: bool, up: int = 0, down: int = 0) -> AuditEvent:
    return EgressEvent(
        task_id=task,
        run_id="r",
        backend="bubblewrap",
        host=host,
        port=443,
        allowed=allowed,
        bytes_up=up,
        bytes_down=down,
        rule="allowedDomains entry 'a.test'"
        if allowed
        else "no allowedDomains entry (or built-in profile host) matching it",
        reason=None if allowed else f"fusion-oci egress: {host}:443 denied",
    )


def test_egress_per_task_and_top_denied() -> None:
    builder = SummaryBuilder()
    events = [
        egress("t1", "a.test", True, 100, 5000),
        egress("t1", "evil.test", False),
        egress("t2", "evil.test", False),
        egress("t2", "other.test", False),
        egress("t2", "a.test", True, 10, 20),
    ]
    for i, e in enumerate(events, start=1):
        builder.add(i, e)
    out = builder.result()["egress"]
    assert (out["total"], out["allowed"], out["denied"]) == (5, 2, 3)
    assert (out["bytesUp"], out["bytesDown"]) == (110, 5020)
    assert out["byTask"] == [
        {
            "taskId": "t2",
            "connections": 3,
            "allowed": 1,
            "denied": 2,
            "bytesUp": 10,
            "bytesDown": 20,
            "hosts": 3,
            "services": 0,
            "inbound": 0,
        },
        {
            "taskId": "t1",
            "connections": 2,
            "allowed": 1,
            "denied": 1,
            "bytesUp": 100,
            "bytesDown": 5000,
            "hosts": 2,
            "services": 0,
            "inbound": 0,
        },
    ]
    assert [(r["host"], r["count"]) for r in out["topDenied"]] == [
        ("evil.test:443", 2),
        ("other.test:443", 1),
    ]
    assert out["topDenied"][0]["rule"].startswith("no allowedDomains entry")
    assert out["recentDenied"][0]["host"] == "other.test:443"


def test_empty_summary_has_an_egress_part() -> None:
    out = SummaryBuilder().result()["egress"]
    assert out == {
        "total": 0,
        "allowed": 0,
        "denied": 0,
        "bytesUp": 0,
        "bytesDown": 0,
        "services": 0,
        "inbound": 0,
        "byTask": [],
        "topDenied": [],
        "recentDenied": [],
    }


def test_audit_summary_document_and_text(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", key=b"")
    log.emit(egress("t1", "a.test", True, 1, 2))
    log.emit(egress("t1", "evil.test", False))
    data = full_summary(tmp_path / "audit.jsonl")
    assert data["egress"]["denied"] == 1
    buf = io.StringIO()
    render_egress(data, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "egress per task (1 allowed, 1 denied" in text
    assert "top denied hosts" in text and "evil.test:443" in text


def test_host_service_connections_are_counted_per_task() -> None:
    """policy.hostServices connections are sandbox:egress events with details.service."""
    builder = SummaryBuilder()
    granted = egress("t1", "127.0.0.1", True, 7, 9).model_copy(
        update={"details": {"service": "127.0.0.1:5432", "protocol": "tcp"}}
    )
    for i, e in enumerate([granted, granted, egress("t1", "a.test", True)], start=1):
        builder.add(i, e)
    out = builder.result()["egress"]
    assert out["services"] == 2 and out["byTask"][0]["services"] == 2
    assert out["byTask"][0]["connections"] == 3


def test_inbound_connections_to_published_ports_count_per_task() -> None:
    """publishPorts: each ``sandbox:inbound`` event counts in its task's row, beside (not
    among) the outbound connections."""
    builder = SummaryBuilder()
    builder.add(1, egress("t1", "a.test", True, 1, 2))
    for i in range(2):
        builder.add(
            2 + i,
            InboundEvent(
                task_id="t1",
                run_id="r",
                backend="bubblewrap",
                host="127.0.0.1",
                port=3000,
                address="127.0.0.1:8080",
                allowed=True,
                bytes_up=10,
                bytes_down=20,
            ),
        )
    out = builder.result()["egress"]
    assert out["inbound"] == 2 and out["allowed"] == 1
    assert out["byTask"][0]["inbound"] == 2 and out["byTask"][0]["connections"] == 1
