"""Task images: resolve a name, gate, build or pull with retries, audit the digest.

Public entry points:

- :func:`resolve_image` — ``"node"`` (a folder under ``images/``) or a full reference
  → :class:`ImageSpec`.
- :func:`ensure_image` — what a container runtime's ``prepare`` awaits: gate → build/pull → audit.
"""

from fusion_oci.images.provision import Engine, ProvisionedImage, ensure_image
from fusion_oci.images.spec import ImageSpec, resolve_image

__all__ = ["Engine", "ImageSpec", "ProvisionedImage", "ensure_image", "resolve_image"]
