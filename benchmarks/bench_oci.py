"""Per-command overhead of the oci runtime (runc on the bundle) against native and raw runc.

    .venv/bin/python benchmarks/bench_oci.py [--runs N] [--runtime runc ...] [--markdown PATH]

Cases, each running `true`: `sh -c true` directly; the native runtime (prepared SyncSandbox);
`runc run` by hand on a bundle written once (the floor for any OCI-runtime path); the oci
runtime (prepared SyncSandbox: a bundle written and `runc run` per command) with network none;
with memory+pids limits (adds `--keep`, the counters read, and `runc delete --force`); and with
egress (slirp4netns attached through the createRuntime hook) when it is available. Prints
medians and ratios; quote the ratios, the machine is shared and noisy. ``--runtime`` may be
given more than once (default: runc and runsc; one that is unavailable here is reported, not
measured). ``--markdown PATH`` writes this benchmark's section of docs/performance.md there.
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
from fusion_oci.models import NetworkMode, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.bundle import write_bundle
from fusion_oci.oci.host import probe_host
from fusion_oci.oci.spec import compile_spec
from fusion_oci.policy.layout import resolve_layout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.oci import OciRuntime, runtime_flags
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
        flags = runtime_flags(runtime, NetworkMode.NONE)  # runsc decides networking by flag
        subprocess.run([runtime, "--root", str(root), *flags, "run", "--bundle",
                        str(bundle.path), cid], check=True, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    return median_ms(go, runs)


Row = tuple[str, float]


def measure(runtime: str, runs: int) -> tuple[str, float, float, float, list[Row]] | str:
    """(version, direct, native, raw, rows) for one runtime, or why it was not measured."""
    oci_settings = SandboxSettings(backend="oci", oci_runtime=runtime)
    probe = OciRuntime(oci_settings, dict(os.environ))
    avail = probe.availability()
    if not avail.available:
        return avail.reason
    with tempfile.TemporaryDirectory() as wt, tempfile.TemporaryDirectory() as tmpdir:
        subprocess.run(["git", "init", "-q", wt], check=True)  # a worktree is a git top
        tmp = Path(tmpdir)
        none = SandboxPolicy(allow_network=False)
        direct = median_ms(run_argv(["/bin/sh", "-c", "true"], cwd=wt), runs)
        native = sandbox_case(SandboxSettings(), wt, none, runs, tmp / "cache")
        raw = raw_runc_case(runtime, wt, tmp, runs)
        rows = [("oci runtime, network none", sandbox_case(oci_settings, wt, none, runs,
                                                            tmp / "cache"))]
        limited = SandboxPolicy(allow_network=False, memory_limit_mb=256, pids_limit=256)
        enforced = {r.value for r in probe.enforces()}
        if "memoryLimitMb" in enforced:
            label = "memory+pids limits (--keep, delete)" if "pidsLimit" in enforced else \
                "memory limit (a cgroup of ours that runsc joins)"
            if "pidsLimit" not in enforced:
                limited = SandboxPolicy(allow_network=False, memory_limit_mb=256)
            rows.append((f"oci runtime, {label}",
                         sandbox_case(oci_settings, wt, limited, runs, tmp / "cache")))
        if probe.egress_status()[0]:
            rows.append(("oci runtime, network egress (slirp4netns)",
                         sandbox_case(oci_settings, wt, SandboxPolicy(allow_network=True),
                                      max(5, runs // 2), tmp / "cache")))
        shutil.rmtree(tmp / "raw-state", ignore_errors=True)
    return avail.version or "", direct, native, raw, rows


def markdown(results: dict[str, tuple[str, float, float, float, list[Row]] | str],
             runs: int) -> str:
    out = [f"## oci runtime: per-command overhead (`benchmarks/bench_oci.py --runs {runs}`)",
           "",
           "Each case runs `true` in a prepared sandbox; ratios against the raw runtime CLI "
           "(`RUNTIME run` on a bundle written once, the floor for any OCI-runtime path) and "
           "`sh -c true`, measured in the same run. One run on a shared, busy 2-core machine: "
           "quote the ratios, not the milliseconds.", ""]
    for runtime, result in results.items():
        if isinstance(result, str):
            out += [f"**{runtime}**: not measured here ({result}).", ""]
            continue
        version, direct, native, raw, rows = result
        out += [f"**{runtime}** ({version})", "",
                "| case | median ms | x raw runtime | x `sh -c true` |",
                "|---|---:|---:|---:|",
                f"| `sh -c true` (direct) | {direct:.1f} | {direct / raw:.2f}x | 1.0x |",
                f"| native runtime | {native:.1f} | {native / raw:.2f}x | "
                f"{native / direct:.1f}x |",
                f"| raw `{runtime} run` | {raw:.1f} | 1.00x | {raw / direct:.1f}x |"]
        out += [f"| {label} | {value:.1f} | {value / raw:.2f}x | {value / direct:.1f}x |"
                for label, value in rows]
        out.append("")
    out += ["Reading it: the oci runtime's own share is the ratio to the raw CLI (writing the "
            "bundle, the launch builder, the init, and with limits a second CLI call to delete "
            "the kept container after its counters are read); the rest is the runtime itself "
            "(runc's container setup; for runsc, gVisor starting its kernel for every "
            "command). Egress adds slirp4netns starting and attaching per command.", ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--runtime", action="append",
                        help="runc, runsc, crun, ... (repeatable; default: runc and runsc)")
    parser.add_argument("--markdown", type=Path, help="write the docs/performance.md section")
    args = parser.parse_args()
    runtimes = args.runtime or ["runc", "runsc"]
    results = {name: measure(name, args.runs) for name in runtimes}
    for name, result in results.items():
        if isinstance(result, str):
            print(f"\n{name}: unavailable: {result}")
            continue
        version, direct, native, raw, rows = result
        print(f"\noci runtime ({name} {version}): per-command overhead of `true`")
        print(f"{'case':<52} {'median ms':>10} {'x direct':>9} {'x native':>9} {'x raw':>7}")
        print(f"{'sh -c true (direct)':<52} {direct:>10.1f} {1.0:>8.1f}x")
        for label, value in [("native runtime (SyncSandbox.run)", native),
                             (f"raw `{name} run` on a written bundle", raw), *rows]:
            print(f"{label:<52} {value:>10.1f} {value / direct:>8.1f}x "
                  f"{value / native:>8.1f}x {value / raw:>6.2f}x")
    if args.markdown:
        args.markdown.write_text(markdown(results, args.runs), encoding="utf-8")
        print(f"\nwrote {args.markdown}")


if __name__ == "__main__":
    main()
