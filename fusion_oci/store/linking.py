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
command (:meth:`fusion_oci.store.tree.StoreLinker.after_command`) the host walks the worktree's
``node_modules/.pnpm`` (pnpm's virtual store, which pnpm never edits in place) and, for every
regular file that is not a blob yet, hashes the bytes it reads, writes those bytes as the blob
of that hash if it is new (a copy: the task's inode never enters the store), and replaces the
file with a link to the blob. Files pnpm changes after import stay the task's own (bin targets,
which every install that links bins ``chmod``-s, and the ``node_modules/.bin`` shims it
rewrites: fusion_oci/store/pnpm_layout.py; one an older pass linked becomes a copy again), or the
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
(:func:`swap`), all relative to the directory fd.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import stat
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusion_oci.store.blobs import (
    MAX_BLOB,
    STORE_UID,
    blob_name,
    inode_index,
    locked,
    write_blob,
)
from fusion_oci.store.files import clones, own_copy, read_file, swap
from fusion_oci.store.pnpm_layout import (
    MAX_MANIFEST,
    PATCHED,
    PackageFacts,
    is_shim_folder,
    package_facts,
    package_root,
)

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
    (fusion_oci/store/tree.py), 0 when it kept none."""
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
    :mod:`fusion_oci.store.tree` keeps; None when the pass stopped early); ``known`` names
    the blobs of files already linked (path below ``node_modules`` -> ``SUB/NAME``), each
    checked by inode before it is believed; ``owner`` is the blobs' uid as this process
    sees it (:data:`STORE_UID`, or 1 in a store namespace: fusion_oci/store/namespace.py)."""
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
        """A file pnpm changes after import (see fusion_oci/store/pnpm_layout.py): never linked."""
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
                self.inodes = inode_index(self.root)
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
        sub, blob = blob_name(hashlib.sha512(data).hexdigest(), executable)
        added = {}
        if write_blob(self.root, sub, blob, data, executable, self.owner):
            added = {"adopted": 1, "adopted_bytes": len(data)}
        tmp = f".fusion-link-{secrets.token_hex(6)}"
        try:
            os.link(self.root / sub / blob, tmp, dst_dir_fd=dir_fd)
        except OSError:
            self.note(folder, name, None)
            return {**added, "skipped": 1}
        try:
            swap(dir_fd, tmp, name)
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
        sub, blob = blob_name(hashlib.sha512(data).hexdigest(), executable)
        if wanted and write_blob(self.root, sub, blob, data, executable, self.owner):
            out |= {"adopted": 1, "adopted_bytes": len(data)}
        source = self.root / sub / blob
        try:
            if st.st_uid == self.owner:
                # A link an older pass made: the task's own file again (a clone where the
                # filesystem clones).
                if own_copy(dir_fd, name, data, executable, source):
                    out["cloned"] = 1
                out = {k: v for k, v in out.items() if k != "skipped"} | {"unlinked": 1}
            elif (
                wanted
                and st.st_nlink == 1
                and clones(st.st_dev)
                and own_copy(dir_fd, name, None, executable, source)
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
