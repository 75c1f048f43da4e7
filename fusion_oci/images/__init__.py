"""Task images: resolve a name, gate, build or pull with retries, audit the digest.

Public entry points:

- :func:`resolve_image` — ``"node"`` (a folder under ``images/``) or a full reference
  → :class:`ImageSpec` (pure apart from hashing the build context).
- :func:`ensure_image` — what a container runtime's ``prepare`` awaits: gate → build, load or
  pull (with retries) → audit → :class:`ProvisionedImage` (reference and digest).
- :class:`ProvisionGate`, :func:`tty_ask` — the ``sandbox_provision`` / ``network_api`` gates.
- :func:`bootstrap_base` — the offline Debian base for machines without a registry.
- :func:`recipe_for` — a project's ``.nvmrc`` / ``.node-version`` / ``package.json`` →
  :class:`ImageRecipe` (pure); :func:`resolve_toolchain` — that recipe's exact releases from
  the npm registry (:class:`Registry`; :class:`RegistryError`, :class:`IntegrityError`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusion_oci.images.bootstrap import BootstrapResult, bootstrap_base
    from fusion_oci.images.engine import open_engine
    from fusion_oci.images.gates import AuditContext, GateRequest, ProvisionGate, tty_ask
    from fusion_oci.images.npm_registry import IntegrityError, Registry, RegistryError
    from fusion_oci.images.provision import (
        Engine,
        ProvisionedImage,
        ProvisionOptions,
        ensure_image,
    )
    from fusion_oci.images.recipe import ImageRecipe, ProjectFiles, read_project_files, recipe_for
    from fusion_oci.images.retry import RetryPolicy
    from fusion_oci.images.spec import BASE_REF, PUBLIC_BASE, ImageSpec, resolve_image
    from fusion_oci.images.toolchain import Toolchain, resolve_toolchain

# Lazy, like the top-level package: `fusion-oci run` reaches the gates module on every command
# and must not pay for the build, bootstrap and progress machinery.
_WHERE = {
    "BootstrapResult": "bootstrap",
    "bootstrap_base": "bootstrap",
    "open_engine": "engine",
    "AuditContext": "gates",
    "GateRequest": "gates",
    "ProvisionGate": "gates",
    "tty_ask": "gates",
    "Engine": "provision",
    "ProvisionedImage": "provision",
    "ProvisionOptions": "provision",
    "ensure_image": "provision",
    "RetryPolicy": "retry",
    "IntegrityError": "npm_registry",
    "Registry": "npm_registry",
    "RegistryError": "npm_registry",
    "ImageRecipe": "recipe",
    "ProjectFiles": "recipe",
    "read_project_files": "recipe",
    "recipe_for": "recipe",
    "Toolchain": "toolchain",
    "resolve_toolchain": "toolchain",
    "BASE_REF": "spec",
    "PUBLIC_BASE": "spec",
    "ImageSpec": "spec",
    "resolve_image": "spec",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"fusion_oci.images.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'fusion_oci.images' has no attribute {name!r}")


__all__ = [
    "BASE_REF",
    "PUBLIC_BASE",
    "AuditContext",
    "BootstrapResult",
    "Engine",
    "GateRequest",
    "ImageRecipe",
    "ImageSpec",
    "IntegrityError",
    "ProjectFiles",
    "ProvisionGate",
    "ProvisionOptions",
    "ProvisionedImage",
    "Registry",
    "RegistryError",
    "RetryPolicy",
    "Toolchain",
    "bootstrap_base",
    "ensure_image",
    "open_engine",
    "read_project_files",
    "recipe_for",
    "resolve_image",
    "resolve_toolchain",
    "tty_ask",
]
