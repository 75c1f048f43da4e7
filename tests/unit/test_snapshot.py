"""Keep-and-restore of the paths landlock cannot make read-only (runtimes/linux/snapshot.py)."""

from __future__ import annotations

import os
from pathlib import Path

from fusion_oci.runtimes.linux.snapshot import MAX_FILE, restore, take


def test_what_the_command_changed_added_or_removed_is_put_back(tmp_path: Path) -> None:
    root = tmp_path / ".fusion"
    (root / "sub").mkdir(parents=True)
    (root / "settings.yaml").write_text("sandbox:\n  backend: landlock\n")
    (root / "sub" / "a").write_text("a")
    (root / "link").symlink_to("settings.yaml")
    dotgit = tmp_path / ".git"
    dotgit.write_text("gitdir: /repo/.git/worktrees/t\n")
    snap = take([str(root), str(dotgit)])
    (root / "settings.yaml").write_text("sandbox:\n  backend: native\n")
    (root / "sub" / "a").unlink()
    (root / "planted").write_text("x")
    (root / "link").unlink()
    (root / "link").symlink_to("/etc/passwd")
    dotgit.unlink()
    dotgit.mkdir()  # a .git/ of the command's making, hooks and all
    (dotgit / "config").write_text("[core]\n\tfsmonitor = touch /tmp/owned\n")
    changed = restore(snap)
    assert (root / "settings.yaml").read_text() == "sandbox:\n  backend: landlock\n"
    assert (root / "sub" / "a").read_text() == "a"
    assert not (root / "planted").exists()
    assert os.readlink(root / "link") == "settings.yaml"
    assert dotgit.is_file() and dotgit.read_text() == "gitdir: /repo/.git/worktrees/t\n"
    assert str(dotgit) in changed and str(root / "planted") in changed
    assert restore(take([str(root), str(dotgit)])) == []  # nothing changed: nothing to do


def test_a_replaced_directory_symlink_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    root = tmp_path / "hooks"
    root.mkdir()
    (root / "pre-commit.sample").write_text("sample")
    snap = take([str(root)])
    root.rename(tmp_path / "moved")
    root.symlink_to(outside)  # restore must not write into outside/
    restore(snap)
    assert root.is_dir() and not root.is_symlink()
    assert (root / "pre-commit.sample").read_text() == "sample"
    assert sorted(p.name for p in outside.iterdir()) == ["keep"]


def test_holes_stay_the_commands_and_big_files_are_reported(tmp_path: Path) -> None:
    root = tmp_path / ".fusion"
    (root / "db").mkdir(parents=True)
    (root / "db" / "fusion.db").write_text("v1")
    (root / "big.log").write_bytes(b"x" * (MAX_FILE + 1))
    snap = take([str(root)], holes=[str(root / "db")])
    assert snap.too_big == [str(root / "big.log")]
    (root / "db" / "fusion.db").write_text("v2")
    (root / "db" / "new").write_text("n")
    assert restore(snap) == []
    assert (root / "db" / "fusion.db").read_text() == "v2" and (root / "db" / "new").exists()
