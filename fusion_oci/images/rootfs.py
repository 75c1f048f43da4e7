"""An image's root filesystem on the host, for OCI runtime CLIs (the ``oci`` runtime).

The engine flattens the image itself: a container is created from it (never started), its
filesystem exported as one tar stream through the SDK and the container removed. So layers,
whiteouts and opaque directories are the engine's business, not ours. The stream is extracted
with the stdlib ``tar`` extraction filter (nothing outside the target, no setuid/setgid bits,
no group/other write bits) plus two rules of ours: hard links stay inside, no device nodes.

One tree per image digest under ``CACHE/<digest>/rootfs``, read-only and shared by every
container of that image. It is assembled in a temporary sibling (``.new-*``) and renamed into
place, so a crash or an error never leaves a half-written tree under the final name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
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


def rootfs_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """The stdlib ``tar`` filter, plus hard links kept inside and device nodes skipped.

    The ``tar`` filter keeps every name inside ``dest`` (through symlinks already extracted
    too) but, unlike ``data``, does not look at hard-link targets: a link to ``/etc/shadow``
    (or ``../../etc/shadow``) would make, as root, a second name of the host's file inside
    the rootfs the container reads. So a hard link's target is taken relative to the archive
    root and must resolve inside ``dest``. A device node in the cache would be a door on the
    host for whoever can read the cache (the container's /dev is its own tmpfs; an image has
    no reason to ship one). Absolute symlinks stay: they are how root filesystems link, and
    they resolve inside the container (``data`` would refuse them).
    """
    filtered = tarfile.tar_filter(member, dest)
    if filtered.ischr() or filtered.isblk():
        return None
    if filtered.islnk():
        linkname = filtered.linkname.lstrip("/")
        real_dest = os.path.realpath(dest)
        target = os.path.realpath(Path(real_dest, linkname))
        if os.path.commonpath([target, real_dest]) != real_dest:
            raise tarfile.LinkOutsideDestinationError(filtered, target)
        if linkname != filtered.linkname:
            filtered = filtered.replace(linkname=linkname, deep=False)
    return filtered


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
    """A flattened filesystem tar stream (an engine's container export) → ``root``."""
    root.mkdir(parents=True)
    with tarfile.open(fileobj=stream, mode="r|*") as tar:  # type: ignore[call-overload]
        # S202: the extraction is filtered (rootfs_filter: the stdlib tar filter, no devices).
        try:
            tar.extractall(root, numeric_owner=True, filter=rootfs_filter)  # noqa: S202
        except KeyError as exc:  # a hard link to a member the archive does not have
            raise tarfile.ExtractError(f"broken hard link in the export: {exc}") from exc


class _Export:
    """What :func:`_engine_export` yields: the image digest, and its filesystem on demand."""

    def __init__(self, engine: Any, ref: str, digest: str) -> None:
        self._engine, self._ref, self.digest = engine, ref, digest
        self._container: Any = None

    def stream(self) -> Iterator[bytes]:
        """Create the (never started) container and stream its export, as tar chunks."""
        from fusion_oci.runtimes.containers import LABEL_KIND
        from fusion_oci.runtimes.engine_probe import current_owner

        labels = {LABEL_KIND: "container", **current_owner().labels()}
        with self._engine.call(f"create a container of {self._ref} to export its filesystem"):
            self._container = self._engine.client.containers.create(
                self.digest, command=EXPORT_COMMAND, labels=labels, network_mode="none")
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
            with contextlib.suppress(FusionOCIError), \
                    self._engine.call(f"remove the export container of {self._ref}"):
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
                f"image '{ref}' is not in podman's local storage", f"podman at {url}",
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
            raise ProvisionError(f"cannot unpack image '{ref}'", str(exc),
                                 f"check free space under {cache}") from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target / "rootfs"
