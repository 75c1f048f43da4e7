"""What pnpm changes after import stays the task's (fusion_oci/store/pnpm_layout.py), and a new
worktree's packages placed from the tree an earlier task's pass kept (fusion_oci/store/tree.py).

These run as root, as the suite does: blobs are chowned to STORE_UID.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fusion_oci.store.blobs import STORE_UID, prune
from fusion_oci.store.linking import dedup, linking_pass
from fusion_oci.store.pnpm_layout import package_facts, package_root
from fusion_oci.store.tree import (
    TREES,
    StoreLinker,
    load_tree,
    place_tree,
    prune_trees,
    record_tree,
    tree_key,
)

VS = Path("node_modules/.pnpm")
CLI = VS / "cli@1.0.0/node_modules/cli"
LIB = VS / "@s+lib@2.0.0/node_modules/@s/lib"
BUILT = VS / "native@1.0.0/node_modules/native"
LOCK = b"lockfileVersion: '9.0'\n"
CONTEXT = "bubblewrap\0"


def pnpm_install(wt: Path) -> None:
    """What pnpm leaves: three packages (one scoped, one with a build), a bin target, the
    shims pnpm writes per worktree, its metadata."""
    files = {
        CLI / "package.json": json.dumps({"name": "cli", "bin": {"cli": "./bin/cli.js"}}),
        CLI / "bin/cli.js": "#!/usr/bin/env node\nrequire('../lib')\n",
        CLI / "lib/index.js": "module.exports = 1\n",
        CLI / "types.d.ts": "export declare const x: 1\n",  # sorts after package.json
        CLI / "node_modules/.bin/lib": f"#!/bin/sh\nexport NODE_PATH={wt}\n",
        LIB / "package.json": json.dumps({"name": "@s/lib"}),
        LIB / "index.js": "exports.x = 2\n",
        BUILT / "package.json": json.dumps({"name": "native", "scripts": {"install": "gyp"}}),
        BUILT / "index.js": "exports.n = 3\n",
    }
    for rel, text in files.items():
        path = wt / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (wt / CLI / "bin/cli.js").chmod(0o755)
    (wt / CLI / "node_modules/.bin/lib").chmod(0o755)
    (wt / VS / "lock.yaml").write_text("lockfileVersion: '9.0'\n")
    (wt / "node_modules/.modules.yaml").write_text("layoutVersion: 5\n")
    (wt / "pnpm-lock.yaml").write_bytes(LOCK)


def prune_stores_of(root: Path) -> None:
    from fusion_oci.store.tree import copied_blobs

    prune(root, keep=copied_blobs(root))


def recorded(tmp_path: Path) -> tuple[Path, Path, str]:
    """A worktree ``a`` installed and passed with recording; (a, store, key)."""
    a, root = tmp_path / "a", tmp_path / "blobs"
    pnpm_install(a)
    key = tree_key(a, CONTEXT)
    assert key is not None
    _, tree = linking_pass(a, root, record=True)
    assert tree is not None and record_tree(root, key, tree) == 2
    return a, root, key


# ----------------------------------------------------------------------------- pnpm_layout


def test_package_folders_are_where_pnpm_puts_them() -> None:
    assert package_root([".pnpm", "a@1", "node_modules", "a", "lib"]) == 4
    assert package_root([".pnpm", "@s+b@1", "node_modules", "@s", "b"]) == 5
    assert package_root([".pnpm", "@s+b@1", "node_modules", "@s"]) == 0
    assert package_root([".pnpm", "node_modules", "a"]) == 0  # pnpm's hoisted links
    assert package_root([".pnpm", "a@1", "x", "a"]) == 0


def test_bin_targets_and_builds_are_read_as_pnpm_reads_them() -> None:
    facts = package_facts(json.dumps({"bin": "./bin/x.js"}).encode(), ["package.json"])
    assert facts.is_bin("bin/x.js") and not facts.builds
    facts = package_facts(json.dumps({"bin": {"a": "a.js", "b": "../../etc/x"}}).encode(), [])
    assert facts.bins == {"a.js"}  # a target outside the package is no file of it
    facts = package_facts(json.dumps({"directories": {"bin": "./tools"}}).encode(), [])
    assert facts.is_bin("tools/deep/x") and not facts.is_bin("toolsx")
    assert package_facts(json.dumps({"scripts": {"postinstall": "x"}}).encode(), []).builds
    assert package_facts(b"{}", ["binding.gyp"]).builds
    assert not package_facts(b"{no json", []).readable


# ------------------------------------------------------------- what the pass leaves alone


def test_bin_targets_and_shims_stay_the_tasks_own_files(tmp_path: Path) -> None:
    a, root = tmp_path / "a", tmp_path / "blobs"
    pnpm_install(a)
    dedup(a, root)
    for kept in (CLI / "bin/cli.js", CLI / "node_modules/.bin/lib"):
        st = (a / kept).stat()
        assert st.st_uid == os.getuid() and st.st_nlink == 1, kept
    assert (a / CLI / "lib/index.js").stat().st_uid == STORE_UID


def test_a_bin_target_an_older_pass_linked_becomes_the_tasks_copy_again(tmp_path: Path) -> None:
    """The reported failure: after a pass, ``pnpm add`` chmods every bin target, and a blob
    is nobody's (EPERM). A pass now gives the task its own copy back, same bytes and mode."""
    a, root = tmp_path / "a", tmp_path / "blobs"
    pnpm_install(a)
    target = a / CLI / "bin/cli.js"
    data = target.read_bytes()
    blob = root / "old-blob"
    root.mkdir()
    blob.write_bytes(data)
    os.chown(blob, STORE_UID, STORE_UID)
    blob.chmod(0o555)
    target.unlink()
    os.link(blob, target)  # what the previous release's pass left
    stats = dedup(a, root)
    st = target.stat()
    assert stats.unlinked == 1 and st.st_uid == os.getuid() and st.st_nlink == 1
    assert target.read_bytes() == data and st.st_mode & 0o777 == 0o755
    os.chmod(target, 0o755)  # what pnpm's fixBin does: allowed on the task's own file


