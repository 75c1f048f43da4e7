"""Writing an OCI bundle directory: config.json and rootfs/, all or nothing."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fusion_oci.errors import BundleError
from fusion_oci.oci.model import ConfigSpec


@dataclass(frozen=True)
class Bundle:
    """A compiled spec, and the directory it was written to (None until written)."""

    spec: ConfigSpec
    path: Path | None = None

    @property
    def config_path(self) -> Path:
        if self.path is None:
            raise BundleError(
                "bundle has no directory", "it was never written", "call write_bundle() first"
            )
        return self.path / "config.json"


def write_bundle(spec: ConfigSpec, target: Path, *, rootfs_from: Path | None = None) -> Bundle:
    """Write ``target/config.json`` and ``target/rootfs`` atomically.

    The bundle is assembled in a sibling temporary directory and renamed into place, so a
    crash or error never leaves a half-written bundle at ``target``.
    """
    target = target.absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise BundleError(
            f"cannot write bundle to {target}",
            "it exists and is not an empty directory",
            "choose a new directory, or remove the old bundle first",
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        rootfs = tmp / spec.task.root.path
        if Path(spec.task.root.path).is_absolute():
            pass  # a rootfs kept outside the bundle (a shared, unpacked image): not ours to make
        elif rootfs_from is not None:
            shutil.copytree(rootfs_from, rootfs, symlinks=True)
        else:
            rootfs.mkdir()
        config = tmp / "config.json"
        with config.open("w", encoding="utf-8") as fh:
            json.dump(spec.to_oci(), fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        tmp.chmod(0o755)
        if target.exists():
            target.rmdir()
        tmp.rename(target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise BundleError(
                f"cannot write bundle to {target}",
                str(exc),
                "check the directory's permissions and free space",
            ) from exc
        raise
    return Bundle(spec, target)
