"""The dashboard's API on a log of 100,000 events, against reading the file raw.

    .venv/bin/python benchmarks/bench_dashboard.py [--events N] [--runs N]

Writes a generated log (realistic lifecycles, through the real AuditLog writer), starts
`fusion-oci dashboard` on a free loopback port, and times (medians):
  * baseline: reading every line and json.loads-ing it (what any reader must pay once);
  * the server's first full read of the log (LogTail.poll, in-process);
  * GET /api/summary unchanged (cached), and right after one appended event (incremental
    tail + summary rebuild);
  * GET /api/events for one task, and for the last 1,000 events by cursor;
  * an appended event's arrival on /api/stream (includes the 0.5 s poll interval);
  * `fusion-oci audit --summary --json` on the whole log (a fresh process);
  * verify_chain on the whole log (what the server re-runs, at most ~10% of the time).
Also the server's resident memory and the summary's size. Quote the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_ms, report, run_argv, write_markdown
from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.dashboard.chain import chain_status, host_key
from fusion_oci.dashboard.tail import LogTail
from tests.auditgen import task_events, write_log
from tests.integration.dashboard_fixture import dashboard

BUDGET_MS = {
    "summary after an append": 250.0,
    "summary (cached)": 50.0,
    "events of one task": 100.0,
    "last 1,000 events": 150.0,
}


def make_log(path: Path, n_events: int) -> int:
    events: list[AuditEvent] = []
    tasks = 0
    while len(events) < n_events:
        tasks += 2000
        events = task_events(tasks, spread_s=7 * 86400)
    write_log(path, events[:n_events], malformed_at={n_events // 2})
    return n_events


def raw_read(path: Path) -> None:
    with path.open("rb") as fh:
        for line in fh:
            with contextlib.suppress(ValueError):
                json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # the writers' audit key (and so the dashboard's MAC check) stays in this run's folder
        os.environ["XDG_STATE_HOME"] = str(Path(tmp) / "state")
        path = Path(tmp) / "audit.jsonl"
        t0 = time.perf_counter()
        make_log(path, args.events)
        print(
            f"wrote {args.events} events ({path.stat().st_size / 1e6:.1f} MB) in "
            f"{time.perf_counter() - t0:.1f} s"
        )
        raw = median_ms(lambda: raw_read(path), max(3, args.runs // 3), warmup=1)
        key = host_key(os.environ)
        chain = median_ms(lambda: chain_status(path, key), 3, warmup=0)
        first = median_ms(lambda: LogTail(path).poll(), max(3, args.runs // 3), warmup=1)
        log = AuditLog(path)
        with dashboard(path, timeout=120) as d:
            started = time.perf_counter()
            summary = d.json("/api/summary")  # the first answer waits for the full read
            first_answer = (time.perf_counter() - started) * 1000
            assert summary["log"]["events"] == args.events - 0, summary["log"]
            cached = median_ms(lambda: d.json("/api/summary"), args.runs)
            counter = iter(range(10**9))

            def append_then_summary() -> None:
                log.emit(
                    AuditEvent(
                        type="sandbox:run",
                        task_id="bench",
                        run_id=str(next(counter)),
                        backend="oci",
                        duration_ms=123,
                        exit_code=0,
                        end_reason="exit",
                        command="pnpm test",
                    )
                )
                d.json("/api/summary")

            after_append = median_ms(append_then_summary, args.runs)
            one_task = median_ms(lambda: d.json("/api/events?task=task-00777"), args.runs)
            cursor = summary["source"]["cursor"]
            last_1000 = median_ms(
                lambda: d.json(f"/api/events?since={cursor - 1000}&limit=1000"), args.runs
            )
            stream = stream_latency(d, log, max(5, args.runs // 2))
            rss_mb = (
                int(
                    next(
                        line.split()[1]
                        for line in Path(f"/proc/{d.proc.pid}/status").read_text().splitlines()
                        if line.startswith("VmRSS:")
                    )
                )
                / 1024
            )
            size_kb = len(json.dumps(d.json("/api/summary"))) / 1024
        cli = median_ms(
            run_argv(
                [
                    sys.executable,
                    "-m",
                    "fusion_oci.cli.main",
                    "audit",
                    "--summary",
                    "--json",
                    "--audit-log",
                    str(path),
                ]
            ),
            max(3, args.runs // 5),
            warmup=1,
        )
    report(
        f"dashboard on {args.events:,} events",
        ("raw read + json.loads of every line", raw),
        [
            ("server's first full read (LogTail.poll)", first),
            ("first /api/summary from the server", first_answer),
            ("fusion-oci audit --summary --json (CLI)", cli),
            ("verify_chain with MACs (chain status)", chain),
        ],
    )
    rows = [
        ("summary (cached)", cached),
        ("summary after an append", after_append),
        ("events of one task", one_task),
        ("last 1,000 events", last_1000),
    ]
    print("\nAPI requests on the loaded log (median ms; % of one raw read; budget)")
    for label, value in rows:
        print(f"{label:<44} {value:>10.1f} {100 * value / raw:>7.1f}% {BUDGET_MS[label]:>8.0f} ms")
    print(f"\n/api/stream: appended event delivered after {stream:.0f} ms (median; poll 500 ms)")
    print(
        f"server memory (RSS) with the log loaded: {rss_mb:.0f} MB; summary JSON {size_kb:.1f} KB"
    )
    over = [f"{k} {v:.1f} ms > {BUDGET_MS[k]:.0f} ms" for k, v in rows if v > BUDGET_MS[k]]
    print("budget: " + ("all within budget" if not over else "OVER: " + "; ".join(over)))
    write_markdown(
        args.markdown,
        "Dashboard API",
        "`benchmarks/bench_dashboard.py`: the dashboard's requests on a large audit log "
        "beside a raw read of the file.",
    )


def stream_latency(d: object, log: AuditLog, samples: int) -> float:
    conn = http.client.HTTPConnection(d.host, d.port, timeout=30)  # type: ignore[attr-defined]
    conn.request("GET", "/api/stream?summary=0")
    resp = conn.getresponse()
    while not resp.readline().startswith(b"data: "):  # up to the `ready` event
        pass
    out = []
    for i in range(samples):
        start = time.perf_counter()
        log.emit(
            AuditEvent(
                type="sandbox:dispose",
                task_id="stream",
                run_id=f"s{i}",
                backend="oci",
                duration_ms=1,
            )
        )
        while True:
            line = resp.readline().decode()
            if line.startswith("data: ") and f'"s{i}"' in line:
                break
            if time.perf_counter() - start > 30:
                raise TimeoutError(f"event s{i} never arrived on /api/stream")
        out.append((time.perf_counter() - start) * 1000)
    conn.close()
    return statistics.median(out)


if __name__ == "__main__":
    main()
