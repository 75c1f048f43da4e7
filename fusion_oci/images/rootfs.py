"""An image's root filesystem on the host, for OCI runtime CLIs (the ``oci`` runtime).

The engine flattens the image itself: a container is created from it (never started), its
filesystem exported as one tar stream through the SDK and the container removed. So layers,
whiteouts and opaque directories are the engine's business, not ours. The stream is extracted
by the rules of :func:`extract_rootfs` (those of the stdlib ``tar`` filter, plus hard links
kept inside and no device nodes), written here so they hold on 3.11.2 as on newer releases.

One tree per image digest under ``CACHE/<digest>/rootfs``, read-only and shared by every
container of that image. It is assembled in a temporary sibling (``.new-*``) and renamed into
place, so a crash or an error never leaves a half-written tree under the final name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from fusion_oci.errors import FusionOCIError, ProvisionError

NEW_DIR_PREFIX = ".new-"
EXPORT_COMMAND = ["/fusion-oci-export-never-started"]
"""The created container's command: it is never started, but an image without CMD needs one."""


def podman_url(env: Mapping[str, str], uid: int, settings_url: str | None = None) -> str:
    """The podman API socket the image is exported from (the engines layer's one resolver:
    ``podman.url``, ``CONTAINER_HOST``, a system connection, podman's default). Pure."""
    from fusion_oci.engines import podman_endpoints

    return podman_endpoints(settings_url, env, uid)[0].url


class UnsafeMemberError(tarfile.ExtractError):
    """A member of the export that would land, or link, outside the root (the stdlib's
    ``tarfile.FilterError`` family is 3.11.4+, so ours: the rules hold on 3.11.2 too)."""


