"""Where fusion-oci keeps its host caches: package caches, the npm registry's, image locks.

Its own module, below the runtimes, the image pipeline and the CLI that all need it, so none
of them imports another for a path.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def default_cache_root(env: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/fusion-oci``, else ``~/.cache/fusion-oci``. Pure."""
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "/tmp")) / ".cache")
    return Path(base) / "fusion-oci"
