"""The worktree transfer's pure parts: path, mode and ref checks, frames, the plan of a pull."""

from __future__ import annotations

import dataclasses

import pytest

from fusion_oci.models import DEFAULT_PROTECTED_PATHS
from fusion_oci.runtimes.kubernetes.sync import SyncRefusedError, SyncSettings
from fusion_oci.runtimes.kubernetes.sync.paths import (
    check_branch,
    check_link_target,
    check_path,
    collisions,
    is_dotgit,
    is_oid,
    protected_by,
    relative_patterns,
)
from fusion_oci.runtimes.kubernetes.sync.plan import Change, build_plan, parse_diff_tree
from fusion_oci.runtimes.kubernetes.sync.remote import frame, parse_head
from tests.golden import assert_golden

A = "a" * 40
B = "b" * 40
C = "c" * 40
PROTECTED = relative_patterns("/w", DEFAULT_PROTECTED_PATHS)


@pytest.mark.parametrize(
    "name",
    [".git", ".GIT", ".Git", ".git ", ".git.", ".git. . ", "git~1", "GIT~1",
     ".git::$INDEX_ALLOCATION", ".g\u200cit", ".gi\ufefft", "\u202a.git"],
)  # fmt: skip
def test_every_spelling_of_dotgit_is_dotgit(name: str) -> None:
    assert is_dotgit(name)
    assert check_path(f"src/{name}/config") is not None
    assert check_path(f"{name}/hooks/pre-commit") is not None


@pytest.mark.parametrize("name", [".github", ".gitignore", ".gitmodules", "git", "x.git", ".gitx"])
def test_names_that_only_look_like_dotgit_pass(name: str) -> None:
    assert not is_dotgit(name)
    assert check_path(f"src/{name}") is None


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("", "empty"),
        ("/etc/passwd", "absolute"),
        ("../x", "'..'"),
        ("a/../../x", "'..'"),
        ("a/./b", "'.'"),
        ("a//b", "empty"),
        ("a/", "empty"),
        ("a\0b", "NUL"),
        ("a\\..\\b", "backslash"),
        ("x" * 256, "longer than 255"),
        ("/".join(["abcdefgh"] * 500), "longer than 4096"),
    ],
)
def test_paths_that_could_land_elsewhere_are_refused(path: str, why: str) -> None:
    found = check_path(path)
    assert found is not None and why in found, found


def test_ordinary_paths_pass() -> None:
    for path in ["a", "src/index.ts", "dir with space/ü.txt", "-rf", "a/b/c/d.e", "\udcff"]:
        assert check_path(path) is None, path


def test_link_targets() -> None:
    assert check_link_target(b"../../etc/passwd") is None  # kept as a link, never followed
    assert check_link_target(b"/abs") is None
    assert check_link_target(b"") is not None
    assert check_link_target(b"a\0b") is not None
    assert check_link_target(b"x" * 5000) is not None


def test_protected_paths_match_folded_and_below() -> None:
    assert protected_by(".vscode/tasks.json", PROTECTED) == ".vscode/"
    assert protected_by(".VSCode/tasks.json", PROTECTED) == ".vscode/"
    assert protected_by(".envrc", PROTECTED) == ".envrc"
    assert protected_by(".fusion/settings.yaml", PROTECTED) == ".fusion/"
    assert protected_by(".gitmodules", PROTECTED) == ".gitmodules"
    assert protected_by("src/.envrc", PROTECTED) is None
    assert protected_by("src/x.ts", PROTECTED) is None
    assert protected_by("docs/secret.md", ["docs/*.md"]) == "docs/*.md"


def test_absolute_protected_paths_become_relative_or_are_dropped() -> None:
    assert relative_patterns("/w", ["/w/cfg/", "/elsewhere", "rel", "/"]) == ("cfg/", "rel")


def test_collisions_fold_case_and_normalisation() -> None:
    found = collisions(["README.md", "readme.MD", "a/e\u0301", "a/\u00e9", "b", "b"])
    assert found["README.md"] == "readme.MD"
    assert found["readme.MD"] == "README.md"
    assert found["a/e\u0301"] == "a/\u00e9"
    assert "b" not in found


@pytest.mark.parametrize(
    "name", ["", "-x", "--upload-pack=evil", "HEAD", "refs/heads/x", "a..b", "a b", "a~1",
             "a:b", "a.lock", "a/.b", "a/", "x@{1}", "a\x01"],
)  # fmt: skip
def test_branch_names_that_git_or_a_command_line_would_misread(name: str) -> None:
    assert check_branch(name) is not None


def test_ordinary_branch_names() -> None:
    for name in ["main", "fusion/task-12", "feature/x.y", "a-b_c"]:
        assert check_branch(name) is None, name


def test_object_ids() -> None:
    assert is_oid(A, 40)
    assert not is_oid(A.upper(), 40)
    assert not is_oid(A[:39], 40)
    assert not is_oid("-" + A[1:], 40)
    assert not is_oid(None, 40)
    assert is_oid("0" * 64, 64)


