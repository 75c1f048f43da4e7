"""The host side of the worktree transfer: :class:`WorktreeSync`, one per task.

``push()`` before each command: the host worktree as it is (tracked and untracked files, not
ignored ones, plus ``bringBack``), its index and its branch, snapshotted as git objects
through a private index (the user's index and refs are not touched), and a thin pack of what
the remote lacks since the last transfer. Nothing crosses when nothing changed.

``pull()`` after it: the remote's snapshot and a thin pack back. The host trusts none of it.
The pack is indexed into a quarantine object directory (``index-pack --strict``: every object
fsck-checked, links complete), bounded in bytes and objects before a byte of it is read;
the changed paths are checked (:mod:`.paths`) and planned (:mod:`.plan`) against what the
host has now, and only then are the objects moved into the repository, the files written
(:mod:`.apply`), the index replaced (only when the host's did not change meanwhile) and the
task branch moved (compare-and-swap against what was pushed). Refs other than the task
branch are never read from the remote.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusion_oci.host.process import run_process
from fusion_oci.models import DEFAULT_PROTECTED_PATHS
from fusion_oci.runtimes.kubernetes.sync.apply import DIR_FLAGS, apply_plan, inspect
from fusion_oci.runtimes.kubernetes.sync.errors import SyncRefusedError, WorktreeSyncError
from fusion_oci.runtimes.kubernetes.sync.paths import (
    check_branch,
    check_link_target,
    check_path,
    is_oid,
    protected_by,
    relative_patterns,
)
from fusion_oci.runtimes.kubernetes.sync.plan import (
    Change,
    Plan,
    build_plan,
    check_changes,
    parse_diff_tree,
)
from fusion_oci.runtimes.kubernetes.sync.remotes import carried_config
from fusion_oci.runtimes.kubernetes.sync.settings import SyncSettings
from fusion_oci.runtimes.kubernetes.sync.stream import ByteStream, request

GIT_TIMEOUT_S = 120.0
EMPTY_TREE = {
    "sha1": "4b825dc642cb6eb9a060e54bf8d69288fbee4904",
    "sha256": "6ef19b41225c5369f1c104d45d8d85efa9b057b53b14b4b9b939dd74decc5321",
}
MIB = 1 << 20
HOST_GIT = (
    "-c",
    "core.fsmonitor=false",
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "safe.directory=*",
    "-c",
    "gc.auto=0",
)
"""The host's git reads the user's config (it is theirs) but runs none of a worktree's
programs: no fsmonitor, no hooks, no automatic gc while a quarantine is open."""
STRICT = "--strict=badFilemode=error,zeroPaddedFilemode=error,fullPathname=error"
"""fsck's checks with the ones it only reports (a mode other than 644, 755, link, folder,
gitlink; a zero-padded mode; a name with a slash) made errors: --strict alone passes them."""


@dataclass(frozen=True)
class State:
    """One side's snapshot: worktree tree, index tree, task branch commit."""

    worktree: str
    index: str | None
    head: str | None

    def oids(self) -> dict[str, str]:
        return {k: v for k, v in vars(self).items() if v}


@dataclass
class PullReport:
    """What a pull did and what it kept out (each with why)."""

    written: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    conflicts: list[tuple[str, str | None]] = field(default_factory=list)
    """(path, the remote's object): changed on the host during the command as well; the
    host's version stays, the remote's object is in the repository (``git cat-file -p``)."""
    refused: list[tuple[str, str]] = field(default_factory=list)
    gitlinks: list[tuple[str, str]] = field(default_factory=list)
    """(path, commit): repositories the command made or changed, left in the sandbox."""
    index: str = "unchanged"
    """``unchanged``, ``updated``, or why the remote's index was not taken."""
    branch: str = "unchanged"
    """``unchanged``, ``updated OLD..NEW``, or why the branch was not moved."""
    pack_bytes: int = 0


def _tail(data: bytes) -> str:
    return data.decode(errors="replace").strip()[-400:]


