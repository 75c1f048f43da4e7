"""Repositories inside the worktree that the host's git would enter (fusion_oci.policy.gitlinks)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from fusion_oci.policy.gitlinks import GitGuard, entry_print, module_dirs, parse_gitlinks
from fusion_oci.policy.layout import inspect_git
from tests.conftest import git, git_init


def test_gitlinks_are_the_160000_entries() -> None:
    out = b"100644 aa 0\tREADME\x00160000 bb 0\tlib\x00160000 cc 0\tdeep/sub mod\x00"
    assert parse_gitlinks(out) == ["lib", "deep/sub mod"]


def test_a_pointer_files_print_follows_its_git_dir(tmp_path: Path) -> None:
    gitdir = tmp_path / "modules" / "lib"
    (gitdir / "hooks").mkdir(parents=True)
    (gitdir / "HEAD").write_text("ref: refs/heads/main\n")
    (gitdir / "config").write_text("[core]\n")
    dotgit = tmp_path / "lib" / ".git"
    dotgit.parent.mkdir()
    dotgit.write_text("gitdir: ../modules/lib\n")
    before = entry_print(dotgit)
    (gitdir / "config").write_text("[core]\n\tfsmonitor = touch /tmp/x\n")
    assert entry_print(dotgit) != before
    assert entry_print(tmp_path / "absent" / ".git") is None
    assert module_dirs(tmp_path) == [gitdir]
    os.symlink("/etc", tmp_path / "link")
    assert entry_print(tmp_path / "link") == f"mode {os.lstat(tmp_path / 'link').st_mode:o}"


def test_a_new_repository_is_moved_and_a_persons_stays(tmp_path: Path) -> None:
    wt = git_init(tmp_path / "wt")
    kept = wt / "kept"
    git(wt, "init", "-q", str(kept))
    git(kept, "commit", "-q", "--allow-empty", "-m", "k")
    git(wt, "add", "kept")
    layout = inspect_git(wt)
    assert layout is not None
    guard = GitGuard(wt, layout, tmp_path / "quarantine", dict(os.environ))
    asyncio.run(guard.prepare())
    assert list(guard.baseline) == [str(kept / ".git")]
    assert asyncio.run(guard.after_command("r0")) == []  # nothing changed: nothing moved
    made = wt / "made"
    git(wt, "init", "-q", str(made))
    git(made, "commit", "-q", "--allow-empty", "-m", "m")
    git(wt, "add", "made")
    moved = asyncio.run(guard.after_command("r1"))
    assert [what for what, _ in moved] == [str(made / ".git")]
    assert not (made / ".git").exists() and Path(moved[0][1], "HEAD").exists()
    assert (kept / ".git").is_dir()
    (kept / ".git" / "config").write_text("[core]\n\tfsmonitor = true\n")
    assert [what for what, _ in asyncio.run(guard.after_command("r2"))] == [str(kept / ".git")]
