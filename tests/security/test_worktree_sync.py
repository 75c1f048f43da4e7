"""The remote worktree transfer against a hostile remote (docs/security.md, "Remote worktree
transfer"): the ``sync-*`` probes.

The transfer is runtime-independent (a byte stream to a script), so these need no runtime:
the remote side is ``sync_hostile_remote.py`` over a pipe — the real script, except that a
pull answers what the probe crafted (objects made with ``hash-object --literally``, as a
hostile git would, packs, refs, raw frames) — or the real script after a hostile command.
Each probe observes the host: files outside the worktree, the worktree, every file of the
host's ``.git`` but its objects, its refs, and a marker a host-side program would write.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from fusion_oci.runtimes.kubernetes.sync import SyncRefusedError, SyncSettings, WorktreeSyncError
from tests.sync_world import World, hostile, open_world, sh

__all__ = ["hostile"]

Z = "0" * 40


def git_dir_print(world: World) -> dict[str, str]:
    """Every file of the host's .git but what a pull may change (objects, the task branch,
    its reflog, the index) and the sync's own state: path -> digest."""
    out = {}
    skip = ("objects/", "logs/", "index", "refs/heads/task")
    root = world.host / ".git"
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if rel.startswith(skip) or path.is_dir():
            continue
        data = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
        out[rel] = hashlib.sha256(data).hexdigest()
    return out


