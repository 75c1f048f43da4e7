"""Per-command overhead of the bubblewrap runtime over the native one.

    .venv/bin/python benchmarks/bench_bubblewrap.py [--runs N]

Both runtimes are prepared once and then run `true` N times through the Python API (as an
executor does between commands); the table gives medians and the ratio to native. Extra rows:
a raw `bwrap` call (the floor), and bubblewrap with egress (slirp4netns per command) and with
cgroup limits (a leaf cgroup per command). Quote the ratios, not the milliseconds.
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
from fusion_oci.models import CpuLimit, PrepareContext, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox


def api_median(backend: str, policy: SandboxPolicy, wt: str, cache: Path, runs: int) -> float:
    settings = SandboxSettings(backend=backend, policy=policy)  # type: ignore[arg-type]
    with SyncSandbox(settings, env=dict(os.environ), cache_root=cache) as sb:
        sb.prepare(PrepareContext(task_id="bench", run_id="r", worktree_path=wt, policy=policy))
        return median_ms(lambda: sb.run("true"), runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    none = SandboxPolicy(allow_network=False)
    egress = SandboxPolicy(network="egress")  # type: ignore[arg-type]
    limited = SandboxPolicy(allow_network=False, memory_limit_mb=512, pids_limit=256,
                            cpu_limit=CpuLimit(max_cores=1))
    with tempfile.TemporaryDirectory() as wt, tempfile.TemporaryDirectory() as cache:
        subprocess.run(["git", "init", "-q", wt], check=True)  # a worktree is a git top
        native = api_median("native", none, wt, Path(cache), args.runs)
        raw = median_ms(run_argv(["bwrap", "--unshare-all", "--die-with-parent",
                                  "--ro-bind", "/", "/", "--", "true"]), args.runs)
        rows = [
            ("raw bwrap --unshare-all --ro-bind / / true", raw),
            ("bubblewrap, network none", api_median("bubblewrap", none, wt, Path(cache),
                                                    args.runs)),
            ("bubblewrap, network egress (slirp4netns)",
             api_median("bubblewrap", egress, wt, Path(cache), args.runs)),
            ("bubblewrap, none + memory/pids/cpu cgroup",
             api_median("bubblewrap", limited, wt, Path(cache), args.runs)),
        ]
    report("bubblewrap runtime: per-command overhead over native (Python API, `true`)",
           ("native, SyncSandbox.run (prepared)", native), rows)
    write_markdown(args.markdown, "Bubblewrap runtime: per-command overhead",
                   "`benchmarks/bench_bubblewrap.py`: `true` through a prepared sandbox "
                   "beside native "
                   "and a raw `bwrap`.")

if __name__ == "__main__":
    main()
