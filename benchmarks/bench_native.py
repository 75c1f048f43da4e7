"""Per-command overhead of fusion-oci's native path against running the command directly.

    .venv/bin/python benchmarks/bench_native.py [--runs N] [--markdown PATH]

Every case runs `/bin/sh -c true` from this one process, interleaved (one of each per round,
the order rotating), so a busy machine slows them alike: the bare `subprocess.run` (the
baseline the issue names); the exec agent alone (`Agent.run`); compiling the spec alone; the
native runtime (spec compile + the agent); the whole lifecycle (`Sandbox.run`: audit event,
result). Then, apart and fewer times, the previous path (a Python reaper shim started per
command, `run_process(reaper_argv(...))`) and the `fusion-oci run` CLI (a fresh interpreter
per command). Medians; quote the differences and ratios, not the absolute times.
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
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_ms, run_argv
from fusion_oci.agent.client import Agent
from fusion_oci.host.process import reaper_argv, run_process
from fusion_oci.models import PrepareContext, RunOptions
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.native import NativeRuntime
from fusion_oci.sandbox import Sandbox

TRUE = ["/bin/sh", "-c", "true"]


async def lifetime(times: int) -> tuple[float, float]:
    """Median ms to start an agent (until its hello) and to close it (until it has exited)."""
    starts, closes = [], []
    for _ in range(times):
        t0 = time.perf_counter()
        agent = await Agent.start_local()
        t1 = time.perf_counter()
        await agent.close()
        starts.append((t1 - t0) * 1000)
        closes.append((time.perf_counter() - t1) * 1000)
    return statistics.median(starts), statistics.median(closes)


async def measure(wt: str, runs: int) -> dict[str, float]:
    env = dict(os.environ)
    res_start, res_close = await lifetime(max(10, runs // 10))
    agent = await Agent.start_local()
    sandbox = Sandbox(SandboxSettings(), env=env)
    await sandbox.prepare(PrepareContext(task_id="bench", run_id="r", worktree_path=wt))
    runtime = sandbox.runtime
    assert isinstance(runtime, NativeRuntime)
    opts = RunOptions()

    async def compile_only() -> None:
        task.process("true", opts)  # the process spec of one command, nothing run

    async def runtime_run() -> None:
        # The runtime alone: plan and execute a process compiled beforehand (the lifecycle's
        # compile is the "compile" case and the gap to "sandbox").
        await runtime.execute(runtime.plan(process), opts)

    assert sandbox.task is not None
    task = sandbox.task
    process = task.process("true", opts)

    async def bare() -> None:
        subprocess.run(TRUE, cwd=wt, check=True)  # noqa: ASYNC221 - the baseline, as named

    cases: dict[str, Callable[[], Awaitable[object]]] = {
        "bare": bare,
        "agent": lambda: agent.run(TRUE, env=env, cwd=wt),
        "compile": compile_only,
        "runtime": runtime_run,
        "sandbox": lambda: sandbox.run("true"),
    }
    samples: dict[str, list[float]] = {name: [] for name in [*cases, "reaper"]}
    try:
        names = list(cases)
        for round_ in range(runs + 3):
            # Each round starts one case later: no case always follows the same neighbour.
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                case = cases[name]
                start = time.perf_counter()
                await case()
                if round_ >= 3:  # warm-up rounds are not counted
                    samples[name].append((time.perf_counter() - start) * 1000)
        # The old path starts an interpreter per command: measured apart (fewer times), as
        # its load would slow the fast cases beside it.
        for _ in range(max(5, runs // 10)):
            start = time.perf_counter()
            await run_process(reaper_argv(TRUE), env=env, cwd=wt, term_group=False)
            samples["reaper"].append((time.perf_counter() - start) * 1000)
    finally:
        await sandbox.dispose()
        await agent.close()
    res = {name: statistics.median(values) for name, values in samples.items()}
    res["agent-start"], res["agent-close"] = res_start, res_close
    # Paired: each round's case minus the same round's bare run, so load that drifts during
    # the run cancels out of the overhead.
    for name in cases:
        res[f"{name}-paired"] = statistics.median(
            value - bare for value, bare in zip(samples[name], samples["bare"], strict=True)
        )
    return res


def markdown(res: dict[str, float], runs: int, cli_runs: int) -> str:
    base = res["bare"]
    rows = [
        ('`subprocess.run(["/bin/sh", "-c", "true"])` (baseline)', "bare"),
        ("exec agent: `Agent.run` (spawn frame, keeper, exit status)", "agent"),
        ("native runtime: `NativeRuntime.run` (spec compile + agent)", "runtime"),
        (
            "  of which: compiling the command's process spec (`ResolvedTask.process`), nothing run",
            "compile",
        ),
        ("Python API: `Sandbox.run` (prepared; lifecycle, audit event)", "sandbox"),
        ("before: a Python reaper shim per command (`run_process(reaper_argv(...))`)", "reaper"),
        ("CLI: `fusion-oci run -- true` (a fresh interpreter per command)", "cli"),
    ]
    lines = [
        "## Native runtime: per-command overhead",
        "",
        f"`benchmarks/bench_native.py --runs {runs}`: medians of `/bin/sh -c true`, every case "
        "from one process and interleaved (one of each per round, the order rotating); "
        f"the old reaper path {max(5, runs // 10)} times after them, the CLI row {cli_runs} "
        "times. Overhead is the median of each round's difference to that round's bare "
        "`subprocess.run` (paired, so load drifting during the run cancels out); the issue's "
        "target is at most +2 ms for the native path.",
        "",
        "| path | median ms | overhead ms | ratio |",
        "|---|---:|---:|---:|",
    ]
    for label, key in rows:
        value = res[key]
        if key == "compile":  # a part of the runtime row, not a path of its own
            lines.append(f"| {label} | {value:.2f} | | |")
            continue
        extra = res.get(f"{key}-paired", value - base)
        lines.append(f"| {label} | {value:.2f} | {extra:+.2f} | {value / base:.2f}x |")
    agent, sandbox, comp = res["agent-paired"], res["sandbox-paired"], res["compile"]
    verdict = "within" if sandbox <= 2.0 else "above"
    lines += [
        "",
        "Reading it:",
        "",
        "- The exec agent (a static C binary started once per sandbox, at prepare) replaces "
        "the interpreter the reaper shim started per command "
        f"({res['reaper'] / res['sandbox']:.0f}x the new path here). Its own cost is the "
        f"`Agent.run` row, {agent:+.2f} ms: two forks in a tiny process (a keeper that is the "
        "tree's subreaper, then the command) and one frame each way, the output straight "
        "into the host's pipes.",
        f"- Through the Python API the native path is {sandbox:+.2f} ms over the bare "
        f"`subprocess.run`, {verdict} the +2 ms target: the agent's {agent:+.2f} ms, "
        f"{comp:.2f} ms compiling the command's spec (the bundle) in Python, which every "
        "runtime pays per command (`compile_spec` copies the whole spec in each step), and "
        f"{sandbox - agent - comp:.2f} ms of the runtime's and the lifecycle's Python (the "
        "result, the audit event).",
        f"- Per sandbox, starting the agent (at prepare, until its hello) takes "
        f"{res['agent-start']:.2f} ms and closing it (at dispose, until it has exited) "
        f"{res['agent-close']:.2f} ms.",
        "- The CLI row is dominated by the interpreter's start-up and imports (issue #12).",
        "- A shared, busy 2-core machine: read the differences and ratios of one run, not the "
        "absolute times.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--markdown", type=Path, help="write the docs/performance.md section")
    args = parser.parse_args()
    cli_runs = max(5, args.runs // 20)
    with tempfile.TemporaryDirectory() as wt:
        subprocess.run(["git", "init", "-q", wt], check=True)  # a worktree is a git top
        res = asyncio.run(measure(wt, args.runs))
        res["cli"] = median_ms(
            run_argv(
                [
                    sys.executable,
                    "-m",
                    "fusion_oci.cli.main",
                    "run",
                    "--audit-log",
                    os.devnull,
                    "--",
                    "true",
                ],
                cwd=wt,
            ),
            cli_runs,
        )
    base = res["bare"]
    print(f"\nnative runtime: per-command overhead ({args.runs} interleaved rounds)")
    print(f"{'case':<10} {'median ms':>10} {'overhead':>10} {'ratio':>8}")
    for name, value in res.items():
        if name.endswith("-paired") or name.startswith("agent-"):
            continue
        extra = res.get(f"{name}-paired", value - base)
        print(f"{name:<10} {value:>10.2f} {extra:>+10.2f} {value / base:>7.2f}x")
    print(f"agent start {res['agent-start']:.2f} ms, close {res['agent-close']:.2f} ms")
    if args.markdown is not None:
        args.markdown.write_text(markdown(res, args.runs, cli_runs))
        print(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()
