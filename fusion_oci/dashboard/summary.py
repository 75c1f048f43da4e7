"""The telemetry summary of an audit log, built one event at a time.

A pure accumulator: :class:`SummaryBuilder` takes events (and malformed lines) in log order and
``result()`` turns what it holds into a JSON-ready dict. The dashboard feeds it from a tail of
the file as lines arrive; ``fusion-oci audit --summary`` feeds it the whole file once. Both show
the same numbers because they share this code.

Memory stays bounded by what the summary needs (durations as machine integers, the last few
rows of each table), not by the number of events, so a log of 100,000 events is cheap.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, assert_never, get_args

from fusion_oci.audit import (
    AuditEvent,
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
from fusion_oci.models import EndReason

RECENT = 25
"""Rows kept for each "recent" table (failing runs, fallbacks, gates, provisioning)."""
TOP = 25
"""Rows shown for tables ranked by count (commands, reasons)."""
MAX_KEYS = 2000
"""Distinct commands / reasons tracked before the rest are counted under ``(other)``: a log
whose every command is unique must not grow the summary without bound."""
MAX_BUCKETS = 60
BUCKET_SIZES = (
    1,
    5,
    15,
    30,
    60,
    300,
    900,
    1800,
    3600,
    3 * 3600,
    6 * 3600,
    12 * 3600,
    86400,
    7 * 86400,
    30 * 86400,
)
OTHER = "(other)"
END_REASONS: tuple[str, ...] = get_args(EndReason)
"""Every end reason, shown with its count even when that is 0 ("no OOM kill so far")."""
LIMITS = frozenset({"timeout", "oom", "pids", "cpu-time", "max-buffer"})
"""End reasons that mean a limit of the policy ended the command."""


def percentile(sorted_values: list[int], p: float) -> int | None:
    """Nearest-rank percentile of an already sorted list (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _epoch(ts: str) -> float | None:
    try:
        return datetime.fromisoformat(ts).timestamp()
    except ValueError:
        return None


def _first_line(text: str | None, limit: int = 160) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else "(no reason)"
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _policy(event: AuditEvent) -> tuple[str | None, str | None]:
    """The policy hash and summary an event names (a connection event names no summary)."""
    match event:
        case PrepareEvent() | RunEvent() | FailureEvent() | FallbackEvent() | DisposeEvent():
            return event.policy_hash, event.policy_summary
        case EgressEvent() | CredentialEvent() | InboundEvent():
            return event.policy_hash, None
        case ProvisionEvent() | GateEvent():
            return None, None
        case _:
            assert_never(event)


def is_failing(event: RunEvent) -> bool:
    """A run that did not end by exiting 0: a non-zero exit, a signal or a limit."""
    reason = event.end_reason or "exit"
    return reason != "exit" or (event.exit_code is not None and event.exit_code != 0)


@dataclass
class _Durations:
    values: array[int] = field(default_factory=lambda: array("q"))

    def row(self) -> dict[str, Any]:
        ordered = sorted(self.values)
        return {
            "runs": len(ordered),
            "p50": percentile(ordered, 50),
            "p95": percentile(ordered, 95),
            "max": ordered[-1] if ordered else None,
        }


@dataclass
class TaskInfo:
    task_id: str
    events: int = 0
    runs: int = 0
    failing: int = 0
    first_ts: str = ""
    last_ts: str = ""
    last_line: int = 0
    backends: set[str] = field(default_factory=set)
    policy_hash: str | None = None
    policy_summary: str | None = None

    def row(self) -> dict[str, Any]:
        return {
            "taskId": self.task_id,
            "events": self.events,
            "runs": self.runs,
            "failing": self.failing,
            "firstTs": self.first_ts,
            "lastTs": self.last_ts,
            "backends": sorted(self.backends),
            "policyHash": self.policy_hash,
            "policySummary": self.policy_summary,
        }


@dataclass
class _EgressTask:
    """One task's ``sandbox:egress`` connections."""

    task_id: str
    allowed: int = 0
    denied: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    hosts: set[str] = field(default_factory=set)
    services: int = 0
    """Connections through a granted host service (``details.service``: policy.hostServices)."""
    inbound: int = 0
    """Connections from the host to a published port (``sandbox:inbound``: publishPorts)."""

    def row(self) -> dict[str, Any]:
        return {
            "taskId": self.task_id,
            "connections": self.allowed + self.denied,
            "allowed": self.allowed,
            "denied": self.denied,
            "bytesUp": self.bytes_up,
            "bytesDown": self.bytes_down,
            "hosts": len(self.hosts),
            "services": self.services,
            "inbound": self.inbound,
        }


class _Capped(Counter[str]):
    """A counter that folds keys beyond :data:`MAX_KEYS` into ``(other)``."""

    def bump(self, key: str) -> str:
        if key not in self and len(self) >= MAX_KEYS:
            key = OTHER
        self[key] += 1
        return key


class SummaryBuilder:
    """Accumulates the summary; feed it with :meth:`add` / :meth:`add_malformed` in log order."""

    def __init__(self) -> None:
        self.lines = 0
        self.events = 0
        self.malformed = 0
        self.malformed_lines: deque[int] = deque(maxlen=RECENT)
        self.first_ts: str | None = None
        self.last_ts: str | None = None
        self.counts: Counter[str] = Counter()
        self.run_times: array[float] = array("d")
        self.run_backend: array[int] = array("H")
        self.run_failing: array[int] = array("b")
        self.backend_ids: dict[str, int] = {}
        self.by_backend: dict[str, _Durations] = {}
        self.prepare_by_backend: dict[str, _Durations] = {}
        self.command_keys = _Capped()
        self.by_command: dict[tuple[str, str], _Durations] = {}
        self.end_reasons: Counter[str] = Counter()
        self.exit_codes: Counter[int] = Counter()
        self.limit_hits: Counter[tuple[str, str]] = Counter()
        self.failing_recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.fallback_reasons = _Capped()
        self.fallback_recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.failure_reasons = _Capped()
        self.failure_recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.unenforced: Counter[str] = Counter()
        self.gates: Counter[tuple[str, str, str]] = Counter()
        self.gate_recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.provision_outcomes: Counter[str] = Counter()
        self.provision_retries = 0
        self.provision_recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.tasks: dict[str, TaskInfo] = {}
        self.egress_tasks: dict[str, _EgressTask] = {}
        self.egress_denied = _Capped()
        self.egress_denied_rule: dict[str, str] = {}
        self.egress_denied_recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.credential_uses: Counter[tuple[str, str, str]] = Counter()
        """(task, host, credential name) -> requests whose sentinel was swapped."""
        self.credential_recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        """The latest refusals: leak attempts and pushes outside allowedRefs."""

    # --- feeding ------------------------------------------------------------------------------

    def add_malformed(self, line_no: int) -> None:
        self.lines = max(self.lines, line_no)
        self.malformed += 1
        self.malformed_lines.append(line_no)

    def add(self, line_no: int, e: AuditEvent) -> None:
        self.lines = max(self.lines, line_no)
        self.events += 1
        if self.first_ts is None:
            self.first_ts = e.ts
        self.last_ts = e.ts
        self.counts[e.type] += 1
        task = self.tasks.get(e.task_id)
        if task is None:
            task = self.tasks[e.task_id] = TaskInfo(e.task_id, first_ts=e.ts)
        task.events += 1
        task.last_ts, task.last_line = e.ts, line_no
        task.backends.add(e.backend)
        policy_hash, policy_summary = _policy(e)
        if policy_hash is not None:
            task.policy_hash, task.policy_summary = policy_hash, policy_summary
        base = {
            "line": line_no,
            "ts": e.ts,
            "taskId": e.task_id,
            "runId": e.run_id,
            "backend": e.backend,
        }
        match e:
            case RunEvent():
                self._run(e, task, base)
            case FallbackEvent():
                key = self.fallback_reasons.bump(_first_line(e.reason))
                frm = (e.details or {}).get("from")
                self.fallback_recent.append({**base, "from": frm, "reason": key})
            case FailureEvent():
                key = self.failure_reasons.bump(_first_line(e.reason))
                self.failure_recent.append(
                    {**base, "reason": key, "command": e.command, "unenforced": e.unenforced or []}
                )
                for part in e.unenforced or []:
                    self.unenforced[part] += 1
            case PrepareEvent():
                if e.duration_ms is not None:
                    self.prepare_by_backend.setdefault(e.backend, _Durations()).values.append(
                        e.duration_ms
                    )
                for part in e.unenforced or []:
                    self.unenforced[part] += 1
            case DisposeEvent():
                pass  # counted with the task's events above; nothing of its own to sum
            case GateEvent():
                self._gate(e, base)
            case EgressEvent():
                self._egress(e, base)
            case CredentialEvent():
                self._credential(e, base)
            case InboundEvent():
                # publishPorts: counted beside the task's outbound connections, not among them.
                inbound = self.egress_tasks.get(e.task_id)
                if inbound is None:
                    inbound = self.egress_tasks[e.task_id] = _EgressTask(e.task_id)
                inbound.inbound += 1
            case ProvisionEvent():
                self._provision(e, base)
            case _:
                assert_never(e)

    def _gate(self, e: GateEvent, base: dict[str, Any]) -> None:
        d = e.details or {}
        gate, decision = str(d.get("gate", "?")), str(d.get("decision", "?"))
        by = str(d.get("decided_by", "?"))
        self.gates[(gate, decision, by)] += 1
        self.gate_recent.append(
            {
                **base,
                "gate": gate,
                "decision": decision,
                "decidedBy": by,
                "action": d.get("action"),
                "target": d.get("target"),
            }
        )

    def _provision(self, e: ProvisionEvent, base: dict[str, Any]) -> None:
        d = e.details or {}
        outcome = str(d.get("outcome", d.get("action", "?")))
        self.provision_outcomes[outcome] += 1
        if outcome == "retry":
            self.provision_retries += 1
        self.provision_recent.append(
            {
                **base,
                "action": d.get("action"),
                "outcome": outcome,
                "ref": d.get("ref"),
                "engine": d.get("engine"),
                "digest": d.get("digest") or d.get("repo_digest"),
                "attempt": d.get("attempt"),
                "durationMs": e.duration_ms,
                "reason": _first_line(e.reason),
            }
        )

    def _egress(self, e: EgressEvent, base: dict[str, Any]) -> None:
        egress = self.egress_tasks.get(e.task_id)
        if egress is None:
            egress = self.egress_tasks[e.task_id] = _EgressTask(e.task_id)
        held = (e.details or {}).get("suppressed")
        if isinstance(held, dict):
            # The proxy's audit budget (fusion_oci/egress/budget.py): counts, not connections.
            for kind, count in held.items():
                if str(kind).startswith("sandbox:egress") and isinstance(count, int):
                    if str(kind).endswith(" allowed"):
                        egress.allowed += count
                    else:
                        egress.denied += count
            return
        host = f"{e.host or '?'}:{e.port if e.port is not None else '?'}"
        if len(egress.hosts) < MAX_KEYS:
            egress.hosts.add(host)
        egress.bytes_up += e.bytes_up or 0
        egress.bytes_down += e.bytes_down or 0
        if (e.details or {}).get("service"):
            egress.services += 1
        if e.allowed:
            egress.allowed += 1
            return
        egress.denied += 1
        key = self.egress_denied.bump(host)
        self.egress_denied_rule[key] = e.rule or _first_line(e.reason)
        self.egress_denied_recent.append(
            {
                **base,
                "host": host,
                "rule": e.rule,
                "reason": _first_line(e.reason),
                "protocol": (e.details or {}).get("protocol"),
            }
        )

    def _credential(self, e: CredentialEvent, base: dict[str, Any]) -> None:
        d = e.details or {}
        name = str(d.get("credential", "?"))
        if e.allowed:
            if d.get("swapped"):
                self.credential_uses[(e.task_id, e.host or "?", name)] += 1
            return
        self.credential_recent.append(
            {
                **base,
                "host": e.host,
                "credential": name,
                "leak": bool(d.get("leak")),
                "reason": _first_line(e.reason),
            }
        )

    def _credential_result(self) -> dict[str, Any]:
        """``sandbox:credential``: swaps per task, host and credential; the latest refusals
        (names and hosts only: an event never holds a value)."""
        refusals = list(reversed(self.credential_recent))
        return {
            "total": self.counts["sandbox:credential"],
            "swaps": sum(self.credential_uses.values()),
            "leakAttempts": sum(1 for r in refusals if r["leak"]),
            "byTask": [
                {"taskId": t, "host": h, "credential": n, "swaps": c}
                for (t, h, n), c in self.credential_uses.most_common(50)
            ],
            "recentRefused": refusals,
        }

    def _egress_result(self) -> dict[str, Any]:
        rows = sorted(self.egress_tasks.values(), key=lambda t: -(t.allowed + t.denied + t.inbound))
        return {
            "total": self.counts["sandbox:egress"],
            "allowed": sum(t.allowed for t in rows),
            "denied": sum(t.denied for t in rows),
            "bytesUp": sum(t.bytes_up for t in rows),
            "bytesDown": sum(t.bytes_down for t in rows),
            "services": sum(t.services for t in rows),
            "inbound": sum(t.inbound for t in rows),
            "byTask": [t.row() for t in rows[:50]],
            "topDenied": [
                {"host": h, "count": n, "rule": self.egress_denied_rule.get(h)}
                for h, n in self.egress_denied.most_common(TOP)
            ],
            "recentDenied": list(reversed(self.egress_denied_recent)),
        }

    def _run(self, e: RunEvent, task: TaskInfo, base: dict[str, Any]) -> None:
        task.runs += 1
        backend_id = self.backend_ids.setdefault(e.backend, len(self.backend_ids))
        failing = is_failing(e)
        self.run_times.append(_epoch(e.ts) or math.nan)
        self.run_backend.append(backend_id)
        self.run_failing.append(1 if failing else 0)
        reason = e.end_reason or "exit"
        self.end_reasons[reason] += 1
        if e.duration_ms is not None:
            self.by_backend.setdefault(e.backend, _Durations()).values.append(e.duration_ms)
            command = self.command_keys.bump((e.command or "").strip() or "(none)")
            self.by_command.setdefault((command, e.backend), _Durations()).values.append(
                e.duration_ms
            )
        if reason in LIMITS:
            self.limit_hits[(e.task_id, reason)] += 1
        if failing:
            task.failing += 1
            if reason == "exit" and e.exit_code is not None:
                self.exit_codes[e.exit_code] += 1
            self.failing_recent.append(
                {
                    **base,
                    "command": e.command,
                    "exitCode": e.exit_code,
                    "signal": e.signal,
                    "endReason": reason,
                    "durationMs": e.duration_ms,
                }
            )

    # --- reading ------------------------------------------------------------------------------

    def _timeline(self) -> dict[str, Any]:
        names = sorted(self.backend_ids, key=self.backend_ids.__getitem__)
        times = [t for t in self.run_times if not math.isnan(t)]
        if not times:
            return {"bucketSeconds": None, "times": [], "series": {}, "failing": []}
        start, end = min(times), max(times)
        size = next((s for s in BUCKET_SIZES if (end - start) / s < MAX_BUCKETS), BUCKET_SIZES[-1])
        first = math.floor(start / size) * size
        count = int((end - first) // size) + 1
        series = [[0] * count for _ in names]
        failing = [0] * count
        for t, b, f in zip(self.run_times, self.run_backend, self.run_failing, strict=True):
            if math.isnan(t):
                continue
            i = int((t - first) // size)
            series[b][i] += 1
            failing[i] += f
        return {
            "bucketSeconds": size,
            "times": [first + i * size for i in range(count)],
            "series": dict(zip(names, series, strict=True)),
            "failing": failing,
        }

    def result(self) -> dict[str, Any]:
        runs = len(self.run_times)
        per_backend = Counter(self.run_backend)
        commands = sorted(self.by_command.items(), key=lambda kv: -len(kv[1].values))[:TOP]
        tasks = sorted(self.tasks.values(), key=lambda t: -t.last_line)[:50]
        return {
            "log": {
                "lines": self.lines,
                "events": self.events,
                "malformed": self.malformed,
                "malformedLines": list(self.malformed_lines),
                "firstTs": self.first_ts,
                "lastTs": self.last_ts,
            },
            "counts": dict(sorted(self.counts.items())),
            "runs": {
                "total": runs,
                "failing": sum(self.run_failing),
                "byBackend": {name: per_backend[i] for name, i in self.backend_ids.items()},
            },
            "timeline": self._timeline(),
            "durations": {
                "byBackend": [
                    {"backend": k, **v.row()} for k, v in sorted(self.by_backend.items())
                ],
                "byCommand": [{"command": c, "backend": b, **v.row()} for (c, b), v in commands],
                "prepareByBackend": [
                    {"backend": k, **v.row()} for k, v in sorted(self.prepare_by_backend.items())
                ],
            },
            "endReasons": {
                **dict(self.end_reasons.most_common()),
                **{r: 0 for r in END_REASONS if r not in self.end_reasons},
            },
            "limits": {
                "byTask": [
                    {"taskId": t, "endReason": r, "runs": n}
                    for (t, r), n in self.limit_hits.most_common(TOP)
                ]
            },
            "failingExits": {
                "byCode": {str(k): v for k, v in self.exit_codes.most_common(TOP)},
                "recent": list(reversed(self.failing_recent)),
            },
            "fallbacks": {
                "total": self.counts["sandbox:fallback"],
                "byReason": [
                    {"reason": r, "count": n} for r, n in self.fallback_reasons.most_common(TOP)
                ],
                "recent": list(reversed(self.fallback_recent)),
            },
            "failures": {
                "total": self.counts["sandbox:failure"],
                "byReason": [
                    {"reason": r, "count": n} for r, n in self.failure_reasons.most_common(TOP)
                ],
                "recent": list(reversed(self.failure_recent)),
            },
            "unenforced": dict(self.unenforced.most_common()),
            "gates": {
                "byDecision": [
                    {"gate": g, "decision": d, "decidedBy": by, "count": n}
                    for (g, d, by), n in self.gates.most_common()
                ],
                "recent": list(reversed(self.gate_recent)),
            },
            "provisioning": {
                "byOutcome": dict(self.provision_outcomes.most_common()),
                "retries": self.provision_retries,
                "recent": list(reversed(self.provision_recent)),
            },
            "egress": self._egress_result(),
            "credentials": self._credential_result(),
            "tasks": {"total": len(self.tasks), "recent": [t.row() for t in tasks]},
        }
