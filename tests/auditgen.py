"""Generated audit logs for the dashboard's tests and benchmark: realistic lifecycles (prepare,
runs, dispose; failures, fallbacks, gates, provisioning) at fixed, deterministic times, written
through the real :class:`~fusion_oci.audit.AuditLog` writer."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

from fusion_oci.audit import (
    AuditEvent,
    AuditLog,
    DisposeEvent,
    FailureEvent,
    FallbackEvent,
    GateEvent,
    PrepareEvent,
    ProvisionEvent,
    RunEvent,
)

START = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
BACKENDS = ("bubblewrap", "podman", "oci")
COMMANDS = ("pnpm test", "pnpm build", "git status", "pnpm lint")
POLICY = "network=none memory=2048MiB pids=512 writable=worktree"


def ts(seconds: float) -> str:
    return (START + timedelta(seconds=seconds)).isoformat(timespec="milliseconds")


def task_events(
    n_tasks: int, *, seed: int = 14, runs_per_task: int = 4, spread_s: float = 7200
) -> list[AuditEvent]:
    """The events of ``n_tasks`` task lifecycles, in time order."""
    rnd = random.Random(seed)
    out: list[AuditEvent] = []
    for t in range(n_tasks):
        task, run = f"task-{t:05d}", f"run-{t:05d}"
        clock = spread_s * t / max(1, n_tasks)
        backend = BACKENDS[t % len(BACKENDS)]
        base = {
            "task_id": task,
            "run_id": run,
            "policy_hash": f"{t:04x}" * 16,
            "policy_summary": POLICY,
        }
        # Provisioning and gates are about an image, not a policy: they name none.
        who = {"task_id": task, "run_id": run}
        if t % 7 == 3:  # bubblewrap missing: fall back to native, losing the limits
            out.append(
                FailureEvent(
                    ts=ts(clock),
                    backend=backend,
                    reason="bubblewrap not found\nhint: apt-get install bubblewrap",
                    **base,
                )
            )
            out.append(
                FallbackEvent(
                    ts=ts(clock),
                    backend="native",
                    reason="bubblewrap not found",
                    fell_back=True,
                    details={"from": backend},
                    **base,
                )
            )
            backend = "native"
        if backend == "podman" and t % 6 == 1:
            decision = "deny" if t % 12 == 7 else "allow"
            out.append(
                GateEvent(
                    ts=ts(clock),
                    backend=backend,
                    reason=f"image-pull {decision} (settings): pull fusion-node",
                    details={
                        "gate": "image-pull",
                        "decision": decision,
                        "decided_by": "settings",
                        "action": "pull",
                        "target": "fusion-node:22",
                    },
                    **who,
                )
            )
            for attempt, outcome in ((1, "retry"), (2, "ok")):
                out.append(
                    ProvisionEvent(
                        ts=ts(clock + attempt),
                        backend=backend,
                        reason=f"pull attempt {attempt}",
                        duration_ms=900 * attempt,
                        details={
                            "action": "pull",
                            "outcome": outcome,
                            "ref": "fusion-node:22",
                            "engine": "podman",
                            "attempt": attempt,
                            **({"digest": f"sha256:{t:064x}"} if outcome == "ok" else {}),
                        },
                        **who,
                    )
                )
        unenforced = ["cpu", "memory", "network", "pids"] if backend == "native" else None
        out.append(
            PrepareEvent(
                ts=ts(clock + 2),
                backend=backend,
                duration_ms=rnd.randint(5, 400),
                unenforced=unenforced,
                fell_back=backend == "native",
                **base,
            )
        )
        for r in range(runs_per_task):
            clock += 3 + r
            command = COMMANDS[(t + r) % len(COMMANDS)]
            roll = rnd.random()
            end_reason, exit_code, signal = "exit", 0, None
            if roll < 0.08:
                exit_code = 1
            elif roll < 0.10:
                end_reason, exit_code, signal = "timeout", None, "SIGKILL"
            elif roll < 0.11:
                end_reason, exit_code = "oom", None
            scale = {"native": 1, "bubblewrap": 1.2, "oci": 1.6, "podman": 3}[backend]
            duration = int(scale * (200 + 800 * abs(math.sin(t * 7 + r))))
            out.append(
                RunEvent(
                    ts=ts(clock + 2),
                    backend=backend,
                    command=command,
                    duration_ms=duration,
                    exit_code=exit_code,
                    signal=signal,
                    timed_out=end_reason == "timeout",
                    end_reason=end_reason,
                    fell_back=backend == "native",
                    unenforced=unenforced,
                    **base,
                )
            )
        out.append(
            DisposeEvent(
                ts=ts(clock + 3),
                backend=backend,
                duration_ms=rnd.randint(1, 50),
                **base,
            )
        )
    return out


def write_log(
    path: Path, events: list[AuditEvent], *, malformed_at: set[int] = frozenset()
) -> AuditLog:
    """Write ``events`` through the real writer; a malformed line before each index given."""
    log = AuditLog(path)
    for i, event in enumerate(events):
        if i in malformed_at:
            append_raw(path, b'{"type": "sandbox:run", "taskId": broken\n')
        log.emit(event)
    return log


def append_raw(path: Path, data: bytes) -> None:
    with path.open("ab") as fh:
        fh.write(data)
