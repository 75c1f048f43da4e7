"""Repositories inside the worktree that the host's git would enter, kept out of a command's hands.

After a command the executor runs git on the host (``git status``, ``git diff``, ``git commit``).
``git status`` runs ``git status`` again inside every *populated submodule* — each gitlink of
the index whose folder holds a ``.git`` — with that repository's own config and hooks, and
``git submodule update`` runs the hooks of the git dirs under ``.git/modules/``. A command can
make such a repository (``git init x && git config -C x core.fsmonitor PROGRAM && git add x``)
or rewrite an existing one's config, and the host's next ``git status`` would run PROGRAM
outside any sandbox. The top repository's ``.git/config`` and hooks are protected paths; these
cannot be (a command creates them at will, anywhere in the worktree).

So the host fingerprints them at prepare (:func:`snapshot`: each populated gitlink's ``.git``
entry and git dir, every git dir under ``modules/``: their config files, ``commondir`` and
hooks), and after every command (:meth:`GitGuard.after_command`) moves each one that is new or
changed out of the worktree, into the project's ``.fusion/quarantine/`` (which no sandbox can
write and no git walks into): the host's git then sees an unpopulated submodule. The run's audit
event and its stderr name what was moved and where. What a person left there before the task
is its baseline and stays.

The check costs one ``stat`` of the index and of ``modules/`` when neither changed and the
worktree has no submodule; otherwise one ``git ls-files`` (the host's git, with fsmonitor
off and no hooks).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fusion_oci.policy.layout import GitLayout

GIT_TIMEOUT_S = 20.0
QUARANTINE_DIR = "quarantine"
FINGERPRINTED = ("config", "config.worktree", "commondir")
"""The files of a git dir that decide what git runs there (hooks/ is listed as well)."""

Fingerprints = dict[str, str]
"""Path of a ``.git`` entry or git dir -> digest of what git would run from it."""


def _digest_file(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return "-"
    except OSError as exc:
        return f"!{exc.errno}"
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            return f"mode {st.st_mode:o}"
        return hashlib.sha256(fh.read(1 << 20)).hexdigest()[:16] + f"/{st.st_size}"


def _gitdir_print(gitdir: Path) -> str:
    """A git dir's config files and hooks, as one digest."""
    parts = [f"{name}={_digest_file(gitdir / name)}" for name in FINGERPRINTED]
    try:
        hooks = sorted(os.scandir(gitdir / "hooks"), key=lambda e: e.name)
    except OSError:
        hooks = []
    for entry in hooks:
        st = entry.stat(follow_symlinks=False)
        parts.append(f"hook {entry.name} {st.st_mode:o} {st.st_size} {st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _pointer(dotgit: Path) -> Path | None:
    """The git dir a ``.git`` file names (``gitdir: PATH``), or None."""
    try:
        fd = os.open(dotgit, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        text = fh.read(4096).decode("utf-8", errors="replace").strip()
    if not text.startswith("gitdir:"):
        return None
    target = Path(text.removeprefix("gitdir:").strip())
    return target if target.is_absolute() else dotgit.parent / target


def entry_print(dotgit: Path) -> str | None:
    """The fingerprint of a gitlink's ``.git`` (a folder, or a file naming its git dir), or
    None when the gitlink is not populated (git does not enter it)."""
    try:
        st = os.lstat(dotgit)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return "dir " + _gitdir_print(dotgit)
    if stat.S_ISREG(st.st_mode):
        target = _pointer(dotgit)
        where = os.path.normpath(target) if target is not None else "?"
        return f"file {where} " + (_gitdir_print(target) if target is not None else "")
    return f"mode {st.st_mode:o}"  # a symlink or anything else: git may follow it


def module_dirs(common_dir: Path, limit: int = 512) -> list[Path]:
    """Every git dir under ``modules/`` (submodules of submodules too), at most ``limit``."""
    found: list[Path] = []
    todo = [common_dir / "modules"]
    while todo and len(found) < limit:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            path = Path(entry.path)
            if os.path.lexists(path / "HEAD"):
                found.append(path)
                todo.append(path / "modules")
            else:
                todo.append(path)  # a submodule named a/b: modules/a/b
    return found


def parse_gitlinks(ls_files: bytes) -> list[str]:
    """The gitlink paths (mode 160000) of ``git ls-files -s -z`` output. Pure."""
    out = []
    for record in ls_files.split(b"\0"):
        meta, _, path = record.partition(b"\t")
        if meta.startswith(b"160000 "):
            out.append(os.fsdecode(path))
    return out


async def _gitlinks(worktree: Path, env: Mapping[str, str]) -> list[str] | None:
    from fusion_oci.host.process import run_process

    argv = [
        "git",
        "-c",
        "core.fsmonitor=false",
        "-c",
        "core.hooksPath=/dev/null",
        "-c",
        "safe.directory=*",
        "--no-optional-locks",
        "-C",
        str(worktree),
        "ls-files",
        "-s",
        "-z",
    ]
    clean = {k: v for k, v in env.items() if k in ("PATH", "HOME", "LANG", "LC_ALL")}
    try:
        done = await run_process(argv, env=clean, timeout_s=GIT_TIMEOUT_S, max_buffer=64 << 20)
    except OSError:
        return None
    if done.returncode != 0 or done.timed_out:
        return None
    return parse_gitlinks(done.stdout)


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class GitGuard:
    """One task's watch over the repositories inside its worktree (module docstring)."""

    worktree: Path
    git: GitLayout
    quarantine: Path
    """``<project>/.fusion/quarantine``: where changed git dirs are moved."""
    env: Mapping[str, str]
    baseline: Fingerprints = field(default_factory=dict)
    _stamps: tuple[object, ...] = ()

    def _stamps_now(self) -> tuple[object, ...]:
        common = Path(self.git.common_dir)
        return (_stamp(Path(self.git.git_dir) / "index"), _stamp(common / "modules"))

    async def snapshot(self) -> Fingerprints:
        """What git would run from, now: every populated gitlink's ``.git`` and every git
        dir under ``modules/``."""
        links = await _gitlinks(self.worktree, self.env)
        return await asyncio.to_thread(self._prints, links or [])

    def _prints(self, links: list[str]) -> Fingerprints:
        prints: Fingerprints = {}
        for rel in links:
            dotgit = self.worktree / rel / ".git"
            found = entry_print(dotgit)
            if found is not None:
                prints[str(dotgit)] = found
        for gitdir in module_dirs(Path(self.git.common_dir)):
            prints[str(gitdir)] = "module " + _gitdir_print(gitdir)
        return prints

    async def prepare(self) -> None:
        """Take the baseline (what a person left there)."""
        self._stamps = self._stamps_now()
        self.baseline = await self.snapshot()

    async def after_command(self, run_id: str) -> list[tuple[str, str]]:
        """Move every new or changed one to the quarantine; (what, where it went) each."""
        stamps = self._stamps_now()
        if stamps == self._stamps and not self.baseline:
            return []  # the index and modules/ unchanged, and no submodule to rewrite
        now = await self.snapshot()
        moved: list[tuple[str, str]] = []
        changed = [path for path, print_ in now.items() if self.baseline.get(path) != print_]
        for path in changed:
            # (off the loop: a move across file systems copies, and the loop may serve others)
            target = await asyncio.to_thread(self._move, Path(path), run_id)
            if target is not None:
                moved.append((path, str(target)))
        self._stamps = self._stamps_now()
        self.baseline = await self.snapshot() if moved else now
        return moved

    def _move(self, path: Path, run_id: str) -> Path | None:
        if not os.path.lexists(path):
            return None
        stamp = time.strftime("%Y%m%dT%H%M%S")
        rel = path.relative_to(path.anchor)
        target = self.quarantine / f"{stamp}-{run_id}" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            shutil.move(str(path), str(target))
        return target


__all__ = ["GitGuard", "entry_print", "module_dirs", "parse_gitlinks"]
