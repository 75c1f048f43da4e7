"""OpenTelemetry spans and metrics from audit events, checked with the SDK's in-memory
exporter and reader."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from fusion_oci import otel
from fusion_oci.audit import (
    AuditLog,
    DisposeEvent,
    FallbackEvent,
    PrepareEvent,
    RunEvent,
)
from fusion_oci.errors import SettingsError


@pytest.fixture
def providers() -> Any:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield tracer_provider, meter_provider, spans, reader
    tracer_provider.shutdown()
    meter_provider.shutdown()


def lifecycle(log: AuditLog) -> None:
    base = {"task_id": "task-1", "run_id": "run-1", "backend": "native", "policy_hash": "ab" * 32}
    log.emit(
        FallbackEvent(
            reason="bwrap missing",
            fell_back=True,
            ts="2026-12-01T09:00:00.000+00:00",
            **base,
        )
    )
    log.emit(
        PrepareEvent(
            ts="2026-12-01T09:00:00.250+00:00",
            duration_ms=250,
            unenforced=["memory", "network"],
            fell_back=True,
            **base,
        )
    )
    log.emit(
        RunEvent(
            ts="2026-12-01T09:00:02.000+00:00",
            duration_ms=1500,
            exit_code=0,
            end_reason="exit",
            command="pnpm test --filter secret=hunter2",
            unenforced=["memory", "network"],
            **base,
        )
    )
    log.emit(
        RunEvent(
            ts="2026-12-01T09:00:05.000+00:00",
            duration_ms=3000,
            exit_code=None,
            end_reason="timeout",
            timed_out=True,
            signal="SIGKILL",
            command="pnpm build",
            **base,
        )
    )
    log.emit(DisposeEvent(ts="2026-12-01T09:00:05.010+00:00", duration_ms=10, **base))


def test_a_span_per_prepare_run_and_dispose(providers: Any) -> None:
    tracer_provider, meter_provider, spans, _ = providers
    log = AuditLog()
    otel.attach(log, tracer_provider, meter_provider)
    lifecycle(log)
    got = spans.get_finished_spans()
    assert [s.name for s in got] == [
        "sandbox.prepare",
        "sandbox.run",
        "sandbox.run",
        "sandbox.dispose",
        "sandbox",
    ]
    prepare, ok, timeout, dispose, root = got
    # one trace per sandbox: the lifecycle spans are children of the `sandbox` span
    assert root.parent is None and root.context is not None
    for child in (prepare, ok, timeout, dispose):
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context is not None
        assert child.context.trace_id == root.context.trace_id
    assert (root.start_time, root.end_time) == (prepare.start_time, dispose.end_time)
    assert prepare.attributes is not None and ok.attributes is not None
    assert prepare.attributes["fusion_oci.task_id"] == "task-1"
    assert prepare.attributes["fusion_oci.run_id"] == "run-1"
    assert prepare.attributes["fusion_oci.backend"] == "native"
    assert tuple(prepare.attributes["fusion_oci.unenforced"]) == ("memory", "network")
    assert ok.attributes["fusion_oci.end_reason"] == "exit"
    # the span lasts the event's duration and ends at its time
    assert ok.end_time is not None and ok.start_time is not None
    assert ok.end_time - ok.start_time == 1500 * 1_000_000
    # only the program, never the command line's arguments, leaves the host
    assert ok.attributes["fusion_oci.program"] == "pnpm"
    assert not any("hunter2" in str(v) for s in got for v in (s.attributes or {}).values())
    assert ok.status.status_code is StatusCode.UNSET
    assert timeout.status.status_code is StatusCode.ERROR
    assert timeout.attributes is not None
    assert timeout.attributes["fusion_oci.end_reason"] == "timeout"
    assert dispose.attributes is not None and dispose.attributes["fusion_oci.run_id"] == "run-1"


def test_run_duration_and_outcome_metrics(providers: Any) -> None:
    tracer_provider, meter_provider, _, reader = providers
    log = AuditLog()
    otel.attach(log, tracer_provider, meter_provider)
    lifecycle(log)
    data = reader.get_metrics_data()
    assert data is not None
    metrics = {
        m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    runs = {
        (p.attributes["fusion_oci.outcome"], p.attributes["fusion_oci.backend"]): p.value
        for p in metrics["fusion_oci.sandbox.runs"].data.data_points
    }
    assert runs == {("ok", "native"): 1, ("timeout", "native"): 1}
    durations = {
        p.attributes["fusion_oci.outcome"]: (p.count, p.sum)
        for p in metrics["fusion_oci.sandbox.run.duration"].data.data_points
    }
    assert durations == {"ok": (1, 1500), "timeout": (1, 3000)}
    assert metrics["fusion_oci.sandbox.run.duration"].unit == "ms"
    setup = [
        p.attributes["fusion_oci.event"]
        for p in metrics["fusion_oci.sandbox.setup_problems"].data.data_points
    ]
    assert setup == ["fallback"]


def test_unsubscribing_stops_the_spans(providers: Any) -> None:
    tracer_provider, meter_provider, spans, _ = providers
    log = AuditLog()
    detach = otel.attach(log, tracer_provider, meter_provider)
    detach()
    lifecycle(log)
    assert spans.get_finished_spans() == ()


def test_export_only_when_otel_variables_ask() -> None:
    assert otel.attach_from_env(AuditLog(), {}) is None
    assert not otel.wants_export({"OTEL_SERVICE_NAME": "x"})
    assert otel.wants_export({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
    assert not otel.wants_export({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"})


def test_exporter_names_are_checked() -> None:
    with pytest.raises(SettingsError, match="OTEL_TRACES_EXPORTER"):
        otel.providers_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(SettingsError, match="http/protobuf"):
        otel.providers_from_env(
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
        )
    tracer_provider, meter_provider = otel.providers_from_env(
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    )
    tracer_provider.shutdown()
    meter_provider.shutdown()


def test_a_sandbox_never_disposed_is_ended_on_detach(providers: Any) -> None:
    tracer_provider, meter_provider, spans, _ = providers
    log = AuditLog()
    detach = otel.attach(log, tracer_provider, meter_provider)
    log.emit(PrepareEvent(task_id="t", run_id="r", backend="oci", duration_ms=5))
    assert [s.name for s in spans.get_finished_spans()] == ["sandbox.prepare"]
    detach()
    assert [s.name for s in spans.get_finished_spans()] == ["sandbox.prepare", "sandbox"]
