"""OpenTelemetry spans and metrics of the sandbox lifecycle (``pip install 'fusion-oci[otel]'``).

An :class:`OtelSubscriber` listens on an :class:`~fusion_oci.audit.AuditLog`, so the lifecycle
code knows nothing of OpenTelemetry: every ``sandbox:prepare``, ``sandbox:run`` and
``sandbox:dispose`` event becomes a span (it ends at the event's time and lasts its
``duration_ms``), all children of one ``sandbox`` span per sandbox (prepare to dispose), and
every run adds to a duration histogram and an outcome counter.

:func:`attach_from_env` is the one-line hook for entry points: it does nothing unless the
standard ``OTEL_*`` variables ask for export (``OTEL_TRACES_EXPORTER``,
``OTEL_METRICS_EXPORTER``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` or its per-signal forms), and
``OTEL_SDK_DISABLED=true`` turns it off. Exporters: ``otlp`` (http/protobuf; endpoint, headers
and timeouts from the usual ``OTEL_EXPORTER_OTLP_*`` variables), ``console``, ``none``.

This module imports no OpenTelemetry code until it is used, so the CLI stays fast without it.
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, assert_never

from fusion_oci.audit import (
    AuditEvent,
    AuditLog,
    CredentialEvent,
    DisposeEvent,
    EgressEvent,
    FailureEvent,
    FallbackEvent,
    GateEvent,
    InboundEvent,
    PrepareEvent,
    ProvisionEvent,
    RunEvent,
)
from fusion_oci.errors import SettingsError

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.trace import Span, TracerProvider

SPANS = {
    "sandbox:prepare": "sandbox.prepare",
    "sandbox:run": "sandbox.run",
    "sandbox:dispose": "sandbox.dispose",
}
CLI_EXPORT_TIMEOUT_S = 2.0
"""OTLP timeout of the CLI hook unless OTEL_EXPORTER_OTLP_*TIMEOUT says: a short-lived
command must not wait the SDK's 10 s (plus retries) for a collector that is down."""
ASKING_VARS = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)


def _ns(ts: str) -> int | None:
    try:
        return int(datetime.fromisoformat(ts).timestamp() * 1e9)
    except ValueError:
        return None


Spanned = PrepareEvent | RunEvent | DisposeEvent
"""The lifecycle events that become spans."""


def attributes(event: Spanned) -> dict[str, Any]:
    """The span attributes of one event. The command is reduced to its program name: a
    command line can carry secrets, and exported telemetry leaves the host."""
    attrs: dict[str, Any] = {
        "fusion_oci.task_id": event.task_id,
        "fusion_oci.run_id": event.run_id,
        "fusion_oci.backend": event.backend,
        "fusion_oci.unenforced": [],
    }
    optional: dict[str, Any]
    match event:
        case RunEvent():
            attrs["fusion_oci.unenforced"] = list(event.unenforced or [])
            optional = {
                "fusion_oci.end_reason": event.end_reason,
                "fusion_oci.exit_code": event.exit_code,
                "fusion_oci.signal": event.signal,
                "fusion_oci.timed_out": event.timed_out,
                "fusion_oci.fell_back": event.fell_back,
                "fusion_oci.policy_hash": event.policy_hash,
                "fusion_oci.duration_ms": event.duration_ms,
                "fusion_oci.program": next(iter((event.command or "").split()), None),
            }
        case PrepareEvent():
            attrs["fusion_oci.unenforced"] = list(event.unenforced or [])
            optional = {
                "fusion_oci.fell_back": event.fell_back,
                "fusion_oci.policy_hash": event.policy_hash,
                "fusion_oci.duration_ms": event.duration_ms,
            }
        case DisposeEvent():
            optional = {
                "fusion_oci.policy_hash": event.policy_hash,
                "fusion_oci.duration_ms": event.duration_ms,
            }
        case _:
            assert_never(event)
    attrs.update({k: v for k, v in optional.items() if v is not None})
    return attrs


def outcome(event: RunEvent) -> str:
    """``ok`` for exit 0; else the end reason, ``exit`` meaning a non-zero exit."""
    reason = event.end_reason or "exit"
    if reason == "exit" and (event.exit_code or 0) == 0:
        return "ok"
    return reason


