"""Per-command overhead of the isolation tiers side by side, from one run: native, landlock,
bubblewrap, oci with runc and oci with gVisor's runsc.

    .venv/bin/python benchmarks/bench_tiers.py [--runs N]

Each runtime is prepared once, on a linked git worktree (a Fusion task's), and runs `true` N
times through the Python API (as an executor does between commands), network none. Floors
measured in the same run: `sh -c true`, a raw `bwrap`, and a raw `runsc --network=none run` on
a bundle written once. The cases take turns (one command of each per round), so load from other
processes on a shared machine falls on all of them alike. A runtime missing here is listed as
such. Ratios are to the native runtime; quote them, not the milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collections.abc import Callable

from benchmarks.common import markdown_table, run_argv, write_markdown
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.bundle import write_bundle
from fusion_oci.oci.host import probe_host
from fusion_oci.policy.layout import resolve_layout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.resolve import ResolvedTask, compile_spec
from fusion_oci.runtimes.registry import create_runtime
from fusion_oci.sandbox import SyncSandbox

NONE = SandboxPolicy(allow_network=False)
TIERS = [
    ("native", {"backend": "native"}),
    ("landlock", {"backend": "landlock"}),
    ("bubblewrap", {"backend": "bubblewrap"}),
    ("oci (runc)", {"backend": "oci", "oci_runtime": "runc"}),
    ("oci (runsc, gVisor)", {"backend": "oci", "oci_runtime": "runsc"}),
]


Case = Callable[[], object] | str
"""One command of the case, or why the case is unavailable here."""


def api_case(settings: SandboxSettings, wt: str, cache: Path, stack: contextlib.ExitStack) -> Case:
    runtime = create_runtime(settings.backend, settings, os.environ)
    avail = runtime.availability()
    if not avail.available:
        return f"unavailable: {avail.reason}"
    sb = stack.enter_context(SyncSandbox(settings, env=dict(os.environ), cache_root=cache))
    sb.prepare(
        PrepareContext(task_id="bench", run_id=uuid.uuid4().hex[:6], worktree_path=wt, policy=NONE)
    )
    assert sb.run("true").exit_code == 0
    return lambda: sb.run("true", RunOptions())


def raw_runsc(wt: str, tmp: Path) -> Case:
    runsc = shutil.which("runsc")
    if runsc is None:
        return "unavailable: runsc is not installed"
    host = probe_host()
    ctx = PrepareContext(task_id="bench", run_id="raw", worktree_path=wt, policy=NONE)
    layout = resolve_layout(ctx, cache_root=tmp / "cache", ca_bundle=host.ca_bundle)
    task = ResolvedTask(ctx=ctx, layout=layout, host=host, env=dict(os.environ))
    spec = compile_spec(task, "true", RunOptions())
    bundle = write_bundle(spec, tmp / "raw-bundle")
    counter = iter(range(10**9))

    def go() -> None:
        cid = f"fusion-oci-bench-{os.getpid()}-{next(counter)}"
        subprocess.run(
            [
                runsc,
                "--root",
                str(tmp / "raw-state"),
                "--network=none",
                "run",
                "--bundle",
                str(bundle.path),
                cid,
            ],
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    return go


def linked_worktree(base: Path) -> str:
    """A repository with one commit and a linked worktree of it (``git worktree add``)."""
    repo, wt = base / "repo", base / "wt"
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "b",
        "GIT_AUTHOR_EMAIL": "b@e",
        "GIT_COMMITTER_NAME": "b",
        "GIT_COMMITTER_EMAIL": "b@e",
    }
    for argv in (
        ["init", "-q", str(repo)],
        ["-C", str(repo), "commit", "-q", "--allow-empty", "-m", "init"],
        ["-C", str(repo), "worktree", "add", "-q", str(wt)],
    ):
        subprocess.run(["git", *argv], check=True, env=env, capture_output=True)
    return str(wt)


def rounds(
    cases: list[tuple[str, Case]], runs: int, warmup: int = 2
) -> list[tuple[str, float | str]]:
    """Median ms of each case, the cases taking turns round after round."""
    samples: dict[str, list[float]] = {label: [] for label, case in cases if callable(case)}
    for i in range(warmup + runs):
        for label, case in cases:
            if callable(case):
                start = time.perf_counter()
                case()
                if i >= warmup:
                    samples[label].append((time.perf_counter() - start) * 1000)
    return [
        (label, statistics.median(samples[label]) if callable(case) else case)
        for label, case in cases
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as base,
        tempfile.TemporaryDirectory() as tmpdir,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(tmpdir)
        wt = linked_worktree(Path(base))
        cases: list[tuple[str, Case]] = [
            ("sh -c true (direct)", run_argv(["/bin/sh", "-c", "true"], cwd=wt)),
        ]
        if shutil.which("bwrap"):
            cases.append(
                (
                    "raw bwrap --unshare-all --ro-bind / / true",
                    run_argv(
                        [
                            "bwrap",
                            "--unshare-all",
                            "--die-with-parent",
                            "--ro-bind",
                            "/",
                            "/",
                            "--",
                            "true",
                        ]
                    ),
                )
            )
        cases.append(("raw runsc --network=none run (bundle written once)", raw_runsc(wt, tmp)))
        for label, fields in TIERS:
            settings = SandboxSettings(**fields, policy=NONE)  # type: ignore[arg-type]
            cases.append(
                (f"{label} runtime, network none", api_case(settings, wt, tmp / "cache", stack))
            )
        rows = rounds(cases, args.runs)
    native = next(v for k, v in rows if k.startswith("native"))
    assert isinstance(native, float)
    print("\nisolation tiers: per-command overhead of `true` (Python API, prepared sandbox)")
    print(f"{'case':<56} {'median ms':>10} {'x native':>9}")
    for label, value in rows:
        if isinstance(value, str):
            print(f"{label:<56} {value}")
        else:
            print(f"{label:<56} {value:>10.1f} {value / native:>8.1f}x")
    write_markdown(
        args.markdown,
        "The isolation tiers, side by side",
        "`benchmarks/bench_tiers.py`: `true` through a prepared sandbox of each tier "
        f"(network none), the cases taking turns; medians of {args.runs}.",
        markdown_table(
            ["case", "median ms", "x native"],
            [
                (label, value, "")
                if isinstance(value, str)
                else (label, value, f"{value / native:.2f}x")
                for label, value in rows
            ],
        ),
    )


if __name__ == "__main__":
    main()
