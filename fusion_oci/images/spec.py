"""Image names in settings → what to provision.

``settings.image`` is either the short name of a folder under ``images/`` (``node``), built into
``localhost/fusion-oci/node:<content-hash-12>``, or a full reference (pulled). Short names of
public images (``debian``) are refused rather than guessed: podman and docker resolve them
differently, and a silent guess is how a task ends up on the wrong image.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fusion_oci.errors import ProvisionError
from fusion_oci.images.context import content_tag, context_hash

if TYPE_CHECKING:
    from fusion_oci.images.toolchain import Toolchain

LOCAL_REPO = "localhost/fusion-oci"
BASE_REF = f"{LOCAL_REPO}/base:bookworm"
"""The offline base made by ``fusion-oci images bootstrap-base``."""
PUBLIC_BASE = "docker.io/library/debian:bookworm-slim"
"""The default ``BASE`` of the Containerfiles under ``images/``."""
CONTAINERFILE = "Containerfile"

LABEL_MANAGED = "io.fusion-oci.managed"
LABEL_NAME = "io.fusion-oci.image"
LABEL_HASH = "io.fusion-oci.context-hash"
LABEL_SOURCE = "io.fusion-oci.source-hash"
"""The hash of the folder and base alone (what "current" means for an image built with a
toolchain: other projects' Node.js versions of the same folder are current too)."""
TOOLCHAIN_ARG = re.compile(r"^\s*ARG\s+NODE_VERSION\b", re.MULTILINE)
"""A Containerfile that declares ``ARG NODE_VERSION`` is built with a resolved toolchain."""

_SHORT = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class ImageSpec:
    """What ``settings.image`` names.

    ``kind == "build"``: the folder ``context`` built into ``ref``
    (``localhost/fusion-oci/NAME:<content-hash-12>``); ``build_args`` holds ``BASE`` when a
    base other than the Containerfile's default is used. ``kind == "pull"``: ``ref`` is a full,
    normalised reference (registry, repository, tag or digest).
    """

    name: str
    ref: str
    kind: Literal["build", "pull"]
    context: Path | None = None
    containerfile: str = CONTAINERFILE
    build_args: dict[str, str] = field(default_factory=dict)
    context_hash: str | None = None
    toolchain: Toolchain | None = None
    """The exact Node.js and package manager releases (folders whose Containerfile declares
    ``ARG NODE_VERSION``); their versions and integrities are in ``build_args`` and so in the
    tag. None: the folder needs none."""
    source_hash: str | None = None
    """The hash of the folder and base without the toolchain (:data:`LABEL_SOURCE`)."""

    @property
    def labels(self) -> dict[str, str]:
        """Labels put on a built image so ``images list``/``prune`` can find it."""
        if self.kind != "build":
            return {}
        return {
            LABEL_MANAGED: "true",
            LABEL_NAME: self.name,
            LABEL_HASH: self.context_hash or "",
            LABEL_SOURCE: self.source_hash or "",
        }


SELF_IMAGE = "fusion-oci"
"""The image of fusion-oci itself, built from the top-level Containerfile."""


PACKAGED_IMAGES = "_images"
"""Where a wheel carries the top-level ``images/`` (pyproject.toml's hatch force-include)."""


def default_images_dir(
    env: Mapping[str, str] | None = None, *, package_root: Path | None = None
) -> Path:
    """``$FUSION_OCI_IMAGES_DIR``; else ``images/`` of the checkout this package was loaded
    from (the source of truth, so an edit there is what builds); else the copy shipped inside
    the package (a wheel or sdist install). Read when called, never at import.

    ``package_root``: the ``fusion_oci`` folder (tests point it at an installed copy).
    """
    value = (os.environ if env is None else env).get("FUSION_OCI_IMAGES_DIR")
    if value:
        return Path(value)
    package = package_root or Path(__file__).resolve().parents[1]
    top = package.parent
    # A checkout has pyproject.toml beside images/; site-packages has neither, and an unrelated
    # site-packages/images (another distribution's) must not be mistaken for ours.
    if (top / "pyproject.toml").is_file() and (top / "images").is_dir():
        return top / "images"
    return package / PACKAGED_IMAGES


def is_short_name(name: str) -> bool:
    return bool(_SHORT.fullmatch(name))


def normalize_ref(ref: str) -> str:
    """Fully qualify a reference the way docker does (``debian:12`` → ``docker.io/library/…``).

    Adds ``:latest`` when neither tag nor digest is given. Pure.
    """
    ref = ref.strip()
    if not ref or any(c.isspace() for c in ref):
        raise ProvisionError(
            f"image reference '{ref}' is not valid",
            "it is empty or has spaces",
            "write a reference like docker.io/library/debian:bookworm-slim",
        )
    first, _, rest = ref.partition("/")
    if not rest or ("." not in first and ":" not in first and first != "localhost"):
        ref = f"docker.io/{ref}" if rest else f"docker.io/library/{ref}"
    last = ref.rsplit("/", 1)[-1]
    if "@" not in last and ":" not in last:
        ref += ":latest"
    return ref


def split_registry(ref: str) -> tuple[str, str]:
    """``registry/repo/path:tag`` → (registry, ``repo/path:tag``) of a normalised reference."""
    registry, _, rest = ref.partition("/")
    return registry, rest


def with_mirror(ref: str, mirror: str) -> str:
    """The same image on a mirror: ``docker.io/library/x:1`` + ``127.0.0.1:5000`` →
    ``127.0.0.1:5000/library/x:1`` (a mirror may carry a path prefix: ``host/prefix``)."""
    return f"{mirror.rstrip('/')}/{split_registry(ref)[1]}"


def is_loopback_registry(ref: str) -> bool:
    """Registries on the loopback interface are plain HTTP (as docker assumes for 127.0.0.0/8).
    Pure."""
    registry = split_registry(ref)[0]
    if registry.startswith("["):
        host = registry[1:].partition("]")[0]
    else:
        host = registry.rpartition(":")[0] if ":" in registry else registry
    return host in ("localhost", "::1") or host.startswith("127.")


def takes_toolchain(context: Path, containerfile: str = CONTAINERFILE) -> bool:
    """Whether the folder's Containerfile is built with a resolved toolchain."""
    path = context / containerfile
    return path.is_file() and bool(TOOLCHAIN_ARG.search(path.read_text(encoding="utf-8")))


def image_context(name: str, images_dir: Path | None = None) -> Path | None:
    """The folder a short name builds from (None when there is none)."""
    root = images_dir or default_images_dir()
    context = root / name
    if name == SELF_IMAGE and not context.is_dir():
        context = root.parent
    return context if (context / CONTAINERFILE).is_file() else None


def resolve_image(
    name: str,
    *,
    images_dir: Path | None = None,
    base: str | None = None,
    toolchain: Toolchain | None = None,
) -> ImageSpec:
    """Short name of a folder under ``images_dir`` → build spec; full reference → pull spec.

    ``base``: the ``BASE`` build argument (e.g. :data:`BASE_REF` on machines without a
    registry); None keeps the Containerfile's default. The tag depends on it, since the image
    does. ``toolchain``: the resolved Node.js and package manager, required by a folder whose
    Containerfile declares ``ARG NODE_VERSION`` (``node``) and hashed into its tag. Reads the
    build context to hash it; no engine or registry is contacted.
    """
    if is_short_name(name):
        root = images_dir or default_images_dir()
        context = root / name
        if name == SELF_IMAGE and not context.is_dir():
            context = root.parent
        if not (context / CONTAINERFILE).is_file():
            known = (
                sorted(p.name for p in root.iterdir() if (p / CONTAINERFILE).is_file())
                if root.is_dir()
                else []
            )
            raise ProvisionError(
                f"image '{name}' is unknown",
                f"there is no {context / CONTAINERFILE}"
                + (f" (images here: {', '.join(known)})" if known else ""),
                f"use one of the folders under {root}, or a full reference such as "
                f"docker.io/library/{name}:latest",
            )
        args = {"BASE": base} if base else {}
        source = context_hash(context, CONTAINERFILE, args)
        digest = source
        if takes_toolchain(context):
            if toolchain is None:
                raise ProvisionError(
                    f"image '{name}' needs its Node.js toolchain resolved",
                    "its Containerfile declares ARG NODE_VERSION, whose value comes from the "
                    "project and the npm registry",
                    "provision it with `fusion-oci images build` or through a runtime",
                )
            args.update(toolchain.build_args())
            digest = context_hash(context, CONTAINERFILE, args)
        return ImageSpec(
            name=name,
            ref=f"{LOCAL_REPO}/{name}:{content_tag(digest)}",
            kind="build",
            context=context,
            build_args=args,
            context_hash=digest,
            toolchain=toolchain if takes_toolchain(context) else None,
            source_hash=source,
        )
    return ImageSpec(name=name, ref=normalize_ref(name), kind="pull")
