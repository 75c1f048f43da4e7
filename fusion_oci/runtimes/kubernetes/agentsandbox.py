"""The Pod mapping as agent-sandbox objects (``extensions.agents.x-k8s.io/v1beta1``). Pure.

A task shape (the pod template :func:`~.pod.pod_manifest` makes, without what names one task)
becomes a ``SandboxTemplate`` named by its content hash, so tasks of one shape share it and its
``SandboxWarmPool`` of ready pods; each task is a ``SandboxClaim`` on that pool, labelled with
its owner (gc removes the claims no live owner holds; the controller removes the claimed pod
with its claim). The template's ``networkPolicy`` is the same rules the plain-Pod mode puts in
its NetworkPolicy (:func:`~.pod.policy_rules`), managed by the agent-sandbox controller.

Field names are those of agent-sandbox v1.0.1's CRDs (the module's ``k8s/crds``), as the test
cluster serves them; the cluster tests create each object with a server-side dry run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fusion_oci.models import NetworkMode
from fusion_oci.runtimes.kubernetes.pod import (
    LABEL_POD,
    MANAGED_BY,
    PodMapping,
    policy_rules,
)
from fusion_oci.runtimes.kubernetes.pod import owner_labels as kube_labels

EXTENSIONS_API = "extensions.agents.x-k8s.io/v1beta1"
LABEL_SHAPE = "io.fusion-oci/shape"
"""The template's content hash, on the template, its pool and their pods."""


@dataclass(frozen=True)
class SandboxObjects:
    template: dict[str, Any]
    pool: dict[str, Any]
    """Its ``replicas`` is ``kubernetes.warmPool`` (0: no ready pods kept)."""
    claim: dict[str, Any]
    shape: str
    """The content hash naming the template and the pool."""


def shape_of(pod_template: Mapping[str, Any]) -> str:
    """The content hash of a pod template (canonical JSON, sha256, 16 hex). Pure."""
    text = json.dumps(pod_template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sandbox_objects(
    mapping: PodMapping,
    network: NetworkMode,
    *,
    claim_name: str,
    owner_labels: Mapping[str, str],
    warm_pool: int,
    shutdown_time: str | None = None,
    blocked: Sequence[str] = (),
) -> SandboxObjects:
    """The template, warm pool and claim for the pod of ``mapping``. ``shutdown_time`` (RFC
    3339): when the controller deletes the claim's sandbox even if nobody disposes it (a
    killed executor's task ends by itself). Pure."""
    pod = mapping.pod
    # The template is shared by every task of the shape: nothing that names one task (its
    # pod name, its policy selector label, its owner) goes into it or into its hash.
    spec = json.loads(json.dumps(pod["spec"]))
    labels = {
        k: v
        for k, v in pod["metadata"]["labels"].items()
        if k != LABEL_POD and k not in kube_labels(owner_labels)
    }
    pod_template = {"metadata": {"labels": labels}, "spec": spec}
    shape = shape_of(pod_template)
    name = f"fusion-oci-{shape}"
    kept = {**MANAGED_BY, LABEL_SHAPE: shape}
    pod_template["metadata"]["labels"] = {**labels, **kept}
    template_spec: dict[str, Any] = {"podTemplate": pod_template}
    if network != NetworkMode.HOST:
        # Managed: the controller makes the policy for the template's pods, no ingress ever.
        template_spec["networkPolicyManagement"] = "Managed"
        template_spec["networkPolicy"] = {"ingress": [], **_egress(network, blocked)}
    template = {
        "apiVersion": EXTENSIONS_API,
        "kind": "SandboxTemplate",
        "metadata": {"name": name, "labels": kept},
        "spec": template_spec,
    }
    # v1beta1 claims name a pool, never a template: the pool exists even with no ready pods.
    pool = {
        "apiVersion": EXTENSIONS_API,
        "kind": "SandboxWarmPool",
        "metadata": {"name": name, "labels": kept},
        "spec": {"replicas": warm_pool, "sandboxTemplateRef": {"name": name}},
    }
    owner = kube_labels(owner_labels)
    # The claim owns its Sandbox, which owns the pod: gc deletes the claim (it carries the
    # owner labels) and the controller the rest. No additionalPodMetadata: a claim that asks
    # for extra pod metadata is not given a warm pod (the controller makes a new one), and
    # extra pod labels are taken only in domains the cluster admin allowlists.
    claim_spec: dict[str, Any] = {"warmPoolRef": {"name": name}}
    if shutdown_time:
        claim_spec["lifecycle"] = {"shutdownTime": shutdown_time, "shutdownPolicy": "Delete"}
    claim = {
        "apiVersion": EXTENSIONS_API,
        "kind": "SandboxClaim",
        "metadata": {
            "name": claim_name,
            "labels": {**kept, **owner},
        },
        "spec": claim_spec,
    }
    return SandboxObjects(template, pool, claim, shape)


def _egress(network: NetworkMode, blocked: Sequence[str]) -> dict[str, Any]:
    return {"egress": policy_rules(network, blocked).get("egress", [])}
