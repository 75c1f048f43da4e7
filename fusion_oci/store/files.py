"""Files a pass writes into a task's worktree, relative to a directory fd and following no
symlink: reading a plain file whole, the task's own copies (clones of a blob where the
filesystem clones), and the atomic swap of a name for a link."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

FICLONE = 0x40049409
"""``ioctl(2)`` FICLONE: a new file shares another's blocks, copy on write (XFS with reflink,
btrfs). The task's own copies of blobs (bin targets) are clones where the filesystem has them,
so they cost no blocks; ext4 has none, and there an own copy is a copy."""
_NO_CLONE: set[int] = set()
"""Filesystems (``st_dev``) that answered a clone with "not supported": not asked again."""


def read_file(
    dir_fd: int,
    name: str,
    most: int,
    accept: Callable[[os.stat_result], bool] = lambda st: True,
) -> tuple[bytes | None, bool]:
    """The bytes and exec bit of a plain file (no symlink followed) that ``accept``-s its
    ``fstat`` and holds at most ``most`` bytes; (None, False) otherwise. No further than the
    size ``fstat`` gave: a process the task left running may still be appending (a blob holds
    exactly the bytes hashed, whatever the file holds after)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None, False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > most or not accept(st):
            return None, False
        chunks, left = [], st.st_size
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), bool(st.st_mode & 0o111)
    finally:
        os.close(fd)


def _new_own_file(
    dir_fd: int, name: str, fill: Callable[[int], None], owner: os.stat_result, executable: bool
) -> None:
    """Create ``name`` (it must not exist), ``fill`` its fd, own it as ``owner``'s uid and gid
    (the folder's: a file the task may ``chmod``), mode 0755 or 0644; on any failure the
    name is removed again (no half-made file stays)."""
    fd = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )
    try:
        fill(fd)
        os.fchown(fd, owner.st_uid, owner.st_gid)
        os.fchmod(fd, 0o755 if executable else 0o644)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)


def write_own_file(
    dir_fd: int, name: str, data: bytes, owner: os.stat_result, executable: bool
) -> None:
    """Create ``name`` (it must not exist) holding ``data``, owned by ``owner``'s uid and gid
    (the folder's: a file the task may ``chmod``), mode 0755 or 0644."""

    def write(fd: int) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    _new_own_file(dir_fd, name, write, owner, executable)


def clones(dev: int) -> bool:
    """Whether files on the filesystem ``dev`` may still be cloned (none refused yet)."""
    return dev not in _NO_CLONE


def clone_own_file(
    dir_fd: int, name: str, source: Path, owner: os.stat_result, executable: bool
) -> bool:
    """Create ``name`` (it must not exist) as a clone of the blob ``source`` (:data:`FICLONE`),
    owned and moded as :func:`write_own_file` makes it; False, with nothing created, where the
    filesystem cannot clone (the caller writes the bytes instead)."""
    if not clones(owner.st_dev):
        return False
    try:
        src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # pruned meanwhile: the caller writes the bytes it holds
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            return False

        def clone(fd: int) -> None:
            fcntl.ioctl(fd, FICLONE, src)

        _new_own_file(dir_fd, name, clone, owner, executable)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.ENOSYS):
            _NO_CLONE.add(owner.st_dev)
            return False
        if exc.errno in (errno.EXDEV, errno.EINVAL):
            return False  # another filesystem, or a file this one cannot clone
        raise
    finally:
        os.close(src)
    return True


def own_copy(
    dir_fd: int, name: str, data: bytes | None, executable: bool, blob: Path | None = None
) -> bool:
    """Put a file of the folder's owner holding ``data`` in the place of ``name``: a clone of
    ``blob`` (which holds ``data``) where the filesystem clones. True when it is one; with
    ``data`` None, nothing changes where it cannot clone."""
    tmp = f".fusion-copy-{secrets.token_hex(6)}"
    owner = os.fstat(dir_fd)
    cloned = blob is not None and clone_own_file(dir_fd, tmp, blob, owner, executable)
    if not cloned:
        if data is None:
            return False
        write_own_file(dir_fd, tmp, data, owner, executable)
    try:
        swap(dir_fd, tmp, name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    return cloned


RENAME_EXCHANGE = 2
"""renameat2(2)'s flag: swap two names atomically."""
_LIBC = ctypes.CDLL(None, use_errno=True)
_RENAMEAT2 = getattr(_LIBC, "renameat2", None)
if _RENAMEAT2 is not None:
    _RENAMEAT2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    _RENAMEAT2.restype = ctypes.c_int


def swap(dir_fd: int, tmp: str, name: str) -> None:
    """Put the link ``tmp`` in the place of ``name`` (both in ``dir_fd``), atomically: the
    name always holds the task's file or the blob.

    Exchanged, then the old file unlinked, rather than renamed over: ext4 (``auto_da_alloc``)
    treats a rename over an existing file as "replace a file by a new version" and starts
    writing the new one's data out at once, so a rename-over makes every pass write out, in
    the command's time, the blobs the previous pass added (50 MB for one install: 13,000
    pages per 1,000 files, measured; an exchange writes none)."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(dir_fd, os.fsencode(tmp), dir_fd, os.fsencode(name), RENAME_EXCHANGE) == 0:
            # ``tmp`` now names the task's copy; a folder the task put there meanwhile stays.
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), name)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # no exchange on this fs
