"""The worktree's part of the built-in profile, pinned at the first prepare that reads it.

The profile allows the registries that the worktree's own ``.npmrc``, ``.yarnrc.yml`` and
``yarn.lock`` name (:mod:`fusion_oci.egress.profile`). Those files are the command's to write:
read afresh at every prepare, one command's ``registry=http://anything/`` would be the next
run's allowlist (the next command of the task, or the next task on that worktree). So the
first prepare that reads them pins the hosts they name, in the project's ``.fusion/`` (which no
sandbox can write: it is protected wherever it lies), and every later prepare allows only what
the files name *and* the pin holds. A host the files name that the pin lacks is left out, with
the file that named it and the fix (``allowedDomains``, or removing the pin file so that the
next prepare pins anew): a person decides, never the worktree.

What the user's own files name (``~/.npmrc``, pnpm's rc, ``~/.yarnrc.yml``, ``npm config get
registry`` run outside the worktree) and the git remotes (``.git/config`` is protected) are
read at every prepare: no sandbox can write them.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fusion_oci.egress.profile import ProfileHost

PIN_DIR = "egress-pins"
"""The pins' folder inside the project's ``.fusion/``."""


@dataclass(frozen=True)
class PinnedProfile:
    """The profile as a task may use it: ``hosts`` allowed, ``left_out`` named by a worktree
    file the pin does not hold, the pin's path, and whether this prepare made it."""

    hosts: tuple[ProfileHost, ...]
    left_out: tuple[ProfileHost, ...]
    pin: Path
    made: bool

    def audit(self) -> dict[str, object]:
        """What the prepare event records."""
        out: dict[str, object] = {"pin": str(self.pin), "pinned_now": self.made}
        if self.left_out:
            out["left_out"] = [f"{h.pattern} ({h.source})" for h in self.left_out]
        return out


def pin_path(project: Path, worktree: Path) -> Path:
    """The pin of one worktree of a project. Pure."""
    key = hashlib.sha256(str(worktree).encode()).hexdigest()[:16]
    return project / ".fusion" / PIN_DIR / f"{key}.json"


def apply_pin(
    hosts: Sequence[ProfileHost], pinned: Sequence[str]
) -> tuple[tuple[ProfileHost, ...], tuple[ProfileHost, ...]]:
    """(allowed, left out): the user's hosts always; the worktree's only when pinned. Pure."""
    held = set(pinned)
    kept = tuple(h for h in hosts if not h.worktree or h.pattern in held)
    left = tuple(h for h in hosts if h.worktree and h.pattern not in held)
    return kept, left


def _read(path: Path) -> list[str] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, encoding="utf-8") as fh:
        data = json.load(fh)
    hosts = data.get("hosts") if isinstance(data, dict) else None
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        raise ValueError(f"{path}: not a fusion-oci egress pin")
    return hosts


def _write(path: Path, worktree: Path, hosts: Sequence[ProfileHost], task_id: str) -> bool:
    """Write the pin unless one exists (another prepare's wins); True when this one did."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    body = {
        "worktree": str(worktree),
        "task": task_id,
        "pinned": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hosts": [h.pattern for h in hosts if h.worktree],
        "sources": {h.pattern: h.source for h in hosts if h.worktree},
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(body, fh, indent=2)
            fh.write("\n")
        try:
            os.link(tmp, path)  # never replaces a pin: the first prepare's stands
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def pin_profile(
    hosts: Sequence[ProfileHost],
    *,
    project: Path,
    worktree: Path,
    task_id: str,
    create: bool,
) -> PinnedProfile:
    """The profile a task may use (module docstring). ``create=False`` (a dry run, ``settings
    show``) reads a pin but makes none: what it would pin counts as pinned."""
    worktree = worktree.resolve()
    path = pin_path(project, worktree)
    try:
        pinned = _read(path)
    except (OSError, ValueError):
        pinned = []  # unreadable: nothing of the worktree's is trusted until it is removed
    made = False
    if pinned is None:
        if create:
            made = _write(path, worktree, hosts, task_id)
            pinned = _read(path) if not made else [h.pattern for h in hosts if h.worktree]
        else:
            pinned = [h.pattern for h in hosts if h.worktree]
    kept, left = apply_pin(hosts, pinned or [])
    return PinnedProfile(kept, left, path, made)


__all__ = ["PIN_DIR", "PinnedProfile", "apply_pin", "pin_path", "pin_profile"]
