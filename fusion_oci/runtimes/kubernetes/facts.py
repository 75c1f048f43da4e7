"""What ``fusion-oci doctor`` says about the cluster: reachable?, which mode, agent-sandbox's
CRDs, whether NetworkPolicy is enforced, and which of the executor's permissions are missing.

Each fact is one bounded call (or a few) to the API server; nothing here raises: a failure is
a fact too (``reachable: false`` with the error's why and hint).

NetworkPolicy enforcement cannot be read from the API: it is probed (:mod:`.netprobe`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fusion_oci.errors import FusionOCIError
from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.runtimes.kubernetes.client import ApiError, KubeClient
from fusion_oci.runtimes.kubernetes.kubeconfig import find_access
from fusion_oci.runtimes.kubernetes.netprobe import probe_network_policy
from fusion_oci.runtimes.kubernetes.rbac import access_reviews

SANDBOX_GROUPS = {
    "extensions.agents.x-k8s.io/v1beta1": ("sandboxtemplates", "sandboxwarmpools", "sandboxclaims"),
    "agents.x-k8s.io/v1beta1": ("sandboxes",),
}


def cluster_facts(
    settings: KubernetesSettings,
    env: Mapping[str, str],
    *,
    probe_image: str | None = None,
    probe_timeout_s: float = 60.0,
) -> dict[str, Any]:
    """The doctor's ``kubernetes`` object (camelCase JSON)."""
    try:
        access = find_access(settings, env)
    except FusionOCIError as exc:
        return {"configured": True, "reachable": False, "why": exc.render()}
    if access is None:
        return {
            "configured": False,
            "reachable": False,
            "why": "no kubeconfig (kubernetes.kubeconfig, KUBECONFIG, ~/.kube/config) and "
            "not in a pod",
        }
    facts: dict[str, Any] = {
        "configured": True,
        "source": access.source,
        "server": access.server,
        "namespace": access.namespace,
    }
    with KubeClient(access, settings.request_timeout_s) as client:
        try:
            version = client.get("/version")
        except ApiError as exc:
            return {**facts, "reachable": False, "why": exc.render()}
        facts["reachable"] = True
        facts["version"] = version.get("gitVersion")
        crds = served_sandbox_apis(client)
        facts["agentSandbox"] = crds
        complete = all(crds.values())
        facts["mode"] = (
            settings.mode if settings.mode != "auto" else ("sandbox" if complete else "pods")
        )
        if settings.mode == "sandbox" and not complete:
            facts["modeProblem"] = (
                "kubernetes.mode is sandbox but the cluster does not serve agent-sandbox's "
                "v1beta1 APIs: install agent-sandbox v1.0+, or set kubernetes.mode: pods"
            )
        missing = missing_permissions(client, access.namespace)
        facts["rbac"] = {
            "missing": missing,
            "ok": not missing,
            **({"hint": "bind the executor to the Role in docs/kubernetes.md"} if missing else {}),
        }
        facts["networkPolicy"] = probe_network_policy(
            client, access.namespace, probe_image, timeout_s=probe_timeout_s, settings=settings
        )
        if settings.runtime_class:
            facts["runtimeClass"] = runtime_class_fact(client, settings.runtime_class)
        return facts


def served_sandbox_apis(client: KubeClient) -> dict[str, bool]:
    """Each agent-sandbox resource the mapping uses: served by the cluster?"""
    out: dict[str, bool] = {}
    for group_version, resources in SANDBOX_GROUPS.items():
        try:
            names = {
                r.get("name") for r in client.get(f"/apis/{group_version}").get("resources", [])
            }
        except ApiError:
            names = set()
        for resource in resources:
            out[f"{group_version.split('/')[0]}/{resource}"] = resource in names
    return out


def missing_permissions(client: KubeClient, namespace: str) -> list[str]:
    """The verbs of the executor's Role (:mod:`.rbac`) this identity may not use here."""
    missing = []
    for label, review in access_reviews(namespace):
        try:
            status = client.create(
                "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", review
            ).get("status", {})
        except ApiError as exc:
            missing.append(f"{label} (cannot ask: HTTP {exc.status})")
            continue
        if not status.get("allowed"):
            missing.append(label)
    return missing


def runtime_class_fact(client: KubeClient, name: str) -> dict[str, Any]:
    try:
        rc = client.get(f"/apis/node.k8s.io/v1/runtimeclasses/{name}")
    except ApiError as exc:
        return {"name": name, "exists": False, "why": exc.why}
    return {"name": name, "exists": True, "handler": rc.get("handler")}
