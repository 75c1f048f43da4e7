"""Audit events as one model per type: old logs still read, re-serialise byte for byte and
verify, and every consumer sees them as it did.

``tests/data/audit/main-243ce86.jsonl`` was written by the single flat ``AuditEvent`` model
(commit 243ce86), through the real ``AuditLog`` writer under :data:`KEY`: one line (or more,
one per writer's field set) for every event type the code emits, the first line from before the
log had a chain. ``main-243ce86.observed.json`` is what that commit's consumers (the dashboard
summary, OpenTelemetry spans and metrics, ``fusion-oci audit`` and ``audit --json``) made of
it, computed by :func:`observe` there; this module's top-level imports are the ones that commit
had, so that :func:`observe` runs on both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, get_args

import pytest

from fusion_oci.audit import AuditLog, EventType, read_events, verify_chain
from tests.golden import DATA

LOG = DATA / "audit" / "main-243ce86.jsonl"
OBSERVED = DATA / "audit" / "main-243ce86.observed.json"
KEY = b"fusion-oci audit fixture key 32b"


def observe(path: Path, state: Path) -> dict[str, Any]:
    """What the consumers make of the log at ``path`` (``state``: an empty state folder, so
    the CLI finds no audit key)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from typer.testing import CliRunner

    from fusion_oci.cli.main import app
    from fusion_oci.dashboard.summary import SummaryBuilder
    from fusion_oci.otel import OtelSubscriber

    events = list(read_events(path))
    summary = SummaryBuilder()
    for n, event in enumerate(events, start=1):
        summary.add(n, event)

    spans = InMemorySpanExporter()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    subscriber = OtelSubscriber(tracer, meters)
    for event in events:
        subscriber(event)
    subscriber.close()
    names = {s.context.span_id: s.name for s in spans.get_finished_spans() if s.context}
    span_rows = [
        {
            "name": s.name,
            "parent": names.get(s.parent.span_id) if s.parent else None,
            "start": s.start_time,
            "end": s.end_time,
            "status": [s.status.status_code.name, s.status.description],
            "attributes": {
                k: list(v) if isinstance(v, tuple) else v for k, v in s.attributes.items()
            }
            if s.attributes
            else {},
        }
        for s in spans.get_finished_spans()
    ]
    data = reader.get_metrics_data()
    metric_rows = sorted(
        (
            m.name,
            sorted(p.attributes.items()) if p.attributes else [],
            getattr(p, "value", None),
            getattr(p, "sum", None),
            getattr(p, "count", None),
        )
        for rm in (data.resource_metrics if data else [])
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
    )
    tracer.shutdown()
    meters.shutdown()

    env = {"XDG_STATE_HOME": str(state), "FUSION_OCI_NO_SERVER": "1"}
    cli: dict[str, str] = {}
    for name, extra in (("table", []), ("json", ["--json"])):
        result = CliRunner().invoke(
            app, ["audit", "--audit-log", str(path), "--limit", "100", *extra], env=env
        )
        assert result.exit_code == 0, result.output
        cli[name] = result.output.replace(str(path), "<log>")
    return {
        "summary": summary.result(),
        "spans": span_rows,
        "metrics": [list(row) for row in metric_rows],
        "cli": cli,
    }


def test_the_fixture_has_every_event_type() -> None:
    from fusion_oci.audit import AuditEvent

    assert {e.type for e in read_events(LOG)} == set(get_args(EventType))
    # One model per type, and the union holds them all.
    members = get_args(get_args(AuditEvent)[0])
    assert sorted(m.model_fields["type"].default for m in members) == sorted(get_args(EventType))
    # The chain's fields close every line (the writer splices the MAC in as the last key).
    assert all(list(m.model_fields)[-2:] == ["prev", "mac"] for m in members)


def test_old_lines_read_as_the_model_of_their_type_and_reserialise_byte_for_byte() -> None:
    from fusion_oci.audit import parse_event

    lines = LOG.read_bytes().splitlines()
    events = list(read_events(LOG))
    assert len(events) == len(lines)
    for line, event in zip(lines, events, strict=True):
        assert type(event).__name__.lower() == event.type.removeprefix("sandbox:") + "event"
        assert event.model_dump_json(by_alias=True, exclude_none=True).encode() == line
        assert parse_event(line) == event


def test_the_old_chain_verifies_and_a_rewrite_is_the_same_file(tmp_path: Path) -> None:
    report = verify_chain(LOG, KEY)
    assert report.ok and report.keyed and report.lines == 22, report
    assert verify_chain(LOG).ok
    # The same events through today's writer, under the same key: the same bytes.
    copy = tmp_path / "audit.jsonl"
    first = LOG.read_bytes().splitlines(keepends=True)[0]
    copy.write_bytes(first)
    log = AuditLog(copy, key=KEY)
    for event in list(read_events(LOG))[1:]:
        log.emit(event.model_copy(update={"prev": None, "mac": None}))
    assert copy.read_bytes() == LOG.read_bytes()


def test_a_batch_writes_the_same_bytes_as_one_event_at_a_time(tmp_path: Path) -> None:
    """emit_many (a task's connections, batched) chains each event to the one before."""
    events = [e.model_copy(update={"prev": None, "mac": None}) for e in read_events(LOG)]
    one, many = tmp_path / "one.jsonl", tmp_path / "sub" / "many.jsonl"
    log = AuditLog(one, key=KEY)
    for event in events:
        log.emit(event)
    batched = AuditLog(many, key=KEY)  # its folder made on first use
    batched.emit_many(events[:1])
    batched.emit_many(events[1:7])
    batched.emit_many(events[7:])
    assert many.read_bytes() == one.read_bytes()
    assert verify_chain(many, KEY).ok


def test_an_event_of_one_type_refuses_the_fields_of_another() -> None:
    from pydantic import ValidationError

    from fusion_oci.audit import parse_event

    with pytest.raises(ValidationError):
        parse_event({"type": "sandbox:dispose", "task_id": "t", "run_id": "r", "backend": "b",
                     "exit_code": 0})  # fmt: skip
    with pytest.raises(ValidationError):
        parse_event({"type": "sandbox:nope", "task_id": "t", "run_id": "r", "backend": "b"})


def test_consumers_see_the_old_log_as_before(tmp_path: Path) -> None:
    import json

    got = json.loads(json.dumps(observe(LOG, tmp_path)))
    if os.environ.get("FUSION_OCI_UPDATE_GOLDEN") == "1":
        pytest.fail("this golden is written by commit 243ce86's consumers, not by today's")
    assert got == json.loads(OBSERVED.read_text())
