"""The project's blob store: content-addressed files no task can write, and what may use it.

A blob's name is the SHA-512 of its bytes (``-exec`` appended when executable), under a folder
of its first two hex digits, like pnpm's own CAFS. A blob is owned by :data:`STORE_UID` with
mode 0444 (0555 when executable) and, once named, holds its bytes for good (:func:`write_blob`
never replaces). Passes (:mod:`.linking`) hold the store's lock shared from their first blob to
their last link; :func:`prune` (``fusion-oci gc``) takes it exclusively without waiting, and
removes the blobs no worktree links any more (link count 1).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

STORE_UID = 65534
"""Owner of every blob (the overflow uid, ``nobody``): a uid no task runs as, so a task holds
no owner rights (chmod) over what it shares."""
MAX_BLOB = 64 * 1024 * 1024
"""Files larger than this are left as they are (read whole into memory to hash and copy)."""
LOCK = ".lock"
"""The store's lock file (``flock``: shared by passes, exclusive for a prune)."""


@dataclass(frozen=True)
class LinkSupport:
    """Whether host-side links can be shared safely for a task, and why not."""

    ok: bool
    reason: str = ""


def link_support(
    *,
    host_uid: int,
    isolating: bool,
    worktree: Path,
    blobs: Path,
    no_namespace: str = "it has no subordinate uid range",
) -> LinkSupport:
    """Can a task's node_modules share the host's blobs without write access to them?

    Needs a host process that can give the blobs another owner (root, or an unprivileged
    caller in its store namespace: fusion_oci/store/namespace.py; ``no_namespace`` says why it has
    none, '' when it has one), a runtime that runs the command without capabilities (every
    isolating one), and the store on the worktree's filesystem (a hard link cannot cross
    filesystems).
    """
    if not isolating:
        return LinkSupport(
            False,
            "the runtime isolates nothing: the command could write every blob (no shared links)",
        )
    if host_uid != 0 and no_namespace:
        return LinkSupport(
            False,
            f"fusion-oci runs unprivileged and {no_namespace}: the blobs would be the "
            "task's own uid's, which it could chmod and rewrite, so each "
            "task keeps its own copies",
        )
    root = blobs
    try:
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)
        same = root.stat().st_dev == worktree.stat().st_dev
    except OSError as exc:
        return LinkSupport(False, f"blob store {root} unusable: {exc.strerror}")
    if not same:
        return LinkSupport(
            False,
            f"blob store {root} is on another filesystem than the "
            "worktree (hard links cannot cross filesystems)",
        )
    return LinkSupport(True)


def blob_name(digest: str, executable: bool) -> tuple[str, str]:
    return digest[:2], digest[2:] + ("-exec" if executable else "")


def write_blob(
    root: Path, sub: str, name: str, data: bytes, executable: bool, owner: int = STORE_UID
) -> bool:
    """Write ``data`` as a blob of ``owner`` unless it exists; True when this call added it."""
    folder = root / sub
    target = folder / name
    if target.exists():
        return False
    folder.mkdir(mode=0o700, exist_ok=True)
    tmp = folder / f".tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
    try:
        with os.fdopen(fd, "wb", closefd=False) as fh:
            fh.write(data)
        os.fchown(fd, owner, owner)
        os.fchmod(fd, 0o555 if executable else 0o444)
    finally:
        os.close(fd)
    try:
        os.link(tmp, target)  # never replaces: a blob, once named, holds its bytes for good
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    return True


@contextlib.contextmanager
def locked(root: Path, how: int) -> Iterator[bool]:
    """Hold the store's lock (``how``: LOCK_SH waits, LOCK_EX|LOCK_NB does not); yields
    whether it is held."""
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, how)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the only fd of this open file releases the flock


def inode_index(root: Path) -> dict[int, str]:
    """Every blob of the store by inode (``SUB/NAME``)."""
    out: dict[int, str] = {}
    for folder in blob_dirs(root):
        with os.scandir(folder.path) as blobs:
            for blob in blobs:
                if not blob.name.startswith("."):
                    with contextlib.suppress(OSError):
                        out[blob.inode()] = f"{folder.name}/{blob.name}"
    return out


STORES_GLOB = "projects/*/store-blobs"
"""Where the blob stores are under a cache root (policy/layout.py: ``TaskLayout.blobs``)."""


@dataclass
class PruneStats:
    """What one prune of one store did (or, dry, would do)."""

    removed: int = 0
    freed_bytes: int = 0
    kept: int = 0
    busy: bool = False
    """A pass held the lock: nothing was looked at (the next gc will)."""
    trees: int = 0
    """Trees removed after the blobs (fusion_oci/store/tree.py: ``prune_trees``)."""


def blob_dirs(root: Path) -> Iterator[os.DirEntry[str]]:
    """The two-hex-digit folders of a store (never a symlink: the store is the host's, but a
    folder that is not ours is not walked into)."""
    with os.scandir(root) as entries:
        for entry in entries:
            if (
                len(entry.name) == 2
                and all(c in "0123456789abcdef" for c in entry.name)
                and entry.is_dir(follow_symlinks=False)
            ):
                yield entry


def prune(root: Path, *, dry_run: bool = False, keep: frozenset[str] = frozenset()) -> PruneStats:
    """Remove the blobs of one store that no worktree links any more (link count 1), but
    those in ``keep`` (``SUB/NAME``: what a kept tree copies, fusion_oci/store/tree.py), and
    the temporary files of a pass that died mid-write. A store a pass is using is left alone
    (see the module docstring): the lock is not waited for."""
    stats = PruneStats()
    if not root.is_dir() or root.is_symlink():
        return stats
    with locked(root, fcntl.LOCK_EX | fcntl.LOCK_NB) as held:
        if not held:
            stats.busy = True
            return stats
        for folder in blob_dirs(root):
            with os.scandir(folder.path) as blobs:
                for blob in blobs:
                    try:
                        st = blob.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    # A temporary name: a pass writes one only while it holds the lock, so
                    # one seen now is a dead pass's.
                    orphan_tmp = blob.name.startswith(".tmp-")
                    if not orphan_tmp and (
                        st.st_nlink > 1
                        or not stat.S_ISREG(st.st_mode)
                        or f"{folder.name}/{blob.name}" in keep
                    ):
                        stats.kept += 1
                        continue
                    stats.removed += 1
                    stats.freed_bytes += st.st_size
                    if not dry_run:
                        Path(blob.path).unlink(missing_ok=True)
            if not dry_run:
                with contextlib.suppress(OSError):
                    Path(folder.path).rmdir()  # only when it emptied: rmdir refuses otherwise
    return stats
