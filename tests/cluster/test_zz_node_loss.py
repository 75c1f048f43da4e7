"""Losing a node: killing one worker's kubelet and containerd (with its shims and pods, as a
dead machine loses them) makes it NotReady, its pods are lost, new pods land on the other
node, and `scripts/cluster.sh stop` still leaves nothing behind. The cluster is started again
afterwards, so whatever runs next finds it as it was. (Named to run last in this folder.)"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import NODES
from tests.cluster.kube import CLUSTER_SH, Kube, wait_for


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


@pytest.mark.slow
def test_losing_a_node(kube: Kube, ns: str) -> None:
    dead, alive = NODES[1], NODES[0]
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
        p for p in kube.get("pods", namespace=ns)["items"] if p["metadata"]["name"] != "victim"
    ]
    assert web["spec"]["nodeName"] == dead

    t0 = time.monotonic()
    _cluster("kill-node", "n2")
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
    print(f"{dead} NotReady after {not_ready_after:.1f} s")

    # stop cleans everything, with a dead node in the cluster
    _cluster("stop")
    assert leftovers(kube.state) == {}
    # and the cluster comes back for what runs after
    _cluster("start")
    wait_for("both nodes Ready again", lambda: all(_node_ready(kube, n) for n in NODES), 120)
