"""Per-command overhead of the oci runtime (runc on the bundle) against native and raw runc.

    .venv/bin/python benchmarks/bench_oci.py [--runs N] [--runtime runc]

Cases, each running `true`: `sh -c true` directly; the native runtime (prepared SyncSandbox);
`runc run` by hand on a bundle written once (the floor for any OCI-runtime path); the oci
runtime (prepared SyncSandbox: a bundle written and `runc run` per command) with network none;
with memory+pids limits (adds `--keep`, the counters read, and `runc delete --force`); and with
egress (slirp4netns attached through the createRuntime hook) when it is available. Prints
medians and ratios; quote the ratios, the machine is shared and noisy.
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

from benchmarks.common import markdown_table, median_ms, run_argv, write_markdown
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.bundle import write_bundle
from fusion_oci.oci.host import probe_host
from fusion_oci.oci.spec import compile_spec
from fusion_oci.policy.layout import resolve_layout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.oci import OciRuntime
from fusion_oci.sandbox import SyncSandbox


def sandbox_case(settings: SandboxSettings, wt: str, policy: SandboxPolicy, runs: int,
                 cache: Path) -> float:
    with SyncSandbox(settings, env=dict(os.environ), cache_root=cache) as sb:
        sb.prepare(PrepareContext(task_id="bench", run_id=uuid.uuid4().hex[:6],
                                  worktree_path=wt, policy=policy))
        result = sb.run("true")
        assert result.exit_code == 0, result
        return median_ms(lambda: sb.run("true", RunOptions()), runs)


def raw_runc_case(runtime: str, wt: str, tmp: Path, runs: int) -> float:
    host = probe_host()
    ctx = PrepareContext(task_id="bench", run_id="raw", worktree_path=wt,
                         policy=SandboxPolicy(allow_network=False))
    layout = resolve_layout(ctx, cache_root=tmp / "cache", ca_bundle=host.ca_bundle)
    spec = compile_spec(ctx, layout, host, "true", RunOptions(), dict(os.environ))
    bundle = write_bundle(spec, tmp / "raw-bundle")
    root = tmp / "raw-state"
    counter = iter(range(10**9))

    def go() -> None:
        cid = f"fusion-oci-bench-{os.getpid()}-{next(counter)}"
        subprocess.run([runtime, "--root", str(root), "run", "--bundle", str(bundle.path), cid],
                       check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    return median_ms(go, runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--runtime", default="runc")
    args = parser.parse_args()
    oci_settings = SandboxSettings(backend="oci", oci_runtime=args.runtime)
    probe = OciRuntime(oci_settings, dict(os.environ))
    avail = probe.availability()
    if not avail.available:
        sys.exit(f"oci runtime unavailable: {avail.reason}")
    with tempfile.TemporaryDirectory() as wt, tempfile.TemporaryDirectory() as tmpdir:
        subprocess.run(["git", "init", "-q", wt], check=True)  # a worktree is a git top
        tmp = Path(tmpdir)
        none = SandboxPolicy(allow_network=False)
        direct = median_ms(run_argv(["/bin/sh", "-c", "true"], cwd=wt), args.runs)
        native = sandbox_case(SandboxSettings(), wt, none, args.runs, tmp / "cache")
        raw = raw_runc_case(args.runtime, wt, tmp, args.runs)
        oci = sandbox_case(oci_settings, wt, none, args.runs, tmp / "cache")
        rows = [("native runtime (SyncSandbox.run)", native),
                (f"raw `{args.runtime} run` on a written bundle", raw),
                ("oci runtime, network none", oci)]
        limited = SandboxPolicy(allow_network=False, memory_limit_mb=256, pids_limit=256)
        if {r.value for r in probe.enforces()} >= {"memoryLimitMb", "pidsLimit"}:
            rows.append(("oci runtime, memory+pids limits (--keep, delete)",
                         sandbox_case(oci_settings, wt, limited, args.runs, tmp / "cache")))
        if probe.egress_status()[0]:
            egress = sandbox_case(oci_settings, wt, SandboxPolicy(allow_network=True),
                                  max(5, args.runs // 2), tmp / "cache")
            rows.append(("oci runtime, network egress (slirp4netns)", egress))
        shutil.rmtree(tmp / "raw-state", ignore_errors=True)
    print(f"\noci runtime ({args.runtime} {avail.version or ''}): per-command overhead of `true`")
    print(f"{'case':<48} {'median ms':>10} {'x direct':>9} {'x native':>9} {'x raw':>7}")
    print(f"{'sh -c true (direct)':<48} {direct:>10.1f} {1.0:>8.1f}x")
    for label, value in rows:
        print(f"{label:<48} {value:>10.1f} {value / direct:>8.1f}x {value / native:>8.1f}x "
              f"{value / raw:>6.2f}x")
    write_markdown(args.markdown, f"OCI runtime ({args.runtime}): per-command overhead",
                   "`benchmarks/bench_oci.py`: `true` through a prepared sandbox beside a raw "
                   f"`{args.runtime} run` of a bundle; medians of {args.runs}.",
                   markdown_table(["case", "median ms", "x direct", "x native", "x raw"],
                                  [("sh -c true (direct)", direct, "1.00x", "", "")] +
                                  [(label, v, f"{v / direct:.2f}x", f"{v / native:.2f}x",
                                    f"{v / raw:.2f}x") for label, v in rows]))


if __name__ == "__main__":
    main()
