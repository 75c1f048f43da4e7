"""``kubernetes:``: where the cluster is and how a task becomes pods on it.

Read by the Kubernetes mapping (:mod:`fusion_oci.runtimes.kubernetes`), ``fusion-oci doctor``
and ``fusion-oci export --format kube``. It lives here, with the other settings sections,
because the settings are below the runtimes (a settings model never imports a runtime).
Every field left out is found the way kubectl finds it (see each field).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from fusion_oci.models import Model

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")

KubernetesMode = Literal["auto", "sandbox", "pods"]


class KubernetesSettings(Model):
    """``kubernetes:`` settings."""

    kubeconfig: str | None = None
    """The kubeconfig file. None: as kubectl finds it: the files of ``KUBECONFIG`` (the first
    that names the context wins), then ``~/.kube/config``, then the in-cluster service account
    (``KUBERNETES_SERVICE_HOST`` and the mounted token) when fusion-oci itself runs in a pod."""
    context: str | None = None
    """The kubeconfig context. None: the file's ``current-context``."""
    namespace: str | None = None
    """Where the task's objects are made. None: the context's namespace, else ``default``."""
    runtime_class: str | None = None
    """The pods' RuntimeClass (e.g. ``gvisor``). None: the cluster's default runtime."""
    warm_pool: int = Field(default=2, ge=0, le=100)
    """Sandbox mode: ready pods the SandboxWarmPool keeps per task shape (template). 0: none
    kept; each claim waits for a new pod."""
    mode: KubernetesMode = "auto"
    """``sandbox``: agent-sandbox's v1beta1 CRDs (SandboxTemplate, SandboxWarmPool,
    SandboxClaim); ``pods``: plain Pods; ``auto``: sandbox when the cluster serves the CRDs."""
    seccomp_profile: str | None = None
    """A Localhost seccomp profile on every node, relative to the kubelet's seccomp folder
    (``fusion-oci/task.json``), holding the bundle's profile. None: the runtime's
    RuntimeDefault profile, and the bundle's own is reported as not enforced."""
    request_timeout_s: float = Field(default=10.0, gt=0, le=300)
    """The bound on every call to the API server, in seconds."""
    start_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    """How long prepare waits for the task's pod to run (scheduling, the image, the volumes)."""
    task_lifetime_s: float = Field(default=86400.0, gt=60)
    """Sandbox mode: the claim's ``shutdownTime`` is this far after prepare, so the controller
    ends a task whose executor died without disposing it (gc does it sooner)."""
    node_networks: list[str] = Field(default_factory=list)
    """CIDRs of the cluster's nodes (and anything else a pod must not reach under ``network:
    egress``, as a local sandbox may not reach the host's loopback): the pod's NetworkPolicy
    excepts them. Empty: ``egress`` is reported unenforced (the runtime cannot know the nodes'
    addresses without a cluster-wide permission), so such tasks are refused."""

    @field_validator("node_networks")
    @classmethod
    def _cidrs(cls, values: list[str]) -> list[str]:
        import ipaddress

        out = []
        for value in values:
            try:
                out.append(str(ipaddress.ip_network(value, strict=False)))
            except ValueError:
                raise ValueError(
                    f"'{value}' is not a network; set kubernetes.nodeNetworks to CIDRs like "
                    "10.0.0.0/16"
                ) from None
        return out

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and not _DNS_LABEL.match(value):
            raise ValueError(
                f"'{value}' is not a namespace name (lower-case letters, digits and '-', at "
                "most 63, starting and ending alphanumeric); set kubernetes.namespace to one"
            )
        return value

    @field_validator("runtime_class")
    @classmethod
    def _runtime_class(cls, value: str | None) -> str | None:
        if value is not None and not _DNS_SUBDOMAIN.match(value):
            raise ValueError(
                f"'{value}' is not a RuntimeClass name (a DNS subdomain); set "
                "kubernetes.runtimeClass to the name `kubectl get runtimeclass` lists"
            )
        return value

    @field_validator("seccomp_profile")
    @classmethod
    def _seccomp(cls, value: str | None) -> str | None:
        if value is not None and (value.startswith("/") or ".." in value.split("/")):
            raise ValueError(
                f"'{value}' must be relative to the kubelet's seccomp folder, without '..'; "
                "set kubernetes.seccompProfile like fusion-oci/task.json"
            )
        return value
