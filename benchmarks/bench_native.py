"""Per-command overhead of fusion-oci's native path against running the command directly.

    .venv/bin/python benchmarks/bench_native.py [--runs N]

Cases: `sh -c true` directly; the Python API (a prepared SyncSandbox, one run per command);
the `fusion-oci run` CLI (a fresh process per command, as an executor shelling out would).
Prints medians and ratios to the direct run; quote the ratios.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_ms, report, run_argv, write_markdown
from fusion_oci.models import PrepareContext
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as wt:
        subprocess.run(["git", "init", "-q", wt], check=True)  # a worktree is a git top
        direct = median_ms(run_argv(["/bin/sh", "-c", "true"], cwd=wt), args.runs)
        with SyncSandbox(SandboxSettings(), env=dict(os.environ)) as sb:
            sb.prepare(PrepareContext(task_id="bench", run_id="r", worktree_path=wt))
            api = median_ms(lambda: sb.run("true"), args.runs)
        cli = median_ms(run_argv([sys.executable, "-m", "fusion_oci.cli.main", "run",
                                  "--audit-log", os.devnull, "--", "true"], cwd=wt),
                        max(5, args.runs // 3))
        imp = median_ms(run_argv([sys.executable, "-c", "import fusion_oci.cli.main"]),
                        max(5, args.runs // 3))
    report("native runtime: per-command overhead", ("sh -c true (direct)", direct), [
        ("Python API: SyncSandbox.run (prepared)", api),
        ("CLI: fusion-oci run -- true", cli),
        ("  of which: python + import of the CLI", imp),
    ])
    write_markdown(args.markdown, "Native runtime: per-command overhead",
                   "`benchmarks/bench_native.py`: `true` through a prepared `SyncSandbox` "
                   "and the CLI "
                   "beside `sh -c true` run directly.")

if __name__ == "__main__":
    main()
