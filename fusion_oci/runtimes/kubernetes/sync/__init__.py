"""The worktree transfer between the executor's host and a remote sandbox (issue #34).

The worktree stays the executor's: before each command :meth:`WorktreeSync.push` sends the
host worktree's difference since the last transfer (git objects in a thin pack over a byte
stream), after it :meth:`WorktreeSync.pull` brings the command's changes back, checked as
coming from a hostile side. The design and its alternatives: docs/worktree-sync.md; the
trust model: "Remote worktree transfer" in docs/security.md.

Parts: :mod:`.remote` (the stdlib-only script on the remote side), :mod:`.stream` (the byte
stream and its frames), :mod:`.paths` and :mod:`.plan` (pure checks and the plan of a pull),
:mod:`.apply` (the only writer into the worktree), :mod:`.host` (the host side).
"""

from fusion_oci.runtimes.kubernetes.sync.errors import SyncRefusedError, WorktreeSyncError
from fusion_oci.runtimes.kubernetes.sync.host import PullReport, State, WorktreeSync
from fusion_oci.runtimes.kubernetes.sync.settings import SyncSettings
from fusion_oci.runtimes.kubernetes.sync.stream import ByteStream, ProcessStream, remote_argv

__all__ = [
    "ByteStream",
    "ProcessStream",
    "PullReport",
    "State",
    "SyncRefusedError",
    "SyncSettings",
    "WorktreeSync",
    "WorktreeSyncError",
    "remote_argv",
]