def tree_print(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if rel == ".git" or rel.startswith(".git/"):
            continue
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = (
                f"{path.stat().st_mode & 0o7777:o} " + hashlib.sha256(path.read_bytes()).hexdigest()
            )
    return out


class Guard:
    """What must not change: outside the worktree, the host's .git, its other refs."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.outside = world.tmp / "outside"
        self.outside.mkdir(exist_ok=True)
        (self.outside / "target").write_text("outside\n")
        self.git = git_dir_print(world)
        self.refs = world.git_host("for-each-ref", "--format=%(refname) %(objectname)")

    def held(self) -> None:
        assert sorted(p.name for p in self.outside.iterdir()) == ["target"]
        assert (self.outside / "target").read_text() == "outside\n"
        assert git_dir_print(self.world) == self.git
        refs = self.world.git_host("for-each-ref", "--format=%(refname) %(objectname)")
        others = [r for r in refs.splitlines() if not r.startswith("refs/heads/task ")]
        assert others == [r for r in self.refs.splitlines() if not r.startswith("refs/heads/task ")]


@pytest_asyncio.fixture
async def pushed(hostile: World) -> AsyncIterator[tuple[World, Guard]]:
    await hostile.sync.push()
    yield hostile, Guard(hostile)


def tree_with(world: World, base: str, files: dict[str, tuple[str, bytes] | None]) -> str:
    """``base`` with ``files`` set (mode, content) or removed (None), made by the remote's
    git through a scratch index."""
    index = str(world.ctl / "scratch.index")
    env = {**os.environ, "GIT_INDEX_FILE": index}
    subprocess.run(["git", "read-tree", base], cwd=world.remote, env=env, check=True)
    for path, entry in files.items():
        if entry is None:
            args = ["update-index", "--force-remove", "--", path]
        else:
            oid = world.blob(entry[1])
            args = ["update-index", "--add", "--cacheinfo", f"{entry[0]},{oid},{path}"]
        subprocess.run(["git", *args], cwd=world.remote, env=env, check=True)
    return subprocess.run(
        ["git", "write-tree"], cwd=world.remote, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()


def reply_tree(world: World, tree: str, **extra: Any) -> None:
    base = world.sync.base
    assert base is not None
    meta = {"ok": True, "headRef": "refs/heads/task", "worktree": tree, "index": base.index,
            "head": base.head, **extra}  # fmt: skip
    world.reply(meta, world.pack(tree, f"^{base.worktree}"))


def reply_objects(world: World, tree: str, objects: list[str]) -> None:
    """A reply whose pack holds exactly ``objects`` (no walk: a broken tree cannot be walked)."""
    base = world.sync.base
    assert base is not None
    pack = subprocess.run(
        ["git", "pack-objects", "--stdout", "-q"], cwd=world.remote,
        input="".join(f"{o}\n" for o in objects).encode(), capture_output=True, check=True,
    ).stdout  # fmt: skip
    meta = {"ok": True, "headRef": "refs/heads/task", **vars(base), "worktree": tree}
    world.reply(meta, pack)


async def refused(world: World, guard: Guard, match: str | None = None) -> None:
    before = tree_print(world.host)
    with pytest.raises(SyncRefusedError, match=match):
        await world.sync.pull()
    assert tree_print(world.host) == before  # nothing of it applied
    guard.held()


# -- paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [b"..", b".", b".git", b".GIT", b".Git", b".git ", b".git.", b"git~1", b".g\xe2\x80\x8cit",
     b"a\\..\\..\\x", b"..\\x", b"", b"/etc", b"../../x"],
)  # fmt: skip
async def test_sync_path_escape(pushed: tuple[World, Guard], name: bytes) -> None:
    """sync-path-escape and sync-dotgit: a tree entry that is ``..``, ``.``, ``.git`` in any
    spelling some file system reads as ``.git``, or a backslash path (a separator on Windows)."""
    world, guard = pushed
    blob = world.blob(b"#!/bin/sh\ntouch pwned\n")
    hooks = world.mktree([("100755", "blob", blob, b"post-checkout")])
    inner = world.mktree([("40000", "tree", hooks, b"hooks"), ("100644", "blob", blob, b"pwned")])
    base = world.sync.base
    assert base is not None
    entries = [("40000", "tree", inner, name), ("100644", "blob", blob, b"zzz-fine")]
    tree = world.mktree(sorted(entries, key=lambda e: e[3]))
    reply_objects(world, tree, [tree, inner, hooks, blob])  # listed: "" cannot be walked
    await refused(world, guard)
    assert not (world.host / "hooks").exists() and not (world.host / "zzz-fine").exists()
    assert not (world.host.parent / "pwned").exists()


async def test_sync_oid_injection(pushed: tuple[World, Guard]) -> None:
    """sync-oid-injection: object names that are options, refs or paths, never passed on."""
    world, guard = pushed
    base = world.sync.base
    assert base is not None
    marker = world.tmp / "marker"
    for key, value in [
        ("worktree", f"--output={marker}"),
        ("worktree", "HEAD"),
        ("worktree", "/etc/passwd"),
        ("index", "-q"),
        ("head", f"--upload-pack=touch {marker}"),
        ("head", base.head.upper() if base.head else "X"),
        ("worktree", None),
    ]:
        meta = {"ok": True, "headRef": "refs/heads/task", **vars(base), key: value}
        world.reply(meta)
        await refused(world, guard, "object id")
        assert not marker.exists()


async def test_sync_symlink_parent(pushed: tuple[World, Guard]) -> None:
    """sync-symlink-parent: the host has an (ignored) symlink to a folder outside; the remote
    sends a file below it. Nothing is written through the link."""
    world, guard = pushed
    os.symlink(guard.outside, world.host / "cache")
    base = world.sync.base
    assert base is not None
    tree = tree_with(world, base.worktree, {"cache/pwned": ("100644", b"pwned\n")})
    reply_tree(world, tree)
    report = await world.sync.pull()
    assert [p for p, _ in report.refused] == ["cache/pwned"], report
    assert os.readlink(world.host / "cache") == str(guard.outside)
    guard.held()


async def test_sync_symlink_swap(pushed: tuple[World, Guard]) -> None:
    """sync-symlink-swap: the remote makes a symlink to a host file outside, then replaces it
    with a file (and a folder with a link in it with a file below): the host replaces the
    links, never writes through them."""
    world, guard = pushed
    target = guard.outside / "target"
    sh(world.remote, f"ln -s {target} s && ln -s {guard.outside} d")
    report = await world.sync.pull()
    assert sorted(report.written) == ["d", "s"]
    assert os.readlink(world.host / "s") == str(target)
    sh(world.remote, "rm s d && echo pwned > s && mkdir d && echo pwned > d/x")
    report = await world.sync.pull()
    assert sorted(report.written) == ["d/x", "s"], report
    assert not (world.host / "s").is_symlink() and (world.host / "s").read_text() == "pwned\n"
    assert not (world.host / "d").is_symlink()
    guard.held()


async def test_sync_symlink_parent_one_tree(pushed: tuple[World, Guard]) -> None:
    """sync-symlink-parent, crafted: one tree holds ``d`` as a symlink to outside and
    ``d/x`` (two entries named ``d``): git's checks refuse it before anything is written."""
    world, guard = pushed
    link = world.blob(str(guard.outside).encode())
    file = world.blob(b"pwned\n")
    sub = world.mktree([("100644", "blob", file, b"x")])
    tree = world.mktree([("120000", "blob", link, b"d"), ("40000", "tree", sub, b"d")])
    reply_objects(world, tree, [tree, sub, link, file])
    await refused(world, guard)


# -- modes, objects, sizes -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["100666", "104755", "100777", "40000", "0100644"])
async def test_sync_bad_mode(pushed: tuple[World, Guard], mode: str) -> None:
    """sync-bad-mode: only 644, 755 and symlinks; no setuid, no world-writable, no blob as a
    folder, no zero-padded mode."""
    world, guard = pushed
    base = world.sync.base
    assert base is not None
    blob = world.blob(b"#!/bin/sh\n")
    tree = world.mktree([("100644", "blob", blob, b"README.md"), (mode, "blob", blob, b"x")])
    reply_objects(world, tree, [tree, blob])
    await refused(world, guard)


async def test_sync_bad_mode_from_an_honest_git(pushed: tuple[World, Guard]) -> None:
    """sync-bad-mode, honest git: setuid, group- and world-writable files come back 755/644."""
    world, guard = pushed
    sh(world.remote, "echo a > suid && chmod 4777 suid && echo b > ww && chmod 666 ww")
    await world.sync.pull()
    assert (world.host / "suid").stat().st_mode & 0o7777 == 0o755
    assert (world.host / "ww").stat().st_mode & 0o7777 == 0o644
    guard.held()


async def test_sync_fsck(pushed: tuple[World, Guard]) -> None:
    """sync-fsck: a tree naming an object that is nowhere, a malformed commit, a corrupt
    pack: refused by ``index-pack --strict`` in the quarantine."""
    world, guard = pushed
    base = world.sync.base
    assert base is not None
    missing = "1" * 40
    tree = world.mktree([("100644", "blob", missing, b"ghost")])
    reply_objects(world, tree, [tree])
    await refused(world, guard)
    commit = world.git_remote(
        "hash-object", "-t", "commit", "-w", "--literally", "--stdin",
        stdin=f"tree {base.worktree}\nauthor nobody\n\nbad\n".encode(),
    ).strip()  # fmt: skip
    world.reply({"ok": True, "headRef": "refs/heads/task", **vars(base), "head": commit},
                world.pack(commit, f"^{base.head}"))  # fmt: skip
    await refused(world, guard)
    good = tree_with(world, base.worktree, {"new.txt": ("100644", b"new\n" * 1000)})
    pack = bytearray(world.pack(good, f"^{base.worktree}"))
    pack[40] ^= 0xFF
    world.reply(
        {"ok": True, "headRef": "refs/heads/task", **vars(base), "worktree": good}, bytes(pack)
    )
    await refused(world, guard)
    assert not list(world.sync.objects.glob("incoming-*"))  # the quarantine is gone


async def test_sync_size(tmp_path: Path) -> None:
    """sync-size: a frame that announces more than the limit is refused unread; a header
    without its newline, a pack claiming more objects than allowed, meta that is not JSON."""
    cases: list[tuple[bytes, str]] = [
        (b"FOSYNC1 2 999999999999\n{}", "limit"),
        (b"FOSYNC1 " + b"9" * 100 + b"\n", "header"),
        (b"FOSYNC1 1048577 0\n", "metadata"),
        (b"FOSYNC1 3 0\nnot", "JSON"),
        (b"FOSYNC1 2 0\n[]", "JSON object"),
    ]
    for i, (raw, match) in enumerate(cases):
        world = await open_world(tmp_path / str(i), hostile=True)
        try:
            await world.sync.push()
            guard = Guard(world)
            world.raw_reply(raw)
            with pytest.raises(SyncRefusedError, match=match):
                await world.sync.pull()
            guard.held()
            with pytest.raises(WorktreeSyncError, match="closed after a failed exchange"):
                await world.sync.push()  # a stream out of step is not used again
        finally:
            await world.sync.close()
    world = await open_world(tmp_path / "count", SyncSettings(max_objects=10), hostile=True)
    try:
        await world.sync.push()
        guard = Guard(world)
        base = world.sync.base
        assert base is not None
        files: dict[str, tuple[str, bytes] | None] = {
            f"f{i}": ("100644", b"%d" % i) for i in range(20)
        }
        reply_tree(world, tree_with(world, base.worktree, files))
        await refused(world, guard, "objects")
        world.reply(
            {"ok": True, "headRef": "refs/heads/task", **vars(base)},
            b"PACK\0\0\0\2\x7f\xff\xff\xff",
        )
        await refused(world, guard, "objects")
    finally:
        await world.sync.close()


# -- refs and the .git folder -----------------------------------------------------------------


async def test_sync_refs(pushed: tuple[World, Guard]) -> None:
    """sync-refs: a HEAD moved to another branch, refs the reply names besides the task
    branch, a head that is a tree: none reaches the host's refs."""
    world, guard = pushed
    base = world.sync.base
    assert base is not None
    sh(
        world.remote,
        "git checkout -q -b main && echo m > m.txt && git add m.txt && git commit -qm main",
    )
    head = world.git_remote("rev-parse", "HEAD").strip()
    tree = world.git_remote("rev-parse", "HEAD^{tree}").strip()
    world.reply(
        {"ok": True, "headRef": "refs/heads/main", "worktree": tree, "index": tree, "head": head,
         "refs": {"refs/heads/main": head, "refs/tags/v1": head, "HEAD": head},
         "packedRefs": f"{head} refs/heads/other\n", "config": "[core]\n\thooksPath = /tmp\n"},
        world.pack(head, f"^{base.head}"),
    )  # fmt: skip
    report = await world.sync.pull()
    assert report.branch.startswith("unchanged: the sandbox's HEAD is 'refs/heads/main'"), report
    assert world.git_host("rev-parse", "refs/heads/task").strip() == base.head
    guard.held()
    world.reply(
        {"ok": True, "headRef": "refs/heads/task", **vars(base), "head": base.worktree},
    )
    await refused(world, guard, "not a commit")


async def test_sync_git_dir(pushed: tuple[World, Guard]) -> None:
    """sync-git-dir: a command rewrites its .git (hooks, config, info/attributes,
    packed-refs, other branches and tags): the host's .git gets none of it."""
    world, guard = pushed
    marker = world.tmp / "marker"
    sh(
        world.remote,
        f"printf '#!/bin/sh\\ntouch {marker}\\n' > .git/hooks/post-checkout && "
        "chmod +x .git/hooks/post-checkout && "
        f"git config core.fsmonitor 'touch {marker}; false' && "
        "mkdir -p .git/info && echo '* filter=evil' > .git/info/attributes && "
        "git branch other && git tag v1 && git pack-refs --all && "
        "echo x > x.txt && git add x.txt && git commit -qm x",
    )
    report = await world.sync.pull()
    assert report.branch.startswith("updated"), report
    guard.held()
    marker.unlink(missing_ok=True)  # the sandbox's own git ran them there (same machine here)
    world.git_host("status")
    world.git_host("checkout", "-q", "-b", "after")
    assert not marker.exists()


async def test_sync_protected(pushed: tuple[World, Guard]) -> None:
    """sync-protected: protectedPaths (and folded spellings of them) never come back."""
    world, guard = pushed
    sh(
        world.remote,
        "mkdir -p .vscode .VSCode .claude .fusion && echo '{}' > .vscode/tasks.json && "
        "echo '{}' > .VSCode/settings.json && echo 'curl x|sh' > .envrc && "
        "echo '[submodule]' > .gitmodules && echo '{}' > .claude/settings.json && "
        "echo 'backend: native' > .fusion/settings.yaml && echo ok > fine.txt",
    )
    report = await world.sync.pull()
    assert sorted(p for p, _ in report.refused) == [
        ".VSCode/settings.json", ".claude/settings.json", ".envrc", ".fusion/settings.yaml",
        ".gitmodules", ".vscode/tasks.json",
    ]  # fmt: skip
    assert report.written == ["fine.txt"]
    for name in (".vscode", ".VSCode", ".claude", ".envrc", ".gitmodules", ".fusion"):
        assert not (world.host / name).exists(), name
    guard.held()
    sh(world.remote, "git add -f .envrc")
    report = await world.sync.pull()
    assert report.index.startswith("kept: it stages protected paths"), report


async def test_sync_gitlink(pushed: tuple[World, Guard]) -> None:
    """sync-gitlink: a repository the command makes, with an fsmonitor and a hook, staged as
    a gitlink: it stays in the sandbox; the host's git runs nothing of it."""
    world, guard = pushed
    marker = world.tmp / "marker"
    sh(
        world.remote,
        "git init -q nested && git -C nested commit -q --allow-empty -m n && "
        f"git -C nested config core.fsmonitor 'touch {marker}; false' && "
        f"printf '#!/bin/sh\\ntouch {marker}\\n' > nested/.git/hooks/post-checkout && "
        "chmod +x nested/.git/hooks/post-checkout && git add nested",
    )
    report = await world.sync.pull()
    assert [p for p, _ in report.gitlinks] == ["nested"], report
    assert not (world.host / "nested" / ".git").exists()
    marker.unlink(missing_ok=True)  # the sandbox's own git ran them there (same machine here)
    world.git_host("status")
    world.git_host("diff", "HEAD")
    assert not marker.exists()
    guard.held()


async def test_sync_case_fold(pushed: tuple[World, Guard]) -> None:
    """sync-case-fold: a name that folds onto an existing host file, or onto another new
    one, is not written (on a case-insensitive host it would replace the other)."""
    world, guard = pushed
    sh(world.remote, "echo x > readme.md && mkdir dup && echo 1 > dup/A && echo 2 > dup/a")
    report = await world.sync.pull()
    assert sorted(p for p, _ in report.refused) == ["dup/A", "dup/a", "readme.md"], report
    assert (world.host / "README.md").read_text() == "hello\n"
    assert not (world.host / "readme.md").exists()
    guard.held()


async def test_sync_conflict(pushed: tuple[World, Guard]) -> None:
    """sync-conflict: the agent changed a file on the host during the command; the remote
    changed or deleted it too: the host's stays."""
    world, guard = pushed
    sh(world.remote, "echo remote > README.md && rm src/a.ts")
    (world.host / "README.md").write_text("agent\n")
    (world.host / "src" / "a.ts").write_text("agent\n")
    report = await world.sync.pull()
    assert sorted(p for p, _ in report.conflicts) == ["README.md", "src/a.ts"]
    assert (world.host / "README.md").read_text() == "agent\n"
    assert (world.host / "src" / "a.ts").read_text() == "agent\n"
    guard.held()


async def test_sync_refused_pull_then_push_restores_the_remote(pushed: tuple[World, Guard]) -> None:
    """After a refused pull the next push hands the remote the host's state again, even when
    the host did not change."""
    world, guard = pushed
    base = world.sync.base
    assert base is not None
    world.reply({"ok": True, "headRef": "refs/heads/task", **vars(base), "worktree": "HEAD"})
    await refused(world, guard)
    sh(world.remote, "echo drift > README.md")
    assert await world.sync.push()
    assert (world.remote / "README.md").read_text() == "hello\n"