def test_frames_round_trip_and_refuse_anything_else() -> None:
    data = frame({"op": "pull", "n": 1}, b"PACK...")
    head, rest = data.split(b"\n", 1)
    meta_size, payload_size = parse_head(head + b"\n")
    assert rest[meta_size:] == b"PACK..." and payload_size == 7
    for bad in [b"FOSYNC1 1 2", b"FOSYNC2 1 2\n", b"FOSYNC1 -1 2\n", b"FOSYNC1 1\n",
                b"FOSYNC1 1 99999999999999\n", b"FOSYNC1 0x1 2\n"]:  # fmt: skip
        with pytest.raises(ValueError):
            parse_head(bad)


def test_diff_tree_output_is_parsed() -> None:
    z = "0" * 40
    out = (
        f":100644 100644 {A} {B} M\0src/a.ts\0"
        f":000000 100755 {z} {C} A\0run.sh\0"
        f":120000 000000 {A} {z} D\0link\0"
    ).encode()
    changes = parse_diff_tree(out)
    assert changes == [
        Change("src/a.ts", "100644", A, "100644", B),
        Change("run.sh", None, None, "100755", C),
        Change("link", "120000", A, None, None),
    ]
    with pytest.raises(SyncRefusedError):
        parse_diff_tree(b"garbage\0x\0")
    with pytest.raises(SyncRefusedError):
        parse_diff_tree(b":100644 100644\0")


def _plan_case() -> dict[str, object]:
    changes = [
        Change("src/a.ts", "100644", A, "100644", B),  # plain modification
        Change("src/gone.ts", "100644", A, None, None),  # deletion
        Change("src/deep/x/y.ts", "100644", A, None, None),  # deletion, deeper
        Change("run.sh", "100644", A, "100755", A),  # mode change
        Change("host-edited.ts", "100644", A, "100644", B),  # the host changed it too
        Change("same-both.ts", "100644", A, "100644", C),  # both made the same change
        Change(".vscode/tasks.json", None, None, "100644", B),  # protected
        Change("nested", None, None, "160000", C),  # a repository the command made
        Change("sub", "160000", A, "100644", B),  # a submodule on the host
        Change("behind-link/x", None, None, "100644", B),  # a parent is a symlink
        Change("Readme.md", None, None, "100644", B),  # folds onto a host sibling
        Change("dup/A", None, None, "100644", B),  # folds onto another new path
        Change("dup/a", None, None, "100644", C),
        Change("was-dir", None, None, "100644", B),  # a folder the deletions empty
        Change("link", "100644", A, "120000", C),  # a file becomes a symlink
    ]
    host = {
        "src/a.ts": ("100644", A),
        "src/gone.ts": ("100644", A),
        "src/deep/x/y.ts": ("100644", A),
        "run.sh": ("100644", A),
        "host-edited.ts": ("100644", C),
        "same-both.ts": ("100644", C),
        "behind-link/x": ("blocked", "'behind-link' on the host is a symlink or not a folder"),
        "Readme.md": ("collides", "its name folds onto 'README.md' on the host"),
        "was-dir": ("dir", "a folder"),
        "link": ("100644", A),
    }
    plan = build_plan(changes, host, PROTECTED)
    return {k: [list(x) if isinstance(x, tuple) else x for x in v] for k, v in {
        "deletes": plan.deletes,
        "writes": [dataclasses.astuple(w) for w in plan.writes],
        "conflicts": plan.conflicts,
        "refused": plan.refused,
        "gitlinks": plan.gitlinks,
    }.items()}  # fmt: skip


def test_the_plan_of_a_pull() -> None:
    assert_golden("worktree_sync/plan.json", _plan_case())


@pytest.mark.parametrize(
    "change",
    [
        Change("../escape", None, None, "100644", B),
        Change("a/.GIT/hooks/post-checkout", None, None, "100755", B),
        Change("x", None, None, "100664", B),
        Change("x", None, None, "040000", B),
        Change("/abs", None, None, "100644", B),
    ],
)
def test_a_crafted_change_refuses_the_whole_pull(change: Change) -> None:
    with pytest.raises(SyncRefusedError):
        build_plan([Change("fine", None, None, "100644", A), change], {}, PROTECTED)


def test_too_many_changes_refuse_the_pull() -> None:
    changes = [Change(f"f{i}", None, None, "100644", A) for i in range(11)]
    with pytest.raises(SyncRefusedError, match="11 changed paths"):
        build_plan(changes, {}, PROTECTED, max_paths=10)


def test_settings_bring_back_is_checked() -> None:
    assert SyncSettings.model_validate({"bringBack": ["dist/", "out"]}).bring_back == [
        "dist",
        "out",
    ]
    for bad in ["../x", "/abs", ".git/x", "a/../b"]:
        with pytest.raises(ValueError):
            SyncSettings.model_validate({"bringBack": [bad]})
    with pytest.raises(ValueError):
        SyncSettings.model_validate({"maxFileMb": 0})
