"""The ``kubernetes`` runtime on the test cluster (scripts/cluster.sh), beside the raw tool:

- a command once the task is prepared (``true``, and ``true`` after a one-file change on the
  host: the worktree transfer's cost), against a bare ``kubectl exec POD -- true`` of the same
  pod in the same run; issue #34's bounds: at most a fifth of the bare exec per command, the
  transfer adding at most 30 ms for a one-file change;
- prepare: plain pods (the pod made and running), and sandbox mode with a warm pool (the
  claim handed a ready pod), until the first command can run.

    .venv/bin/python -m benchmarks.bench_kube_runtime [--rounds 20] [--markdown FILE]

A benchmark, not a timed test. It needs the cluster running (``scripts/cluster.sh start``)
with the node image loaded (``scripts/cluster.sh load-image REF``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.common import markdown_table, write_markdown
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.policy.settings import GateSettings, SandboxSettings
from fusion_oci.sandbox import Sandbox
from tests.cluster.kube import Kube, cluster_env

STEP = RunOptions(timeout_ms=60_000)


def _settings(kube: Kube, ns: str, mode: str) -> SandboxSettings:
    return SandboxSettings(
        backend="kubernetes",
        image=kube.node_image,
        gates=GateSettings(sandbox_provision="allow"),
        kubernetes=KubernetesSettings(
            kubeconfig=str(kube.kubeconfig),
            namespace=ns,
            mode=mode,  # type: ignore[arg-type]
            warm_pool=2,
            seccomp_profile="fusion-oci/task.json",
            node_networks=["10.231.0.0/16"],
        ),
    )


def _worktree(site: Path, name: str) -> Path:
    wt = site / name
    wt.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", "-b", "task", str(wt)], check=True)
    for i in range(200):  # a small project's worth of tracked files
        (wt / f"src{i % 10}").mkdir(exist_ok=True)
        (wt / f"src{i % 10}" / f"f{i}.ts").write_text(f"export const v{i} = {i};\n" * 20)
    subprocess.run(["git", "-C", str(wt), "add", "."], check=True)
    subprocess.run(
        ["git", "-C", str(wt), "-c", "user.name=b", "-c", "user.email=b@b", "commit", "-qm", "b"],
        check=True,
    )
    return wt


def _ctx(wt: Path, task: str) -> PrepareContext:
    return PrepareContext(
        task_id=task,
        run_id="r1",
        worktree_path=str(wt),
        policy=SandboxPolicy(allow_network=False),
        project_dir=str(wt.parent / "project"),
    )


async def _commands(kube: Kube, ns: str, site: Path, rounds: int) -> list[list[object]]:
    wt = _worktree(site, "wt-cmd")
    async with Sandbox(_settings(kube, ns, "pods"), cache_root=site / "cache") as sb:
        await sb.prepare(_ctx(wt, "bench-cmd"))
        pod = sb.runtime._pod  # type: ignore[union-attr]
        for _ in range(3):
            await sb.run("true", STEP)
        ours, changed, bare = [], [], []
        for i in range(rounds):
            t0 = time.perf_counter()
            await sb.run("true", STEP)
            ours.append((time.perf_counter() - t0) * 1000)
            (wt / "src0" / "f0.ts").write_text(f"export const v0 = {i};\n")
            t0 = time.perf_counter()
            await sb.run("true", STEP)
            changed.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            await asyncio.to_thread(kube.exec, ns, pod, "true")
            bare.append((time.perf_counter() - t0) * 1000)
    m_ours, m_changed, m_bare = (statistics.median(x) for x in (ours, changed, bare))
    bare_what = "`kubectl exec POD -- true` (the bare tool, same pod, same run)"
    ours_what = "`true` through the runtime (the agent's stream; nothing changed)"
    changed_what = "`true` after a one-file change on the host (push + pull)"
    return [
        [bare_what, f"{m_bare:.1f} ms", "1.00x"],
        [ours_what, f"{m_ours:.1f} ms", f"{m_ours / m_bare:.2f}x"],
        [changed_what, f"{m_changed:.1f} ms", f"{m_changed / m_bare:.2f}x"],
        ["the one-file transfer's own cost (the two above)", f"{m_changed - m_ours:.1f} ms", ""],
    ]


async def _prepares(kube: Kube, ns: str, site: Path, rounds: int) -> list[list[object]]:
    rows: list[list[object]] = []
    claims: list[float] = []
    for mode in ("pods", "sandbox"):
        times = []
        for i in range(rounds + 1):
            wt = _worktree(site / mode, f"wt{i}")
            async with Sandbox(_settings(kube, ns, mode), cache_root=site / "cache") as sb:
                t0 = time.perf_counter()
                await sb.prepare(_ctx(wt, f"bench-{mode}-{i}"))
                took = (time.perf_counter() - t0) * 1000
                claim_ms = getattr(sb.runtime, "claim_ms", None)
                await sb.run("true", STEP)
            if i:  # the first makes the shape (sandbox: template and pool) and probes the CNI
                times.append(took)
                if claim_ms is not None:
                    claims.append(claim_ms)
            if mode == "sandbox":
                await asyncio.sleep(3)  # the pool refills: the next claim gets a warm pod
        what = (
            "prepare, plain pods (policy + pod, pod running, both streams open)"
            if mode == "pods"
            else "prepare, sandbox mode (claim on a warm pool, pod bound, both streams open)"
        )
        rows.append([what, f"{statistics.median(times):.0f} ms", f"min {min(times):.0f} ms"])
    if claims:
        rows.append([
            "SandboxClaim on a warm pool: create → Ready (issue #34: p50 ≤ 100 ms)",
            f"{statistics.median(claims):.0f} ms",
            f"min {min(claims):.0f} ms, max {max(claims):.0f} ms",
        ])  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    args, _ = parser.parse_known_args()
    env = cluster_env()
    if not env.get("FUSION_OCI_K8S_BIN"):
        raise SystemExit("the cluster is not running: scripts/cluster.sh start")
    kube = Kube.from_env(env)
    if not kube.node_image:
        raise SystemExit("no task image in the cluster: scripts/cluster.sh load-image REF")
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    kube.run("create", "namespace", ns)
    kube.run("-n", ns, "wait", "--for=create", "serviceaccount/default", "--timeout=60s")
    try:
        with tempfile.TemporaryDirectory(prefix="bench-kube-") as tmp:
            site = Path(tmp)
            (site / "project").mkdir()
            for sub in ("pods", "sandbox"):
                (site / sub).mkdir()
                (site / sub / "project").mkdir()
            rows = asyncio.run(_commands(kube, ns, site, args.rounds))
            rows += asyncio.run(_prepares(kube, ns, site, max(3, args.rounds // 4)))
    finally:
        kube.run("delete", "namespace", ns, "--wait=false", check=False)
    body = markdown_table(["what", "median", "ratio / note"], rows)
    print(body)
    write_markdown(
        args.markdown,
        "The kubernetes runtime on the test cluster",
        f"`benchmarks/bench_kube_runtime.py --rounds {args.rounds}`: a task's pod on the "
        "two-node cluster of scripts/cluster.sh, its commands through the exec agent over one "
        "`pods/exec` stream, the worktree pushed before and pulled after each command; "
        "`kubectl exec` of the same pod measured in the same rounds. Issue #34's bounds: a "
        "command at most a fifth of the bare exec, a one-file transfer at most 30 ms.",
        body,
        "",
    )


if __name__ == "__main__":
    main()
