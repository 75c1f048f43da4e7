"""The worktree's part of the egress profile is pinned at the first prepare (issue #31, item 2)."""

from __future__ import annotations

import os
from pathlib import Path

from fusion_oci.egress.pin import apply_pin, pin_path, pin_profile
from fusion_oci.egress.profile import ProfileHost, file_hosts, merge


def _hosts(worktree: Path, home: Path) -> list[ProfileHost]:
    return merge(file_hosts(worktree, {"HOME": str(home)}))


def test_the_worktrees_hosts_are_pinned_at_the_first_prepare(tmp_path: Path) -> None:
    wt, home, project = tmp_path / "wt", tmp_path / "home", tmp_path / "project"
    for d in (wt, home, project):
        d.mkdir()
    (wt / ".npmrc").write_text("registry=https://npm.corp.example/\n")
    (home / ".npmrc").write_text("@acme:registry=https://acme.example/\n")
    first = pin_profile(_hosts(wt, home), project=project, worktree=wt, task_id="t", create=True)
    assert first.made and not first.left_out
    assert {h.pattern for h in first.hosts} == {"npm.corp.example:443", "acme.example:443"}
    # A command rewrites the worktree's rc: the next prepare keeps the pin, the user's file
    # is read afresh.
    (wt / ".npmrc").write_text(
        "registry=http://evil.example/\n@x:registry=https://npm.corp.example/"
    )
    (home / ".npmrc").write_text("@acme:registry=https://acme2.example/\n")
    later = pin_profile(_hosts(wt, home), project=project, worktree=wt, task_id="u", create=True)
    assert not later.made
    assert {h.pattern for h in later.hosts} == {"npm.corp.example:443", "acme2.example:443"}
    assert [h.pattern for h in later.left_out] == ["evil.example:80"]
    assert later.audit()["left_out"] == [f"evil.example:80 ({wt / '.npmrc'} (registry))"]


def test_a_dry_run_makes_no_pin(tmp_path: Path) -> None:
    (tmp_path / ".npmrc").write_text("registry=https://npm.corp.example/\n")
    hosts = _hosts(tmp_path, tmp_path / "nohome")
    dry = pin_profile(hosts, project=tmp_path, worktree=tmp_path, task_id="t", create=False)
    assert [h.pattern for h in dry.hosts] == ["npm.corp.example:443"]
    assert not dry.pin.exists()


def test_an_unreadable_pin_trusts_nothing_of_the_worktree(tmp_path: Path) -> None:
    pin = pin_path(tmp_path, tmp_path)
    pin.parent.mkdir(parents=True)
    pin.write_text("not json")
    (tmp_path / "yarn.lock").write_text("")
    got = pin_profile(
        _hosts(tmp_path, tmp_path / "nohome"),
        project=tmp_path,
        worktree=tmp_path,
        task_id="t",
        create=True,
    )
    assert not got.hosts and [h.pattern for h in got.left_out] == ["registry.yarnpkg.com:443"]


def test_a_host_both_the_user_and_the_worktree_name_is_the_users() -> None:
    merged = merge(
        [ProfileHost("a.example:443", "wt/.npmrc", True), ProfileHost("a.example:443", "~/.npmrc")]
    )
    assert merged == [ProfileHost("a.example:443", "wt/.npmrc; ~/.npmrc", False)]
    assert apply_pin(merged, []) == (tuple(merged), ())


def test_planted_rc_files_are_not_followed_nor_waited_on(tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    wt.mkdir()
    elsewhere = tmp_path / "elsewhere.yml"
    elsewhere.write_text('npmRegistryServer: "https://followed.example"\n')
    (wt / ".yarnrc.yml").symlink_to(elsewhere)
    os.mkfifo(wt / ".npmrc")  # a read would block until a writer came
    assert _hosts(wt, tmp_path / "nohome") == []


def test_a_users_rc_may_be_a_symlink(tmp_path: Path) -> None:
    home, dotfiles = tmp_path / "home", tmp_path / "dotfiles"
    home.mkdir()
    dotfiles.mkdir()
    (dotfiles / "npmrc").write_text("registry=https://npm.corp.example/\n")
    (home / ".npmrc").symlink_to(dotfiles / "npmrc")
    wt = tmp_path / "wt"
    wt.mkdir()
    assert _hosts(wt, home) == [
        ProfileHost("npm.corp.example:443", f"{home / '.npmrc'} (registry)")
    ]
