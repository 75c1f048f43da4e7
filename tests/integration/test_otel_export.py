"""`fusion-oci run` exports its spans and metrics over OTLP where OTEL_* says: a real OTLP
http/protobuf export to a recording collector on loopback."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.integration.test_cli import cli

pytestmark = pytest.mark.native


@contextlib.contextmanager
def collector() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
    got: list[tuple[str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.append((self.path, self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", got
    finally:
        server.shutdown()
        server.server_close()


def test_run_exports_lifecycle_spans_and_run_metrics(worktree: Path) -> None:
    with collector() as (endpoint, got):
        p = cli(
            "run",
            "--backend",
            "native",
            "--task-id",
            "otel-task",
            "--",
            "exit 3",
            cwd=worktree,
            env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "fusion-oci-test"},
        )
    assert p.returncode == 3, p.stderr
    traces = [
        ExportTraceServiceRequest.FromString(body) for path, body in got if path == "/v1/traces"
    ]
    spans = [
        s for req in traces for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans
    ]
    assert sorted(s.name for s in spans) == [
        "sandbox",
        "sandbox.dispose",
        "sandbox.prepare",
        "sandbox.run",
    ]
    assert len({s.trace_id for s in spans}) == 1
    run = next(s for s in spans if s.name == "sandbox.run")
    attrs = {a.key: a.value for a in run.attributes}
    assert attrs["fusion_oci.task_id"].string_value == "otel-task"
    assert attrs["fusion_oci.backend"].string_value == "native"
    assert attrs["fusion_oci.end_reason"].string_value == "exit"
    assert attrs["fusion_oci.exit_code"].int_value == 3
    resource = {
        a.key: a.value.string_value for a in traces[0].resource_spans[0].resource.attributes
    }
    assert resource["service.name"] == "fusion-oci-test"
    metrics = [
        ExportMetricsServiceRequest.FromString(body) for path, body in got if path == "/v1/metrics"
    ]
    names = {
        m.name
        for req in metrics
        for rm in req.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert {"fusion_oci.sandbox.runs", "fusion_oci.sandbox.run.duration"} <= names


def test_otel_sdk_disabled_means_no_export(worktree: Path) -> None:
    with collector() as (endpoint, got):
        p = cli(
            "run",
            "--backend",
            "native",
            "--",
            "true",
            cwd=worktree,
            env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SDK_DISABLED": "true"},
        )
    assert p.returncode == 0
    assert got == []


def test_a_collector_that_is_down_costs_one_stderr_line(worktree: Path) -> None:
    with collector() as (endpoint, _got):
        pass  # closed again: its port now refuses connections
    p = cli(
        "run",
        "--backend",
        "native",
        "--",
        "echo out",
        cwd=worktree,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint},
    )
    assert (p.returncode, p.stdout) == (0, "out\n")
    # Beside the one-line note that native isolates nothing (issue 12), one line for OTel.
    lines = [line for line in p.stderr.splitlines() if "isolates nothing" not in line]
    assert len(lines) == 1 and lines[0].startswith("fusion-oci: OpenTelemetry: "), p.stderr
