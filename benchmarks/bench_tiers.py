"""Per-command overhead of the isolation tiers side by side, from one run: native, landlock,
bubblewrap, oci with runc and oci with gVisor's runsc.

    .venv/bin/python benchmarks/bench_tiers.py [--runs N]

Each runtime is prepared once and runs `true` N times through the Python API (as an executor
does between commands), network none. Floors measured in the same run: `sh -c true`, a raw
`bwrap`, and a raw `runsc --network=none run` on a bundle written once. A runtime missing here
is listed as such. Ratios are to the native runtime; quote them, not the milliseconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_ms, run_argv
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.bundle import write_bundle
from fusion_oci.oci.host import probe_host
from fusion_oci.oci.spec import compile_spec
from fusion_oci.policy.layout import resolve_layout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.registry import create_runtime
from fusion_oci.sandbox import SyncSandbox

NONE = SandboxPolicy(allow_network=False)
TIERS = [("native", {"backend": "native"}), ("landlock", {"backend": "landlock"}),
         ("bubblewrap", {"backend": "bubblewrap"}),
         ("oci (runc)", {"backend": "oci", "oci_runtime": "runc"}),
         ("oci (runsc, gVisor)", {"backend": "oci", "oci_runtime": "runsc"})]


def api_median(settings: SandboxSettings, wt: str, cache: Path, runs: int) -> float | str:
    runtime = create_runtime(settings.backend, settings, os.environ)
    avail = runtime.availability()
    if not avail.available:
        return f"unavailable: {avail.reason}"
    with SyncSandbox(settings, env=dict(os.environ), cache_root=cache) as sb:
        sb.prepare(PrepareContext(task_id="bench", run_id=uuid.uuid4().hex[:6],
                                  worktree_path=wt, policy=NONE))
        assert sb.run("true").exit_code == 0
        return median_ms(lambda: sb.run("true", RunOptions()), runs)


def raw_runsc(wt: str, tmp: Path, runs: int) -> float | str:
    runsc = shutil.which("runsc")
    if runsc is None:
        return "unavailable: runsc is not installed"
    host = probe_host()
    ctx = PrepareContext(task_id="bench", run_id="raw", worktree_path=wt, policy=NONE)
    layout = resolve_layout(ctx, cache_root=tmp / "cache", ca_bundle=host.ca_bundle)
    spec = compile_spec(ctx, layout, host, "true", RunOptions(), dict(os.environ))
    bundle = write_bundle(spec, tmp / "raw-bundle")
    counter = iter(range(10**9))

    def go() -> None:
        cid = f"fusion-oci-bench-{os.getpid()}-{next(counter)}"
        subprocess.run([runsc, "--root", str(tmp / "raw-state"), "--network=none", "run",
                        "--bundle", str(bundle.path), cid], check=True,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    return median_ms(go, runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as wt, tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        rows: list[tuple[str, float | str]] = [
            ("sh -c true (direct)", median_ms(run_argv(["/bin/sh", "-c", "true"], cwd=wt),
                                              args.runs)),
        ]
        if shutil.which("bwrap"):
            rows.append(("raw bwrap --unshare-all --ro-bind / / true", median_ms(run_argv(
                ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--",
                 "true"]), args.runs)))
        rows.append(("raw runsc --network=none run (bundle written once)",
                     raw_runsc(wt, tmp, args.runs)))
        for label, fields in TIERS:
            settings = SandboxSettings(**fields, policy=NONE)  # type: ignore[arg-type]
            rows.append((f"{label} runtime, network none",
                         api_median(settings, wt, tmp / "cache", args.runs)))
    native = next(v for k, v in rows if k.startswith("native"))
    assert isinstance(native, float)
    print("\nisolation tiers: per-command overhead of `true` (Python API, prepared sandbox)")
    print(f"{'case':<56} {'median ms':>10} {'x native':>9}")
    for label, value in rows:
        if isinstance(value, str):
            print(f"{label:<56} {value}")
        else:
            print(f"{label:<56} {value:>10.1f} {value / native:>8.1f}x")


if __name__ == "__main__":
    main()
