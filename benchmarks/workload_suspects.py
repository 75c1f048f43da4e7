"""One suspect at a time for a runtime's workload gap: the workload project's tests, type check
and build (installed once on the host) in prepared sandboxes of one runtime under different
networks, beside the raw tool, interleaved rounds, medians as ratios to the host.

    .venv/bin/python benchmarks/workload_suspects.py oci-runsc [--rounds 5]

For ``oci-runsc``: ours under ``egress`` (what bench_workload measures: each command's sandbox
starts in a fresh network namespace with its slirp), ours under ``none`` (runsc's empty
netstack), and raw ``runsc do`` per step. Not part of scripts/bench.sh (a diagnosis, not a
table of the report).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_workload import LONG, WORK, linked_project, make_runtime
from benchmarks.workload_raw import raw_runsc_argv, timed
from fusion_oci.models import NetworkMode
from tests.contract.harness import Runtime, sandbox


async def ours(rt: Runtime, wt: Path, network: NetworkMode) -> list[float]:
    out = []
    async with sandbox(rt, wt, network=network) as box:
        for _, command in WORK:
            start = time.monotonic()
            r = await box.run(command, LONG)
            out.append(time.monotonic() - start)
            assert r.exit_code == 0, (r.stderr or r.stdout)[-300:]
    return out


def host(wt: Path) -> list[float]:
    out = []
    for _, command in WORK:
        start = time.monotonic()
        subprocess.run(
            ["/bin/sh", "-c", command],
            cwd=wt,
            check=True,
            capture_output=True,
            env={**os.environ, "CI": "1"},
        )
        out.append(time.monotonic() - start)
    return out


def install(wt: Path) -> None:
    subprocess.run(
        ["pnpm", "install", "--frozen-lockfile"],
        cwd=wt,
        check=True,
        capture_output=True,
        env={**os.environ, "CI": "1"},
    )


def raw(wt: Path) -> list[float]:
    out = []
    for _, command in WORK:
        took, code, tail = timed(raw_runsc_argv(wt, f"export CI=1 && {command}"))
        assert code == 0, tail
        out.append(took)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runtime", choices=["oci-runsc"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rt = make_runtime(args.runtime)
    assert isinstance(rt, Runtime), rt
    with tempfile.TemporaryDirectory(prefix="fusion-oci-suspects-") as tmp:
        wt = linked_project(Path(tmp))
        install(wt)
        cases: dict[str, list[float]] = {}
        for i in range(args.rounds):
            got = {
                "host": host(wt),
                "ours, egress": await ours(rt, wt, NetworkMode.EGRESS),
                "ours, none": await ours(rt, wt, NetworkMode.NONE),
                "raw runsc do": raw(wt),
            }
            for k, v in got.items():
                cases.setdefault(k, []).append(sum(v))
                print(f"round {i + 1} {k}: " + " ".join(f"{x:.2f}" for x in v), flush=True)
        base = statistics.median(cases["host"])
        print(f"\ntests + check + build, median of {args.rounds} rounds")
        for k, v in cases.items():
            m = statistics.median(v)
            print(
                f"{k:<16} {m:6.2f} s {m / base:5.2f}x host "
                f"{m / statistics.median(cases['raw runsc do']):5.2f}x raw"
            )


if __name__ == "__main__":
    asyncio.run(main())