def _member_parts(name: str) -> list[str]:
    """A member's name as path components under the root: leading ``/`` stripped (as the
    stdlib filters do), ``.`` and empty components dropped, ``..`` refused. Pure."""
    parts = [p for p in name.lstrip("/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeMemberError(f"{name!r}: '..' in a member's name")
    return parts


def _escapes(parts: list[str], link: str) -> bool:
    """Would the relative symlink ``link`` in the directory ``parts`` climb above the root,
    resolved lexically? Pure."""
    depth = len(parts)
    for comp in link.split("/"):
        if comp == "..":
            depth -= 1
            if depth < 0:
                return True
        elif comp not in ("", "."):
            depth += 1
    return False


def _real_parent(root: Path, parts: list[str], name: str, make: bool = True) -> Path:
    """``root/parts[:-1]``, made as needed (``make``), every component a real directory: a
    symlink in the way (one this archive planted, to a host directory) is refused, never
    followed. A flattened export lists no member under a symlink, so nothing real is
    refused."""
    here = root
    for comp in parts[:-1]:
        here = here / comp
        try:
            st = here.lstat()
        except FileNotFoundError:
            if not make:
                raise tarfile.ExtractError(f"{name!r}: no such member") from None
            here.mkdir(mode=0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeMemberError(f"{name!r}: {comp!r} on its path is not a directory")
    return here


def _real_dir(root: Path, path: Path) -> bool:
    """Is ``path`` (under ``root``) a directory reached through directories only?"""
    here = root
    for comp in path.relative_to(root).parts:
        here = here / comp
        try:
            if not stat.S_ISDIR(here.lstat().st_mode):
                return False
        except FileNotFoundError:
            return False
    return True


def _clear(path: Path, member: tarfile.TarInfo) -> None:
    """Remove what an earlier member left at ``path`` (a later member replaces it, as with
    tar), so nothing is written through an old symlink. A directory stays for a directory."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        if not member.isdir():
            shutil.rmtree(path)
    else:
        path.unlink()


def _own(path: Path, member: tarfile.TarInfo) -> None:
    # numeric ids, never looked up by name on the host; only root can give files away
    if os.geteuid() == 0:
        os.chown(path, member.uid, member.gid, follow_symlinks=False)


def _extract_member(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    root: Path,
    dirs: list[tuple[Path, tarfile.TarInfo]],
) -> None:
    """One member of the export under ``root`` by the rules of :func:`extract_rootfs`."""
    parts = _member_parts(member.name)
    if member.ischr() or member.isblk() or member.isfifo():
        return
    if not parts:  # the root itself ("./"): only its mode and owner
        if member.isdir():
            dirs.append((root, member))
        return
    path = _real_parent(root, parts, member.name) / parts[-1]
    _clear(path, member)
    if member.isdir():
        if not path.is_dir():
            path.mkdir(mode=0o700)
        dirs.append((path, member))
    elif member.issym():
        if not member.linkname.startswith("/") and _escapes(parts[:-1], member.linkname):
            raise UnsafeMemberError(
                f"{member.name!r}: symlink to {member.linkname!r} climbs out of the root"
            )
        path.symlink_to(member.linkname)
        _own(path, member)
    elif member.islnk():
        target_parts = _member_parts(member.linkname)
        if not target_parts:
            raise UnsafeMemberError(f"{member.name!r}: hard link to the root")
        target = _real_parent(root, target_parts, member.linkname, make=False) / target_parts[-1]
        if not os.path.lexists(target) or target.is_dir():
            raise tarfile.ExtractError(
                f"broken hard link in the export: {member.name!r} -> {member.linkname!r}"
            )
        os.link(target, path, follow_symlinks=False)
    else:  # a regular file (tar extracts members of unknown types as regular files too)
        src = tar.extractfile(member)
        # O_EXCL | O_NOFOLLOW: a fresh file, never a symlink's target (_clear removed it)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            if src is not None:
                shutil.copyfileobj(src, out)
            out.flush()
            if os.geteuid() == 0:
                os.fchown(fd, member.uid, member.gid)
            os.fchmod(fd, member.mode & SAFE_MODE_BITS)  # after chown, which clears setuid
            os.utime(fd, (member.mtime, member.mtime))


SAFE_MODE_BITS = 0o755
"""The mode bits kept (the stdlib ``tar`` filter's mask): no setuid, setgid or sticky bit,
no group or other write."""


class _ChunkReader:
    """A read-only file over an iterator of byte chunks (the SDK's export stream)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks: Iterator[bytes] = iter(chunks)
        self._buf = b""

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self._buf) < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._buf += chunk
        if size < 0:
            out, self._buf = self._buf, b""
        else:
            out, self._buf = self._buf[:size], self._buf[size:]
        return out


def extract_rootfs(stream: IO[bytes] | _ChunkReader, root: Path) -> None:
    """A flattened filesystem tar stream (an engine's container export) → ``root``.

    Our own extraction, not ``extractall(filter=...)``: that argument is 3.11.4+, and its
    default changes in 3.14, so the rules are written here and hold on every interpreter:

    * every name lands under ``root``: a leading ``/`` is stripped, ``..`` is refused, and no
      symlink is ever followed while writing (none may stand on a member's path);
    * a hard link's target is a member already under ``root`` (a link to ``/etc/shadow`` would
      make, as root, a second name of the host's file in the rootfs the container reads);
    * a relative symlink may not climb above ``root``; absolute symlinks stay: they are how
      root filesystems link, and they resolve inside the container;
    * no device node or FIFO (the container's /dev is its own tmpfs; a FIFO in the shared
      cache would be a channel between containers of the image);
    * mode bits masked to 0o755: no setuid, setgid or sticky bit, no group/other write;
      owners numeric, set only when running as root.
    """
    root.mkdir(parents=True)
    dirs: list[tuple[Path, tarfile.TarInfo]] = []
    with tarfile.open(fileobj=stream, mode="r|*") as tar:  # type: ignore[call-overload]
        for member in tar:
            _extract_member(tar, member, root, dirs)
    # Directories last, deepest first: a read-only directory must not stop its own members.
    for path, member in sorted(dirs, key=lambda d: len(d[0].parts), reverse=True):
        if not _real_dir(root, path):
            continue  # a later member replaced it (or a parent) with a symlink: never follow
        _own(path, member)
        path.chmod(member.mode & SAFE_MODE_BITS)
        os.utime(path, (member.mtime, member.mtime))


class _Export:
    """What :func:`_engine_export` yields: the image digest, and its filesystem on demand."""

    def __init__(self, engine: Any, ref: str, digest: str) -> None:
        self._engine, self._ref, self.digest = engine, ref, digest
        self._container: Any = None

    def stream(self) -> Iterator[bytes]:
        """Create the (never started) container and stream its export, as tar chunks."""
        from fusion_oci.engines.labels import LABEL_KIND, current_owner

        labels = {LABEL_KIND: "container", **current_owner().labels()}
        with self._engine.call(f"create a container of {self._ref} to export its filesystem"):
            self._container = self._engine.client.containers.create(
                self.digest, command=EXPORT_COMMAND, labels=labels, network_mode="none"
            )
            chunks = self._container.export()
        while True:
            # Each read of the stream inside the SDK boundary: a broken connection mid-export
            # is a ProvisionError, not a requests exception.
            with self._engine.call(f"export the filesystem of {self._ref}"):
                chunk = next(chunks, None)
            if chunk is None:
                return
            yield chunk

    def remove(self) -> None:
        if self._container is not None:
            with (
                contextlib.suppress(FusionOCIError),
                self._engine.call(f"remove the export container of {self._ref}"),
            ):
                self._container.remove(force=True, v=True)
            self._container = None


@contextlib.contextmanager
def _engine_export(ref: str, url: str) -> Iterator[_Export]:
    """Every engine call of this module: the image's digest (one inspect), and on demand its
    flattened filesystem; the export container is removed on every path. SDK errors arrive as
    ProvisionError from the engine client's own boundary."""
    from fusion_oci.images.engine import open_engine

    with open_engine("podman", url) as engine:
        info = engine.image(ref)
        if info is None:
            raise ProvisionError(
                f"image '{ref}' is not in podman's local storage",
                f"podman at {url}",
                "provision it first (backend podman, `podman build`, or `podman load`)",
            )
        export = _Export(engine, ref, info.id)
        try:
            yield export
        finally:
            export.remove()


def sweep_partial(cache: Path, min_age_s: float = 300.0) -> list[Path]:
    """Remove half-written trees (``.new-*``) that a killed process left, once they are older
    than ``min_age_s`` (a younger one may be another process's export in progress)."""
    removed: list[Path] = []
    try:
        entries = list(cache.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(NEW_DIR_PREFIX):
            continue
        with contextlib.suppress(OSError):
            if time.time() - entry.lstat().st_mtime > min_age_s:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def export_image_rootfs(ref: str, cache: Path, url: str) -> Path:
    """The image's root filesystem, exported once per image digest under ``cache``.

    Blocking (SDK calls and tar extraction); call it in a thread. What a killed export left
    (its ``.new-*`` tree; the engine's container carries gc labels) is swept here.
    """
    sweep_partial(cache)
    with _engine_export(ref, url) as export:
        image_id = export.digest.removeprefix("sha256:")
        target = cache / image_id
        if target.is_dir():
            return target / "rootfs"
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{NEW_DIR_PREFIX}{image_id[:12]}.", dir=cache))
        try:
            extract_rootfs(_ChunkReader(export.stream()), tmp / "rootfs")
            tmp.chmod(0o755)
            try:
                tmp.rename(target)
            except OSError:
                if not target.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # a concurrent prepare won the race
        except (OSError, tarfile.TarError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ProvisionError(
                f"cannot unpack image '{ref}'", str(exc), f"check free space under {cache}"
            ) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target / "rootfs"