class WorktreeSync:
    """The transfer of one task's worktree to and from its remote sandbox."""

    def __init__(
        self,
        worktree: Path,
        stream: ByteStream,
        state_dir: Path,
        settings: SyncSettings | None = None,
        protected: Sequence[str] = DEFAULT_PROTECTED_PATHS,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.root = worktree.resolve()
        self.stream = stream
        self.state_dir = state_dir
        self.settings = settings or SyncSettings()
        self.protected = relative_patterns(str(self.root), protected)
        base_env = env if env is not None else os.environ
        self._env = {k: v for k, v in base_env.items() if k in ("PATH", "HOME", "LANG", "LC_ALL")}
        self._env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        self.base: State | None = None
        """What both sides have: the last state pushed or pulled (None: nothing yet)."""
        self.branch = ""
        self.git_dir = Path()
        self.common = Path()
        self.objects = Path()
        self.algo = "sha1"
        self._index_stamp: tuple[int, int, int] | None = None
        self._wt_stamp: tuple[int, int, int] | None = None
        self._wt_tree: str | None = None
        self._index_tree: str | None = None
        self._broken = False
        self._config: list[tuple[str, str]] | None = None
        """The host repository's config the remote's gets (sync/remotes.py), until sent."""
        self._dirs: set[str] = set()
        """Folders the remote was asked to make (``push(dirs=...)``)."""
        self._stale = False
        """A pull was refused: the remote holds what the host did not take, so the next
        push sends the host's state even if the host did not change."""
        self._turn = asyncio.Lock()
        """One transfer at a time: the stream carries one request and its reply at a time,
        and a push and a pull both move ``base``. Concurrent commands of a task (an executor
        runs them) take turns here, each whole."""

    # -- git on the host -------------------------------------------------------------------

    async def _git(
        self,
        *args: str,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        max_buffer: int = 64 * MIB,
        check: bool = True,
    ) -> bytes:
        argv = ["git", *HOST_GIT, "-C", str(self.root), *args]
        done = await run_process(
            argv,
            env={**self._env, **(env or {})},
            stdin=stdin,
            timeout_s=GIT_TIMEOUT_S,
            max_buffer=max_buffer,
        )
        if done.truncated:
            raise WorktreeSyncError(f"git {args[0]} on the host", "its output passed its bound")
        if check and done.returncode != 0:
            raise WorktreeSyncError(
                f"git {args[0]} on the host failed",
                f"exit {done.returncode}, {'timed out, ' if done.timed_out else ''}"
                f"stderr: {_tail(done.stderr)}",
                "check the worktree with `git status`",
            )
        return done.stdout if done.returncode == 0 else b""

    async def open(self) -> None:
        """Find the repository and the task branch (the branch the worktree has checked out)."""
        out = await self._git("rev-parse", "--absolute-git-dir", "--git-common-dir")
        git_dir, common = out.decode().splitlines()[:2]
        self.git_dir = Path(git_dir)
        self.common = (self.root / common).resolve()
        self.objects = self.common / "objects"
        fmt = await self._git("rev-parse", "--show-object-format", check=False)
        self.algo = "sha256" if fmt.strip() == b"sha256" else "sha1"
        ref = (await self._git("symbolic-ref", "-q", "HEAD", check=False)).decode().strip()
        branch = ref.removeprefix("refs/heads/")
        why = check_branch(branch) if ref.startswith("refs/heads/") else "HEAD is detached"
        if why is not None:
            raise WorktreeSyncError(
                "the worktree's branch cannot be the task branch",
                f"{ref or 'HEAD'}: {why}",
                "check out the task's branch in the worktree (`git switch BRANCH`)",
            )
        self.branch = branch
        # the repository's remotes, so `git push origin` works in the pod (sync/remotes.py)
        listing = await self._git("config", "--local", "--list", "-z", check=False)
        pairs = [
            entry.partition("\n")[::2] for entry in listing.decode(errors="replace").split("\0")
        ]
        self._config = carried_config(((k, v) for k, v in pairs if k), branch)
        self.state_dir.mkdir(parents=True, exist_ok=True)

    @property
    def hex_len(self) -> int:
        return 64 if self.algo == "sha256" else 40

    # -- push --------------------------------------------------------------------------------

    async def _worktree_tree(self) -> str:
        private = self.state_dir / "worktree.index"
        real = self.git_dir / "index"
        if not private.exists() and real.exists():
            # Start from the user's index: its stat data spares hashing every file once.
            await asyncio.to_thread(shutil.copyfile, real, private)
        env = {"GIT_INDEX_FILE": str(private)}
        # The untracked cache (kept in the private index) spares re-reading every folder
        # whose mtime did not change: it halves `add -A` on a worktree of 2000 files.
        await self._git("-c", "core.untrackedCache=true", "add", "-A", env=env)
        back = [p for p in self.settings.bring_back if _lexists(self.root / p)]
        if back:
            await self._git("add", "-A", "-f", "--", *back, env=env)
        # git rewrites an index only when something in it changed (a new file each time):
        # the same file means the same tree, and write-tree is skipped.
        if self._wt_tree is not None and _stamp(private) == self._wt_stamp:
            return self._wt_tree
        tree = (await self._git("write-tree", env=env)).decode().strip()
        self._wt_stamp, self._wt_tree = _stamp(private), tree
        return tree

    async def _index_tree_now(self) -> str | None:
        """The tree of the user's index, written from a copy (the user's file is not
        locked or rewritten); cached while the file's stat is the same."""
        real = self.git_dir / "index"
        try:
            st = real.stat()
        except FileNotFoundError:
            return None
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._index_stamp and self._index_tree is not None:
            return self._index_tree
        copy = self.state_dir / "index.copy"
        await asyncio.to_thread(shutil.copyfile, real, copy)
        out = await self._git("write-tree", env={"GIT_INDEX_FILE": str(copy)}, check=False)
        self._index_stamp, self._index_tree = stamp, out.decode().strip() or None
        return self._index_tree

    async def _head_now(self) -> str | None:
        # The loose ref file when there is one (the host's own, read as git would); else git.
        with contextlib.suppress(OSError, ValueError):
            text = (self.common / "refs" / "heads" / self.branch).read_text("ascii").strip()
            if is_oid(text, self.hex_len):
                return text
        ref = f"refs/heads/{self.branch}^{{commit}}"
        out = await self._git("rev-parse", "-q", "--verify", ref, check=False)
        return out.decode().strip() or None

    async def snapshot(self) -> State:
        """The host's state now, as objects in its repository (its refs untouched)."""
        worktree, index, head = await asyncio.gather(
            self._worktree_tree(), self._index_tree_now(), self._head_now()
        )
        return State(worktree=worktree, index=index, head=head)

    def _check_usable(self) -> None:
        if self._broken:
            raise WorktreeSyncError(
                "the transfer stream was closed after a failed exchange",
                "it cannot be trusted to be in step",
                "dispose of the task and prepare it again",
            )

    async def push(self, dirs: Sequence[str] = ()) -> bool:
        """Make the remote worktree, index and branch the host's. False: nothing had changed
        since the last transfer, and nothing crossed. ``dirs``: folders (relative to the
        worktree) the remote must have even when empty, which git does not carry: a
        command's working directory."""
        async with self._turn:
            return await self._push(dirs)

    async def _push(self, dirs: Sequence[str]) -> bool:
        self._check_usable()
        state = await self.snapshot()
        wanted_dirs = sorted(d for d in dirs if d not in self._dirs)
        for d in wanted_dirs:
            why = check_path(d)
            if why is not None:
                raise WorktreeSyncError(f"the folder {d!r} cannot cross to the sandbox", why)
        if state == self.base and not self._stale and not wanted_dirs:
            return False
        have = self.base.oids() if self.base is not None else {}
        wanted = [v for k, v in state.oids().items() if have.get(k) != v]
        pack = b""
        if wanted:
            revs = "".join(f"{v}\n" for v in wanted) + "".join(f"^{v}\n" for v in have.values())
            pack = await self._git(
                "pack-objects", "--revs", "--thin", "--stdout", "-q",
                stdin=revs.encode(), max_buffer=1 << 31,
            )  # fmt: skip
        meta: dict[str, Any] = {
            "op": "push",
            "branch": self.branch,
            "objectFormat": self.algo,
            "bringBack": self.settings.bring_back,
            "dirs": wanted_dirs,
            **vars(state),
        }
        if self._config is not None:
            meta["config"] = self._config
        self.base = None  # until the remote says it has it
        reply, _ = await self._exchange(meta, pack)
        if reply.get("ok") is not True:
            raise WorktreeSyncError(
                "the sandbox could not take the worktree", str(reply.get("error"))[:600]
            )
        self.base = state
        self._stale = False
        self._dirs.update(wanted_dirs)
        self._config = None
        return True

    async def _exchange(self, meta: dict[str, Any], pack: bytes) -> tuple[dict[str, Any], bytes]:
        try:
            return await request(
                self.stream,
                meta,
                pack,
                max_payload=self.settings.max_transfer_mb * MIB,
                timeout_s=GIT_TIMEOUT_S,
            )
        except WorktreeSyncError:
            self._broken = True
            await self.stream.close()
            raise

    # -- pull --------------------------------------------------------------------------------

    def _remote_state(self, reply: dict[str, Any]) -> tuple[State, str | None]:
        if reply.get("ok") is not True:
            raise WorktreeSyncError(
                "the sandbox could not snapshot its worktree", str(reply.get("error"))[:600]
            )
        values: dict[str, str | None] = {}
        for key in ("worktree", "index", "head"):
            value = reply.get(key)
            if value is None and key != "worktree":
                values[key] = None
            elif not is_oid(value, self.hex_len):
                raise SyncRefusedError(f"{key}: {str(value)[:80]!r} is not an object id")
            else:
                values[key] = str(value)
        head_ref = reply.get("headRef")
        if head_ref is not None and not isinstance(head_ref, str):
            raise SyncRefusedError("headRef is not a string")
        worktree = values["worktree"]
        assert worktree is not None
        return State(worktree, values["index"], values["head"]), head_ref

    def _check_pack(self, pack: bytes) -> None:
        if len(pack) < 12 or pack[:4] != b"PACK" or pack[4:8] not in (b"\0\0\0\2", b"\0\0\0\3"):
            raise SyncRefusedError("the reply's payload is not a git pack")
        count = int.from_bytes(pack[8:12], "big")
        if count > self.settings.max_objects:
            raise SyncRefusedError(
                f"a pack of {count} objects (the limit is {self.settings.max_objects})"
            )

    async def pull(self) -> PullReport:
        """Bring what the command changed back into the host worktree (module docstring)."""
        async with self._turn:
            return await self._pull()

    async def _pull(self) -> PullReport:
        self._check_usable()
        if self.base is None:
            raise WorktreeSyncError("pull before push", "the remote has no worktree yet")
        base = self.base
        meta = {
            "op": "pull",
            "branch": self.branch,
            "bringBack": self.settings.bring_back,
            "base": vars(base),
        }
        self._stale = True
        reply, pack = await self._exchange(meta, b"")
        new, head_ref = self._remote_state(reply)
        report = PullReport(pack_bytes=len(pack))
        if new == base and not pack:
            self._stale = False
            return report
        if pack:
            self._check_pack(pack)
        quarantine = Path(tempfile.mkdtemp(prefix="incoming-fusion-sync-", dir=self.objects))
        try:
            await self._pull_into(quarantine, pack, base, new, head_ref, report)
        finally:
            await asyncio.to_thread(shutil.rmtree, quarantine, True)
        self.base = new
        self._stale = False
        return report

    def _qenv(self, quarantine: Path) -> dict[str, str]:
        return {
            "GIT_OBJECT_DIRECTORY": str(quarantine),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(self.objects),
        }

    async def _pull_into(
        self,
        quarantine: Path,
        pack: bytes,
        base: State,
        new: State,
        head_ref: str | None,
        report: PullReport,
    ) -> None:
        qenv = self._qenv(quarantine)
        if pack:
            await self._index_pack(pack, qenv)
        changes: list[Change] = []
        if new.worktree != base.worktree:
            changes = await self._diff(base.worktree, new.worktree, qenv)
        index_changes: list[Change] = []
        if new.index and new.index != base.index:
            index_changes = await self._diff(base.index, new.index, qenv)
            check_changes(index_changes, self.settings.max_paths)
        plan = await self._plan(changes)
        blobs = await self._objects(new, plan, qenv)
        await asyncio.to_thread(self._migrate, quarantine)
        failed = await asyncio.to_thread(apply_plan, self.root, plan, blobs)
        done_writes = {w.path for w in plan.writes} - {p for p, _ in failed}
        report.written = sorted(done_writes)
        report.deleted = sorted(set(plan.deletes) - {p for p, _ in failed})
        report.conflicts = plan.conflicts
        report.refused = plan.refused + failed
        report.gitlinks = plan.gitlinks
        if new.index != base.index:
            report.index = await self._take_index(base, new, index_changes)
        if new.head != base.head or head_ref != f"refs/heads/{self.branch}":
            report.branch = await self._take_branch(base, new, head_ref)

    async def _index_pack(self, pack: bytes, qenv: dict[str, str]) -> None:
        # --strict: every object fsck-checked (names like .GIT, bad modes, broken trees and
        # commits) and every link present; --fix-thin: the deltas' bases come from the host.
        done = await run_process(
            ["git", *HOST_GIT, "-C", str(self.root), "index-pack", "--stdin", STRICT,
             "--fix-thin", f"--max-input-size={len(pack)}"],
            env={**self._env, **qenv}, stdin=pack, timeout_s=GIT_TIMEOUT_S,
        )  # fmt: skip
        if done.returncode != 0:
            raise SyncRefusedError(f"the pack failed git's checks: {_tail(done.stderr)}")

    async def _diff(self, old: str | None, new: str, qenv: dict[str, str]) -> list[Change]:
        # diff-tree also proves both sides are trees the host has (base ones or checked ones).
        done = await run_process(
            ["git", *HOST_GIT, "-C", str(self.root), "diff-tree", "-r", "-z", "--no-renames",
             "--no-commit-id", old or EMPTY_TREE[self.algo], new],
            env={**self._env, **qenv}, timeout_s=GIT_TIMEOUT_S, max_buffer=256 * MIB,
        )  # fmt: skip
        if done.returncode != 0 or done.truncated:
            raise SyncRefusedError(
                f"{new} is not a tree the host can compare: {_tail(done.stderr)}"
            )
        return parse_diff_tree(done.stdout)

    async def _plan(self, changes: list[Change]) -> Plan:
        check_changes(changes, self.settings.max_paths)
        adding = {c.path for c in changes if c.old is None}
        paths = [c.path for c in changes]

        def look() -> dict[str, Any]:
            fd = os.open(self.root, DIR_FLAGS)
            try:
                return inspect(fd, paths, adding, self.algo)
            finally:
                os.close(fd)

        host = await asyncio.to_thread(look)
        return build_plan(changes, host, self.protected, self.settings.max_paths)

    async def _objects(self, new: State, plan: Plan, qenv: dict[str, str]) -> dict[str, bytes]:
        """The contents of the blobs to write, and the remote's state checked for type, in
        one ``cat-file --batch`` whose output is bounded by maxTransferMb; each blob's size
        is then held to maxFileMb."""
        want = {new.worktree: "tree"}
        if new.index:
            want[new.index] = "tree"
        if new.head:
            want[new.head] = "commit"
        for item in plan.writes:
            want.setdefault(item.oid, "blob")
        query = "".join(f"{oid}\n" for oid in want).encode()
        max_total = self.settings.max_transfer_mb * MIB
        done = await run_process(
            ["git", *HOST_GIT, "-C", str(self.root), "cat-file", "--batch"],
            env={**self._env, **qenv}, stdin=query, timeout_s=GIT_TIMEOUT_S,
            max_buffer=max_total + 4 * MIB,
        )  # fmt: skip
        if done.truncated:
            raise SyncRefusedError(f"more than {max_total} bytes of files (maxTransferMb)")
        if done.returncode != 0:
            raise WorktreeSyncError("git cat-file on the host failed", _tail(done.stderr))
        found = _parse_batch(done.stdout)
        max_file = self.settings.max_file_mb * MIB
        for oid, kind in want.items():
            got = found.get(oid)
            if got is None or got[0] != kind:
                raise SyncRefusedError(f"{oid} is not a {kind} the host has")
        blobs = {oid: found[oid][1] for oid, kind in want.items() if kind == "blob"}
        for item in plan.writes:
            data = blobs[item.oid]
            if len(data) > max_file:
                raise SyncRefusedError(
                    f"{item.path!r} is {len(data)} bytes (the limit is {max_file}: maxFileMb)"
                )
            why = check_link_target(data) if item.mode == "120000" else None
            if why is not None:
                raise SyncRefusedError(f"{item.path!r}: {why}")
        return blobs

    def _migrate(self, quarantine: Path) -> None:
        """Move the checked objects into the repository: packs before their indexes (a
        reader must never find an index without its pack), loose objects as they are."""
        order = {".pack": 0, ".rev": 1, ".idx": 2}
        pack_dir = quarantine / "pack"
        files = sorted(
            (p for p in pack_dir.iterdir() if p.suffix in order) if pack_dir.is_dir() else [],
            key=lambda p: order[p.suffix],
        )
        (self.objects / "pack").mkdir(exist_ok=True)
        for path in files:
            target = self.objects / "pack" / path.name
            if not target.exists():
                path.replace(target)
        for sub in quarantine.iterdir():
            if len(sub.name) == 2 and sub.is_dir():
                (self.objects / sub.name).mkdir(exist_ok=True)
                for obj in sub.iterdir():
                    target = self.objects / sub.name / obj.name
                    if not target.exists():
                        obj.replace(target)

    async def _take_index(self, base: State, new: State, changes: list[Change]) -> str:
        if new.index is None:
            return "kept: the sandbox's index has unmerged entries"
        touched = [c.path for c in changes if protected_by(c.path, self.protected)]
        if touched:
            return f"kept: it stages protected paths ({', '.join(touched[:5])})"
        self._index_stamp = None
        if await self._index_tree_now() != base.index:
            return "kept: the host's index changed during the command"
        # --reset (without -u: the worktree is not touched) keeps the stat data of entries
        # whose content is the same, and takes the others as they are staged in the sandbox.
        await self._git("read-tree", "--reset", new.index)
        self._index_stamp = None
        return "updated"

    async def _take_branch(self, base: State, new: State, head_ref: str | None) -> str:
        want = f"refs/heads/{self.branch}"
        if head_ref != want:
            return f"unchanged: the sandbox's HEAD is {str(head_ref)[:120]!r}, not {want}"
        if new.head is None:
            return "unchanged: the sandbox's branch has no commit"
        old = base.head or "0" * self.hex_len
        # Compare-and-swap against what was pushed: a branch the host moved meanwhile stays.
        await self._git(
            "update-ref", "-m", "fusion-oci: commits made in the sandbox", want, new.head, old,
            check=False,
        )  # fmt: skip
        if await self._head_now() != new.head:
            return f"unchanged: the host's {want} moved during the command (sandbox: {new.head})"
        return f"updated {base.head or '(none)'}..{new.head}"

    async def close(self) -> None:
        await self.stream.close()


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _lexists(path: Path) -> bool:
    return path.is_symlink() or path.exists()


def _parse_batch(out: bytes) -> dict[str, tuple[str, bytes]]:
    """``git cat-file --batch`` output: oid -> (type, content); missing objects left out."""
    found: dict[str, tuple[str, bytes]] = {}
    pos = 0
    while pos < len(out):
        end = out.index(b"\n", pos)
        head = out[pos:end].decode("ascii", "replace").split(" ")
        if len(head) != 3:
            pos = end + 1  # "<oid> missing"
            continue
        size = int(head[2])
        found[head[0]] = (head[1], out[end + 1 : end + 1 + size])
        pos = end + 1 + size + 1
    return found


__all__ = ["PullReport", "State", "WorktreeSync"]
