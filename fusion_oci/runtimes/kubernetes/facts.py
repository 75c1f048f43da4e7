"""What ``fusion-oci doctor`` says about the cluster: reachable?, which mode, agent-sandbox's
CRDs, whether NetworkPolicy is enforced, and which of the executor's permissions are missing.

Each fact is one bounded call (or a few) to the API server; nothing here raises: a failure is
a fact too (``reachable: false`` with the error's why and hint).

NetworkPolicy enforcement cannot be read from the API (a policy is stored whether or not a
CNI plugin acts on it, and plugins such as kube-router may run outside any pod). So it is
probed: a pod under a deny-all-egress policy tries, for a few seconds, to open a TCP
connection to the API server's service (the one address every pod is told,
``KUBERNETES_SERVICE_HOST``). Refused or timed out → enforced; connected throughout → not
enforced. The probe needs an image the nodes have (``sandbox.image``) with ``node``, ``bash``
or ``python3`` in it; without one the answer is ``unknown``, never a guess.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fusion_oci.errors import FusionOCIError
from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.runtimes.kubernetes.client import ApiError, KubeClient, collection
from fusion_oci.runtimes.kubernetes.kubeconfig import find_access
from fusion_oci.runtimes.kubernetes.pod import MANAGED_BY
from fusion_oci.runtimes.kubernetes.rbac import access_reviews

SANDBOX_GROUPS = {
    "extensions.agents.x-k8s.io/v1beta1": ("sandboxtemplates", "sandboxwarmpools", "sandboxclaims"),
    "agents.x-k8s.io/v1beta1": ("sandboxes",),
}

PROBE_JS = (
    "const s=require('net').connect({host:process.argv[1],port:+process.argv[2],timeout:1000});"
    "s.on('connect',()=>process.exit(0));s.on('timeout',()=>process.exit(1));"
    "s.on('error',()=>process.exit(1))"
)
PROBE_PY = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)"
PROBE_SCRIPT = r"""
h="$KUBERNETES_SERVICE_HOST"; p="$KUBERNETES_SERVICE_PORT"; i=0
try() {
  if command -v node >/dev/null 2>&1; then node -e "$PROBE_JS" "$h" "$p"
  elif command -v bash >/dev/null 2>&1; then timeout 1 bash -c "exec 3<>/dev/tcp/$h/$p" 2>/dev/null
  elif command -v python3 >/dev/null 2>&1; then python3 -c "$PROBE_PY" "$h" "$p" 2>/dev/null
  else exit 3; fi
}
while [ $i -lt 8 ]; do try || exit 2; i=$((i+1)); sleep 0.5; done
exit 0
"""
"""Exit 2: a connection failed under the deny-all policy (enforced); 0: every attempt over
~5 s connected (not enforced); 3: the image has no tool to connect with."""


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
    client = KubeClient(access, settings.request_timeout_s)
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


def probe_network_policy(
    client: KubeClient,
    namespace: str,
    image: str | None,
    *,
    timeout_s: float = 60.0,
    settings: KubernetesSettings | None = None,
) -> dict[str, Any]:
    """Whether a deny-all-egress NetworkPolicy stops a pod's connection (module docstring).
    Creates a pod and a policy labelled as fusion-oci's and deletes both before returning."""
    if not image:
        return {
            "enforced": None,
            "how": "not probed: no image to probe with (set sandbox.image to an image the "
            "nodes have)",
        }
    name = f"fusion-oci-netprobe-{uuid.uuid4().hex[:8]}"
    rc = settings.runtime_class if settings is not None else None
    runtime_class = {"runtimeClassName": rc} if rc else {}
    labels = {**MANAGED_BY, "io.fusion-oci/probe": name}
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": labels},
        "spec": {"podSelector": {"matchLabels": labels}, "policyTypes": ["Egress"]},
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 0,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 65534,
                "runAsGroup": 65534,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            **runtime_class,
            "containers": [
                {
                    "name": "probe",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sh", "-c", PROBE_SCRIPT],
                    "env": [
                        {"name": "PROBE_JS", "value": PROBE_JS},
                        {"name": "PROBE_PY", "value": PROBE_PY},
                    ],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }
    pods = collection("v1", "pods", namespace)
    policies = collection("networking.k8s.io/v1", "networkpolicies", namespace)
    try:
        # The policy first: the pod is never without it.
        client.create(policies, policy)
        client.create(pods, pod)
        return _probe_result(client, f"{pods}/{name}", timeout_s)
    except ApiError as exc:
        return {"enforced": None, "how": f"probe failed: {exc.render()}"}
    finally:
        for path in (f"{pods}/{name}", f"{policies}/{name}"):
            # gone already, or never made; gc removes a leftover by its labels
            with contextlib.suppress(ApiError):
                client.delete(path)


def _probe_result(client: KubeClient, path: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get(path).get("status", {})
        for cs in status.get("containerStatuses", []):
            state = cs.get("state", {})
            waiting = state.get("waiting", {})
            if waiting.get("reason") in STUCK:
                why = f"{waiting.get('reason')}: {waiting.get('message', '')}"
                return {"enforced": None, "how": f"probe pod could not start: {why}"}
            if "terminated" in state:
                return PROBE_EXITS.get(
                    state["terminated"].get("exitCode"),
                    {"enforced": None, "how": "probe inconclusive: the image has no node, bash "
                     "or python3 to connect with"},
                )  # fmt: skip
        time.sleep(0.5)
    return {"enforced": None, "how": f"probe pod did not finish within {timeout_s:.0f} s"}


STUCK = frozenset({"ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "CreateContainerError"})
"""A probe container waiting for one of these never starts."""
PROBE_EXITS: dict[int, dict[str, Any]] = {
    2: {"enforced": True, "how": "probe: a deny-all egress policy stopped a pod's connection "
        "to the API server's service"},
    0: {"enforced": False, "how": "probe: a pod under a deny-all egress policy connected for "
        "5 s; the CNI does not enforce NetworkPolicy"},
}  # fmt: skip
