"""``fusion-oci export``: the task environment of a run (or of the current settings) as a file
an engine's own tools reproduce it with: a compose service, a ``devcontainer.json``, a
Kubernetes Pod (+ NetworkPolicy), or a shell script around ``podman run``.

Each writer is a pure function of an :class:`ExportSource` (itself read from the resolved
spec) that returns the file's text and the parts of the spec the format cannot express. Those
are listed in a comment at the top of the file and, by the CLI, on stderr: never dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from fusion_oci.export.common import limit_flags
from fusion_oci.export.compose import to_compose
from fusion_oci.export.devcontainer import to_devcontainer
from fusion_oci.export.kube import to_kube
from fusion_oci.export.script import podman_argv, to_script
from fusion_oci.export.source import (
    ExportSource,
    Mount,
    default_image,
    read_spec,
    safe_name,
    source_from_record,
)

__all__ = [
    "EXPORT_FORMATS",
    "ExportSource",
    "Mount",
    "default_image",
    "export_run",
    "limit_flags",
    "podman_argv",
    "read_spec",
    "safe_name",
    "source_from_record",
    "to_compose",
    "to_devcontainer",
    "to_kube",
    "to_script",
]

EXPORT_FORMATS = ("compose", "devcontainer", "kube", "script")
WRITERS: dict[str, Callable[[ExportSource], tuple[str, list[str]]]] = {
    "compose": to_compose,
    "devcontainer": to_devcontainer,
    "kube": to_kube,
    "script": to_script,
}


def export_run(src: ExportSource, fmt: str) -> tuple[str, list[str]]:
    """The file's text and what it cannot express. Pure."""
    return WRITERS[fmt](src)
