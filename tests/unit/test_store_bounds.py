"""fusion_oci/store/linking.py's limits: the blob store's prune (``fusion-oci gc``) against a
concurrent pass, and the bounds of one host pass (entries, bytes, depth), on a temporary
directory. Run as root, as the suite does (blobs are chowned to STORE_UID)."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest

from fusion_oci.gc import gc
from fusion_oci.store import blobs, files, linking
from fusion_oci.store.blobs import STORE_UID, prune
from fusion_oci.store.linking import dedup
from fusion_oci.store.tree import StoreLinker, prune_stores

PKG = Path("node_modules/.pnpm/pkg@1.0.0/node_modules/pkg")


def install(wt: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = wt / PKG / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (wt / "node_modules" / ".modules.yaml").write_text(f"layoutVersion: 5 # {len(files)}\n")


def blobs_in(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*") if not p.name.startswith(".tmp-"))


def test_prune_removes_only_blobs_no_worktree_links(tmp_path: Path) -> None:
    a, b, root = tmp_path / "a", tmp_path / "b", tmp_path / "blobs"
    install(a, {"shared.js": b"shared", "only-a.js": b"a" * 1000})
    install(b, {"shared.js": b"shared"})
    dedup(a, root)
    dedup(b, root)
    assert len(blobs_in(root)) == 2
    assert prune(root).removed == 0  # every blob is linked from a worktree
    (a / PKG / "only-a.js").unlink()  # the task threw its copy away (or its worktree went)
    dry = prune(root, dry_run=True)
    assert (dry.removed, dry.freed_bytes) == (1, 1000) and len(blobs_in(root)) == 2
    done = prune(root)
    assert (done.removed, done.freed_bytes, done.kept) == (1, 1000, 1)
    [left] = blobs_in(root)
    assert left.samefile(b / PKG / "shared.js")
    # Whatever a task still holds keeps its bytes: b's file is untouched by the prune.
    assert (b / PKG / "shared.js").read_bytes() == b"shared"


def test_prune_leaves_a_store_a_pass_holds(tmp_path: Path) -> None:
    a, root = tmp_path / "a", tmp_path / "blobs"
    install(a, {"x.js": b"x"})
    dedup(a, root)
    (a / PKG / "x.js").unlink()
    # A pass in another process holds the lock shared (flock: per open file, so a second
    # open of the lock file here conflicts just as another process's would).
    fd = os.open(root / blobs.LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        busy = prune(root)
        assert busy.busy and busy.removed == 0 and len(blobs_in(root)) == 1
    finally:
        os.close(fd)
    assert prune(root).removed == 1 and blobs_in(root) == []


def test_prune_takes_a_dead_passs_temporary_files(tmp_path: Path) -> None:
    a, root = tmp_path / "a", tmp_path / "blobs"
    install(a, {"x.js": b"x"})
    dedup(a, root)
    tmp = blobs_in(root)[0].parent / ".tmp-0123456789abcdef"
    tmp.write_bytes(b"half a blob")
    assert prune(root).removed == 1 and not tmp.exists() and len(blobs_in(root)) == 1


def test_a_pass_and_a_prune_at_once_lose_no_link(tmp_path: Path) -> None:
    """Every new blob has a link count of 1 between its write and the worktree's link: a prune
    that ran then would take it. With the lock none does, however the two interleave."""
    wt, root = tmp_path / "wt", tmp_path / "blobs"
    install(wt, {f"f{i}.js": f"file {i}\n".encode() * 50 for i in range(400)})
    root.mkdir()
    done = threading.Event()
    pruned = 0

    def pruner() -> None:
        nonlocal pruned
        while not done.is_set():
            pruned += prune(root).removed

    thread = threading.Thread(target=pruner)
    thread.start()
    try:
        stats = dedup(wt, root)
    finally:
        done.set()
        thread.join()
    assert (stats.linked, pruned) == (400, 0)
    for path in (wt / PKG).iterdir():
        st = path.stat()
        assert st.st_uid == STORE_UID and st.st_nlink == 2, path
    # The swap (link to a temporary name, exchange, unlink) leaves no name of its own behind.
    assert not [p for p in (wt / PKG).iterdir() if p.name.startswith(".fusion-link-")]


def test_a_swap_in_a_pool_of_threads_links_every_folder(tmp_path: Path) -> None:
    """Folders are linked by several threads: each gets its own directory fd, and every file
    of every folder ends as the one blob of its bytes."""
    wt, root = tmp_path / "wt", tmp_path / "blobs"
    for n in range(60):
        pkg = wt / "node_modules" / ".pnpm" / f"p{n}@1.0.0" / "node_modules" / f"p{n}"
        pkg.mkdir(parents=True)
        for i in range(5):
            (pkg / f"f{i}.js").write_bytes(f"shared {i}\n".encode())
    stats = dedup(wt, root)
    assert (stats.linked, stats.adopted) == (300, 5)
    assert {p.stat().st_nlink for p in blobs_in(root)} == {61}


def test_gc_prunes_the_stores_of_its_cache_root(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path)}
    root = tmp_path / "xdg" / "fusion-oci" / "projects" / "0123abcd" / "store-blobs"
    wt = tmp_path / "wt"
    install(wt, {"x.js": b"x" * 2_000_000})
    dedup(wt, root)
    cache_root = tmp_path / "xdg" / "fusion-oci"
    assert prune_stores(cache_root) == ([], [], [])  # linked: nothing to say
    (wt / PKG / "x.js").unlink()
    report = gc(env=env, engines=(), dry_run=True)
    assert report.removed == [f"blob store {root}: 1 blobs no worktree links (2.0 MB)"]
    assert len(blobs_in(root)) == 1
    assert prune_stores(cache_root)[0] == report.removed and blobs_in(root) == []
    # A store a pass holds is kept, and said so.
    (wt / PKG / "y.js").write_bytes(b"y")
    dedup(wt, root)
    (wt / PKG / "y.js").unlink()
    fd = os.open(root / blobs.LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        busy = gc(env=env, engines=())
    finally:
        os.close(fd)
    assert busy.kept == [f"blob store {root} (a pass is linking into it now)"]
    assert len(blobs_in(root)) == 1


# ---------------------------------------------------------------------------- bounds


def test_a_pass_stops_at_its_entry_bound_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wt, root = tmp_path / "wt", tmp_path / "blobs"
    install(wt, {f"f{i:03}.js": f"{i}".encode() for i in range(100)})
    monkeypatch.setattr(linking, "MAX_PASS_ENTRIES", 50)
    linker = StoreLinker(wt, root)
    stats = linker.after_command()
    assert stats.stopped.startswith("more than 50 entries") and stats.linked < 50
    audit = stats.audit()
    assert audit is not None and audit["stopped"] == stats.stopped
    assert audit["linked"] == stats.linked
    # What was not reached stays the task's own file, as it was.
    left = [p for p in (wt / PKG).iterdir() if p.stat().st_uid != STORE_UID]
    assert len(left) == 100 - stats.linked
    assert linker.after_command().audit() is None  # no install since: no second walk


def test_a_pass_stops_at_its_byte_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wt, root = tmp_path / "wt", tmp_path / "blobs"
    install(wt, {f"f{i}.js": bytes([i]) * 1000 for i in range(10)})
    monkeypatch.setattr(linking, "MAX_PASS_BYTES", 3500)
    stats = dedup(wt, root)
    assert stats.linked == 3 and stats.hashed_bytes == 3000
    assert "MiB to hash" in stats.stopped


def test_the_walk_does_not_descend_past_its_depth(tmp_path: Path) -> None:
    wt, root = tmp_path / "wt", tmp_path / "blobs"
    install(wt, {"index.js": b"top"})
    deep = wt / "node_modules" / ".pnpm" / "deep"
    for _ in range(linking.MAX_DEPTH + 5):
        deep = deep / "d"
    deep.mkdir(parents=True)
    (deep / "bottom.js").write_bytes(b"bottom")
    stats = dedup(wt, root)
    assert stats.linked == 1 and stats.too_deep == 1 and not stats.stopped
    assert (deep / "bottom.js").stat().st_uid == os.getuid()
    audit = StoreLinker(wt, root).after_command().audit()
    assert audit is not None and audit["too_deep"] == 1


def test_a_file_growing_during_the_pass_is_read_to_its_size(tmp_path: Path) -> None:
    """A process the task left behind may append while the host reads: the read stops at the
    size fstat gave (a FIFO is never opened for reading at all: not a regular file)."""
    wt, root = tmp_path / "wt", tmp_path / "blobs"
    install(wt, {"a.js": b"abc"})
    os.mkfifo(wt / PKG / "pipe")
    stats = dedup(wt, root)
    assert stats.linked == 1 and stats.skipped >= 1


def test_a_failing_pass_is_reported_not_raised(tmp_path: Path) -> None:
    wt, root = tmp_path / "wt", tmp_path / "blobs"
    install(wt, {"a.js": b"abc"})
    root.write_text("not a folder")  # the store's path taken by a file: every write fails
    stats = StoreLinker(wt, root).after_command()
    assert stats.stopped.startswith("host pass failed") and stats.linked == 0
    assert (wt / PKG / "a.js").read_bytes() == b"abc"


def test_the_swap_exchanges_names_and_leaves_none_of_its_own(tmp_path: Path) -> None:
    """The file's name holds the old file or the new link at every moment (an exchange, not
    an unlink then a link), and the old file goes after; a name that vanished meanwhile is an
    error the pass counts as skipped (its temporary link is the caller's to remove)."""
    (tmp_path / "blob").write_bytes(b"blob")
    (tmp_path / "name").write_bytes(b"task's copy")
    os.link(tmp_path / "blob", tmp_path / "tmp")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        files.swap(fd, "tmp", "name")
        assert (tmp_path / "name").samefile(tmp_path / "blob")
        assert not (tmp_path / "tmp").exists()
        os.link(tmp_path / "blob", tmp_path / "tmp")
        with pytest.raises(FileNotFoundError):
            files.swap(fd, "tmp", "gone")
        assert (tmp_path / "tmp").exists() and not (tmp_path / "gone").exists()
    finally:
        os.close(fd)


def test_pnpms_staging_folders_are_not_walked(tmp_path: Path) -> None:
    """A package pnpm is importing (``NAME_tmp_PID``, renamed into place when complete) may be
    half-written by a command still running: its files stay as they are."""
    wt, root = tmp_path / "wt", tmp_path / "blobs"
    install(wt, {"index.js": b"done"})
    stage = wt / "node_modules" / ".pnpm" / "other@1.0.0" / "node_modules" / "other_tmp_4242"
    stage.mkdir(parents=True)
    (stage / "index.js").write_bytes(b"half a fi")
    assert dedup(wt, root).linked == 1
    assert (stage / "index.js").stat().st_uid == os.getuid()
