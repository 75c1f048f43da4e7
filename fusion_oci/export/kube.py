"""The environment as a Kubernetes Pod and, unless it uses the host network, a
NetworkPolicy."""

from __future__ import annotations

from typing import Any

import yaml

from fusion_oci.export.common import common_unexpressed, header
from fusion_oci.export.source import ExportSource


def to_kube(src: ExportSource) -> tuple[str, list[str]]:
    missing = [*common_unexpressed(src)]
    if src.seccomp:
        missing.append(
            "seccomp: the recorded profile is not a Localhost profile on the "
            "node; the Pod asks for RuntimeDefault"
        )
    if src.pids:
        missing.append(
            f"pidsLimit {src.pids}: a Pod cannot set it (the kubelet's "
            "podPidsLimit does, node-wide)"
        )
    if src.rlimits:
        missing.append(
            "rlimits (" + ", ".join(sorted(src.rlimits)) + "): a Pod cannot set "
            "them (the container runtime's defaults apply; where podman's exceed "
            "the host's hard limits, set default_ulimits in containers.conf)"
        )
    if src.network == "egress":
        missing.append(
            "network egress without host loopback: the NetworkPolicy allows "
            "egress except loopback and link-local; the node's own addresses "
            "depend on the cluster and are not excluded"
        )
    if src.network != "host":
        missing.append(
            "the NetworkPolicy is enforced only by a CNI plugin that supports "
            "NetworkPolicy (podman kube play ignores it)"
        )
    passed = [k for k, v in src.env.items() if v is None]
    if passed:
        missing.append(
            "caller env (" + ", ".join(passed) + "): read from Secret "
            f"{src.name}-env (create it; keys are optional)"
        )
    env: list[dict[str, Any]] = []
    for key, value in src.env.items():
        if value is None:
            env.append(
                {
                    "name": key,
                    "valueFrom": {
                        "secretKeyRef": {"name": f"{src.name}-env", "key": key, "optional": True}
                    },
                }
            )
        else:
            env.append({"name": key, "value": value})
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for n, m in enumerate(src.mounts):
        vol = f"v{n}"
        if m.kind == "tmpfs":
            empty: dict[str, Any] = {"medium": "Memory"}
            if m.size:
                empty["sizeLimit"] = _kube_size(m.size)
            volumes.append({"name": vol, "emptyDir": empty})
            if m.mode:
                missing.append(f"tmpfs mode {m.mode} of {m.target}: emptyDir has none")
        else:
            volumes.append(
                {
                    "name": vol,
                    "hostPath": {"path": m.source, "type": "File" if m.is_file else "Directory"},
                }
            )
        mounts.append({"name": vol, "mountPath": m.target, "readOnly": m.read_only})
    resources: dict[str, Any] = {}
    limits: dict[str, str] = {}
    if src.memory_bytes:
        limits["memory"] = f"{max(1, src.memory_bytes // (1024 * 1024))}Mi"
    if src.cpus:
        limits["cpu"] = f"{int(src.cpus * 1000)}m"
    if limits:
        resources = {"limits": limits, "requests": dict(limits)}
    security: dict[str, Any] = {
        "runAsUser": src.uid,
        "runAsGroup": src.gid,
        "privileged": False,
        "allowPrivilegeEscalation": not src.no_new_privileges,
        "readOnlyRootFilesystem": src.read_only_root,
        "capabilities": {
            "drop": ["ALL"],
            **(
                {"add": [c.removeprefix("CAP_") for c in src.capabilities]}
                if src.capabilities
                else {}
            ),
        },
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    labels = {"app.kubernetes.io/managed-by": "fusion-oci", "io.fusion-oci/task": src.name}
    container: dict[str, Any] = {
        "name": "task",
        "image": src.image,
        "imagePullPolicy": "Never",
        "command": src.argv,
        "workingDir": src.cwd,
        "env": env,
        "securityContext": security,
        "volumeMounts": mounts,
    }
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": src.name,
            "labels": labels,
            "annotations": {
                **src.labels,
                **({"io.fusion-oci/image-digest": src.image_digest} if src.image_digest else {}),
            },
        },
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "containers": [container],
            "volumes": volumes,
        },
    }
    if src.hostname:
        pod["spec"]["hostname"] = src.hostname
    if src.network == "host":
        pod["spec"]["hostNetwork"] = True
    docs = [pod]
    if src.network != "host":
        policy: dict[str, Any] = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"{src.name}-net", "labels": labels},
            "spec": {
                "podSelector": {"matchLabels": {"io.fusion-oci/task": src.name}},
                "policyTypes": ["Ingress", "Egress"],
            },
        }
        if src.network == "egress":
            policy["spec"]["egress"] = [
                {
                    "to": [
                        {
                            "ipBlock": {
                                "cidr": "0.0.0.0/0",
                                "except": ["127.0.0.0/8", "169.254.0.0/16"],
                            }
                        }
                    ]
                }
            ]
        docs.append(policy)
    body = yaml.safe_dump_all(docs, sort_keys=False)
    return header(missing, "kube", src, "#") + body, missing


def _kube_size(size: str) -> str:
    units = {"k": "Ki", "m": "Mi", "g": "Gi"}
    last = size[-1].lower()
    return size[:-1] + units[last] if last in units else size
