"""Is NetworkPolicy enforced on this cluster? A probe, because the API cannot say.

A NetworkPolicy is stored whether or not a CNI plugin acts on it, and an enforcer may run
outside any pod (kube-router does on the test cluster), so neither the objects nor the pods in
``kube-system`` tell. The probe, in two phases so that an address that is simply unreachable
is never mistaken for a policy:

1. a pod (no policy selects it yet) connects, every half second, to the API server's service
   (``KUBERNETES_SERVICE_HOST``, the one address every pod is given); its first success marks
   it Ready (a readiness probe on a file it writes);
2. once it is Ready, a deny-all-egress policy selecting it is created; the pod goes on
   connecting. A connection failing after the first success → enforced (exit 2); every one
   still succeeding ~15 s later → not enforced (exit 0); never reached → unknown (exit 4).

It needs an image the nodes have (``sandbox.image``) with ``node``, ``bash`` or ``python3``;
without one the answer is ``unknown``, never a guess. The pod and the policy carry fusion-oci's
labels and are deleted before the probe returns.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.runtimes.kubernetes.client import ApiError, KubeClient, collection
from fusion_oci.runtimes.kubernetes.pod import MANAGED_BY

PROBE_JS = (
    "const s=require('net').connect({host:process.argv[1],port:+process.argv[2],timeout:1000});"
    "s.on('connect',()=>process.exit(0));s.on('timeout',()=>process.exit(1));"
    "s.on('error',()=>process.exit(1))"
)
PROBE_PY = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)"
PROBE_SCRIPT = r"""
h="$KUBERNETES_SERVICE_HOST"; p="$KUBERNETES_SERVICE_PORT"; i=0; reached=0
try() {
  if command -v node >/dev/null 2>&1; then node -e "$PROBE_JS" "$h" "$p"
  elif command -v bash >/dev/null 2>&1; then timeout 1 bash -c "exec 3<>/dev/tcp/$h/$p" 2>/dev/null
  elif command -v python3 >/dev/null 2>&1; then python3 -c "$PROBE_PY" "$h" "$p" 2>/dev/null
  else exit 3; fi
}
while [ $i -lt 60 ]; do
  if try; then
    if [ $reached = 0 ]; then reached=1; i=30; touch /tmp/reached; fi
  elif [ $reached = 1 ]; then exit 2; fi
  i=$((i+1)); sleep 0.5
done
[ $reached = 1 ] && exit 0 || exit 4
"""
"""Before its first success the loop has up to 30 s; after it, 30 more tries (~15 s)."""

STUCK = frozenset({"ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "CreateContainerError"})
"""A probe container waiting for one of these never starts."""
EXITS: dict[int, dict[str, Any]] = {
    2: {"enforced": True, "how": "probe: a pod's connections to the API server's service "
        "stopped once a deny-all egress policy selected it"},
    0: {"enforced": False, "how": "probe: a pod under a deny-all egress policy still connected "
        "for 15 s; the CNI does not enforce NetworkPolicy"},
    3: {"enforced": None, "how": "probe inconclusive: the image has no node, bash or python3"},
    4: {"enforced": None, "how": "probe inconclusive: the pod never reached the API server's "
        "service, even before any policy"},
}  # fmt: skip


def probe_network_policy(
    client: KubeClient,
    namespace: str,
    image: str | None,
    *,
    timeout_s: float = 90.0,
    settings: KubernetesSettings | None = None,
) -> dict[str, Any]:
    """``{"enforced": True | False | None, "how": ...}`` (module docstring)."""
    if not image:
        return {
            "enforced": None,
            "how": "not probed: no image to probe with (set sandbox.image to an image the "
            "nodes have)",
        }
    name = f"fusion-oci-netprobe-{uuid.uuid4().hex[:8]}"
    labels = {**MANAGED_BY, "io.fusion-oci/probe": name}
    pods = collection("v1", "pods", namespace)
    policies = collection("networking.k8s.io/v1", "networkpolicies", namespace)
    try:
        client.create(pods, _pod(name, labels, image, settings))
        phase = _wait(client, f"{pods}/{name}", time.monotonic() + timeout_s, until_ready=True)
        if phase is not None:
            return phase
        client.create(policies, _deny_all(name, labels))
        done = _wait(client, f"{pods}/{name}", time.monotonic() + timeout_s, until_ready=False)
        return done or {"enforced": None, "how": "probe ended without a result"}
    except ApiError as exc:
        return {"enforced": None, "how": f"probe failed: {exc.render()}"}
    finally:
        for path in (f"{pods}/{name}", f"{policies}/{name}"):
            # gone already, or never made; gc removes a leftover by its labels
            with contextlib.suppress(ApiError):
                client.delete(path)


def _pod(
    name: str, labels: dict[str, str], image: str, settings: KubernetesSettings | None
) -> dict[str, Any]:
    rc = settings.runtime_class if settings is not None else None
    return {
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
            **({"runtimeClassName": rc} if rc else {}),
            "volumes": [{"name": "tmp", "emptyDir": {"medium": "Memory"}}],
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
                    "readinessProbe": {
                        "exec": {"command": ["test", "-e", "/tmp/reached"]},
                        "periodSeconds": 1,
                    },
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def _deny_all(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": labels},
        "spec": {"podSelector": {"matchLabels": labels}, "policyTypes": ["Egress"]},
    }


def _wait(
    client: KubeClient, path: str, deadline: float, *, until_ready: bool
) -> dict[str, Any] | None:
    """Phase 1 (``until_ready``): None once the pod is Ready; phase 2: the result once it
    ends. Either way a result when the pod ends early, cannot start, or the deadline passes."""
    while time.monotonic() < deadline:
        status = client.get(path).get("status", {})
        for cs in status.get("containerStatuses", []):
            state = cs.get("state", {})
            waiting = state.get("waiting", {})
            if waiting.get("reason") in STUCK:
                why = f"{waiting.get('reason')}: {waiting.get('message', '')}"
                return {"enforced": None, "how": f"probe pod could not start: {why}"}
            if "terminated" in state:
                code = state["terminated"].get("exitCode")
                return EXITS.get(code, {"enforced": None, "how": f"probe exited {code}"})
            if until_ready and cs.get("ready"):
                return None
        time.sleep(0.25)
    return {"enforced": None, "how": "probe pod did not finish in time"}
