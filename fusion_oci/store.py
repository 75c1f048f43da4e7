"""Hard links between a verified package store and a task's ``node_modules``, made on the host.

Why on the host: ``link(2)`` works only within one mount (the sandbox's pnpm store and its
worktree are separate mounts: EXDEV), and with ``fs.protected_hardlinks=1`` a process may link
only a file it owns or can read *and write*. So any file a task can link itself is a file it
can change for every other task sharing the inode. The links are therefore made here, by the
host, to inodes no task can write: blobs owned by :data:`STORE_UID` with mode 0444 (0555 when
executable), while every isolating runtime runs the task as the caller without
``CAP_FOWNER``/``CAP_DAC_OVERRIDE``/``CAP_CHOWN``.

The blob store (one per project: ``TaskLayout.blobs``) is content-addressed like pnpm's own
CAFS: a blob's name is the SHA-512 of its bytes (``-exec`` appended when executable). After a
command (:meth:`StoreLinker.after_command`) the host walks the worktree's
``node_modules/.pnpm`` (pnpm's virtual store, which pnpm never edits in place) and, for every
regular file that is not a blob yet, hashes the bytes it reads, writes those bytes as the blob
of that hash if it is new (a copy: the task's inode never enters the store), and replaces the
file with a link to the blob. A task can add blobs, but only under the hash of their own bytes:
it cannot change what any name in the store holds, nor any byte of a file another task got from
it. What it can do is stated in docs/security.md ("the poisoning model").

Nothing here trusts paths in the worktree: the walk holds directory fds (``os.fwalk``, which
follows no symlink), files are opened with ``O_NOFOLLOW|O_NONBLOCK`` and checked with
``fstat``, and the swap is ``link`` to a temporary name then ``rename``, both relative to the
directory fd.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

STORE_UID = 65534
"""Owner of every blob (the overflow uid, ``nobody``): a uid no task runs as, so a task holds
no owner rights (chmod) over what it shares."""
MAX_BLOB = 64 * 1024 * 1024
"""Files larger than this are left as they are (read whole into memory to hash and copy)."""
VIRTUAL_STORE = ("node_modules", ".pnpm")


@dataclass(frozen=True)
class LinkSupport:
    """Whether host-side links can be shared safely for a task, and why not."""

    ok: bool
    reason: str = ""


@dataclass
class LinkStats:
    """What one pass did: files replaced by a link, blobs added, bytes those blobs hold."""

    linked: int = 0
    adopted: int = 0
    adopted_bytes: int = 0
    skipped: int = 0
    seconds: float = 0.0


def link_support(*, host_uid: int, isolating: bool, worktree: Path,
                 blobs: Path) -> LinkSupport:
    """Can a task's node_modules share the host's blobs without write access to them?

    Needs a host process that can give the blobs another owner (root), a runtime that runs the
    command without capabilities (every isolating one), and the store on the worktree's
    filesystem (a hard link cannot cross filesystems).
    """
    if not isolating:
        return LinkSupport(False, "the runtime isolates nothing: the command could write "
                                  "every blob (no shared links)")
    if host_uid != 0:
        return LinkSupport(False, "fusion-oci runs unprivileged: the blobs would be the "
                                  "task's own uid's, which it could chmod and rewrite, so each "
                                  "task keeps its own copies")
    root = blobs
    try:
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)
        same = root.stat().st_dev == worktree.stat().st_dev
    except OSError as exc:
        return LinkSupport(False, f"blob store {root} unusable: {exc.strerror}")
    if not same:
        return LinkSupport(False, f"blob store {root} is on another filesystem than the "
                                  "worktree (hard links cannot cross filesystems)")
    return LinkSupport(True)


def _blob_name(digest: str, executable: bool) -> tuple[str, str]:
    return digest[:2], digest[2:] + ("-exec" if executable else "")


def _write_blob(root: Path, sub: str, name: str, data: bytes, executable: bool) -> bool:
    """Write ``data`` as a blob unless it exists; True when this call added it."""
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
        os.fchown(fd, STORE_UID, STORE_UID)
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


def _read_single(dir_fd: int, name: str) -> tuple[bytes, bool] | None:
    """The bytes and exec bit of ``name`` if it is a plain file that is not a blob yet.

    A file with other links is taken too: where the store and the worktree share a mount
    (landlock), pnpm links the task-writable pnpm store's inode itself, which is exactly the
    sharing a task could rewrite for others; the blob link replaces it."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid == STORE_UID
                or st.st_mode & (stat.S_ISUID | stat.S_ISGID) or st.st_size > MAX_BLOB):
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks), bool(st.st_mode & 0o111)
    finally:
        os.close(fd)


