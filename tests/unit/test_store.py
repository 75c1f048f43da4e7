"""fusion_oci/store/linking.py on a temporary directory: blobs, links, and what the walk refuses."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from fusion_oci.store.blobs import STORE_UID, link_support
from fusion_oci.store.linking import dedup
from fusion_oci.store.tree import StoreLinker, task_linker

PKG = Path("node_modules/.pnpm/pkg@1.0.0/node_modules/pkg")

# Blobs are chowned to STORE_UID: these tests run as root, as the suite does (CI too).


def install(wt: Path, files: dict[str, bytes], exec_names: tuple[str, ...] = ()) -> None:
    for name, data in files.items():
        path = wt / PKG / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if name in exec_names:
            path.chmod(0o755)
    (wt / "node_modules" / ".modules.yaml").write_text("layoutVersion: 5\n")


def test_files_become_links_to_read_only_blobs_named_by_their_hash(tmp_path: Path) -> None:
    a, b, blobs = tmp_path / "a", tmp_path / "b", tmp_path / "blobs"
    files = {"index.js": b"module.exports = 1\n", "bin.js": b"#!/usr/bin/env node\n"}
    install(a, files, ("bin.js",))
    install(b, files, ("bin.js",))
    first = dedup(a, blobs)
    assert (first.linked, first.adopted) == (2, 2)
    second = dedup(b, blobs)
    assert (second.linked, second.adopted) == (2, 0)
    for name, data in files.items():
        fa, fb = a / PKG / name, b / PKG / name
        assert fa.stat().st_ino == fb.stat().st_ino and fa.read_bytes() == data
        assert fa.stat().st_uid == STORE_UID and fa.stat().st_mode & 0o222 == 0
        digest = hashlib.sha512(data).hexdigest()
        suffix = "-exec" if name == "bin.js" else ""
        assert (blobs / digest[:2] / f"{digest[2:]}{suffix}").samefile(fa)
    assert (a / PKG / "bin.js").stat().st_mode & 0o111
    assert dedup(a, blobs).linked == 0  # blobs already: nothing to do


def test_pnpms_own_metadata_stays_the_tasks(tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    install(wt, {"index.js": b"x"})
    lock = wt / "node_modules" / ".pnpm" / "lock.yaml"
    lock.write_text("lockfileVersion: '9.0'\n")
    dedup(wt, tmp_path / "blobs")
    assert lock.stat().st_uid == os.getuid() and lock.stat().st_nlink == 1


def test_a_blob_is_never_replaced_by_other_bytes(tmp_path: Path) -> None:
    a, blobs = tmp_path / "a", tmp_path / "blobs"
    install(a, {"index.js": b"good"})
    dedup(a, blobs)
    digest = hashlib.sha512(b"good").hexdigest()
    blob = blobs / digest[:2] / digest[2:]
    # A task that replaces its file (it may: the directory is its own) changes only its view.
    (a / PKG / "index.js").unlink()
    (a / PKG / "index.js").write_bytes(b"evil")
    dedup(a, blobs)
    assert blob.read_bytes() == b"good"
    assert (a / PKG / "index.js").read_bytes() == b"evil"


def test_the_walk_follows_no_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / ".pnpm").mkdir(parents=True)
    secret = outside / ".pnpm" / "secret"
    secret.write_text("host file")
    wt, blobs = tmp_path / "wt", tmp_path / "blobs"
    wt.mkdir()
    (wt / "node_modules").symlink_to(outside)
    assert dedup(wt, blobs).linked == 0 and secret.stat().st_nlink == 1
    (wt / "node_modules").unlink()
    (wt / "node_modules" / ".pnpm").mkdir(parents=True)
    (wt / "node_modules" / ".pnpm" / "out").symlink_to(outside / ".pnpm")
    (wt / "node_modules" / ".pnpm" / "file").symlink_to(secret)
    assert dedup(wt, blobs).linked == 0 and secret.stat().st_nlink == 1
    assert (wt / "node_modules" / ".pnpm" / "file").is_symlink()


def test_a_pass_runs_only_when_an_install_rewrote_modules_yaml(tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    install(wt, {"index.js": b"x"})
    linker = StoreLinker(wt, tmp_path / "blobs")
    assert linker.after_command().linked == 1
    install(wt, {"other.js": b"y"})  # rewrites .modules.yaml (a new inode, a new mtime)
    assert linker.after_command().linked == 1
    (wt / PKG / "late.js").write_bytes(b"z")
    assert linker.after_command().linked == 0  # no install since: not walked


def test_where_links_are_not_shared_the_reason_is_given(tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    wt.mkdir()
    kw = {"worktree": wt, "blobs": tmp_path / "blobs"}
    assert "isolates nothing" in link_support(host_uid=0, isolating=False, **kw).reason
    assert "unprivileged" in link_support(host_uid=1000, isolating=True, **kw).reason
    linker, why = task_linker(blobs=None, host_uid=0, isolating=True, worktree=wt)
    assert linker is None and "cacheMode off" in why.reason
    linker, why = task_linker(
        blobs=str(tmp_path / "blobs"), host_uid=0, isolating=True, worktree=wt
    )
    assert linker is not None and why.ok
