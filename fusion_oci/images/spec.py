"""Image names in settings → what to provision (pure apart from reading the build context)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class ImageSpec:
    """What ``settings.image`` names.

    ``kind == "build"``: a folder under ``images/`` built into ``ref``
    (``localhost/fusion-oci/NAME:<content-hash-12>``). ``kind == "pull"``: a full reference.
    """

    name: str
    ref: str
    kind: Literal["build", "pull"]
    context: Path | None = None
    build_args: dict[str, str] = field(default_factory=dict)


def resolve_image(name: str, *, images_dir: Path | None = None,
                  base: str | None = None) -> ImageSpec:
    """Short name of a folder under ``images_dir`` → build spec; anything else → pull spec."""
    raise NotImplementedError
