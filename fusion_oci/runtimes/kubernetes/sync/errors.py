"""The transfer's errors, in the package's one tree (fusion_oci.errors).

::

    FusionOCIError
    └── WorktreeSyncError              the transfer could not be made (stream, git)   setup-failed
        └── SyncRefusedError (PermissionError)  the remote sent what the host refuses

A refused pull applies nothing: no file, no object, no ref. What is refused path by path
(a conflict, a protected path, a gitlink) is not an error: the pull's report lists it.
"""

from __future__ import annotations

from fusion_oci.errors import FusionOCIError


class WorktreeSyncError(FusionOCIError):
    """The worktree could not be sent to the remote side or brought back from it."""

    exit_code = 125
    kind = "setup-failed"


class SyncRefusedError(WorktreeSyncError, PermissionError):
    """The remote side sent something the host refuses (a path, a mode, a ref, an object, a
    size): nothing of that pull was applied."""

    def __init__(self, why: str, hint: str = "") -> None:
        super().__init__(
            "the worktree transfer from the sandbox was refused; nothing of it was applied",
            why,
            hint
            or "the command wrote something the host never takes back (see 'remote worktree "
            "transfer' in docs/security.md); the sandbox keeps its copy",
        )


__all__ = ["SyncRefusedError", "WorktreeSyncError"]
