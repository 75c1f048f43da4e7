"""What pnpm's virtual store (``node_modules/.pnpm``) holds, read as pnpm reads it: pure.

The host-side store pass (fusion_oci/store/linking.py) and the placement of a recorded tree
(fusion_oci/store/tree.py) need three facts about a folder of the virtual store, and take
them from pnpm's own rules (pnpm 9: ``@pnpm/link-bins``, ``@pnpm/exec.pkg-requires-build``):

- where a package's own folder is (``.pnpm/NAME@VER/node_modules/NAME``, scoped
  ``.pnpm/@S+N@VER/node_modules/@S/N``): its files are the package's, everything beside it
  is pnpm's links;
- which of its files pnpm changes after import: every *bin target* (``bin``, or every file of
  ``directories.bin``) is ``chmod``-ed to 0755 by each install that links bins (bin-links'
  ``fixBin``), and every file of a ``node_modules/.bin`` folder is a shim pnpm rewrites with
  this worktree's absolute paths. Those must stay the task's own files: ``chmod`` of a file
  the task does not own is EPERM, and pnpm fails the whole install on it;
- whether the package is built after import (an install script, ``binding.gyp`` or
  ``.hooks/``): a build writes into the package's folder, so a folder placed from another
  task's files would be rebuilt over read-only links.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAX_MANIFEST = 1 << 20
"""Most bytes of a ``package.json`` read (a real one is a few KiB; the task writes it)."""
BUILD_SCRIPTS = ("preinstall", "install", "postinstall")
PATCHED = "_patch_hash="
"""In a virtual-store folder name: a patched package (pnpm patches it after import)."""


def package_root(parts: Sequence[str]) -> int:
    """How many leading components of ``parts`` (a path below ``node_modules``, split on
    ``/``) name a package's own folder in the virtual store, or 0 when the path is not in
    one: 4 for ``.pnpm/DEP/node_modules/NAME``, 5 for ``.pnpm/DEP/node_modules/@S/NAME``."""
    if len(parts) < 4 or parts[0] != ".pnpm" or parts[2] != "node_modules":
        return 0
    if parts[3].startswith("@"):
        return 5 if len(parts) >= 5 else 0
    return 4


def is_shim_folder(parts: Sequence[str]) -> bool:
    """A ``node_modules/.bin`` folder: pnpm's shims, written with absolute paths per
    worktree."""
    return len(parts) >= 2 and parts[-1] == ".bin" and parts[-2] == "node_modules"


def _relative(path: object) -> str | None:
    """A manifest path as pnpm resolves it inside the package, or None when it leaves it."""
    if not isinstance(path, str) or not path:
        return None
    norm = posixpath.normpath(path.replace("\\", "/"))
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or norm == ".":
        return None
    return norm


@dataclass(frozen=True)
class PackageFacts:
    """What the host needs of one package's ``package.json`` (and its root file names)."""

    bins: frozenset[str] = frozenset()
    """Bin targets, relative to the package folder."""
    bin_dirs: tuple[str, ...] = ()
    """``directories.bin`` (every file below it is a bin target), when ``bin`` is absent."""
    builds: bool = False
    """pnpm runs a build after importing it (install scripts, binding.gyp, .hooks/)."""
    readable: bool = True
    """False when the manifest could not be read as JSON: nothing of it is trusted."""

    def is_bin(self, rel: str) -> bool:
        return rel in self.bins or any(rel.startswith(d + "/") for d in self.bin_dirs)


def package_facts(manifest: bytes | None, root_names: Iterable[str]) -> PackageFacts:
    """The facts of a package from its manifest's bytes and the names in its folder."""
    names = set(root_names)
    builds_by_file = "binding.gyp" in names or ".hooks" in names
    if manifest is None or len(manifest) > MAX_MANIFEST:
        return PackageFacts(builds=builds_by_file, readable=False)
    try:
        data = json.loads(manifest)
    except (ValueError, RecursionError):
        return PackageFacts(builds=builds_by_file, readable=False)
    if not isinstance(data, dict):
        return PackageFacts(builds=builds_by_file, readable=False)
    scripts = data.get("scripts")
    builds = builds_by_file or (
        isinstance(scripts, dict) and any(bool(scripts.get(s)) for s in BUILD_SCRIPTS)
    )
    raw = data.get("bin")
    targets: list[object] = []
    if isinstance(raw, str):
        targets = [raw]
    elif isinstance(raw, dict):
        targets = list(raw.values())
    bins = frozenset(t for t in map(_relative, targets) if t is not None)
    bin_dirs: tuple[str, ...] = ()
    directories = data.get("directories")
    if raw is None and isinstance(directories, dict):
        folder = _relative(directories.get("bin"))
        bin_dirs = (folder,) if folder is not None else ()
    return PackageFacts(bins=bins, bin_dirs=bin_dirs, builds=builds)
