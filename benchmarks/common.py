"""Shared timing helpers: medians of repeated runs, reported as ratios (the machine is noisy)."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable, Sequence


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
        return subprocess.run(argv, cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    return go


def report(title: str, baseline: tuple[str, float], rows: list[tuple[str, float]]) -> None:
    name, base = baseline
    print(f"\n{title}")
    print(f"{'case':<44} {'median ms':>10} {'ratio':>8}")
    print(f"{name:<44} {base:>10.1f} {1.0:>8.1f}x")
    for label, value in rows:
        print(f"{label:<44} {value:>10.1f} {value / base:>8.1f}x")
