"""Losing a node: killing one worker's kubelet and containerd (with its shims and pods, as a
dead machine loses them) makes it NotReady, its pods are lost (a kubernetes task's command in
flight there ends ``agent-lost``), new pods (and the next task) land on the other node, and
`scripts/cluster.sh stop` still leaves nothing behind. The cluster is started again
afterwards, so whatever runs next finds it as it was. (Named to run last in this folder.)"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.errors import AgentLostError
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox
from tests.cluster.conftest import NODES
from tests.cluster.kube import CLUSTER_SH, Kube, wait_for
from tests.conftest import git_init


def _cluster(*args: str, timeout: float = 600) -> str:
    proc = subprocess.run(
        ["bash", str(CLUSTER_SH), *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, f"cluster.sh {' '.join(args)}: {proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _node_ready(kube: Kube, node: str) -> bool:
    conds = kube.get("node", node)["status"]["conditions"]
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def leftovers(state: Path) -> dict[str, Any]:
    """What the cluster could leave on the machine outside its state folder's files."""
    cgroups = [str(p) for p in Path("/sys/fs/cgroup").glob("*/fusion-oci-cluster")]
    mounts = [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(f"{state}/")
    ]
    netns = sorted(p.name for p in Path("/run/netns").glob("foci-k8s-*"))
    links = subprocess.run(
        ["ip", "-o", "link", "show", "foci-k8s0"], capture_output=True, text=True
    )
    rules = [
        line
        for table in ("filter", "nat")
        for line in subprocess.run(
            ["iptables-save", "-t", table], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        if "FOCI-K8S" in line
    ]
    routes = [
        line
        for line in subprocess.run(
            ["ip", "route"], capture_output=True, text=True
        ).stdout.splitlines()
        if line.startswith(("10.231.", "10.232.", "10.233."))
    ]
    pids = [p for p in (state / "run").glob("*.pid")]
    logs = [
        str(p) for p in Path("/var/log/containers").glob("*.log")
        if p.is_symlink() and str(p.readlink()).startswith(f"{state}/")
    ] if Path("/var/log/containers").is_dir() else []  # fmt: skip
    results = Path("/var/lib/cni/results")
    cni_cache = [
        str(p) for p in (results.glob("*") if results.is_dir() else [])
        if f"{state}/" in p.read_text(errors="replace")
    ]  # fmt: skip
    found = {
        "cni cache": cni_cache,
        "cgroups": cgroups,
        "mounts": mounts,
        "netns": netns,
        "host link": links.stdout.strip(),
        "iptables": rules,
        "routes": routes,
        "pidfiles": [str(p) for p in pids],
        "container log links": logs,
    }
    return {k: v for k, v in found.items() if v}


def _task_pod_node(kube: Kube, ns: str, sb: SyncSandbox) -> str:
    pod = sb.sandbox.runtime._pod  # type: ignore[union-attr]
    return str(kube.get("pod", pod, namespace=ns)["spec"]["nodeName"])


def _kube_task(kube: Kube, ns: str, site: Path, name: str) -> SyncSandbox:
    """A prepared ``kubernetes`` task (plain pods) in ``ns``."""
    wt = git_init(site / name)
    (site / "project").mkdir(exist_ok=True)
    settings = SandboxSettings(
        backend="kubernetes",
        image=kube.node_image,
        kubernetes=KubernetesSettings(
            kubeconfig=str(kube.kubeconfig), namespace=ns, mode="pods",
            seccomp_profile="fusion-oci/task.json", node_networks=["10.231.0.0/16"],
        ),
    )  # fmt: skip
    sb = SyncSandbox(settings, cache_root=site / "cache")
    sb.prepare(
        PrepareContext(
            task_id=name, run_id="r1", worktree_path=str(wt),
            policy=SandboxPolicy(allow_network=False), project_dir=str(site / "project"),
        )
    )  # fmt: skip
    return sb


def _task_on(kube: Kube, ns: str, site: Path, node: str) -> SyncSandbox:
    """A kubernetes task whose pod the scheduler put on ``node`` (it spreads a namespace's
    pods: a few tries at most); the others are disposed."""
    for i in range(6):
        sb = _kube_task(kube, ns, site, f"k{i}")
        if _task_pod_node(kube, ns, sb) == node:
            return sb
        sb.dispose()
    raise AssertionError(f"no task pod landed on {node}")


@pytest.mark.slow
def test_losing_a_node(kube: Kube, ns: str, tmp_path: Path) -> None:
    dead, alive = NODES[1], NODES[0]
    # the kubernetes runtime: a task on the node that dies, with a command in flight
    doomed = _task_on(kube, ns, tmp_path, dead)
    in_flight = ThreadPoolExecutor(1)
    lost_run = in_flight.submit(doomed.run, "sleep 600", RunOptions(timeout_ms=600_000))
    time.sleep(1)
    kube.apply(kube.pod("victim", ["sleep", "infinity"], node=dead), namespace=ns)
    kube.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        **kube.pod("x", ["sleep", "infinity"])["spec"],
                        "restartPolicy": "Always",
                        "affinity": {
                            "nodeAffinity": {
                                "preferredDuringSchedulingIgnoredDuringExecution": [
                                    {
                                        "weight": 100,
                                        "preference": {
                                            "matchExpressions": [
                                                {
                                                    "key": "kubernetes.io/hostname",
                                                    "operator": "In",
                                                    "values": [dead],
                                                }
                                            ]
                                        },
                                    }
                                ]
                            }
                        },
                    },
                },
            },
        },
        namespace=ns,
    )
    kube.wait_ready(ns, "victim")
    kube.run("-n", ns, "rollout", "status", "deployment/web", "--timeout=180s", timeout=200)
    (web,) = [
        p
        for p in kube.get("pods", namespace=ns)["items"]
        if p["metadata"]["name"].startswith("web-")
    ]
    assert web["spec"]["nodeName"] == dead

    t0 = time.monotonic()
    _cluster("kill-node", "n2")
    # the command on the dead node ends, typed, not after its timeout
    with pytest.raises(AgentLostError) as lost:
        lost_run.result(timeout=90)
    assert lost.value.kind == "agent-lost", lost.value.render()
    lost_after = time.monotonic() - t0
    in_flight.shutdown()
    doomed.dispose()
    wait_for(f"{dead} NotReady", lambda: not _node_ready(kube, dead), 90, every=1)
    not_ready_after = time.monotonic() - t0

    # the dead node's pods are lost: not Ready, then evicted (10 s toleration)
    def victim_lost() -> bool:
        pod = kube.get("pod", "victim", namespace=ns)
        ready = [c for c in pod["status"].get("conditions", []) if c["type"] == "Ready"]
        return bool(pod["metadata"].get("deletionTimestamp")) or (
            bool(ready) and ready[0]["status"] != "True"
        )

    wait_for("the victim pod lost", victim_lost, 90, every=1)

    # the deployment's replacement, and any new pod, land on the live node
    def replacement() -> str | None:
        for p in kube.get("pods", namespace=ns)["items"]:
            if (
                p["metadata"]["name"].startswith("web-")
                and not p["metadata"].get("deletionTimestamp")
                and p["spec"].get("nodeName") == alive
            ):
                return str(p["metadata"]["name"])
        return None

    new_web = wait_for("the replacement on the live node", replacement, 120, every=1)
    kube.wait_ready(ns, new_web)
    kube.apply(kube.pod("newcomer", ["sleep", "infinity"]), namespace=ns)
    kube.wait_ready(ns, "newcomer")
    assert kube.get("pod", "newcomer", namespace=ns)["spec"]["nodeName"] == alive
    # and the next kubernetes task lands on the live node and runs
    with _kube_task(kube, ns, tmp_path, "after") as sb:
        assert _task_pod_node(kube, ns, sb) == alive
        assert sb.run("echo alive", RunOptions(timeout_ms=60_000)).stdout == "alive\n"
    print(f"{dead} NotReady after {not_ready_after:.1f} s; its task's command agent-lost after "
          f"{lost_after:.1f} s")  # fmt: skip

    # stop cleans everything, with a dead node in the cluster
    _cluster("stop")
    assert leftovers(kube.state) == {}
    # and the cluster comes back for what runs after
    _cluster("start")
    wait_for("both nodes Ready again", lambda: all(_node_ready(kube, n) for n in NODES), 120)
