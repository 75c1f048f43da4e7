"""Build contexts: their content hash (→ the image tag) and the tar sent to an engine.

The tag of a built image is the first 12 hex digits of a hash over everything that can change
the image: every file of the context (path, type, executable bit, content, symlink target),
the Containerfile's name and the build arguments. Ownership and timestamps are left out, so a
fresh clone hashes the same as the working copy it came from. The host CA bundle, passed as a
build secret, is deliberately not part of the hash: it never becomes part of the image.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

HASH_FORMAT = "fusion-oci-context-v1"
TAG_LENGTH = 12
IGNORE_FILES = (".containerignore", ".dockerignore")


def ignore_patterns(context: Path) -> list[str]:
    """Lines of ``.containerignore`` (or ``.dockerignore``) as the docker SDK reads a
    ``.dockerignore``: stripped, without blank lines and ``#`` comments; ``!`` lines re-include."""
    for name in IGNORE_FILES:
        path = context / name
        if path.is_file():
            lines = path.read_text(encoding="utf-8").splitlines()
            return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    return []


def context_entries(
    context: Path, containerfile: str = "Containerfile"
) -> Iterator[tuple[str, Path]]:
    """(posix relative path, absolute path) of every entry in the context, sorted, not ignored.

    What is sent is decided by the docker SDK's own build-context rules
    (``docker.utils.build.exclude_paths``: Go's filepath.Match per path component, a matched
    directory excludes what is under it, later lines win, ``!`` re-includes, the Containerfile
    and ``.dockerignore`` are always sent), so the hash covers exactly what an engine builds.
    """
    from docker.utils.build import exclude_paths

    patterns = ignore_patterns(context)
    if not patterns:
        kept = None
    else:
        kept = {
            Path(p).as_posix()
            for p in exclude_paths(str(context), patterns, dockerfile=containerfile)
        }
    found: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(context, followlinks=False):
        for name in dirs + files:
            path = Path(root) / name
            rel = path.relative_to(context).as_posix()
            if kept is None or rel in kept:
                found.append((rel, path))
    yield from sorted(found)


def context_hash(
    context: Path, containerfile: str = "Containerfile", build_args: Mapping[str, str] | None = None
) -> str:
    """Full sha256 hex digest of the context, the Containerfile name and the build args."""
    h = hashlib.sha256()

    def put(*fields: str | bytes) -> None:
        for f in fields:
            data = f.encode() if isinstance(f, str) else f
            h.update(len(data).to_bytes(8, "big"))
            h.update(data)

    put(HASH_FORMAT, "containerfile", containerfile)
    for key in sorted(build_args or {}):
        put("arg", key, (build_args or {})[key])
    for rel, path in context_entries(context, containerfile):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            put("link", rel, str(path.readlink()))
        elif stat.S_ISDIR(st.st_mode):
            put("dir", rel)
        elif stat.S_ISREG(st.st_mode):
            put("file", rel, "x" if st.st_mode & 0o111 else "-")
            fh = hashlib.sha256()
            with path.open("rb") as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    fh.update(block)
            put(fh.digest())
        # sockets, fifos, devices: engines skip them, so do we
    return h.hexdigest()


def content_tag(digest: str) -> str:
    return digest[:TAG_LENGTH]


def write_context_tar(
    context: Path,
    dest: IO[bytes],
    secrets: Mapping[str, Path] | None = None,
    replace: Mapping[str, bytes] | None = None,
    containerfile: str = "Containerfile",
    extra: Mapping[str, Path] | None = None,
) -> None:
    """Write the context as an uncompressed tar; ``secrets`` are extra files (tar name → path).

    ``replace`` swaps the content of some files (tar name → bytes), e.g. a rewritten
    Containerfile for an engine that cannot parse secret mounts. ``extra`` adds files that
    are not in the folder (tar name → path, mode 0644): the verified toolchain tarballs, which
    the tag covers through their integrity hashes rather than by hashing them again.

    Podman's API takes a build secret as a file inside the uploaded context and moves it out of
    the context directory before the build starts, so ``COPY .`` never sees it.
    """
    with tarfile.open(fileobj=dest, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, path in context_entries(context, containerfile):
            info = tar.gettarinfo(str(path), arcname=rel)
            if not (info.isfile() or info.isdir() or info.issym()):
                continue
            # The engine should not learn the caller's uid or names.
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if info.isfile() and replace and rel in replace:
                info.size = len(replace[rel])
                tar.addfile(info, io.BytesIO(replace[rel]))
            elif info.isfile():
                with path.open("rb") as src:
                    tar.addfile(info, src)
            else:
                tar.addfile(info)
        dirs: set[str] = set()
        for name, path in sorted((extra or {}).items()):
            parent = name.rpartition("/")[0]
            if parent and parent not in dirs:
                dirs.add(parent)
                folder = tarfile.TarInfo(parent)
                folder.type, folder.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(folder)
            info = tarfile.TarInfo(name)
            info.size = path.stat().st_size
            info.mode = 0o644
            info.uname = info.gname = "root"
            with path.open("rb") as src:
                tar.addfile(info, src)
        for name, path in (secrets or {}).items():
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o600
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(data))
