"""What a pull does to the host worktree, decided before anything is written. Pure.

Input: the remote's changes (``git diff-tree -r`` from the tree the host last sent to the
tree the remote has now) and what the host has at each of those paths now. Output: a
:class:`Plan` — deletions, writes, and what is kept out path by path (a conflict, a protected
path, a gitlink, a name that folds onto another) — or :class:`SyncRefusedError` when the
remote sent what no honest git produces (a bad path or mode): then nothing is applied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fusion_oci.runtimes.kubernetes.sync.errors import SyncRefusedError
from fusion_oci.runtimes.kubernetes.sync.paths import (
    FILE_MODES,
    GITLINK,
    check_path,
    collisions,
    protected_by,
)


@dataclass(frozen=True)
class Change:
    """One path the remote changed: the base side (what the host sent) and the new one."""

    path: str
    old_mode: str | None
    old_oid: str | None
    new_mode: str | None
    new_oid: str | None

    @property
    def old(self) -> tuple[str, str] | None:
        return (self.old_mode, self.old_oid) if self.old_mode and self.old_oid else None

    @property
    def new(self) -> tuple[str, str] | None:
        return (self.new_mode, self.new_oid) if self.new_mode and self.new_oid else None


def parse_diff_tree(out: bytes) -> list[Change]:
    """``git diff-tree -r -z --no-renames`` output as changes. Raises SyncRefusedError on
    anything but that format (the output is about objects the remote made)."""
    fields = out.split(b"\0")
    if fields and fields[-1] == b"":
        fields.pop()
    if len(fields) % 2:
        raise SyncRefusedError("the tree difference could not be read")
    changes = []
    for meta, raw in zip(fields[::2], fields[1::2], strict=True):
        parts = meta.decode("ascii", "replace").split(" ")
        if len(parts) != 5 or not parts[0].startswith(":"):
            raise SyncRefusedError(f"the tree difference could not be read: {meta[:80]!r}")
        old_mode, new_mode, old_oid, new_oid = parts[0][1:], parts[1], parts[2], parts[3]
        absent = set("0")
        changes.append(
            Change(
                path=raw.decode("utf-8", "surrogateescape"),
                old_mode=None if set(old_mode) <= absent else old_mode,
                old_oid=None if set(old_oid) <= absent else old_oid,
                new_mode=None if set(new_mode) <= absent else new_mode,
                new_oid=None if set(new_oid) <= absent else new_oid,
            )
        )
    return changes


HostEntry = tuple[str, str] | None
"""What the host has at a path: (mode, oid) of a file or symlink, None when nothing is there,
or (kind, detail) with kind ``dir``, ``other`` (a FIFO, a device), ``blocked`` (a parent is a
symlink or not a folder: never walked through) or ``collides`` (a sibling whose name folds
onto this one)."""


@dataclass(frozen=True)
class Write:
    path: str
    mode: str
    oid: str


@dataclass
class Plan:
    deletes: list[str] = field(default_factory=list)
    """Paths to remove, deepest first (before the writes: a file may replace a folder)."""
    writes: list[Write] = field(default_factory=list)
    conflicts: list[tuple[str, str | None]] = field(default_factory=list)
    """(path, the remote's object or None for a deletion): the host changed the path during
    the command too; the host's version stays."""
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(path, why) kept out: a protected path, a blocked parent, a folded-name clash."""
    gitlinks: list[tuple[str, str]] = field(default_factory=list)
    """(path, commit): a repository the remote made or changed, left in the sandbox (the host
    quarantines such repositories: see fusion_oci/policy/gitlinks.py)."""


def check_changes(changes: Sequence[Change], max_paths: int) -> None:
    """Refuse the whole pull when a change is one no honest git makes: too many, a bad path,
    a bad mode."""
    if len(changes) > max_paths:
        raise SyncRefusedError(f"{len(changes)} changed paths (the limit is {max_paths})")
    for change in changes:
        why = check_path(change.path)
        if why is not None:
            raise SyncRefusedError(f"path {change.path!r}: {why}")
        for mode in (change.old_mode, change.new_mode):
            if mode is not None and mode not in FILE_MODES and mode != GITLINK:
                raise SyncRefusedError(f"path {change.path!r}: mode {mode} (only 644, 755, links)")


def _below(path: str, folders: set[str]) -> bool:
    parts = path.split("/")
    return any("/".join(parts[:i]) in folders for i in range(1, len(parts)))


def build_plan(
    changes: Sequence[Change],
    host: Mapping[str, HostEntry],
    protected: Sequence[str],
    max_paths: int = 100_000,
) -> Plan:
    """The plan for ``changes`` given what the host has now (``host``: every changed path)."""
    check_changes(changes, max_paths)
    plan = Plan()
    folded = collisions(c.path for c in changes if c.new is not None)
    # A file or symlink the plan removes (the host's is the one that was sent) may be a
    # folder's place in the new tree: below it, the host will have nothing.
    removed = {c.path for c in changes if c.new is None and host.get(c.path) == c.old}
    for change in changes:
        now = host.get(change.path)
        if now is not None and now[0] == "blocked" and _below(change.path, removed):
            now = None
        if now is not None and now[0] == "dir" and change.old is None:
            now = None  # a folder the deletions empty (else the write is refused when made)
        if change.new_mode == GITLINK:
            plan.gitlinks.append((change.path, change.new_oid or ""))
            continue
        if change.old_mode == GITLINK:
            plan.refused.append((change.path, "a submodule on the host"))
            continue
        pattern = protected_by(change.path, protected)
        if pattern is not None:
            plan.refused.append((change.path, f"a protected path ({pattern})"))
            continue
        if change.path in folded:
            plan.refused.append((change.path, f"its name folds onto {folded[change.path]!r}"))
            continue
        if now is not None and now[0] in ("blocked", "collides"):
            plan.refused.append((change.path, now[1]))
            continue
        if now == change.new:
            continue  # the host already has it
        if now != change.old:
            plan.conflicts.append((change.path, change.new_oid))
            continue
        if change.new is None:
            plan.deletes.append(change.path)
        else:
            assert change.new_mode is not None and change.new_oid is not None
            plan.writes.append(Write(change.path, change.new_mode, change.new_oid))
    plan.deletes.sort(key=lambda p: (-p.count("/"), p))
    return plan


__all__ = ["Change", "HostEntry", "Plan", "Write", "build_plan", "check_changes", "parse_diff_tree"]
