"""A task's host-side store work: the pass after each command, and a new worktree's
``node_modules`` placed, at prepare, from the tree an earlier task of the project installed.

Why place: inside a sandbox pnpm cannot link from its store (another mount: EXDEV; and
``fs.protected_hardlinks`` forbids linking the blobs, which is the point of them), so every
install copies every file, about 0.5 CPU-s for tests/data/workload-project, and the host's
pass then swaps the copies for links. When a task installs, the pass also records the *tree*
(:func:`record_tree`): for every package folder of the virtual store
(``.pnpm/DEP/node_modules/NAME``), the blob of each of its files. The next task of the
project whose ``pnpm-lock.yaml`` holds the same bytes, on the same runtime and image
(:func:`tree_key`), gets those folders made by the host before its first command
(:func:`place_tree`): folders of the worktree's owner, files as links to the blobs (what the
pass would have made of pnpm's copies), bin targets as copies of their own (pnpm ``chmod``-s
them). pnpm 9 then imports no package whose folder already holds a ``package.json`` (its
importers skip it: ``@pnpm/fs.indexed-pkg-importer``), and links, shims and builds the rest
as usual. ``package.json`` is placed last in each folder, so a folder left half made (a blob
pruned, the disk full) is one pnpm imports over.

Not placed: packages built or patched after import (pnpm builds them again, and a build
writes into its folder), packages with a file the pass could not make a blob (too large,
unreadable), and the whole tree with ``cacheMode: isolated`` (a tree is what one task left,
so placing it in another is sharing; the pnpm store is per task there for the same reason).
With ``cacheMode: shared`` the tree is exactly as trusted as the project's shared pnpm store,
which any task can already write (docs/security.md, "the poisoning model").

Nothing here trusts the worktree: placement makes ``node_modules`` itself (it must not exist),
walks only folders it made, by directory fd, with ``O_NOFOLLOW``; the lockfile is read
through ``O_NOFOLLOW`` and bounded; a tree file is checked name by name before use.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fusion_oci.store.blobs import (
    MAX_BLOB,
    STORE_UID,
    STORES_GLOB,
    LinkSupport,
    link_support,
    locked,
    prune,
)
from fusion_oci.store.files import clone_own_file, read_file, write_own_file
from fusion_oci.store.linking import LinkStats, PassTree, TreeFile, linking_pass
from fusion_oci.store.namespace import NS_OWNER, StoreNamespace, caller_namespace, run_in_namespace
from fusion_oci.store.pnpm_layout import package_root

TREES = "trees"
"""The folder of a blob store that holds its trees (``KEY.json``)."""
TREE_VERSION = 1
LOCKFILE = "pnpm-lock.yaml"
MAX_LOCKFILE = 64 << 20
MAX_TREE = 256 << 20
"""Most bytes of a tree file read (tests/data/workload-project's: about 200 KB)."""
NO_TREE = "no tree of this lockfile, runtime and image yet"
_BLOB = re.compile(r"[0-9a-f]{2}/[0-9a-f]{126}(-exec)?")


def tree_key(worktree: Path, context: str) -> str | None:
    """The tree a worktree's install can be placed from: its lockfile's bytes and the
    runtime and image (``context``) it installs under; None without a lockfile."""
    try:
        fd = os.open(worktree / LOCKFILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_LOCKFILE:
            return None
        digest = hashlib.sha256(b"fusion-oci tree 1\0" + context.encode() + b"\0")
        left = st.st_size
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            digest.update(chunk)
            left -= len(chunk)
        return digest.hexdigest()
    finally:
        os.close(fd)


def _tree_path(root: Path, key: str) -> Path:
    return root / TREES / f"{key}.json"


def tree_size(root: Path, key: str) -> int:
    """How many packages the kept tree ``key`` holds (0: none kept)."""
    tree = load_tree(root, key)
    return 0 if tree is None else len(tree)


def record_tree(root: Path, key: str, tree: PassTree) -> int:
    """Keep what a pass saw as the tree ``key``, unless the kept one holds as many packages
    (a pass over a worktree whose packages it cannot all name sees fewer); returns how many
    packages it holds (0: not kept)."""
    packages = {
        package: files
        for package, files in tree.files.items()
        if package not in tree.unplaceable and "package.json" in files
    }
    if not packages or tree_size(root, key) >= len(packages):
        return 0
    body = {
        "version": TREE_VERSION,
        "packages": {
            package: {
                rel: [f.blob, f.copy] if f.copy else f.blob for rel, f in sorted(files.items())
            }
            for package, files in sorted(packages.items())
        },
    }
    folder = root / TREES
    folder.mkdir(mode=0o700, exist_ok=True)
    tmp = folder / f".tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", closefd=False) as fh:
            json.dump(body, fh, separators=(",", ":"))
        tmp.replace(_tree_path(root, key))  # whole or not at all, for a reader
    finally:
        os.close(fd)
        tmp.unlink(missing_ok=True)
    return len(packages)


def _safe_parts(path: object) -> list[str] | None:
    if not isinstance(path, str) or not path or len(path) > 4096:
        return None
    parts = path.split("/")
    if any(p in ("", ".", "..") or "\0" in p for p in parts):
        return None
    return parts


def load_tree(root: Path, key: str) -> dict[str, dict[str, TreeFile]] | None:
    """The tree ``key``, each name checked (a package folder where pnpm puts one, relative
    file names, blob names of the store's shape), or None when there is none or it is not one
    this version wrote."""
    try:
        fd = os.open(_tree_path(root, key), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size > MAX_TREE:
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = json.loads(fh.read())
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("version") != TREE_VERSION:
        return None
    raw = data.get("packages")
    if not isinstance(raw, dict):
        return None
    out: dict[str, dict[str, TreeFile]] = {}
    for package, files in raw.items():
        parts = _safe_parts(package)
        if parts is None or package_root(parts) != len(parts) or not isinstance(files, dict):
            return None
        entry: dict[str, TreeFile] = {}
        for rel, value in files.items():
            blob, copy = (value, False) if isinstance(value, str) else (None, False)
            if isinstance(value, list) and len(value) == 2 and value[1] is True:
                blob, copy = value[0], True
            if _safe_parts(rel) is None or not isinstance(blob, str) or not _BLOB.fullmatch(blob):
                return None
            entry[rel] = TreeFile(blob, copy)
        out[package] = entry
    return out


@dataclass
class PlaceStats:
    """What placing a tree did, or why it did not (``reason``)."""

    packages: int = 0
    files: int = 0
    copies: int = 0
    incomplete: int = 0
    """Packages left without their package.json (a blob gone): pnpm imports them."""
    seconds: float = 0.0
    reason: str = ""

    def audit(self) -> dict[str, Any]:
        if self.reason:
            return {"placed": 0, "reason": self.reason}
        out: dict[str, Any] = {
            "placed": self.packages,
            "files": self.files,
            "seconds": round(self.seconds, 3),
        }
        if self.incomplete:
            out["incomplete"] = self.incomplete
        return out


class _Folders:
    """Folders below a ``node_modules`` placement made, by fd: made when missing (owned by the
    worktree's owner), opened with ``O_NOFOLLOW``; all closed at the end of a package."""

    def __init__(self, nm_fd: int, owner: os.stat_result) -> None:
        self.nm_fd = nm_fd
        self.owner = owner
        self.fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        if not path:
            return self.nm_fd
        if (known := self.fds.get(path)) is not None:
            return known
        parent, _, name = path.rpartition("/")
        parent_fd = self.fd(parent)
        try:
            os.mkdir(name, 0o755, dir_fd=parent_fd)
            made = True
        except FileExistsError:
            made = False
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
        if made:
            os.fchown(fd, self.owner.st_uid, self.owner.st_gid)
        self.fds[path] = fd
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _copy_blob(root: Path, blob: str, dir_fd: int, name: str, owner: os.stat_result) -> None:
    """A file of the owner's holding the blob's bytes (a bin target: pnpm ``chmod``-s it):
    a clone of the blob where the filesystem clones, else a copy."""
    folder, _, blob_name = blob.partition("/")
    if clone_own_file(dir_fd, name, root / folder / blob_name, owner, blob.endswith("-exec")):
        return
    blob_fd = os.open(root / folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        data, _ = read_file(blob_fd, blob_name, MAX_BLOB)
    finally:
        os.close(blob_fd)
    if data is None:
        raise FileNotFoundError(f"blob {blob}")
    write_own_file(dir_fd, name, data, owner, blob.endswith("-exec"))


def _place_package(
    folders: _Folders,
    root: Path,
    package: str,
    files: Mapping[str, TreeFile],
    stats: PlaceStats,
    known: dict[str, str],
) -> None:
    order = sorted(files, key=lambda rel: (rel == "package.json", rel))
    linked: dict[str, str] = {}
    made = copies = 0
    try:
        for rel in order:
            file = files[rel]
            folder, _, name = f"{package}/{rel}".rpartition("/")
            dir_fd = folders.fd(folder)
            if file.copy:
                _copy_blob(root, file.blob, dir_fd, name, folders.owner)
                copies += 1
            else:
                os.link(root / file.blob, name, dst_dir_fd=dir_fd, follow_symlinks=False)
                linked[f"{package}/{rel}"] = file.blob
            made += 1
    except OSError:
        stats.incomplete += 1  # without its package.json: pnpm imports it over what is here
        return
    finally:
        folders.close()
    stats.packages += 1
    stats.files += made
    stats.copies += copies
    known.update(linked)


def place_tree(worktree: Path, root: Path, key: str) -> tuple[PlaceStats, dict[str, str]]:
    """Make the worktree's ``node_modules`` from the tree ``key`` (see the module
    docstring); returns what it did and the blob of each file it linked (path below
    ``node_modules`` -> ``SUB/NAME``: what :func:`linking_pass` is told it knows)."""
    start = time.monotonic()
    known: dict[str, str] = {}
    tree = load_tree(root, key)
    if tree is None:
        return PlaceStats(reason=NO_TREE), known
    stats = PlaceStats()
    wt_fd = os.open(worktree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        owner = os.fstat(wt_fd)
        try:
            os.mkdir("node_modules", 0o755, dir_fd=wt_fd)
        except FileExistsError:
            return PlaceStats(reason="node_modules exists"), known
        nm_fd = os.open("node_modules", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=wt_fd)
        try:
            os.fchown(nm_fd, owner.st_uid, owner.st_gid)
            folders = _Folders(nm_fd, owner)
            with locked(root, fcntl.LOCK_SH):  # no prune between a blob's check and its link
                for package, files in sorted(tree.items()):
                    _place_package(folders, root, package, files, stats, known)
        finally:
            os.close(nm_fd)
    finally:
        os.close(wt_fd)
    stats.seconds = time.monotonic() - start
    return stats, known


def copied_blobs(root: Path) -> frozenset[str]:
    """The blobs the store's trees place as copies: no worktree links them (its copy is its
    own file), so only this keeps them from the prune."""
    folder = root / TREES
    if not folder.is_dir() or folder.is_symlink():
        return frozenset()
    out: set[str] = set()
    for path in folder.glob("*.json"):
        for files in (load_tree(root, path.stem) or {}).values():
            out.update(f.blob for f in files.values() if f.copy)
    return frozenset(out)


def prune_trees(root: Path, *, dry_run: bool = False) -> int:
    """Remove the trees of a store that name a blob it no longer holds (run after its blobs
    were pruned: placement would leave those packages to pnpm anyway), and the temporary
    files of a tree write that died; returns how many trees went."""
    folder = root / TREES
    gone = 0
    if not folder.is_dir() or folder.is_symlink():
        return 0
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".tmp-"):
            if not dry_run:
                path.unlink(missing_ok=True)
            continue
        tree = load_tree(root, path.name.removesuffix(".json"))
        whole = tree is not None and all(
            (root / f.blob).exists() for files in tree.values() for f in files.values()
        )
        if not whole:
            gone += 1
            if not dry_run:
                path.unlink(missing_ok=True)
    return gone


def prune_stores(
    cache_root: Path, *, dry_run: bool = False
) -> tuple[list[str], list[str], list[str]]:
    """``fusion-oci gc``'s part: prune every project's blob store under ``cache_root`` (the
    sandboxes'). Returns gc's (removed, kept, errors): a line per store that had blobs to
    remove, that a pass was using, or that could not be read."""
    removed: list[str] = []
    kept: list[str] = []
    errors: list[str] = []
    for root in sorted(cache_root.glob(STORES_GLOB)):
        try:
            done = prune(root, dry_run=dry_run, keep=copied_blobs(root))
            if not done.busy:
                done.trees = prune_trees(root, dry_run=dry_run)
        except OSError as exc:
            errors.append(f"blob store {root}: not pruned ({exc.strerror})")
            continue
        if done.busy:
            kept.append(f"blob store {root} (a pass is linking into it now)")
        if done.trees:
            removed.append(f"blob store {root}: {done.trees} trees of packages no worktree holds")
        if not done.busy and done.removed:
            removed.append(
                f"blob store {root}: {done.removed} blobs no worktree links "
                f"({done.freed_bytes / 1e6:.1f} MB)"
            )
    return removed, kept, errors


def _pass(
    worktree: Path,
    root: Path,
    key: str | None,
    known: Mapping[str, str],
    stats: LinkStats,
    owner: int,
) -> None:
    """One pass over the worktree (recording its tree as ``key``, when given), into
    ``stats``; a failure is in ``stats.stopped``."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Held from the pass's first blob to the tree naming them: a blob only a tree
        # will hold (a bin target's bytes) must not meet a prune before it is named.
        with locked(root, fcntl.LOCK_SH):
            _, tree = linking_pass(
                worktree, root, stats, record=key is not None, known=known, owner=owner
            )
            if key is not None and tree is not None:
                stats.recorded = record_tree(root, key, tree)
    except OSError as exc:
        # The store's disk full, a folder the task made unreadable: what was linked stays
        # linked, the rest the task's own copies, and the audit says why.
        stats.stopped = f"host pass failed: {exc}"


def namespace_job(job: dict[str, Any]) -> dict[str, Any]:
    """A job of fusion_oci/store/namespace.py, run in the store namespace (blobs are
    :data:`~fusion_oci.store.namespace.NS_OWNER`'s there): ``pass`` or ``place``."""
    worktree, root, key = Path(job["worktree"]), Path(job["root"]), job["key"]
    if job["op"] == "place":
        try:
            placed, known = place_tree(worktree, root, key)
        except OSError as exc:
            placed, known = PlaceStats(reason=f"not placed: {exc}"), {}
        return {"stats": asdict(placed), "known": known}
    stats = LinkStats(ran=True)
    _pass(worktree, root, key, job["known"], stats, NS_OWNER)
    return {"stats": asdict(stats)}


class StoreLinker:
    """One task's host-side store work: placement at prepare (:meth:`place`) and a pass
    after each command that changed its install (:meth:`after_command`).

    A pass runs only when pnpm rewrote ``node_modules/.modules.yaml`` (every install does), so
    a command that installs nothing costs one ``stat``. ``context`` is the runtime and image
    a tree is kept for, or None where trees are not shared (``cacheMode: isolated``).
    ``namespace``: fusion-oci runs unprivileged, and both run in that store namespace
    (fusion_oci/store/namespace.py); None: as root, here.
    """

    def __init__(
        self,
        worktree: Path,
        root: Path,
        context: str | None = None,
        namespace: StoreNamespace | None = None,
    ) -> None:
        self.worktree = worktree
        self.root = root
        self.context = context
        self.namespace = namespace
        self._seen: tuple[int, int] | None = None
        self.last = LinkStats()
        self.known: dict[str, str] = {}
        self.placed = PlaceStats(reason="not placed yet")

    def _marker(self) -> tuple[int, int] | None:
        try:
            st = os.lstat(self.worktree / "node_modules" / ".modules.yaml")
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino

    @property
    def owner(self) -> int:
        """The blobs' uid as the host sees it."""
        return STORE_UID if self.namespace is None else self.namespace.subuid

    def _job(self, op: str, key: str | None) -> dict[str, Any]:
        assert self.namespace is not None
        job = {"op": op, "worktree": str(self.worktree), "root": str(self.root), "key": key}
        return run_in_namespace(self.namespace, job | {"known": self.known})

    def _key(self) -> str | None:
        return None if self.context is None else tree_key(self.worktree, self.context)

    def wants_placement(self) -> bool:
        """Whether a placement could do anything now: trees are shared and the worktree has
        no ``node_modules`` (one ``lstat``; the command that follows is likely an install)."""
        return self.context is not None and not os.path.lexists(self.worktree / "node_modules")

    def place(self) -> PlaceStats:
        """Place the worktree's packages from the project's tree of its lockfile, if any."""
        self.placed = self._place()
        return self.placed

    def _place(self) -> PlaceStats:
        if self.context is None:
            return PlaceStats(reason="cacheMode isolated: no tree of another task is placed")
        key = self._key()
        if key is None:
            return PlaceStats(reason=f"no {LOCKFILE}")
        if not _tree_path(self.root, key).is_file():
            # Said here, not by a job: before a first install every command would otherwise
            # start the store namespace's process (rootless) only to learn there is no tree.
            return PlaceStats(reason=NO_TREE)
        try:
            if self.namespace is not None:
                answer = self._job("place", key)
                self.known = answer["known"]
                return PlaceStats(**answer["stats"])
            stats, self.known = place_tree(self.worktree, self.root, key)
        except OSError as exc:
            return PlaceStats(reason=f"not placed: {exc}")
        return stats

    def after_command(self) -> LinkStats:
        marker = self._marker()
        if marker is None or marker == self._seen:
            self.last = LinkStats()
            return self.last
        start = time.monotonic()
        self.last = LinkStats(ran=True)
        key = self._key()
        if self.namespace is None:
            _pass(self.worktree, self.root, key, self.known, self.last, STORE_UID)
        else:
            try:
                self.last = LinkStats(**self._job("pass", key)["stats"])
            except OSError as exc:
                self.last.stopped = f"host pass failed: {exc}"
        self.last.seconds = time.monotonic() - start
        self._seen = marker
        return self.last


def task_linker(
    *,
    blobs: str | None,
    host_uid: int,
    isolating: bool,
    worktree: Path,
    tree_context: str | None = None,
    namespace: Callable[[int], tuple[StoreNamespace | None, str]] = caller_namespace,
) -> tuple[StoreLinker | None, LinkSupport]:
    """The linker of a task (its layout's blob store), or None with the reason;
    ``tree_context`` as :class:`StoreLinker`'s ``context``; ``namespace`` finds an
    unprivileged caller's store namespace (fusion_oci/store/namespace.py)."""
    if blobs is None:
        return None, LinkSupport(False, "cacheMode off: no caches, no shared blobs")
    ns, why = (None, "") if host_uid == 0 or not isolating else namespace(host_uid)
    support = link_support(
        host_uid=host_uid,
        isolating=isolating,
        worktree=worktree,
        blobs=Path(blobs),
        no_namespace=why,
    )
    if not support.ok:
        return None, support
    return StoreLinker(worktree, Path(blobs), tree_context, ns), support