# ------------------------------------------------------------------------------- the tree


def test_a_pass_keeps_the_tree_of_placeable_packages(tmp_path: Path) -> None:
    _, root, key = recorded(tmp_path)
    tree = load_tree(root, key)
    assert tree is not None
    cli = str(CLI.relative_to("node_modules"))
    assert set(tree) == {cli, str(LIB.relative_to("node_modules"))}  # not the built one
    assert tree[cli]["bin/cli.js"].copy and not tree[cli]["lib/index.js"].copy
    assert "node_modules/.bin/lib" not in tree[cli]  # shims are pnpm's, per worktree


def test_a_new_worktree_gets_links_and_its_own_bin_targets(tmp_path: Path) -> None:
    a, root, key = recorded(tmp_path)
    b = tmp_path / "b"
    b.mkdir()
    (b / "pnpm-lock.yaml").write_bytes(LOCK)
    assert tree_key(b, CONTEXT) == key
    stats, known = place_tree(b, root, key)
    assert (stats.packages, stats.copies, stats.incomplete) == (2, 1, 0)
    assert (b / CLI / "lib/index.js").samefile(a / CLI / "lib/index.js")
    assert (b / LIB / "index.js").stat().st_uid == STORE_UID
    own = (b / CLI / "bin/cli.js").stat()
    assert own.st_uid == os.getuid() and own.st_nlink == 1 and own.st_mode & 0o777 == 0o755
    assert (b / CLI / "package.json").is_file() and not (b / BUILT).exists()
    assert not (b / CLI / "node_modules").exists()  # pnpm makes its links and shims
    assert (b / "node_modules").stat().st_uid == os.getuid()
    assert known[str((CLI / "lib/index.js").relative_to("node_modules"))]
    # Its pass finds nothing to do and still names every placed file (the tree stays whole).
    again, tree = linking_pass(b, root, record=True, known=known)
    assert again.linked == 0 and tree is not None
    assert set(tree.files) - tree.unplaceable >= set(load_tree(root, key) or {})


