"""Keep-and-restore for paths a runtime cannot make read-only (landlock's carve-outs).

Landlock cannot take write access away beneath a writable directory, so the read-only paths
the bundle lays over the worktree (a linked worktree's ``.git`` file, ``.fusion/``,
``.vscode/``...) stay writable during the command. What the host trusts there is read *after*
the command, so the runtime copies them before each command and puts them back after it,
before the result is returned: a rewritten ``.git`` pointer, settings file or audit log never
reaches the host's next git call or settings load. What the snapshot cannot hold (a file over
``MAX_FILE``, more than ``MAX_TOTAL`` in all) is reported, never silently skipped.
"""

# String paths and the os calls that never follow a final symlink (lstat, readlink, unlink,
# O_NOFOLLOW): the command may have planted links anywhere in these trees.
# ruff: noqa: PTH101, PTH102, PTH108, PTH112, PTH114, PTH115, PTH118, PTH208, PTH211
from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

MAX_FILE = 4 << 20
MAX_TOTAL = 32 << 20
MAX_ENTRIES = 5000


@dataclass
class Snapshot:
    """Regular files, directories and symlinks under some roots, as they were."""

    roots: list[str]
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    dirs: dict[str, int] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    too_big: list[str] = field(default_factory=list)
    """Paths not held (over a limit): they cannot be restored."""
    holes: list[str] = field(default_factory=list)
    """Writable paths inside the roots: neither held nor removed."""


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def take(roots: list[str], holes: Sequence[str] = ()) -> Snapshot:
    """Hold ``roots`` as they are now, except what lies in ``holes`` (writable on purpose)."""
    snap = Snapshot(list(roots), holes=list(holes))
    total = 0
    for root in roots:
        todo = [root]
        while todo:
            path = todo.pop()
            if _inside(path, snap.holes):
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if len(snap.files) + len(snap.dirs) + len(snap.links) >= MAX_ENTRIES:
                snap.too_big.append(path)
                continue
            if stat.S_ISLNK(st.st_mode):
                snap.links[path] = os.readlink(path)
            elif stat.S_ISDIR(st.st_mode):
                snap.dirs[path] = stat.S_IMODE(st.st_mode)
                todo += [os.path.join(path, name) for name in sorted(os.listdir(path))]
            elif stat.S_ISREG(st.st_mode):
                if st.st_size > MAX_FILE or total + st.st_size > MAX_TOTAL:
                    snap.too_big.append(path)
                    continue
                snap.files[path] = (Path(path).read_bytes(), stat.S_IMODE(st.st_mode))
                total += st.st_size
    return snap


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def _same_file(path: str, data: bytes, mode: int) -> bool:
    try:
        st = os.lstat(path)
        return (
            stat.S_ISREG(st.st_mode)
            and stat.S_IMODE(st.st_mode) == mode
            and st.st_size == len(data)
            and Path(path).read_bytes() == data
        )
    except OSError:
        return False


def restore(snap: Snapshot) -> list[str]:
    """Put every held path back as it was, remove what appeared beside them; the changed paths.

    Paths too big to hold are left as the command left them (and were reported as such).
    """
    changed: list[str] = []
    kept = set(snap.too_big) | set(snap.holes)
    for path, mode in sorted(snap.dirs.items()):  # parents first
        try:
            st = os.lstat(path)
            ok = stat.S_ISDIR(st.st_mode)
        except FileNotFoundError:
            ok = False
        if not ok:
            _remove(path)
            os.mkdir(path, mode)
            changed.append(path)
        elif stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)
            changed.append(path)
        for name in os.listdir(path):
            child = os.path.join(path, name)
            if (
                child not in snap.files
                and child not in snap.dirs
                and child not in snap.links
                and child not in kept
            ):
                _remove(child)
                changed.append(child)
    for path, target in snap.links.items():
        if not (os.path.islink(path) and os.readlink(path) == target):
            _remove(path)
            os.symlink(target, path)
            changed.append(path)
    for path, (data, mode) in snap.files.items():
        if not _same_file(path, data, mode):
            _remove(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            try:
                os.write(fd, data)
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            changed.append(path)
    for root in snap.roots:  # a root that was absent must stay absent
        if (
            root not in snap.files
            and root not in snap.dirs
            and root not in snap.links
            and root not in kept
            and (os.path.lexists(root))
        ):
            _remove(root)
            changed.append(root)
    return changed