def dedup(worktree: Path, root: Path) -> LinkStats:
    """Replace every file of the worktree's pnpm virtual store by a link to the
    blob of its bytes (adopting the blob first when new). See the module docstring."""
    stats = LinkStats()
    try:
        # node_modules is the task's: a symlink there must not lead the walk off the worktree.
        nm_fd = os.open(worktree / VIRTUAL_STORE[0],
                        os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return stats
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        _walk(nm_fd, root, stats)
    finally:
        os.close(nm_fd)
    return stats


def _walk(nm_fd: int, root: Path, stats: LinkStats) -> None:
    for dirpath, _dirs, files, dir_fd in os.fwalk(VIRTUAL_STORE[1], dir_fd=nm_fd,
                                                  follow_symlinks=False):
        if dirpath == VIRTUAL_STORE[1]:
            # pnpm's own metadata (lock.yaml): rewritten by every install through
            # write-file-atomic, which chowns its temporary file to the old file's owner.
            stats.skipped += len(files)
            continue
        for name in files:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == STORE_UID or not stat.S_ISREG(st.st_mode):
                stats.skipped += 1  # a blob already, a symlink, a socket: no open at all
                continue
            read = _read_single(dir_fd, name)
            if read is None:
                stats.skipped += 1
                continue
            data, executable = read
            sub, blob = _blob_name(hashlib.sha512(data).hexdigest(), executable)
            if _write_blob(root, sub, blob, data, executable):
                stats.adopted += 1
                stats.adopted_bytes += len(data)
            tmp = f".fusion-link-{secrets.token_hex(6)}"
            try:
                os.link(root / sub / blob, tmp, dst_dir_fd=dir_fd)
            except OSError:
                stats.skipped += 1
                continue
            try:
                os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                stats.skipped += 1
                continue
            stats.linked += 1


class StoreLinker:
    """One task's host-side linking: a pass after each command that changed its install.

    A pass runs only when pnpm rewrote ``node_modules/.modules.yaml`` (every install does), so
    a command that installs nothing costs one ``stat``.
    """

    def __init__(self, worktree: Path, root: Path) -> None:
        self.worktree = worktree
        self.root = root
        self._seen: tuple[int, int] | None = None
        self.last = LinkStats()

    def _marker(self) -> tuple[int, int] | None:
        try:
            st = os.lstat(self.worktree / "node_modules" / ".modules.yaml")
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino

    def after_command(self) -> LinkStats:
        marker = self._marker()
        if marker is None or marker == self._seen:
            self.last = LinkStats()
            return self.last
        start = time.monotonic()
        self.last = dedup(self.worktree, self.root)
        self.last.seconds = time.monotonic() - start
        self._seen = marker
        return self.last


def task_linker(*, blobs: str | None, host_uid: int, isolating: bool,
                worktree: Path) -> tuple[StoreLinker | None, LinkSupport]:
    """The linker of a task (its layout's blob store), or None with the reason."""
    if blobs is None:
        return None, LinkSupport(False, "cacheMode off: no caches, no shared blobs")
    support = link_support(host_uid=host_uid, isolating=isolating, worktree=worktree,
                           blobs=Path(blobs))
    if not support.ok:
        return None, support
    return StoreLinker(worktree, Path(blobs)), support
