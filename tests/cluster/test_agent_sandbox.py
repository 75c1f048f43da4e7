"""agent-sandbox (sigs.k8s.io/agent-sandbox, API agents.x-k8s.io / extensions.agents.x-k8s.io
v1beta1) runs on the cluster: a warm pool of a template yields ready pods, a claim binds one of
them, deleting the claim deletes its pod, and a claim's shutdownTime ends it."""

from __future__ import annotations

import datetime as dt
from typing import Any

from tests.cluster.kube import Kube, wait_for

EXT = "extensions.agents.x-k8s.io/v1beta1"


def _template(kube: Kube) -> dict[str, Any]:
    return {
        "apiVersion": EXT,
        "kind": "SandboxTemplate",
        "metadata": {"name": "node-task"},
        "spec": {
            "podTemplate": {
                "spec": {
                    "containers": [
                        {
                            "name": "task",
                            "image": kube.node_image,
                            "imagePullPolicy": "Never",
                            "command": ["sleep", "infinity"],
                        }
                    ],
                    "terminationGracePeriodSeconds": 0,
                    "automountServiceAccountToken": False,
                }
            },
        },
    }


def _pool(replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": EXT,
        "kind": "SandboxWarmPool",
        "metadata": {"name": "pool"},
        "spec": {"replicas": replicas, "sandboxTemplateRef": {"name": "node-task"}},
    }


def _claim(name: str, lifecycle: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"warmPoolRef": {"name": "pool"}}
    if lifecycle:
        spec["lifecycle"] = lifecycle
    return {
        "apiVersion": EXT,
        "kind": "SandboxClaim",
        "metadata": {"name": name},
        "spec": spec,
    }


def _ready_pods(kube: Kube, ns: str) -> list[str]:
    out = []
    for pod in kube.get("pods", namespace=ns)["items"]:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        conds = pod.get("status", {}).get("conditions", [])
        if any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
            out.append(pod["metadata"]["name"])
    return sorted(out)


def _bound_sandbox(kube: Kube, ns: str, claim: str) -> str | None:
    st = kube.get("sandboxclaim", claim, namespace=ns).get("status", {})
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))
    name = st.get("sandbox", {}).get("name")
    return str(name) if ready and name else None


def test_warm_pool_claim_and_release(kube: Kube, ns: str) -> None:
    kube.apply(_template(kube), _pool(2), namespace=ns)

    def two_ready() -> list[str] | None:
        pods = _ready_pods(kube, ns)
        return pods if len(pods) == 2 else None

    warm = wait_for("two warm pods", two_ready, 180)

    kube.apply(_claim("c1"), namespace=ns)
    sandbox = wait_for("the claim bound", lambda: _bound_sandbox(kube, ns, "c1"), 120)
    # it took a pod of the warm pool (adoption), not a new one
    pod_of = {p["metadata"]["name"]: p for p in kube.get("pods", namespace=ns)["items"]}
    claimed = [n for n in warm if n in pod_of and n == sandbox]
    assert claimed == [sandbox], (warm, sandbox)
    assert kube.exec(ns, sandbox, "sh", "-c", "echo hi").stdout == "hi\n"

    # the pool refills to two unclaimed pods
    wait_for(
        "the pool refilled",
        lambda: len([p for p in _ready_pods(kube, ns) if p != sandbox]) >= 2 or None,
        180,
    )

    kube.run("-n", ns, "delete", "sandboxclaim", "c1", "--wait=true", timeout=120)
    wait_for("the claimed pod deleted", lambda: not kube.exists("pod", sandbox, ns), 120)


def test_claim_shutdown_time_expires(kube: Kube, ns: str) -> None:
    kube.apply(_template(kube), _pool(1), namespace=ns)
    wait_for("a warm pod", lambda: _ready_pods(kube, ns) or None, 180)
    at = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=15)).strftime("%Y-%m-%dT%H:%M:%SZ")
    kube.apply(_claim("short", {"shutdownTime": at, "shutdownPolicy": "Delete"}), namespace=ns)
    sandbox = wait_for("the claim bound", lambda: _bound_sandbox(kube, ns, "short"), 120)
    assert kube.exists("pod", sandbox, ns)
    wait_for("the expired sandbox's pod deleted", lambda: not kube.exists("pod", sandbox, ns), 120)
    wait_for("the expired claim deleted", lambda: not kube.exists("sandboxclaim", "short", ns), 60)
