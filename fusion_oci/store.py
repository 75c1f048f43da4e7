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
command (``fusion_oci.store_tree.StoreLinker.after_command``) the host walks the worktree's
``node_modules/.pnpm`` (pnpm's virtual store, which pnpm never edits in place) and, for every
regular file that is not a blob yet, hashes the bytes it reads, writes those bytes as the blob
of that hash if it is new (a copy: the task's inode never enters the store), and replaces the
file with a link to the blob. Files pnpm changes after import stay the task's own (bin targets,
which every install that links bins ``chmod``-s, and the ``node_modules/.bin`` shims it
rewrites: fusion_oci/pnpm_layout.py; one an older pass linked becomes a copy again), or the
next ``pnpm add`` fails with EPERM. A task can add blobs, but only under the hash of their own
bytes: it cannot change what any name in the store holds, nor any byte of a file another task got
from it. What it can do is stated in docs/security.md ("the poisoning model").

Bounds: one pass looks at most at :data:`MAX_PASS_ENTRIES` directory entries, hashes at most
:data:`MAX_PASS_BYTES` and descends at most :data:`MAX_DEPTH` directories: a task that fills
``node_modules/.pnpm`` with millions of files (or one deep chain) costs the host a bounded walk,
then the pass stops, leaves the rest as the task's own copies, and says so
(:meth:`LinkStats.audit`, in the ``sandbox:run`` event's ``details.store_links``).

Pruning (:func:`prune`, from ``fusion-oci gc``): a blob whose link count is 1 is held by no
worktree any more and goes. Every pass holds the store's lock shared (``flock``) from its first
blob to its last link, and the prune takes it exclusively without waiting (a busy store is
left for the next gc): a blob a pass has just written, or found and is about to link, has a
link count of 1 only while that pass holds the lock, so the prune never sees it.

Nothing here trusts paths in the worktree: the walk holds directory fds (``os.fwalk``, which
follows no symlink), files are opened with ``O_NOFOLLOW|O_NONBLOCK`` and checked with
``fstat``, and the swap is ``link`` to a temporary name then an exchange of the two names
(:func:`_swap`), all relative to the directory fd.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusion_oci.pnpm_layout import (
    MAX_MANIFEST,
    PATCHED,
    PackageFacts,
    is_shim_folder,
    package_facts,
    package_root,
)

STORE_UID = 65534
"""Owner of every blob (the overflow uid, ``nobody``): a uid no task runs as, so a task holds
no owner rights (chmod) over what it shares."""
MAX_BLOB = 64 * 1024 * 1024
"""Files larger than this are left as they are (read whole into memory to hash and copy)."""
VIRTUAL_STORE = ("node_modules", ".pnpm")
MAX_PASS_ENTRIES = 250_000
"""Most directory entries (files and folders) one pass looks at. pnpm's virtual store holds one
entry per package file plus its folders: 1,330 for tests/data/workload-project (vitest, tsc,
esbuild), so this leaves room for a project two hundred times that. Past it the pass stops: a
walk the task can make as long as it likes must not be the host's."""
MAX_PASS_BYTES = 4 << 30
"""Most bytes one pass reads and hashes (4 GiB; tests/data/workload-project: 57 MB). Files
already blobs cost a ``stat``, not a read, and do not count."""
MAX_DEPTH = 48
"""Deepest folder (below ``node_modules/.pnpm``) the walk enters: pnpm's own layout is 3-4
deep (``NAME@VER/node_modules/@SCOPE/NAME``), tests/data/workload-project 7 in all; each
level holds a directory fd while the walk is below it."""
STAGING = "_tmp_"
"""In a folder name: pnpm's staging folder of a package being imported (never walked)."""
LOCK = ".lock"
"""The store's lock file (``flock``: shared by passes, exclusive for a prune)."""
FICLONE = 0x40049409
"""``ioctl(2)`` FICLONE: a new file shares another's blocks, copy on write (XFS with reflink,
btrfs). The task's own copies of blobs (bin targets) are clones where the filesystem has them,
so they cost no blocks; ext4 has none, and there an own copy is a copy."""
_NO_CLONE: set[int] = set()
"""Filesystems (``st_dev``) that answered a clone with "not supported": not asked again."""


@dataclass(frozen=True)
class LinkSupport:
    """Whether host-side links can be shared safely for a task, and why not."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class TreeFile:
    """What one package file of a worktree is in the blob store: the blob (``SUB/NAME``)
    it is a link to, or, with ``copy``, the blob of its bytes (a file pnpm changes after
    import, which stays the task's own: placed as a copy)."""

    blob: str
    copy: bool = False


@dataclass
class LinkStats:
    """What one pass did: files replaced by a link, blobs added, bytes those blobs hold."""

    linked: int = 0
    adopted: int = 0
    adopted_bytes: int = 0
    skipped: int = 0
    unlinked: int = 0
    """Files an older pass linked that pnpm changes (bin targets, shims): the task's own
    copies again."""
    cloned: int = 0
    """Own copies (bin targets) made clones of their blob: they share its blocks
    (:data:`FICLONE`)."""
    recorded: int = 0
    """Packages of the tree this pass kept for the next task on the same lockfile
    (fusion_oci/store_tree.py), 0 when it kept none."""
    seconds: float = 0.0
    entries: int = 0
    """Directory entries the walk looked at (bounded by :data:`MAX_PASS_ENTRIES`)."""
    hashed_bytes: int = 0
    """Bytes read and hashed (bounded by :data:`MAX_PASS_BYTES`)."""
    too_deep: int = 0
    """Folders below :data:`MAX_DEPTH` that were not entered."""
    stopped: str = ""
    """Why the pass stopped before the end of the walk (a bound reached), or ''."""
    ran: bool = False
    """Whether a pass ran at all (False: no install since the last one)."""

    def audit(self) -> dict[str, Any] | None:
        """What the audit event says of this pass, or None when no pass ran."""
        if not self.ran:
            return None
        out: dict[str, Any] = {
            "linked": self.linked,
            "adopted": self.adopted,
            "adopted_bytes": self.adopted_bytes,
            "seconds": round(self.seconds, 3),
        }
        if self.unlinked:
            out["unlinked"] = self.unlinked
        if self.recorded:
            out["recorded"] = self.recorded
        if self.cloned:
            out["cloned"] = self.cloned
        if self.too_deep:
            out["too_deep"] = self.too_deep
        if self.stopped:
            out["stopped"] = self.stopped
        return out


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
    caller in its store namespace: fusion_oci/store_ns.py; ``no_namespace`` says why it has
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


def _blob_name(digest: str, executable: bool) -> tuple[str, str]:
    return digest[:2], digest[2:] + ("-exec" if executable else "")


def _write_blob(
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


def _read_single(dir_fd: int, name: str, most: int, owner: int) -> tuple[bytes, bool] | None:
    """The bytes and exec bit of ``name`` if it is a plain file that is not a blob yet.

    A file with other links is taken too: where the store and the worktree share a mount
    (landlock), pnpm links the task-writable pnpm store's inode itself, which is exactly the
    sharing a task could rewrite for others; the blob link replaces it."""
    data, executable = read_file(
        dir_fd,
        name,
        most,  # the bytes reserved for it (it grew since: left as is)
        lambda st: st.st_uid != owner and not st.st_mode & (stat.S_ISUID | stat.S_ISGID),
    )
    return None if data is None else (data, executable)


@dataclass
class PassTree:
    """What a recording pass saw of each package folder (see :func:`dedup`)."""

    files: dict[str, dict[str, TreeFile]] = field(default_factory=dict)
    """Package folder (relative to ``node_modules``) -> its files (relative to it)."""
    unplaceable: set[str] = field(default_factory=set)
    """Package folders with a file that is no blob, or built or patched after import."""


def dedup(
    worktree: Path, root: Path, stats: LinkStats | None = None, *, owner: int = STORE_UID
) -> LinkStats:
    """Replace every file of the worktree's pnpm virtual store by a link to the
    blob of its bytes (adopting the blob first when new), counting into ``stats``. See the
    module docstring."""
    return linking_pass(worktree, root, stats, owner=owner)[0]


def linking_pass(
    worktree: Path,
    root: Path,
    stats: LinkStats | None = None,
    *,
    record: bool = False,
    known: Mapping[str, str] | None = None,
    owner: int = STORE_UID,
) -> tuple[LinkStats, PassTree | None]:
    """:func:`dedup`, and with ``record`` also what each package file became (the tree
    :mod:`fusion_oci.store_tree` keeps; None when the pass stopped early); ``known`` names
    the blobs of files already linked (path below ``node_modules`` -> ``SUB/NAME``), each
    checked by inode before it is believed; ``owner`` is the blobs' uid as this process
    sees it (:data:`STORE_UID`, or 1 in a store namespace: fusion_oci/store_ns.py)."""
    stats = stats if stats is not None else LinkStats()
    try:
        # node_modules is the task's: a symlink there must not lead the walk off the worktree.
        nm_fd = os.open(worktree / VIRTUAL_STORE[0], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return stats, None
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with locked(root, fcntl.LOCK_SH) as held:
            assert held  # a shared request waits: it always gets the lock
            run = _walk(nm_fd, root, stats, record, known or {}, owner)
    finally:
        os.close(nm_fd)
    stats.ran = True
    if not record or stats.stopped:
        return stats, None
    return stats, PassTree(run.files, run.unplaceable)


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


@dataclass(frozen=True)
class _Folder:
    """One folder of the virtual store as the walk found it: what its files are to pnpm."""

    path: str
    """Relative to ``node_modules`` (``.pnpm/DEP/node_modules/NAME/lib``)."""
    package: str | None = None
    """The package folder it is in (relative to ``node_modules``), or None."""
    inside: str = ""
    """Its path relative to that package folder ('' for the package folder itself)."""
    facts: PackageFacts | None = None
    shims: bool = False
    """A ``node_modules/.bin`` folder: every file stays the task's own."""

    def rel(self, name: str) -> str:
        return f"{self.inside}/{name}" if self.inside else name

    def kept(self, name: str) -> bool:
        """A file pnpm changes after import (see fusion_oci/pnpm_layout.py): never linked."""
        return self.shims or (self.facts is not None and self.facts.is_bin(self.rel(name)))


class _Pass:
    """One pass's shared state: its counters (under a lock: folders are linked by several
    threads), its byte budget and its stop flag, and, when the pass records the tree, what
    each package file became (:attr:`files`) and which packages cannot be placed from it."""

    def __init__(
        self, root: Path, stats: LinkStats, record: bool, known: Mapping[str, str], owner: int
    ) -> None:
        self.root = root
        self.owner = owner
        self.stats = stats
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.record = record
        self.known = known
        self.files: dict[str, dict[str, TreeFile]] = {}
        self.unplaceable: set[str] = set()
        self.inodes: dict[int, str] | None = None

    def count(self, **add: int) -> None:
        with self.lock:
            for key, value in add.items():
                setattr(self.stats, key, getattr(self.stats, key) + value)

    def note(self, folder: _Folder, name: str, file: TreeFile | None) -> None:
        """What a package file became, for the tree (None: the package is not placeable)."""
        if not self.record or folder.package is None or folder.shims:
            return
        with self.lock:
            if file is None:
                self.unplaceable.add(folder.package)
            else:
                self.files.setdefault(folder.package, {})[folder.rel(name)] = file

    def reserve(self, size: int) -> bool:
        """Take ``size`` bytes of the pass's hashing budget; False (and the pass stops) when
        they are not left."""
        with self.lock:
            if self.stats.hashed_bytes + size > MAX_PASS_BYTES:
                self.stats.stopped = (
                    f"more than {MAX_PASS_BYTES >> 20} MiB to hash under "
                    "node_modules/.pnpm: the rest stays the task's own "
                    "copies"
                )
                self.stop.set()
                return False
            self.stats.hashed_bytes += size
            return True

    def folder(self, dir_fd: int, folder: _Folder, names: list[str]) -> None:
        """Link every file of one folder (``dir_fd`` is this call's own: it closes it)."""
        try:
            for name in names:
                if self.stop.is_set():
                    return
                if folder.kept(name):
                    self.count(**self._keep(dir_fd, folder, name))
                else:
                    self.count(**self._one(dir_fd, folder, name))
        except BaseException:
            self.stop.set()  # the other folders stop too; the walk re-raises this
            raise
        finally:
            os.close(dir_fd)

    def _known_blob(self, folder: _Folder, name: str, st: os.stat_result) -> TreeFile | None:
        """The blob a file that is one already is: named by ``known`` (what placement linked)
        and checked by inode, else found by inode in the store (an index of it made once per
        pass, when first needed); None when it is no blob of this store."""
        blob = self.known.get(f"{folder.path}/{name}")
        if blob is not None:
            with contextlib.suppress(OSError):
                if (self.root / blob).lstat().st_ino == st.st_ino:
                    return TreeFile(blob)
        with self.lock:
            if self.inodes is None:
                self.inodes = _inode_index(self.root)
            found = self.inodes.get(st.st_ino)
        return TreeFile(found) if found is not None else None

    def _one(self, dir_fd: int, folder: _Folder, name: str) -> dict[str, int]:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return {}
        if not stat.S_ISREG(st.st_mode):
            return {"skipped": 1}  # a symlink, a socket: no open at all
        if st.st_uid == self.owner:
            if self.record:
                self.note(folder, name, self._known_blob(folder, name, st))
            return {"skipped": 1}  # a blob already
        if st.st_size > MAX_BLOB:
            self.note(folder, name, None)
            return {"skipped": 1}
        if not self.reserve(st.st_size):
            return {}
        read = _read_single(dir_fd, name, st.st_size, self.owner)
        if read is None:
            self.note(folder, name, None)
            return {"skipped": 1}
        data, executable = read
        sub, blob = _blob_name(hashlib.sha512(data).hexdigest(), executable)
        added = {}
        if _write_blob(self.root, sub, blob, data, executable, self.owner):
            added = {"adopted": 1, "adopted_bytes": len(data)}
        tmp = f".fusion-link-{secrets.token_hex(6)}"
        try:
            os.link(self.root / sub / blob, tmp, dst_dir_fd=dir_fd)
        except OSError:
            self.note(folder, name, None)
            return {**added, "skipped": 1}
        try:
            _swap(dir_fd, tmp, name)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            self.note(folder, name, None)
            return {**added, "skipped": 1}
        self.note(folder, name, TreeFile(f"{sub}/{blob}"))
        return {**added, "linked": 1}

    def _keep(self, dir_fd: int, folder: _Folder, name: str) -> dict[str, int]:
        """A file pnpm changes after import: it stays (or, linked by an older pass, becomes
        again) the task's own file; for the tree its bytes are a blob, placed as a copy."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return {}
        if not stat.S_ISREG(st.st_mode):
            return {"skipped": 1}
        wanted = self.record and not folder.shims
        if st.st_uid != self.owner and not wanted:
            return {"skipped": 1}
        if st.st_size > MAX_BLOB or not self.reserve(st.st_size):
            self.note(folder, name, None)
            return {"skipped": 1}
        data, executable = read_file(dir_fd, name, st.st_size)
        if data is None:
            self.note(folder, name, None)
            return {"skipped": 1}
        out = {"skipped": 1}
        sub, blob = _blob_name(hashlib.sha512(data).hexdigest(), executable)
        if wanted and _write_blob(self.root, sub, blob, data, executable, self.owner):
            out |= {"adopted": 1, "adopted_bytes": len(data)}
        source = self.root / sub / blob
        try:
            if st.st_uid == self.owner:
                # A link an older pass made: the task's own file again (a clone where the
                # filesystem clones).
                if _own_copy(dir_fd, name, data, executable, source):
                    out["cloned"] = 1
                out = {k: v for k, v in out.items() if k != "skipped"} | {"unlinked": 1}
            elif (
                wanted
                and st.st_nlink == 1
                and clones(st.st_dev)
                and _own_copy(dir_fd, name, None, executable, source)
            ):
                # pnpm's copy became a clone of its blob, where the filesystem clones (same
                # bytes, same owner: the task may chmod it, and a write copies what it changes).
                out["cloned"] = 1
        except OSError:
            self.note(folder, name, None)
            return {"skipped": 1}
        if wanted:
            self.note(folder, name, TreeFile(f"{sub}/{blob}", copy=True))
        return out


def _inode_index(root: Path) -> dict[int, str]:
    """Every blob of the store by inode (``SUB/NAME``)."""
    out: dict[int, str] = {}
    for folder in _blob_dirs(root):
        with os.scandir(folder.path) as blobs:
            for blob in blobs:
                if not blob.name.startswith("."):
                    with contextlib.suppress(OSError):
                        out[blob.inode()] = f"{folder.name}/{blob.name}"
    return out


def read_file(
    dir_fd: int,
    name: str,
    most: int,
    accept: Callable[[os.stat_result], bool] = lambda st: True,
) -> tuple[bytes | None, bool]:
    """The bytes and exec bit of a plain file (no symlink followed) that ``accept``-s its
    ``fstat`` and holds at most ``most`` bytes; (None, False) otherwise. No further than the
    size ``fstat`` gave: a process the task left running may still be appending (a blob holds
    exactly the bytes hashed, whatever the file holds after)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None, False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > most or not accept(st):
            return None, False
        chunks, left = [], st.st_size
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), bool(st.st_mode & 0o111)
    finally:
        os.close(fd)


def _new_own_file(
    dir_fd: int, name: str, fill: Callable[[int], None], owner: os.stat_result, executable: bool
) -> None:
    """Create ``name`` (it must not exist), ``fill`` its fd, own it as ``owner``'s uid and gid
    (the folder's: a file the task may ``chmod``), mode 0755 or 0644; on any failure the
    name is removed again (no half-made file stays)."""
    fd = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )
    try:
        fill(fd)
        os.fchown(fd, owner.st_uid, owner.st_gid)
        os.fchmod(fd, 0o755 if executable else 0o644)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)


def write_own_file(
    dir_fd: int, name: str, data: bytes, owner: os.stat_result, executable: bool
) -> None:
    """Create ``name`` (it must not exist) holding ``data``, owned by ``owner``'s uid and gid
    (the folder's: a file the task may ``chmod``), mode 0755 or 0644."""

    def write(fd: int) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    _new_own_file(dir_fd, name, write, owner, executable)


def clones(dev: int) -> bool:
    """Whether files on the filesystem ``dev`` may still be cloned (none refused yet)."""
    return dev not in _NO_CLONE


def clone_own_file(
    dir_fd: int, name: str, source: Path, owner: os.stat_result, executable: bool
) -> bool:
    """Create ``name`` (it must not exist) as a clone of the blob ``source`` (:data:`FICLONE`),
    owned and moded as :func:`write_own_file` makes it; False, with nothing created, where the
    filesystem cannot clone (the caller writes the bytes instead)."""
    if not clones(owner.st_dev):
        return False
    try:
        src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # pruned meanwhile: the caller writes the bytes it holds
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            return False

        def clone(fd: int) -> None:
            fcntl.ioctl(fd, FICLONE, src)

        _new_own_file(dir_fd, name, clone, owner, executable)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.ENOSYS):
            _NO_CLONE.add(owner.st_dev)
            return False
        if exc.errno in (errno.EXDEV, errno.EINVAL):
            return False  # another filesystem, or a file this one cannot clone
        raise
    finally:
        os.close(src)
    return True


def _own_copy(
    dir_fd: int, name: str, data: bytes | None, executable: bool, blob: Path | None = None
) -> bool:
    """Put a file of the folder's owner holding ``data`` in the place of ``name``: a clone of
    ``blob`` (which holds ``data``) where the filesystem clones. True when it is one; with
    ``data`` None, nothing changes where it cannot clone."""
    tmp = f".fusion-copy-{secrets.token_hex(6)}"
    owner = os.fstat(dir_fd)
    cloned = blob is not None and clone_own_file(dir_fd, tmp, blob, owner, executable)
    if not cloned:
        if data is None:
            return False
        write_own_file(dir_fd, tmp, data, owner, executable)
    try:
        _swap(dir_fd, tmp, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    return cloned


def _folder_of(
    dirpath: str, files: list[str], dir_fd: int, packages: dict[str, PackageFacts]
) -> _Folder:
    """What a folder of the walk is to pnpm (reads a package folder's manifest once: the walk
    is top-down, so a package's folder comes before its subfolders)."""
    parts = dirpath.split("/")  # fwalk's relative path: not a Path
    shims = is_shim_folder(parts)
    depth = package_root(parts)
    if not depth:
        return _Folder(dirpath, shims=shims)
    package = "/".join(parts[:depth])
    inside = "/".join(parts[depth:])
    facts = packages.get(package)
    if facts is None:
        manifest = None
        if "package.json" in files:
            manifest, _ = read_file(dir_fd, "package.json", MAX_MANIFEST)
        facts = package_facts(manifest, files) if not inside else PackageFacts(readable=False)
        packages[package] = facts
    return _Folder(dirpath, package, inside, facts, shims)


def _walk(
    nm_fd: int,
    root: Path,
    stats: LinkStats,
    record: bool,
    known: Mapping[str, str],
    owner: int,
) -> _Pass:
    """Walk the virtual store in this thread (the bounds on entries and depth are counted
    here), and link each folder's files in a pool of :data:`PASS_WORKERS` threads."""
    run = _Pass(root, stats, record, known, owner)
    packages: dict[str, PackageFacts] = {}
    slots = threading.BoundedSemaphore(PASS_WORKERS * 4)  # folders (dup'd fds) in flight
    with ThreadPoolExecutor(PASS_WORKERS, thread_name_prefix="fusion-store") as pool:
        pending: list[Future[None]] = []
        try:
            for dirpath, dirs, files, dir_fd in os.fwalk(
                VIRTUAL_STORE[1], dir_fd=nm_fd, follow_symlinks=False
            ):
                if run.stop.is_set():
                    break
                with run.lock:
                    stats.entries += len(dirs) + len(files)
                    if stats.entries > MAX_PASS_ENTRIES:
                        stats.stopped = (
                            f"more than {MAX_PASS_ENTRIES} entries under "
                            "node_modules/.pnpm: the rest stays the task's own "
                            "copies"
                        )
                        break
                folder = _folder_of(dirpath, files, dir_fd, packages)
                if folder.package is not None and (
                    PATCHED in folder.package
                    or folder.facts is None
                    or folder.facts.builds
                    or not folder.facts.readable
                ):
                    run.note(folder, "", None)  # built or patched after import: not placed
                if dirpath.count(os.sep) >= MAX_DEPTH and dirs:
                    run.count(too_deep=len(dirs))
                    if folder.package is not None:
                        run.note(folder, "", None)
                    dirs.clear()  # topdown: fwalk enters only what is left in the list
                # pnpm imports a package into NAME_tmp_PID (then renames it into place): files
                # there may be half-written by a command still running, and a blob of half a
                # file swapped in would be what the package holds once renamed.
                dirs[:] = [d for d in dirs if STAGING not in d]
                if dirpath == VIRTUAL_STORE[1]:
                    # pnpm's own metadata (lock.yaml): rewritten by every install through
                    # write-file-atomic, which chowns its temporary file to the old owner.
                    run.count(skipped=len(files))
                    continue
                if not files:
                    continue
                slots.acquire()
                try:
                    job = pool.submit(run.folder, os.dup(dir_fd), folder, files)
                except BaseException:
                    slots.release()
                    raise
                job.add_done_callback(lambda _job: slots.release())
                pending.append(job)
        finally:
            for job in pending:
                job.result()  # a folder's OSError ends the pass (after every folder ended)
    return run


PASS_WORKERS = 4
"""Threads of one pass. The per-file work is system calls (open, read, link, exchange,
unlink) and hashing, which all run without the GIL; most of a pass's time is waiting on the
filesystem's journal, which several threads overlap (tests/data/workload-project's warm pass,
962 files: 1.37 s in one thread, 0.39 s in four, the same CPU)."""


RENAME_EXCHANGE = 2
"""renameat2(2)'s flag: swap two names atomically."""
_LIBC = ctypes.CDLL(None, use_errno=True)
_RENAMEAT2 = getattr(_LIBC, "renameat2", None)
if _RENAMEAT2 is not None:
    _RENAMEAT2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    _RENAMEAT2.restype = ctypes.c_int


def _swap(dir_fd: int, tmp: str, name: str) -> None:
    """Put the link ``tmp`` in the place of ``name`` (both in ``dir_fd``), atomically: the
    name always holds the task's file or the blob.

    Exchanged, then the old file unlinked, rather than renamed over: ext4 (``auto_da_alloc``)
    treats a rename over an existing file as "replace a file by a new version" and starts
    writing the new one's data out at once, so a rename-over makes every pass write out, in
    the command's time, the blobs the previous pass added (50 MB for one install: 13,000
    pages per 1,000 files, measured; an exchange writes none)."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(dir_fd, os.fsencode(tmp), dir_fd, os.fsencode(name), RENAME_EXCHANGE) == 0:
            # ``tmp`` now names the task's copy; a folder the task put there meanwhile stays.
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), name)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # no exchange on this fs


# ---------------------------------------------------------------------------- pruning

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
    """Trees removed after the blobs (fusion_oci/store_tree.py: ``prune_trees``)."""


def _blob_dirs(root: Path) -> Iterator[os.DirEntry[str]]:
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
    those in ``keep`` (``SUB/NAME``: what a kept tree copies, fusion_oci/store_tree.py), and
    the temporary files of a pass that died mid-write. A store a pass is using is left alone
    (see the module docstring): the lock is not waited for."""
    stats = PruneStats()
    if not root.is_dir() or root.is_symlink():
        return stats
    with locked(root, fcntl.LOCK_EX | fcntl.LOCK_NB) as held:
        if not held:
            stats.busy = True
            return stats
        for folder in _blob_dirs(root):
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
