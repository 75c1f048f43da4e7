"""The worktree transfer between two real repositories over a subprocess's pipes.

The remote side is the real script under Debian's python3 (as in the task image); "a
command" is a shell script run in the remote worktree between a push and a pull, as the
exec agent would run it in the pod. What each test observes is the host worktree, its
index and its refs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fusion_oci.runtimes.kubernetes.sync import SyncRefusedError, SyncSettings
from tests.sync_world import World, open_world, sh, world

__all__ = ["world"]


async def test_the_remote_sees_the_host_worktree_as_it_is(world: World) -> None:
    (world.host / "untracked.txt").write_text("new on the host\n")
    (world.host / "src" / "a.ts").write_text("export const a = 2;\n")
    (world.host / "node_modules").mkdir()
    (world.host / "node_modules" / "dep.js").write_text("ignored on the host\n")
    world.git_host("rm", "-q", "--cached", "README.md")  # staged, not committed
    assert await world.sync.push()
    assert (world.remote / "untracked.txt").read_text() == "new on the host\n"
    assert (world.remote / "src" / "a.ts").read_text() == "export const a = 2;\n"
    assert not (world.remote / "node_modules").exists()
    assert os.access(world.remote / "run.sh", os.X_OK)
    assert world.git_remote("rev-parse", "HEAD") == world.git_host("rev-parse", "HEAD")
    assert world.git_remote("symbolic-ref", "HEAD").strip() == "refs/heads/task"
    assert world.git_remote("status", "--porcelain") == world.git_host("status", "--porcelain")
    # Nothing changed: nothing crosses, not even a request.
    assert not await world.sync.push()
    (world.host / "untracked.txt").unlink()
    assert await world.sync.push()
    assert not (world.remote / "untracked.txt").exists()


async def test_ignored_outputs_stay_remote(world: World) -> None:
    await world.sync.push()
    sh(
        world.remote,
        "mkdir -p node_modules/x dist && echo m > node_modules/x/i.js && echo d > dist/o.js",
    )
    report = await world.sync.pull()
    assert report.written == [] and report.pack_bytes == 0
    assert not (world.host / "node_modules").exists() and not (world.host / "dist").exists()
    (world.host / "README.md").write_text("host edit\n")
    await world.sync.push()  # and a push does not remove them over there
    assert (world.remote / "node_modules" / "x" / "i.js").exists()
    assert (world.remote / "README.md").read_text() == "host edit\n"


async def test_listed_ignored_outputs_come_back(tmp_path: Path) -> None:
    w = await open_world(tmp_path, SyncSettings(bring_back=["dist"]))
    try:
        await w.sync.push()
        sh(
            w.remote,
            "mkdir -p dist node_modules && echo built > dist/app.js && echo n > node_modules/n",
        )
        report = await w.sync.pull()
        assert report.written == ["dist/app.js"]
        assert (w.host / "dist" / "app.js").read_text() == "built\n"
        assert not (w.host / "node_modules").exists()
        assert not await w.sync.push()  # the host's snapshot has dist/ too: nothing to send
        assert (w.remote / "dist" / "app.js").exists()
    finally:
        await w.sync.close()


async def test_what_a_command_changes_comes_back(world: World) -> None:
    (world.host / "keep.bin").write_bytes(b"k")
    await world.sync.push()
    binary = bytes(range(256)) * 64
    sh(
        world.remote,
        "echo changed > README.md; rm keep.bin; git mv -k src/a.ts src/b.ts 2>/dev/null || "
        "mv src/a.ts src/b.ts; chmod -x run.sh; mkdir -p new/deep; echo n > new/deep/f.txt; "
        "ln -s ../README.md new/link; ln -s /etc/passwd abs-link",
    )
    (world.remote / "data.bin").write_bytes(binary)
    report = await world.sync.pull()
    assert report.conflicts == [] and report.refused == [], report
    assert (world.host / "README.md").read_text() == "changed\n"
    assert not (world.host / "keep.bin").exists()
    assert not (world.host / "src" / "a.ts").exists()
    assert (world.host / "src" / "b.ts").read_text() == "export const a = 1;\n"
    assert not os.access(world.host / "run.sh", os.X_OK)
    assert (world.host / "run.sh").stat().st_mode & 0o777 == 0o644
    assert (world.host / "new" / "deep" / "f.txt").read_text() == "n\n"
    assert os.readlink(world.host / "new" / "link") == "../README.md"
    assert os.readlink(world.host / "abs-link") == "/etc/passwd"  # kept a link, not followed
    assert (world.host / "data.bin").read_bytes() == binary
    # The host's own view agrees with the remote's, file for file.
    assert world.git_host("status", "--porcelain") == world.git_remote("status", "--porcelain")


async def test_commits_and_staged_changes_come_back(world: World) -> None:
    await world.sync.push()
    before = world.git_host("rev-parse", "HEAD").strip()
    sh(
        world.remote,
        "echo one > one.txt && git add one.txt && git commit -qm 'in the sandbox' && "
        "echo two > two.txt && git add two.txt && echo dirty > README.md",
    )
    report = await world.sync.pull()
    after = world.git_host("rev-parse", "HEAD").strip()
    assert report.branch == f"updated {before}..{after}"
    assert world.git_host("log", "-1", "--format=%s") == "in the sandbox\n"
    assert world.git_host("rev-parse", "HEAD^").strip() == before
    assert report.index == "updated"
    assert world.git_host("diff", "--cached", "--name-only") == "two.txt\n"
    assert world.git_host("diff", "--name-only") == "README.md\n"
    world.git_host("fsck", "--strict")
    # The next command sees the same again, and a later host commit goes over.
    world.git_host("commit", "-qam", "on the host")
    assert await world.sync.push()
    assert world.git_remote("log", "-1", "--format=%s") == "on the host\n"
    assert world.git_remote("status", "--porcelain") == ""


async def test_a_host_change_during_the_command_is_a_conflict(world: World) -> None:
    await world.sync.push()
    sh(world.remote, "echo remote > README.md && echo remote > src/a.ts && echo r > only-remote")
    (world.host / "README.md").write_text("host, during the command\n")  # the agent edits
    report = await world.sync.pull()
    assert [p for p, _ in report.conflicts] == ["README.md"]
    assert (world.host / "README.md").read_text() == "host, during the command\n"
    assert (world.host / "src" / "a.ts").read_text() == "remote\n"  # the rest is applied
    assert (world.host / "only-remote").read_text() == "r\n"
    oid = report.conflicts[0][1]
    assert oid is not None and world.git_host("cat-file", "-p", oid) == "remote\n"
    # The next push hands the remote the host's version.
    await world.sync.push()
    assert (world.remote / "README.md").read_text() == "host, during the command\n"


async def test_a_host_commit_during_the_command_keeps_the_host_branch(world: World) -> None:
    await world.sync.push()
    sh(world.remote, "echo r > r.txt && git add r.txt && git commit -qm remote")
    world.git_host("commit", "-q", "--allow-empty", "-m", "host meanwhile")
    host_head = world.git_host("rev-parse", "HEAD").strip()
    report = await world.sync.pull()
    assert report.branch.startswith("unchanged: the host's refs/heads/task moved"), report
    assert world.git_host("rev-parse", "HEAD").strip() == host_head
    assert (world.host / "r.txt").read_text() == "r\n"


async def test_only_the_difference_crosses(world: World) -> None:
    (world.host / "big.bin").write_bytes(os.urandom(4 << 20))
    world.git_host("add", "big.bin")
    world.git_host("commit", "-qm", "big")
    await world.sync.push()
    (world.host / "README.md").write_text("one line\n")
    sizes = []
    real = world.sync.stream.write

    async def counting(data: bytes) -> None:
        sizes.append(len(data))
        await real(data)

    world.sync.stream.write = counting  # type: ignore[method-assign]
    await world.sync.push()
    assert sum(sizes) < 4096, sizes
    sh(world.remote, "echo remote > src/a.ts")
    report = await world.sync.pull()
    assert 0 < report.pack_bytes < 4096, report


async def test_a_50_mb_file_is_bounded_by_the_limit(tmp_path: Path) -> None:
    w = await open_world(tmp_path, SyncSettings(max_file_mb=40, max_transfer_mb=64))
    try:
        await w.sync.push()
        sh(w.remote, "head -c 52428800 /dev/zero > zeros.bin && echo small > small.txt")
        with pytest.raises(SyncRefusedError, match="maxFileMb"):
            await w.sync.pull()  # a 50 MB file packs to 50 KB: the object's size decides
        assert not (w.host / "zeros.bin").exists() and not (w.host / "small.txt").exists()
    finally:
        await w.sync.close()
    w = await open_world(tmp_path / "random", SyncSettings(max_file_mb=100, max_transfer_mb=40))
    try:
        await w.sync.push()
        (w.remote / "random.bin").write_bytes(os.urandom(50 << 20))
        with pytest.raises(SyncRefusedError, match="maxTransferMb"):
            await w.sync.pull()  # refused from the frame's header, before reading the pack
        assert not (w.host / "random.bin").exists()
    finally:
        await w.sync.close()


@pytest.mark.slow
async def test_a_50_mb_file_within_the_limit_crosses(world: World) -> None:
    await world.sync.push()
    data = os.urandom(50 << 20)
    (world.remote / "random.bin").write_bytes(data)
    report = await world.sync.pull()
    assert report.written == ["random.bin"]
    assert (world.host / "random.bin").read_bytes() == data


async def test_a_detached_host_head_is_refused_at_open(tmp_path: Path) -> None:
    from fusion_oci.runtimes.kubernetes.sync import WorktreeSyncError

    w = await open_world(tmp_path)
    await w.sync.close()
    w.git_host("checkout", "-q", "--detach")
    from fusion_oci.runtimes.kubernetes.sync import WorktreeSync

    with pytest.raises(WorktreeSyncError, match="detached"):
        await WorktreeSync(w.host, w.sync.stream, tmp_path / "s2").open()


async def test_a_sha256_repository(tmp_path: Path) -> None:
    from fusion_oci.runtimes.kubernetes.sync import ProcessStream, WorktreeSync, remote_argv
    from fusion_oci.runtimes.kubernetes.sync.stream import local_python
    from tests.sync_world import GIT_ENV, git

    host = tmp_path / "host"
    host.mkdir()
    git(host, "init", "-q", "-b", "task", "--object-format=sha256")
    (host / "a.txt").write_text("a\n")
    git(host, "add", "-A")
    git(host, "commit", "-qm", "init")
    argv = remote_argv(str(tmp_path / "remote"), python=local_python())
    stream = await ProcessStream.start(argv, env=GIT_ENV)
    sync = WorktreeSync(host, stream, tmp_path / "state", env=GIT_ENV)
    try:
        await sync.open()
        assert sync.hex_len == 64
        assert await sync.push()
        sh(tmp_path / "remote", "echo b > b.txt && git add b.txt && git commit -qm b")
        report = await sync.pull()
        assert report.written == ["b.txt"] and report.branch.startswith("updated"), report
        assert git(host, "log", "-1", "--format=%s") == "b\n"
    finally:
        await sync.close()


async def test_the_host_remotes_cross_without_their_secrets(world: World) -> None:
    """`git push origin` works in the pod as on a local runtime: the host repository's
    network remotes are the pod's, a password in a URL is not, a path remote is left out."""
    world.git_host("remote", "add", "origin", "https://bot:s3cret@git.test/acme/widget.git")
    world.git_host("remote", "add", "upstream", "git@git.test:acme/widget.git")
    world.git_host("remote", "add", "local", str(world.tmp / "elsewhere.git"))
    world.git_host("config", "branch.task.remote", "origin")
    world.git_host("config", "branch.task.merge", "refs/heads/task")
    await world.sync.open()  # the config is read when the transfer opens
    assert await world.sync.push()
    got = world.git_remote("config", "--local", "--get-regexp", r"^(remote|branch)\.")
    assert "s3cret" not in got and "elsewhere" not in got
    assert world.git_remote("remote").split() == ["origin", "upstream"]
    assert world.git_remote("remote", "get-url", "origin").strip() == (
        "https://git.test/acme/widget.git"
    )
    assert world.git_remote("remote", "get-url", "upstream").strip() == (
        "git@git.test:acme/widget.git"
    )
    assert world.git_remote("config", "branch.task.merge").strip() == "refs/heads/task"
    # sent once: a later push carries none, and what the pod set stays
    (world.host / "README.md").write_text("again\n")
    assert await world.sync.push()
    assert world.git_remote("remote").split() == ["origin", "upstream"]
