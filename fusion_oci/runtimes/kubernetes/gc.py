"""``fusion-oci gc`` on the cluster: what a killed executor left in its namespace.

Every object the runtime makes for a task carries the owner labels the engines' objects
carry (:mod:`fusion_oci.engines.labels`, under our domain prefix): the owner's host, boot,
pid and its start time. An object whose owner on this host is gone (``kill -9``, a crash, a
lost machine's boot) is deleted; another host's objects are that host's to judge. The tools
ConfigMaps (shared, one per fusion-oci build) go once no pod of ours mounts them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fusion_oci.engines.labels import LABEL_KIND, LABEL_TASK
from fusion_oci.errors import FusionOCIError
from fusion_oci.gc import GcReport, Here, here, owner_state
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.kubernetes.client import KubeClient, collection
from fusion_oci.runtimes.kubernetes.kubeconfig import find_access
from fusion_oci.runtimes.kubernetes.pod import label_key, label_value
from fusion_oci.runtimes.kubernetes.tools import LABEL_TOOLS

KINDS = (
    ("extensions.agents.x-k8s.io/v1beta1", "sandboxclaims"),
    ("v1", "pods"),
    ("networking.k8s.io/v1", "networkpolicies"),
    ("v1", "secrets"),
)
"""Claims first (each owns its sandbox and pod), the pods before their policies."""


def gc_cluster(
    settings: SandboxSettings, env: Mapping[str, str], *, task_id: str | None, dry_run: bool
) -> GcReport:
    """The cluster's leftovers, when one is configured for fusion-oci (``kubernetes.kubeconfig``,
    ``KUBECONFIG`` or ``backend: kubernetes``): a kubeconfig of someone else's cluster in
    ``~/.kube/config`` alone is not looked at."""
    kube = settings.kubernetes
    if not (kube.kubeconfig or env.get("KUBECONFIG") or settings.backend == "kubernetes"):
        return GcReport()
    try:
        access = find_access(kube, env)
        if access is None:
            return GcReport()
        with KubeClient(access, kube.request_timeout_s) as client:
            return collect_cluster(client, access.namespace, task_id=task_id, dry_run=dry_run)
    except FusionOCIError as exc:
        return GcReport(errors=[f"kubernetes: {exc.render()}"])


def engine_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """A Kubernetes object's labels under the engines' keys (``io.fusion-oci/owner-pid`` →
    ``io.fusion-oci.owner-pid``), for :func:`fusion_oci.gc.owner_state`. Pure."""
    return {k.replace("io.fusion-oci/", "io.fusion-oci."): v for k, v in labels.items()}


def collect_cluster(
    client: KubeClient,
    namespace: str,
    *,
    task_id: str | None = None,
    dry_run: bool = False,
    at: Here | None = None,
) -> GcReport:
    at = at or here()
    # label values are made label-safe when written: compare like with like
    at = Here(label_value(at.host), label_value(at.boot), at.alive, at.exists)
    report = GcReport(engines=[f"kubernetes {client.access.server} namespace {namespace}"])
    selector = label_key(LABEL_KIND)
    mounted: set[str] = set()
    for api, plural in KINDS:
        try:
            items = client.get(
                collection(api, plural, namespace), query={"labelSelector": selector}
            )
        except FusionOCIError as exc:
            if api.startswith("extensions.") and getattr(exc, "status", None) == 404:
                continue  # the cluster does not serve agent-sandbox
            report.errors.append(f"kubernetes {plural}: {exc.why}")
            continue
        for obj in items.get("items", []):
            meta = obj.get("metadata", {})
            labels = engine_labels(meta.get("labels") or {})
            name = meta.get("name", "")
            if plural == "pods":
                mounted |= _tools_of(obj)
            if task_id is not None and labels.get(LABEL_TASK) != label_value(task_id):
                report.kept.append(f"kubernetes {plural} {name}")
                continue
            if owner_state(labels, at) != "dead":
                report.kept.append(f"kubernetes {plural} {name}")
                continue
            _remove(client, f"{collection(api, plural, namespace)}/{name}", plural, name, report,
                    dry_run)  # fmt: skip
            if plural == "pods":
                mounted -= _tools_of(obj)
    if task_id is None:
        try:
            maps = client.get(
                collection("v1", "configmaps", namespace),
                query={"labelSelector": f"{LABEL_TOOLS}=tools"},
            )
        except FusionOCIError as exc:
            report.errors.append(f"kubernetes configmaps: {exc.why}")
            return report
        for obj in maps.get("items", []):
            name = obj.get("metadata", {}).get("name", "")
            if name not in mounted:
                path = f"{collection('v1', 'configmaps', namespace)}/{name}"
                _remove(client, path, "configmaps", name, report, dry_run)
    return report


def _tools_of(pod: Mapping[str, Any]) -> set[str]:
    return {
        v["configMap"]["name"] for v in pod.get("spec", {}).get("volumes") or [] if "configMap" in v
    }


def _remove(
    client: KubeClient, path: str, plural: str, name: str, report: GcReport, dry_run: bool
) -> None:
    label = f"kubernetes {plural} {name}"
    report.removed.append(label)
    if dry_run:
        return
    try:
        client.delete(path)
    except FusionOCIError as exc:
        if getattr(exc, "status", None) != 404:  # gone already: what gc wanted
            report.errors.append(f"{label}: {exc.why}")
