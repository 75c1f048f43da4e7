"""Everything the kubernetes runtime makes for one task, from its spec and the settings. Pure.

``pods`` mode: the task's Pod and its NetworkPolicy. ``sandbox`` mode: the shape's
SandboxTemplate and SandboxWarmPool (shared by tasks of one shape) and the task's
SandboxClaim. Either way :attr:`TaskObjects.unenforced` is what the runtime's ``check``
reports, and :meth:`TaskObjects.manifests` the objects in the order they are created.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fusion_oci.oci.model import ProcessSpec, TaskSpec
from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.runtimes.kubernetes.agentsandbox import SandboxObjects, sandbox_objects
from fusion_oci.runtimes.kubernetes.pod import PodMapping, PodOptions, PodService, pod_manifest

Mode = Literal["sandbox", "pods"]
GRACE_S = 2


@dataclass(frozen=True)
class TaskObjects:
    mode: Mode
    mapping: PodMapping
    sandbox: SandboxObjects | None

    @property
    def unenforced(self) -> list[str]:
        return self.mapping.unenforced

    @property
    def not_carried(self) -> list[str]:
        return self.mapping.not_carried

    def manifests(self) -> list[dict[str, Any]]:
        """In creation order: a pod's policy before the pod (never a moment without it); a
        template before its pool before the claim."""
        if self.sandbox is not None:
            s = self.sandbox
            return [s.template, s.pool, s.claim]
        policy = self.mapping.network_policy
        return [*([policy] if policy else []), self.mapping.pod]


def task_objects(
    task: TaskSpec,
    agent: ProcessSpec,
    settings: KubernetesSettings,
    *,
    mode: Mode,
    name: str,
    image: str,
    owner_labels: Mapping[str, str],
    transferred: Sequence[str] = (),
    shutdown_time: str | None = None,
    tools: str | None = None,
    skip: frozenset[str] = frozenset(),
    files_from: Mapping[str, tuple[str, str]] | None = None,
    services: Sequence[PodService] = (),
) -> TaskObjects:
    """The objects of one task. ``agent``: the process the pod's one container runs (the exec
    agent); ``transferred``: the destinations the worktree transfer fills; ``mode``: already
    decided (``auto`` is the doctor's and prepare's question to the cluster); ``services``:
    the task's service containers, with the images the nodes run them from."""
    opts = PodOptions(
        name=name,
        image=image,
        transferred=tuple(transferred),
        labels=owner_labels,
        runtime_class=settings.runtime_class,
        seccomp_profile=settings.seccomp_profile,
        # The agent is the pod's PID 1 and ends the task's commands itself at dispose; a
        # disposed task's pod should be gone in seconds, not the default 30.
        grace_s=GRACE_S,
        tools=tools,
        skip=skip,
        files_from=dict(files_from or {}),
        blocked_networks=tuple(settings.node_networks),
        services=tuple(services),
    )
    mapping = pod_manifest(task, agent, opts)
    if mode == "pods":
        return TaskObjects(mode, mapping, None)
    objs = sandbox_objects(
        mapping,
        task.network,
        claim_name=name,
        owner_labels=owner_labels,
        warm_pool=settings.warm_pool,
        shutdown_time=shutdown_time,
        blocked=tuple(settings.node_networks),
    )
    return TaskObjects(mode, mapping, objs)
