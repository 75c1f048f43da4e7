"""The task's own copies of blobs (bin targets) share the blob's blocks where the filesystem
clones (fusion_oci/store/files.py: ``FICLONE``), on a real XFS made for the test.

A bin target must be the task's own file (every install that links bins ``chmod``-s it), so on
ext4 each task holds a full copy: esbuild's is its 9.5 MB native binary. On XFS (reflink) and
btrfs that copy is a clone: the task may chmod it and write it (copy on write: the blob and the
other tasks' clones keep their bytes), and it adds no data blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.disk_usage import extent_kib
from fusion_oci.store import files as store_files
from fusion_oci.store.blobs import STORE_UID
from fusion_oci.store.linking import linking_pass
from fusion_oci.store.tree import load_tree, place_tree, record_tree, tree_key
from tests.unit.test_store_tree import CLI, CONTEXT, pnpm_install

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="mounts a loop device (Linux, root: the suite runs as root)",
)

BIG = 8 << 20
"""The bin target's size: big enough that a copy shows in the free blocks."""


@pytest.fixture
def xfs(tmp_path: Path) -> Iterator[Path]:
    """A fresh XFS with reflink on a loop device, unmounted (and the device freed) after."""
    image, mount = tmp_path / "xfs.img", tmp_path / "xfs"
    with image.open("wb") as fh:
        fh.truncate(512 << 20)
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], check=True)
    mount.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def free_bytes(path: Path) -> int:
    os.sync()
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


def big_bin_target(wt: Path) -> bytes:
    data = os.urandom(BIG)
    (wt / CLI / "bin/cli.js").write_bytes(data)
    return data


def test_bin_targets_are_clones_of_their_blob_on_xfs(xfs: Path) -> None:
    a, b, root = xfs / "a", xfs / "b", xfs / "blobs"
    pnpm_install(a)
    data = big_bin_target(a)
    key = tree_key(a, CONTEXT)
    assert key is not None

    stats, tree = linking_pass(a, root, record=True)
    assert stats.cloned == 1, stats  # pnpm's copy became a clone of the blob it adopted
    assert tree is not None and record_tree(root, key, tree) >= 1
    target = a / CLI / "bin/cli.js"
    st = target.stat()
    assert (st.st_uid, st.st_nlink) == (os.getuid(), 1)  # still the task's own file
    assert target.read_bytes() == data

    # The next task on the lockfile: its bin target is placed as a clone, so the placement
    # adds directories and links, not the 8 MiB.
    b.mkdir()
    before = free_bytes(xfs)
    placed, _ = place_tree(b, root, key)
    added = before - free_bytes(xfs)
    assert placed.packages >= 1 and placed.copies == 1, placed
    assert added < BIG // 4, f"placing added {added} bytes: the bin target was copied"
    # What the benchmark counts (benchmarks/disk_usage.py): du counts the clone again in full,
    # the extent count does not; on ext4 the two agree.
    du = subprocess.run(
        ["du", "-sk", str(root), str(a / "node_modules"), str(b / "node_modules")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert int(du[-2]) >= BIG // 1024
    assert extent_kib(root, a / "node_modules", b / "node_modules")[-1] < BIG // 4096

    # Still a file the task may chmod and rewrite, without touching the blob or task a.
    mine = b / CLI / "bin/cli.js"
    assert mine.stat().st_uid == os.getuid() and mine.read_bytes() == data
    mine.chmod(0o700)
    with mine.open("r+b") as fh:
        fh.write(b"poison")
    tree_file = load_tree(root, key)
    assert tree_file is not None
    blob = root / tree_file[str(CLI.relative_to("node_modules"))]["bin/cli.js"].blob
    assert blob.stat().st_uid == STORE_UID
    assert blob.read_bytes() == data and target.read_bytes() == data


def test_where_the_filesystem_cannot_clone_the_copy_is_a_copy(tmp_path: Path) -> None:
    """ext4 (this machine's own filesystem) answers FICLONE with EOPNOTSUPP: the pass copies,
    and does not ask that filesystem again."""
    a, root = tmp_path / "a", tmp_path / "blobs"
    pnpm_install(a)
    data = big_bin_target(a)
    fs = subprocess.run(
        ["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout.strip()
    if fs in ("xfs", "btrfs"):
        pytest.fail(f"tmp_path is on {fs}: this case needs a filesystem without reflinks")
    stats, _ = linking_pass(a, root, record=True)
    assert stats.cloned == 0
    assert not store_files.clones(os.stat(a).st_dev)
    du = subprocess.run(["du", "-sk", str(root), str(a)], capture_output=True, text=True)
    assert extent_kib(root, a) == [int(line.split()[0]) for line in du.stdout.splitlines()]
    assert (a / CLI / "bin/cli.js").read_bytes() == data
