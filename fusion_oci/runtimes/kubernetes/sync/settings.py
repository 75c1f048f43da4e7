"""The transfer's settings: what comes back besides tracked and untracked files, and bounds."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from fusion_oci.models import Model
from fusion_oci.runtimes.kubernetes.sync.paths import check_path


class SyncSettings(Model):
    """How a task's worktree crosses to its remote sandbox and back (docs/worktree-sync.md)."""

    bring_back: list[str] = Field(default_factory=list)
    """Ignored paths (relative to the worktree: ``dist``, ``coverage/lcov.info``) that cross
    both ways like tracked files, so a build's output comes back after each command. Empty:
    ignored outputs (``node_modules``, build folders) stay in the sandbox."""
    max_transfer_mb: Annotated[int, Field(gt=0)] = 256
    """Largest pack from the sandbox, and largest total of file contents one pull writes."""
    max_file_mb: Annotated[int, Field(gt=0)] = 100
    """Largest single file a pull writes (checked on the object's size, before inflating)."""
    max_objects: Annotated[int, Field(gt=0)] = 200_000
    """Most objects in one pack from the sandbox."""
    max_paths: Annotated[int, Field(gt=0)] = 100_000
    """Most changed paths one pull applies."""

    @field_validator("bring_back")
    @classmethod
    def _relative(cls, values: list[str]) -> list[str]:
        for value in values:
            why = check_path(value.rstrip("/"))
            if why is not None:
                raise ValueError(f"bringBack entry {value!r}: {why}")
        return [v.rstrip("/") for v in values]


__all__ = ["SyncSettings"]
