"""``ensure_image``: the provisioning path a container runtime's ``prepare`` goes through."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog
    from fusion_oci.images.gates import GateRequest
    from fusion_oci.policy.settings import SandboxSettings

Engine = Literal["podman", "docker"]
"""Which SDK talks to the engine (rootless podman is ``podman`` with the user's socket URL)."""

AskCallback = Callable[["GateRequest"], bool | Awaitable[bool]]


@dataclass(frozen=True)
class ProvisionedImage:
    ref: str
    """The reference to create containers from."""
    digest: str
    """Image id (``sha256:...``) as the engine reports it; recorded in the audit."""
    action: Literal["present", "built", "pulled"]


async def ensure_image(
    engine: Engine,
    client_or_url: Any,
    image_name: str,
    settings: SandboxSettings,
    audit: AuditLog,
    task_id: str,
    run_id: str,
    *,
    ask: AskCallback | None = None,
    mirrors: list[str] | None = None,
) -> ProvisionedImage:
    """Make ``image_name`` present in the engine and return its reference and digest.

    ``client_or_url``: a ``podman.PodmanClient`` / ``docker.DockerClient``, or a socket URL
    (``unix:///...``) for which a client is opened and closed here. ``image_name`` is what
    ``settings.image`` says: a folder under ``images/`` (built, tag from the context hash) or
    a full reference (pulled). When missing, the ``sandbox_provision`` gate decides first
    (``ask`` is called for ``ask``; no callback → denied); then build or pull with retries of
    transient failures. Emits ``sandbox:gate`` and ``sandbox:provision`` events (the latter
    with the digest). Raises :class:`~fusion_oci.errors.GateDeniedError` or
    :class:`~fusion_oci.errors.ProvisionError`.
    """
    raise NotImplementedError