class OtelSubscriber:
    """An AuditLog subscriber that turns lifecycle events into spans and run metrics."""

    def __init__(self, tracer_provider: TracerProvider, meter_provider: MeterProvider) -> None:
        from opentelemetry.trace import Status, StatusCode

        from fusion_oci import __version__

        self._status = Status
        self._warned = False
        self._sandboxes: dict[tuple[str, str], Span] = {}
        self._error = StatusCode.ERROR
        self.tracer = tracer_provider.get_tracer("fusion_oci", __version__)
        meter = meter_provider.get_meter("fusion_oci", __version__)
        self.run_duration = meter.create_histogram(
            "fusion_oci.sandbox.run.duration",
            unit="ms",
            description="Wall-clock time of one sandboxed command",
        )
        self.runs = meter.create_counter(
            "fusion_oci.sandbox.runs",
            unit="{run}",
            description="Sandboxed commands by backend and outcome",
        )
        self.setup = meter.create_counter(
            "fusion_oci.sandbox.setup_problems",
            unit="{event}",
            description="Sandbox failures and fallbacks to the native runtime",
        )

    def __call__(self, event: AuditEvent) -> None:
        # AuditLog.emit calls subscribers inline: telemetry trouble must never fail a run.
        try:
            self._record(event)
        except Exception as exc:
            if not self._warned:
                self._warned = True
                print(
                    f"fusion-oci: OpenTelemetry: {type(exc).__name__}: {exc} (telemetry "
                    "skipped; the sandbox is unaffected)",
                    file=sys.stderr,
                )

    def _record(self, event: AuditEvent) -> None:
        match event:
            case PrepareEvent() | DisposeEvent():
                self._span(event)
            case RunEvent():
                self._span(event)
                labels: dict[str, str | bool] = {
                    "fusion_oci.backend": event.backend,
                    "fusion_oci.outcome": outcome(event),
                    "fusion_oci.end_reason": event.end_reason or "exit",
                    "fusion_oci.fell_back": bool(event.fell_back),
                }
                self.runs.add(1, labels)
                if event.duration_ms is not None:
                    self.run_duration.record(event.duration_ms, labels)
            case FailureEvent() | FallbackEvent():
                self.setup.add(
                    1,
                    {
                        "fusion_oci.backend": event.backend,
                        "fusion_oci.event": event.type.removeprefix("sandbox:"),
                    },
                )
            case (
                ProvisionEvent() | GateEvent() | EgressEvent() | CredentialEvent() | InboundEvent()
            ):
                pass  # not a step of the sandbox's lifecycle: no span, no metric
            case _:
                assert_never(event)

    def _span(self, event: Spanned) -> None:
        from opentelemetry import trace

        end = _ns(event.ts)
        start = None if end is None else end - (event.duration_ms or 0) * 1_000_000
        key = (event.task_id, event.run_id)
        if isinstance(event, PrepareEvent) and key not in self._sandboxes:
            # One trace per sandbox: a `sandbox` span from the start of prepare to the end
            # of dispose, parent of the lifecycle spans.
            self._sandboxes[key] = self.tracer.start_span(
                "sandbox",
                start_time=start,
                attributes={
                    "fusion_oci.task_id": event.task_id,
                    "fusion_oci.run_id": event.run_id,
                    "fusion_oci.backend": event.backend,
                },
            )
        parent = self._sandboxes.get(key)
        context = trace.set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span(
            SPANS[event.type], context=context, start_time=start, attributes=attributes(event)
        )
        if isinstance(event, RunEvent) and outcome(event) != "ok":
            span.set_status(self._status(self._error, outcome(event)))
        span.end(end_time=end)
        if isinstance(event, DisposeEvent) and parent is not None:
            del self._sandboxes[key]
            parent.end(end_time=end)

    def close(self) -> None:
        """End the `sandbox` spans of sandboxes never disposed (a crash, an early exit)."""
        for span in self._sandboxes.values():
            span.end()
        self._sandboxes.clear()


