"""Shared timing helpers: medians of repeated runs, reported as ratios (the machine is noisy)."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def median_ms(fn: Callable[[], object], runs: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def run_argv(argv: Sequence[str], cwd: str | None = None) -> Callable[[], object]:
    def go() -> object:
        return subprocess.run(
            argv,
            cwd=cwd,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )

    return go


RECORDED: list[tuple[str, tuple[str, float], list[tuple[str, float]]]] = []
"""Every table :func:`report` printed in this process, for ``--markdown``."""


def report(title: str, baseline: tuple[str, float], rows: list[tuple[str, float]]) -> None:
    RECORDED.append((title, baseline, list(rows)))
    name, base = baseline
    print(f"\n{title}")
    print(f"{'case':<44} {'median ms':>10} {'ratio':>8}")
    print(f"{name:<44} {base:>10.1f} {1.0:>8.1f}x")
    for label, value in rows:
        print(f"{label:<44} {value:>10.1f} {value / base:>8.1f}x")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""

    def cell(value: object) -> str:
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    def numeric(i: int) -> bool:
        return (
            all(
                isinstance(r[i], int | float) or str(r[i]).rstrip("x").replace(".", "", 1).isdigit()
                for r in rows
            )
            if rows
            else False
        )

    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---:" if numeric(i) else "---" for i in range(len(headers))) + "|",
    ]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def recorded_markdown() -> str:
    """Every table report() printed, as markdown: case, median ms, ratio to the baseline."""
    out = []
    for title, (name, base), rows in RECORDED:
        table = [(name, base, "1.00x")] + [
            (label, value, f"{value / base:.2f}x") for label, value in rows
        ]
        out.append(f"**{title}**\n\n" + markdown_table(["case", "median ms", "ratio"], table))
    return "\n".join(out)


def write_markdown(
    path: str | None, heading: str, intro: str = "", body: str | None = None, reading: str = ""
) -> None:
    """Write this benchmark's section of docs/performance.md (scripts/bench.sh assembles
    them): ``## heading``, an intro, the tables (default: every report() table), reading it."""
    if not path:
        return
    text = f"## {heading}\n\n"
    if intro:
        text += intro.strip() + "\n\n"
    text += (recorded_markdown() if body is None else body).rstrip() + "\n"
    if reading:
        text += "\nReading it:\n\n" + reading.strip() + "\n"
    Path(path).write_text(text, encoding="utf-8")
