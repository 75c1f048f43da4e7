"""Per-command overhead of the oci runtime (one container per task, a spawn frame per command)
against native and the raw runtime CLI.

    .venv/bin/python benchmarks/bench_oci.py [--runs N] [--runtime runc ...] [--markdown PATH]

Cases, each running `true`: `sh -c true` directly; the native runtime (prepared SyncSandbox);
`RUNTIME exec C true` by hand on a running container of the same bundle (the raw tool's own way
to run a command in a running container: the floor the oci runtime is held to); `RUNTIME run`
by hand on a bundle written once (a container per command, what the oci runtime did before);
the oci runtime (prepared SyncSandbox: the task's container started at prepare, its agent
spawns each command) with network none, with memory(+pids) limits (the cgroup's counters read
after each command) and with egress (slirp4netns, attached once at prepare) when available.
Prints medians and ratios; quote the ratios, the machine is shared and noisy. ``--runtime`` may
be given more than once (default: runc and runsc; one that is unavailable here is reported,
not measured). ``--markdown PATH`` writes this benchmark's section of docs/performance.md.
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
from fusion_oci.oci.model import ConfigSpec
from fusion_oci.policy.layout import resolve_layout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.resolve import ResolvedTask, compile_spec
from fusion_oci.runtimes.oci import OciRuntime, bundle_spec, runtime_flags
from fusion_oci.sandbox import SyncSandbox


def sandbox_case(
    settings: SandboxSettings, wt: str, policy: SandboxPolicy, runs: int, cache: Path
) -> float:
    with SyncSandbox(settings, env=dict(os.environ), cache_root=cache) as sb:
        sb.prepare(
            PrepareContext(
                task_id="bench", run_id=uuid.uuid4().hex[:6], worktree_path=wt, policy=policy
            )
        )
        result = sb.run("true")
        assert result.exit_code == 0, result
        return median_ms(lambda: sb.run("true", RunOptions()), runs)


def raw_spec(runtime: str, wt: str, tmp: Path, command: str) -> ConfigSpec:
    host = probe_host()
    ctx = PrepareContext(
        task_id="bench", run_id="raw", worktree_path=wt, policy=SandboxPolicy(allow_network=False)
    )
    layout = resolve_layout(ctx, cache_root=tmp / "cache", ca_bundle=host.ca_bundle)
    task = ResolvedTask(ctx=ctx, layout=layout, host=host, env=dict(os.environ))
    spec = compile_spec(task, command, RunOptions())
    if Path(runtime).name == "runsc":
        spec = bundle_spec(spec, errno_ret=False)  # runsc answers every errno rule with EPERM
    return spec


def raw_run_case(runtime: str, wt: str, tmp: Path, runs: int) -> float:
    """``RUNTIME run`` of a bundle written once: a container per command."""
    bundle = write_bundle(raw_spec(runtime, wt, tmp, "true"), tmp / "raw-bundle")
    root = tmp / "raw-state"
    counter = iter(range(10**9))
    flags = runtime_flags(runtime, NetworkMode.NONE)  # runsc decides networking by flag

    def go() -> None:
        cid = f"fusion-oci-bench-{os.getpid()}-{next(counter)}"
        subprocess.run(
            [runtime, "--root", str(root), *flags, "run", "--bundle", str(bundle.path), cid],
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    return median_ms(go, runs)


def raw_exec_case(runtime: str, wt: str, tmp: Path, runs: int) -> float:
    """``RUNTIME exec C true`` on a running container of the same bundle (its init a sleep)."""
    bundle = write_bundle(raw_spec(runtime, wt, tmp, "exec sleep 100000"), tmp / "exec-bundle")
    root = tmp / "exec-state"
    cid = f"fusion-oci-bench-exec-{os.getpid()}"
    flags = runtime_flags(runtime, NetworkMode.NONE)
    subprocess.run(
        [
            runtime,
            "--root",
            str(root),
            *flags,
            "run",
            "--detach",
            "--bundle",
            str(bundle.path),
            cid,
        ],
        check=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=60,
    )
    try:
        return median_ms(
            run_argv([runtime, "--root", str(root), *flags, "exec", cid, "/bin/true"]), runs
        )
    finally:
        subprocess.run(
            [runtime, "--root", str(root), "delete", "--force", cid],
            check=False,
            capture_output=True,
            timeout=60,
        )


def lifecycle_case(settings: SandboxSettings, wt: str, runs: int, cache: Path) -> float:
    """prepare + one `true` + dispose: what moved from every command to the task."""

    def go() -> None:
        with SyncSandbox(settings, env=dict(os.environ), cache_root=cache) as sb:
            sb.prepare(
                PrepareContext(
                    task_id="bench",
                    run_id=uuid.uuid4().hex[:6],
                    worktree_path=wt,
                    policy=SandboxPolicy(allow_network=False),
                )
            )
            assert sb.run("true").exit_code == 0

    return median_ms(go, runs, warmup=1)


Row = tuple[str, float]
Result = tuple[str, float, float, float, float, list[Row]]
"""(version, direct, native, raw exec, raw run, rows)."""


def measure(runtime: str, runs: int) -> Result | str:
    """One runtime's numbers, or why it was not measured."""
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
        raw_exec = raw_exec_case(runtime, wt, tmp, runs)
        raw_run = raw_run_case(runtime, wt, tmp, runs)
        rows = [
            ("oci runtime, network none", sandbox_case(oci_settings, wt, none, runs, tmp / "cache"))
        ]
        limited = SandboxPolicy(allow_network=False, memory_limit_mb=256, pids_limit=256)
        enforced = {r.value for r in probe.enforces()}
        if "memoryLimitMb" in enforced:
            label = (
                "memory+pids limits (counters read per command)"
                if "pidsLimit" in enforced
                else "memory limit (a cgroup of ours that runsc joins)"
            )
            if "pidsLimit" not in enforced:
                limited = SandboxPolicy(allow_network=False, memory_limit_mb=256)
            rows.append(
                (
                    f"oci runtime, {label}",
                    sandbox_case(oci_settings, wt, limited, runs, tmp / "cache"),
                )
            )
        if probe.egress_status()[0]:
            rows.append(
                (
                    "oci runtime, network egress (slirp4netns)",
                    sandbox_case(
                        oci_settings, wt, SandboxPolicy(allow_network=True), runs, tmp / "cache"
                    ),
                )
            )
        rows.append(
            (
                "oci runtime: prepare + one `true` + dispose (once per task)",
                lifecycle_case(oci_settings, wt, max(5, runs // 5), tmp / "cache"),
            )
        )
        shutil.rmtree(tmp / "raw-state", ignore_errors=True)
    return avail.version or "", direct, native, raw_exec, raw_run, rows


def markdown(results: dict[str, Result | str], runs: int) -> str:
    out = [
        f"## oci runtime: per-command overhead (`benchmarks/bench_oci.py --runs {runs}`)",
        "",
        "Each case runs `true` in a prepared sandbox: the task's container is started once "
        "at prepare with the exec agent as its init, and each command is a spawn frame to "
        "it. Against, measured in the same run: the native runtime (the same agent, on the "
        "host), the raw CLI's `RUNTIME exec C true` on a running container of the same "
        "bundle, and `RUNTIME run` of a bundle written once (a container per command, what "
        "the oci runtime did before). One run on a shared, busy 2-core machine: quote the "
        "ratios, not the milliseconds.",
        "",
    ]
    for runtime, result in results.items():
        if isinstance(result, str):
            out += [f"**{runtime}**: not measured here ({result}).", ""]
            continue
        version, direct, native, raw_exec, raw_run, rows = result
        out += [
            f"**{runtime}** ({version})",
            "",
            "| case | median ms | vs native | x raw `exec` | x raw `run` |",
            "|---|---:|---:|---:|---:|",
            f"| `sh -c true` (direct) | {direct:.1f} | {direct - native:+.1f} ms | "
            f"{direct / raw_exec:.2f}x | {direct / raw_run:.2f}x |",
            f"| native runtime | {native:.1f} | +0.0 ms | {native / raw_exec:.2f}x | "
            f"{native / raw_run:.2f}x |",
            f"| raw `{runtime} exec` on a running container | {raw_exec:.1f} | "
            f"{raw_exec - native:+.1f} ms | 1.00x | {raw_exec / raw_run:.2f}x |",
            f"| raw `{runtime} run` (a container per command) | {raw_run:.1f} | "
            f"{raw_run - native:+.1f} ms | {raw_run / raw_exec:.2f}x | 1.00x |",
        ]
        out += [
            f"| {label} | {value:.1f} | {value - native:+.1f} ms | "
            f"{value / raw_exec:.2f}x | {value / raw_run:.2f}x |"
            for label, value in rows
        ]
        out.append("")
    out += [
        "Reading it: with runc a command costs the agent's spawn (fork, exec, the frames) "
        "plus the cgroup counters read after it, close to native's; under runsc the "
        "spawn runs inside gVisor (ptrace platform: every system call of the fork and "
        "exec is trapped), which is most of its time, and still below `runsc exec`, "
        "which starts a process through the sandbox's control socket per command. Egress "
        "and limits cost at prepare (slirp4netns attached once, the cgroup made once), "
        "not per command.",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument(
        "--runtime",
        action="append",
        help="runc, runsc, crun, ... (repeatable; default: runc and runsc)",
    )
    parser.add_argument("--markdown", type=Path, help="write the docs/performance.md section")
    args = parser.parse_args()
    runtimes = args.runtime or ["runc", "runsc"]
    results = {name: measure(name, args.runs) for name in runtimes}
    for name, result in results.items():
        if isinstance(result, str):
            print(f"\n{name}: unavailable: {result}")
            continue
        version, direct, native, raw_exec, raw_run, rows = result
        print(f"\noci runtime ({name} {version}): per-command overhead of `true`")
        print(f"{'case':<52} {'median ms':>10} {'vs native':>10} {'x exec':>7} {'x run':>7}")
        for label, value in [
            ("sh -c true (direct)", direct),
            ("native runtime (SyncSandbox.run)", native),
            (f"raw `{name} exec` on a running container", raw_exec),
            (f"raw `{name} run` on a written bundle", raw_run),
            *rows,
        ]:
            print(
                f"{label:<52} {value:>10.1f} {value - native:>+9.1f}m "
                f"{value / raw_exec:>6.2f}x {value / raw_run:>6.2f}x"
            )
    if args.markdown:
        args.markdown.write_text(markdown(results, args.runs), encoding="utf-8")
        print(f"\nwrote {args.markdown}")


if __name__ == "__main__":
    main()
