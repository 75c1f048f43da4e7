"""A service container as an engine creates it: name, labels and the SDK's create arguments.
Pure (golden-tested), for podman's and docker's SDKs.

What a service container is given, and why:

- ``network_mode: none``: a network namespace with only ``lo``. The service listens on its
  own 127.0.0.1; the one way in is the task's relay, which makes its sockets inside that
  namespace (:mod:`fusion_oci.services.netns`). No bridge, no published port: nothing on the
  host's network, and no other task, has a route to it.
- ``hostname``: the service's name (what its logs and prompts say).
- the engine's default capabilities minus the ones a service never needs (raw sockets,
  device nodes, chroot, file capabilities, audit writes), and no new privileges. Not all of
  them: a user's own image (the official postgres one) starts as root and drops to its user
  with setuid/chown, which the defaults allow. Our own images run as the service's user.
- a pids limit and, on podman, rlimits within the host's hard limits (podman's defaults for
  root exceed them here and runc then fails with "setrlimit ... operation not permitted").
- the owner's labels (``io.fusion-oci.kind: service``, the task, pid, start time, boot and
  host): ``gc`` removes it once its owner is gone, as any container fusion-oci made.
"""

from __future__ import annotations

from typing import Any, Literal

from fusion_oci.engines.base import ContainerPlan
from fusion_oci.engines.labels import LABEL_KIND, LABEL_TASK, Owner
from fusion_oci.models import ServiceContainer
from fusion_oci.oci.model import ANN

KIND = "service"
"""The ``io.fusion-oci.kind`` label of a service container."""
LABEL_SERVICE = ANN + "service"
"""The service's name (``db``)."""
DROPPED_CAPS = ("NET_RAW", "MKNOD", "AUDIT_WRITE", "SYS_CHROOT", "SETFCAP")
PIDS_LIMIT = 1024


def service_container_name(task_id: str, service: str, nonce: str) -> str:
    """Unique per task and service; ``podman ps`` says whose it is."""
    return f"fusion-oci-{task_id}-svc-{service}-{nonce}"


def plan_service(
    service: ServiceContainer,
    image_ref: str,
    *,
    engine: Literal["podman", "docker"],
    task_id: str,
    owner: Owner,
    nonce: str,
    rlimits: dict[str, tuple[int, int]] | None = None,
) -> ContainerPlan:
    """The create arguments of ``service``'s container on ``engine``. ``rlimits``: the
    host's hard limits by name (``nofile``, ``nproc``), which podman's must stay within."""
    name = service_container_name(task_id, service.name, nonce)
    labels = {
        LABEL_KIND: KIND,
        LABEL_TASK: task_id,
        LABEL_SERVICE: service.name,
        **owner.labels(),
    }
    create: dict[str, Any] = {
        "image": image_ref,
        "name": name,
        "hostname": service.name,
        "labels": labels,
        "environment": dict(service.env),
        "network_mode": "none",
        "cap_drop": list(DROPPED_CAPS),
        "pids_limit": PIDS_LIMIT,
    }
    if service.command is not None:
        create["command"] = list(service.command)
    if engine == "podman":
        create["no_new_privileges"] = True
        create["ulimits"] = [
            {"Name": what, "Soft": soft, "Hard": hard}
            for what, (soft, hard) in sorted((rlimits or {}).items())
        ]
    else:
        create["security_opt"] = ["no-new-privileges"]
    notes = [
        f"service {service.name}: {image_ref}, network none (only its own loopback); the "
        f"task's relay connects to 127.0.0.1:{service.port} inside its network namespace",
    ]
    if service.env:
        notes.append(f"service {service.name}: env " + ", ".join(sorted(service.env)))
    return ContainerPlan(name=name, image=image_ref, create=create, notes=notes)


def ready_argv(service: ServiceContainer) -> list[str] | None:
    """The readiness probe run inside the container (a shell command line), or None: the
    port accepting a connection is enough."""
    return ["/bin/sh", "-c", service.ready] if service.ready else None


__all__ = [
    "DROPPED_CAPS",
    "KIND",
    "LABEL_SERVICE",
    "PIDS_LIMIT",
    "plan_service",
    "ready_argv",
    "service_container_name",
]
