"""The only code that writes what came from the remote into the host worktree.

Every path is walked from an open descriptor of the worktree, one component at a time, with
``O_NOFOLLOW | O_DIRECTORY``: a symlink (one the remote made, or one on the host) or a file
where a folder should be stops the walk, and that path is refused; nothing is ever written
through a link. A file is written to a fresh temporary name in its folder (``O_EXCL``, mode
set with ``fchmod`` to exactly 644 or 755) and renamed over the old entry, so a symlink at
the target is replaced, never followed, and a reader never sees half a file. A symlink is
made the same way (``symlinkat`` + rename).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from fusion_oci.runtimes.kubernetes.sync.paths import fold
from fusion_oci.runtimes.kubernetes.sync.plan import HostEntry, Plan, Write

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_CHUNK = 1 << 20


class Blocked(Exception):
    """A path's parent on the host is a symlink or not a folder."""


def blob_oid(data: bytes, algo: str) -> str:
    """The git object id of a blob with this content."""
    digest = hashlib.new(algo)
    digest.update(b"blob %d\0" % len(data))
    digest.update(data)
    return digest.hexdigest()


@contextlib.contextmanager
def parent_dir(root_fd: int, path: str, create: bool = False) -> Iterator[int]:
    """An open descriptor of ``path``'s folder, walked without following anything."""
    parts = path.split("/")[:-1]
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Blocked(f"{part!r} on the host is a symlink or not a folder") from exc
                raise
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _read_entry(dir_fd: int, name: str, algo: str) -> HostEntry:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(name, dir_fd=dir_fd)
        return ("120000", blob_oid(os.fsencode(target), algo))
    if stat.S_ISDIR(st.st_mode):
        return ("dir", "a folder")
    if not stat.S_ISREG(st.st_mode):
        return ("other", "neither a file, a symlink nor a folder")
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read()
    mode = "100755" if st.st_mode & 0o100 else "100644"
    return (mode, blob_oid(data, algo))


def inspect(
    root_fd: int, paths: Sequence[str], adding: set[str], algo: str
) -> dict[str, HostEntry]:
    """What the host has at each path now (for conflicts); for paths being added, whether a
    sibling's name folds onto theirs."""
    out: dict[str, HostEntry] = {}
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        try:
            with parent_dir(root_fd, path) as fd:
                entry = _read_entry(fd, name, algo)
                if entry is None and path in adding:
                    names = os.listdir(fd)  # noqa: PTH208 (a descriptor: never re-walked by name)
                    clash = [n for n in names if n != name and fold(n) == fold(name)]
                    if clash:
                        entry = ("collides", f"its name folds onto {clash[0]!r} on the host")
                out[path] = entry
        except FileNotFoundError:
            out[path] = None
        except Blocked as exc:
            out[path] = ("blocked", str(exc))
    return out


def _prune(root_fd: int, path: str) -> None:
    """Remove the folders above ``path`` that its removal left empty."""
    parts = path.split("/")[:-1]
    while parts:
        with contextlib.suppress(OSError), parent_dir(root_fd, "/".join(parts)) as fd:
            os.rmdir(parts[-1], dir_fd=fd)
        parts.pop()


def _write(root_fd: int, item: Write, data: bytes) -> None:
    name = item.path.rsplit("/", 1)[-1]
    with parent_dir(root_fd, item.path, create=True) as fd:
        tmp = f".fusion-sync-{secrets.token_hex(6)}"
        if item.mode == "120000":
            os.symlink(os.fsdecode(data), tmp, dir_fd=fd)
        else:
            out = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=fd,
            )
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view[:READ_CHUNK]) :]
                os.fchmod(out, 0o755 if item.mode == "100755" else 0o644)
            finally:
                os.close(out)
        try:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    os.rmdir(name, dir_fd=fd)  # an empty folder the deletions left
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise


def apply_plan(root: Path, plan: Plan, blobs: Mapping[str, bytes]) -> list[tuple[str, str]]:
    """Carry out ``plan`` in ``root``; (path, why) of each path that could not be written
    after all (a parent became a symlink, a folder that still holds files)."""
    failed: list[tuple[str, str]] = []
    root_fd = os.open(root, DIR_FLAGS)
    try:
        for path in plan.deletes:
            name = path.rsplit("/", 1)[-1]
            try:
                with parent_dir(root_fd, path) as fd:
                    os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except (Blocked, OSError) as exc:
                failed.append((path, str(exc)))
                continue
            _prune(root_fd, path)
        for item in plan.writes:
            try:
                _write(root_fd, item, blobs[item.oid])
            except (Blocked, OSError) as exc:
                failed.append((item.path, str(exc)))
    finally:
        os.close(root_fd)
    return failed


__all__ = ["Blocked", "apply_plan", "blob_oid", "inspect", "parent_dir"]
