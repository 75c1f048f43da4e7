"""``fusion-oci audit --summary``: the dashboard's summary as terminal tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fusion_oci.dashboard.chain import chain_status
from fusion_oci.dashboard.tail import LogTail


def full_summary(
    path: Path, task: str | None = None, chain_key: bytes | None = None
) -> dict[str, Any]:
    """The same JSON as the dashboard's ``/api/summary``."""
    tail = LogTail(path, task=task)
    tail.poll()
    summary = tail.summary.result()
    return {
        **summary,
        "chain": chain_status(path, chain_key),
        "source": {
            "path": str(path),
            "bytes": tail.offset,
            "cursor": tail.cursor,
            "generation": 0,
            "error": tail.error,
        },
    }


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> Table | str:
    if not rows:
        return f"[bold]{title}[/]: none"
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*("-" if v is None else str(v) for v in row))
    return table


def render(s: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    log, chain, runs = s["log"], s["chain"], s["runs"]
    chain_text = chain["status"] + (" (hashes and MACs)" if chain.get("keyed") else "")
    if chain["status"] == "broken":
        chain_text += f" at line {chain['firstBadLine']}: {chain['reason']}"
    console.print(
        f"[bold]{s['source']['path']}[/]: {log['events']} events in {log['lines']} "
        f"lines, {log['malformed']} malformed; {runs['total']} runs, "
        f"{runs['failing']} failing; {s['tasks']['total']} tasks; "
        f"chain: {chain_text}"
    )
    if s["source"]["error"]:
        console.print(f"[red]cannot read the log[/]: {s['source']['error']}")
    if log["malformed"]:
        console.print(
            "malformed lines (latest): " + ", ".join(str(n) for n in log["malformedLines"])
        )
    d = s["durations"]
    console.print(
        _table(
            "runs and durations per backend (ms)",
            ["backend", "runs", "p50", "p95", "max"],
            [[r["backend"], r["runs"], r["p50"], r["p95"], r["max"]] for r in d["byBackend"]],
        )
    )
    console.print(
        _table(
            "prepare (sandbox set-up) per backend (ms)",
            ["backend", "prepares", "p50", "p95", "max"],
            [
                [r["backend"], r["runs"], r["p50"], r["p95"], r["max"]]
                for r in d["prepareByBackend"]
            ],
        )
    )
    console.print(
        _table(
            "durations per command (ms)",
            ["command", "backend", "runs", "p50", "p95"],
            [[r["command"], r["backend"], r["runs"], r["p50"], r["p95"]] for r in d["byCommand"]],
        )
    )
    console.print(
        _table("end reasons", ["reason", "runs"], [[k, v] for k, v in s["endReasons"].items()])
    )
    console.print(
        _table(
            "tasks that hit a limit",
            ["task", "limit", "runs"],
            [[r["taskId"], r["endReason"], r["runs"]] for r in s["limits"]["byTask"]],
        )
    )
    console.print(
        _table(
            "failing exit codes",
            ["exit code", "runs"],
            [[k, v] for k, v in s["failingExits"]["byCode"].items()],
        )
    )
    for key, title in (("fallbacks", "fallbacks"), ("failures", "failures")):
        console.print(
            _table(
                f"{title} ({s[key]['total']})",
                ["reason", "count"],
                [[r["reason"], r["count"]] for r in s[key]["byReason"]],
            )
        )
    console.print(
        _table(
            "unenforced policy parts",
            ["part", "events"],
            [[k, v] for k, v in s["unenforced"].items()],
        )
    )
    console.print(
        _table(
            "gate decisions",
            ["gate", "decision", "decided by", "count"],
            [
                [r["gate"], r["decision"], r["decidedBy"], r["count"]]
                for r in s["gates"]["byDecision"]
            ],
        )
    )
    p = s["provisioning"]
    console.print(
        _table(
            f"image provisioning (retries: {p['retries']})",
            ["time", "action", "outcome", "ref", "digest", "ms", "attempt"],
            [
                [
                    r["ts"],
                    r["action"],
                    r["outcome"],
                    r["ref"],
                    (r["digest"] or "")[:19] or None,
                    r["durationMs"],
                    r["attempt"],
                ]
                for r in p["recent"]
            ],
        )
    )
