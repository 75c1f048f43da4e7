"""The image API of an engine, as the image pipeline sees it.

Image operations are methods of the engines layer's adapters
(:class:`~fusion_oci.engines.EngineAdapter`: one per SDK, the same object the runtimes and
``gc`` use), and their SDK errors become :class:`EngineOpError` there (a
:class:`~fusion_oci.errors.ProvisionError` that knows whether a retry may help). This module
opens them for the image pipeline and keeps the one image-specific rewrite.
"""

from __future__ import annotations

import re
from typing import Any

from fusion_oci.engines import Endpoint, EngineAdapter, EngineKind, image_errors, open_adapter

_SECRET_MOUNT = re.compile(r"--mount=type=secret\S*\s*")


def strip_secret_mounts(containerfile: str) -> str:
    """Drop ``--mount=type=secret,…`` flags: what a build without the secret would see.

    For docker's classic builder (API 1.41 without a BuildKit session), which cannot parse
    ``RUN --mount`` at all. Secret mounts are optional by default in BuildKit and podman, so a
    RUN step written for a missing secret behaves the same. Pure.
    """
    return _SECRET_MOUNT.sub("", containerfile)


def open_engine(kind: EngineKind, client_or_url: Any, *, name: str | None = None) -> EngineAdapter:
    """An adapter: one already open (a runtime's, borrowed: closing it closes nothing), or a
    new one for a ``unix://`` / ``tcp://`` URL (closed on close())."""
    if isinstance(client_or_url, EngineAdapter):
        return client_or_url
    if not isinstance(client_or_url, str):
        raise TypeError(
            "open_engine takes an EngineAdapter (fusion_oci.engines) or a URL, "
            f"not {type(client_or_url).__name__}"
        )
    url = client_or_url
    label = name or kind
    with image_errors(f"connect to {label}", label, url):
        return open_adapter(kind, Endpoint(url, label), name=label)