def test_a_pass_names_blobs_it_did_not_place_by_inode(tmp_path: Path) -> None:
    """A worktree linked by an earlier pass (not placed): its next install's tree is whole."""
    a, root, key = recorded(tmp_path)
    _, tree = linking_pass(a, root, record=True)
    assert tree is not None
    assert set(tree.files) - tree.unplaceable == set(load_tree(root, key) or {})


def test_nothing_is_placed_over_an_existing_node_modules_or_from_another_lockfile(
    tmp_path: Path,
) -> None:
    _, root, key = recorded(tmp_path)
    b = tmp_path / "b"
    (b / "node_modules").mkdir(parents=True)
    assert place_tree(b, root, key)[0].reason == "node_modules exists"
    c = tmp_path / "c"
    c.mkdir()
    (c / "pnpm-lock.yaml").write_bytes(LOCK + b"# changed\n")
    other = tree_key(c, CONTEXT)
    assert other != key and place_tree(c, root, str(other))[0].reason.startswith("no tree")
    assert tree_key(c, "podman\0img") != other  # another runtime or image: another tree


def test_a_package_whose_blob_went_is_left_to_pnpm(tmp_path: Path) -> None:
    a, root, key = recorded(tmp_path)
    (a / CLI / "types.d.ts").unlink()
    blob = (load_tree(root, key) or {})[str(CLI.relative_to("node_modules"))]["types.d.ts"]
    prune_stores_of(root)  # the blob no worktree links any more goes
    b = tmp_path / "b"
    b.mkdir()
    stats, _ = place_tree(b, root, key)
    assert stats.incomplete == 1 and stats.packages == 1
    assert not (b / CLI / "package.json").exists()  # pnpm imports it over what is there
    assert not (root / blob.blob).exists()
    copied = (load_tree(root, key) or {})[str(CLI.relative_to("node_modules"))]["bin/cli.js"]
    assert (root / copied.blob).exists()  # only the tree holds it: gc's prune keeps it
    assert prune_trees(root) == 1 and not any((root / TREES).iterdir())


def test_a_tree_with_a_name_that_climbs_out_is_not_read(tmp_path: Path) -> None:
    _, root, key = recorded(tmp_path)
    path = root / TREES / f"{key}.json"
    body = json.loads(path.read_text())
    package = next(iter(body["packages"]))
    body["packages"][package]["../../../etc/x"] = "ab/" + "c" * 126
    path.write_text(json.dumps(body))
    assert load_tree(root, key) is None


def test_with_cache_mode_isolated_no_tree_is_placed(tmp_path: Path) -> None:
    _, root, _ = recorded(tmp_path)
    b = tmp_path / "b"
    b.mkdir()
    (b / "pnpm-lock.yaml").write_bytes(LOCK)
    assert "isolated" in StoreLinker(b, root, None).place().reason
    assert not (b / "node_modules").exists()
    assert StoreLinker(b, root, CONTEXT).place().packages == 2


@pytest.mark.parametrize("fewer", [True, False])
def test_a_fuller_tree_replaces_a_thinner_one(tmp_path: Path, fewer: bool) -> None:
    a, root, key = recorded(tmp_path)
    _, tree = linking_pass(a, root, record=True)
    assert tree is not None
    if fewer:
        tree.unplaceable.add(next(iter(tree.files)))
        assert record_tree(root, key, tree) == 0  # the kept one has more
    else:
        assert record_tree(root, key, tree) == 0  # as many: kept as it is
    assert len(load_tree(root, key) or {}) == 2


def test_a_worktree_whose_node_modules_went_is_placed_again(tmp_path: Path) -> None:
    """``rm -rf node_modules`` as one command, ``pnpm install`` as the next: Sandbox.run
    places again before it (``wants_placement``: one lstat)."""
    import shutil

    _, root, _ = recorded(tmp_path)
    b = tmp_path / "b"
    b.mkdir()
    (b / "pnpm-lock.yaml").write_bytes(LOCK)
    linker = StoreLinker(b, root, CONTEXT)
    assert linker.wants_placement() and linker.place().packages == 2
    assert not linker.wants_placement()
    shutil.rmtree(b / "node_modules")
    assert not StoreLinker(b, root, None).wants_placement()  # isolated: never
    assert linker.wants_placement() and linker.place().packages == 2
