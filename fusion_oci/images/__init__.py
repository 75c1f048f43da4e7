"""Task images: resolve a name, gate, build or pull with retries, audit the digest.

Public entry points:

- :func:`resolve_image` — ``"node"`` (a folder under ``images/``) or a full reference
  → :class:`ImageSpec` (pure apart from hashing the build context).
- :func:`ensure_image` — what a container runtime's ``prepare`` awaits: gate → build, load or
  pull (with retries) → audit → :class:`ProvisionedImage` (reference and digest).
- :class:`ProvisionGate`, :func:`tty_ask` — the ``sandbox_provision`` / ``network_api`` gates.
- :func:`bootstrap_base` — the offline Debian base for machines without a registry.
"""

from fusion_oci.images.bootstrap import BootstrapResult, bootstrap_base
from fusion_oci.images.engine import EngineClient, EngineTarget, engine_targets, open_engine
from fusion_oci.images.gates import AuditContext, GateRequest, ProvisionGate, tty_ask
from fusion_oci.images.provision import (
    Engine,
    ProvisionedImage,
    ProvisionOptions,
    ensure_image,
)
from fusion_oci.images.retry import RetryPolicy
from fusion_oci.images.spec import BASE_REF, PUBLIC_BASE, ImageSpec, resolve_image

__all__ = [
    "BASE_REF",
    "PUBLIC_BASE",
    "AuditContext",
    "BootstrapResult",
    "Engine",
    "EngineClient",
    "EngineTarget",
    "GateRequest",
    "ImageSpec",
    "ProvisionGate",
    "ProvisionOptions",
    "ProvisionedImage",
    "RetryPolicy",
    "bootstrap_base",
    "engine_targets",
    "ensure_image",
    "open_engine",
    "resolve_image",
    "tty_ask",
]