class _FirstErrorToStderr(logging.Handler):
    """The SDK's first error as one line; its retry warnings dropped. The CLI's stderr is the
    command's stderr: a collector that is down must not flood it."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.done = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.done:
            self.done = True
            print(f"fusion-oci: OpenTelemetry: {record.getMessage()}", file=sys.stderr)


def _quiet_sdk_logs() -> None:
    logger = logging.getLogger("opentelemetry")
    if not any(isinstance(h, _FirstErrorToStderr) for h in logger.handlers):
        logger.addHandler(_FirstErrorToStderr())
        logger.propagate = False


def wants_export(environ: Mapping[str, str]) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(environ.get(name) for name in ASKING_VARS)


def _names(environ: Mapping[str, str], var: str) -> list[str]:
    names = [n.strip().lower() for n in environ.get(var, "otlp").split(",") if n.strip()]
    unknown = sorted(set(names) - {"otlp", "console", "none"})
    if unknown:
        raise SettingsError(
            f"{var}={environ[var]!r}: unknown exporter {', '.join(unknown)}",
            "fusion-oci's otel extra knows otlp, console and none",
            f"set {var} to otlp, console or none",
        )
    protocol = environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if "otlp" in names and protocol != "http/protobuf":
        raise SettingsError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported",
            "the otel extra ships the OTLP http/protobuf exporter only",
            "unset it, or set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
        )
    return names


def _timeout(environ: Mapping[str, str], signal: str, default: float | None) -> float | None:
    """The OTLP timeout to pass: None (the SDK reads its variables) when one is set."""
    if environ.get("OTEL_EXPORTER_OTLP_TIMEOUT") or environ.get(
        f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT"
    ):
        return None
    return default


def providers_from_env(
    environ: Mapping[str, str], *, default_timeout_s: float | None = None
) -> tuple[SdkTracerProvider, SdkMeterProvider]:
    """SDK providers exporting where the ``OTEL_*`` variables say. The SDK's own exporters
    read their endpoint/headers/timeout variables from the process environment;
    ``default_timeout_s`` replaces the SDK's 10 s OTLP timeout when no variable sets one."""
    from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        MetricReader,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME", "fusion-oci")})
    tracer_provider = SdkTracerProvider(resource=resource)
    for name in _names(environ, "OTEL_TRACES_EXPORTER"):
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            tracer_provider.add_span_processor(
                BatchSpanProcessor(
                    OTLPSpanExporter(timeout=_timeout(environ, "TRACES", default_timeout_s))
                )
            )
        elif name == "console":
            tracer_provider.add_span_processor(
                BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr))
            )
    readers: list[MetricReader] = []
    for name in _names(environ, "OTEL_METRICS_EXPORTER"):
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )

            readers.append(
                PeriodicExportingMetricReader(
                    OTLPMetricExporter(timeout=_timeout(environ, "METRICS", default_timeout_s))
                )
            )
        elif name == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stderr)))
    return tracer_provider, SdkMeterProvider(resource=resource, metric_readers=readers)


def attach(
    audit: AuditLog, tracer_provider: TracerProvider, meter_provider: MeterProvider
) -> Callable[[], None]:
    """Subscribe an :class:`OtelSubscriber`; returns the function that unsubscribes (and
    ends the spans of sandboxes still open)."""
    subscriber = OtelSubscriber(tracer_provider, meter_provider)
    unsubscribe = audit.subscribe(subscriber)

    def detach() -> None:
        unsubscribe()
        subscriber.close()

    return detach


def attach_from_env(audit: AuditLog, environ: Mapping[str, str]) -> Callable[[], None] | None:
    """The entry points' hook: export this log's lifecycle when ``OTEL_*`` asks for it.

    Returns a function that unsubscribes and flushes (also registered to run at exit), or
    None when nothing was asked for. Asked for without the extra installed: a one-line
    warning on stderr, and the run goes on.
    """
    if not wants_export(environ):
        return None
    try:
        tracer_provider, meter_provider = providers_from_env(
            environ, default_timeout_s=CLI_EXPORT_TIMEOUT_S
        )
    except ImportError:
        print(
            "fusion-oci: OTEL_* is set but the otel extra is not installed "
            "(pip install 'fusion-oci[otel]'); no telemetry exported",
            file=sys.stderr,
        )
        return None
    _quiet_sdk_logs()
    unsubscribe = attach(audit, tracer_provider, meter_provider)
    done = False

    def close() -> None:
        nonlocal done
        if done:
            return
        done = True
        unsubscribe()
        tracer_provider.shutdown()  # flushes the batch of spans
        meter_provider.shutdown()  # collects and exports the metrics once more

    atexit.register(close)
    return close
