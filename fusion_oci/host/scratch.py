"""Per-task host scratch folders, stamped with their owner so that gc can remove what a killed
process left.

Every folder is ``$TMPDIR/fusion-oci-KIND-TASK-XXXXXXXX`` with an ``owner`` file holding the
creating process's pid, its start time and the boot id. A folder is garbage when that process
no longer runs (same pid *and* start time: a reused pid is not the owner) or the machine has
rebooted since. :func:`gc_scratch` runs at every prepare, so ``kill -9`` of a CLI leaves its
folders only until the next task starts.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "fusion-oci-"
OWNER_FILE = "owner"


def boot_id() -> str:
    """This boot of the machine (a stamp from another boot names a dead owner)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def process_start(pid: int) -> str | None:
    """Start time of a pid in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[-1].split()
    return fields[19].decode() if len(fields) > 19 else None


def owner_stamp(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid} {process_start(pid) or '0'} {boot_id()}\n"


def owner_alive(stamp: str) -> bool:
    """Whether the process a stamp names still runs (a stamp from another boot: no)."""
    parts = stamp.split()
    if len(parts) != 3 or not parts[0].isdigit():
        return True  # not ours to judge: keep it
    pid, start, boot = parts
    if boot != boot_id():
        return False
    return process_start(int(pid)) == start


def make_scratch(kind: str, task_id: str) -> Path:
    """A new private (0700) scratch folder owned by this process."""
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-{task_id}-"))
    (path / OWNER_FILE).write_text(owner_stamp(), encoding="utf-8")
    return path


def gc_scratch(base: Path | None = None) -> list[str]:
    """Remove scratch folders whose owner is gone; returns what was removed. Folders without an
    owner file (not ours, or still being made) and folders of other users are left alone."""
    base = Path(tempfile.gettempdir()) if base is None else base
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    uid = os.geteuid()
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != uid:
                continue
            stamp = (Path(entry.path) / OWNER_FILE).read_text(encoding="utf-8")
        except OSError:
            continue
        if not owner_alive(stamp):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed
