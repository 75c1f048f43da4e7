"""The test cluster of scripts/cluster.sh on this machine: how long it takes to start (the
cold build excluded: the binaries come from the build cache), a pod from create to Ready, a
warm-pool SandboxClaim from create to Ready (agent-sandbox), and a `kubectl exec true` round
trip. A benchmark, not a timed test.

    .venv/bin/python -m benchmarks.bench_cluster [--rounds 10] [--markdown FILE]

When no cluster runs, it starts one (timed) and stops it afterwards (timed); a running
cluster is used as it is and its start is not measured.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable

from benchmarks.common import markdown_table, write_markdown
from tests.cluster.kube import CLUSTER_SH, Kube, KubectlError, cluster_env, wait_for
from tests.cluster.test_agent_sandbox import _bound_sandbox, _claim, _pool, _ready_pods, _template


def _cluster(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        ["bash", str(CLUSTER_SH), *args], check=True, stdin=subprocess.DEVNULL, timeout=900
    )
    return time.perf_counter() - t0


def _running() -> Kube | None:
    env = cluster_env()
    if not env.get("FUSION_OCI_K8S_BIN"):
        return None
    kube = Kube.from_env(env)
    try:
        kube.run("get", "--raw", "/readyz", timeout=10)
    except KubectlError:
        return None
    return kube


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def pod_to_ready(kube: Kube, ns: str, i: int) -> float:
    def go() -> None:
        kube.apply(kube.pod(f"p{i}", ["sleep", "infinity"]), namespace=ns)
        kube.wait_ready(ns, f"p{i}")

    return _timed(go)


def claim_to_ready(kube: Kube, ns: str, i: int) -> float:
    # the pool is full (2 ready pods) before each claim: the claim adopts a warm pod
    wait_for("a full pool", lambda: len(_ready_pods(kube, ns)) >= 2 + i or None, 180, every=0.2)

    def go() -> None:
        kube.apply(_claim(f"c{i}"), namespace=ns)
        wait_for("bound", lambda: _bound_sandbox(kube, ns, f"c{i}"), 120, every=0.05)

    return _timed(go)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    args, _ = parser.parse_known_args()
    rows: list[list[object]] = []
    kube = _running()
    started = kube is None
    if kube is None:
        rows.append(
            [
                "cluster start (`scripts/cluster.sh start`, build cached)",
                f"{_cluster('start'):.1f} s",
            ]
        )
        kube = _running()
        assert kube is not None
    if not kube.node_image:
        raise SystemExit("no task image in the cluster: scripts/cluster.sh load-image REF")
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    kube.run("create", "namespace", ns)
    kube.run("-n", ns, "wait", "--for=create", "serviceaccount/default", "--timeout=60s")
    try:
        pods = [pod_to_ready(kube, ns, i) for i in range(args.rounds)]
        kube.exec(ns, "p0", "true")
        execs = [_timed(lambda: kube.exec(ns, "p0", "true")) for _ in range(args.rounds * 2)]
        kube.apply(_template(kube), _pool(2), namespace=ns)
        claims = [claim_to_ready(kube, ns, i) for i in range(min(args.rounds, 5))]
        rows += [
            ["pod create → Ready (kubectl apply + wait)", f"{statistics.median(pods):.0f} ms"],
            ["warm-pool SandboxClaim create → Ready", f"{statistics.median(claims):.0f} ms"],
            ["`kubectl exec POD -- true` round trip", f"{statistics.median(execs):.0f} ms"],
        ]
    finally:
        kube.run("delete", "namespace", ns, "--wait=false", check=False)
    if started:
        rows.append(["cluster stop (`scripts/cluster.sh stop`)", f"{_cluster('stop'):.1f} s"])
    body = markdown_table(["what", "median"], rows)
    print(body)
    write_markdown(
        args.markdown,
        "Kubernetes test cluster (`scripts/cluster.sh`)",
        f"`benchmarks/bench_cluster.py --rounds {args.rounds}`: the two-node cluster the "
        "cluster tests run against (kubelet + containerd 1.6 + runc per node, in network "
        "namespaces on this machine); medians. Each timing includes kubectl's own start "
        "(a Go binary: `kubectl version --client` takes ~64 ms here).",
        body,
        "",
    )


if __name__ == "__main__":
    main()
