"""State and gc of the ``oci`` runtime's containers.

Each prepared task owns ``STATE_BASE/<task>-<run>-<nonce>/`` (the runtime's ``--root`` in
``state/``, the task container's bundle in ``bundle/``) and holds an ``flock`` on its ``lock``
file until dispose. :func:`gc_oci` (also run by every ``prepare``) deletes the containers of
directories whose lock is free (their process is gone, ``kill -9`` included) and removes the
directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusion_oci.errors import SandboxSetupError
from fusion_oci.host.process import ProcessOutcome, run_process
from fusion_oci.oci.model import ANN_TASK
from fusion_oci.runtimes.linux.cgroups import CgroupEvents, read_events

CONTROL_TIMEOUT_S = 30.0
"""For the runtime's own bookkeeping commands (delete, list)."""
NEW_DIR_PREFIX = ".new-"


def state_base(env: Mapping[str, str], uid: int) -> Path:
    """Where the per-task state directories live. Pure.

    root: ``/run/fusion-oci/oci`` (tmpfs, like runc's own ``/run/runc``); others:
    ``$XDG_RUNTIME_DIR/fusion-oci/oci``, or ``/tmp/fusion-oci-UID/oci`` without one.
    """
    if uid == 0:
        return Path("/run/fusion-oci/oci")
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "fusion-oci" / "oci"
    # Per uid and created 0700, so another user cannot pre-create or read it.
    return Path("/tmp") / f"fusion-oci-{uid}" / "oci"


def _ids(task_id: str, run_id: str) -> str:
    base = f"{task_id}-{run_id}"
    if len(base) > 160:
        base = f"{task_id[:80]}-{run_id[:60]}"
    return base


def task_dir_name(task_id: str, run_id: str, nonce: str) -> str:
    """``TASK-RUN-NONCE``: the task's state directory and its one container's id; unique per
    prepare, and short enough to name a cgroup. Pure.

    The nonce keeps two processes that reuse a task and run id from sharing a cgroup path.
    """
    return f"{_ids(task_id, run_id)}-{nonce}"


container_id = task_dir_name
"""The task's container is named as its state directory."""


@dataclass
class TaskState:
    """One prepared task's state directory (locked while ``lock_fd`` is open)."""

    dir: Path
    nonce: str
    lock_fd: int
    leftovers: set[str] = field(default_factory=set)

    @property
    def root(self) -> Path:
        """The runtime's ``--root``: its state of this task's containers."""
        return self.dir / "state"


def open_task_dir(final: Path, nonce: str, owner: Mapping[str, Any]) -> TaskState:
    """Create and lock the task's state directory ``final``; it appears under its name
    already locked."""
    base = final.parent
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = Path(tempfile.mkdtemp(prefix=NEW_DIR_PREFIX, dir=base))
    fd = os.open(tmp / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        data = {"pid": os.getpid(), **owner, "created": time.time()}
        (tmp / "owner.json").write_text(json.dumps(data) + "\n", encoding="utf-8")
        (tmp / "state").mkdir(mode=0o700)
        tmp.rename(final)
    except BaseException:
        os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return TaskState(final, nonce, fd)


def cgroup_paths(state_root: Path, cid: str) -> dict[str, str]:
    """The container's cgroup directories, from runc's ``state.json`` (``{}`` for a runtime
    that keeps no such file: its counters stay 0, unknown, no claim)."""
    try:
        state = json.loads((state_root / cid / "state.json").read_text(encoding="utf-8"))
        paths: dict[str, str] = state.get("cgroup_paths") or {}
    except (OSError, ValueError):
        return {}
    return paths


def read_counters(state_root: Path, cid: str) -> CgroupEvents:
    """The container's OOM kills and pids-limit hits so far (see :func:`cgroup_paths`)."""
    return read_events(cgroup_paths(state_root, cid))


# --- the runtime CLI's bookkeeping ----------------------------------------------------------


def cli_env(env: Mapping[str, str]) -> dict[str, str]:
    """The runtime CLI's own environment (the container's is in config.json). Pure."""
    out = {"PATH": env.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")}
    if env.get("XDG_RUNTIME_DIR"):
        out["XDG_RUNTIME_DIR"] = env["XDG_RUNTIME_DIR"]
    return out


def tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:]) or "no output"


async def cli(binary: str, root: Path, *args: str, env: Mapping[str, str]) -> ProcessOutcome:
    return await run_process(
        [binary, "--root", str(root), *args], env=cli_env(env), timeout_s=CONTROL_TIMEOUT_S
    )


async def wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` (not our child: the container's pid 1) exits; False on timeout.

    A pidfd becomes readable when the process exits, child or not, so nothing polls.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    loop.add_reader(fd, exited.set)
    try:
        await asyncio.wait_for(exited.wait(), timeout_s)
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return True


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


async def list_containers(binary: str, root: Path, env: Mapping[str, str]) -> list[dict[str, Any]]:
    """``RUNTIME --root ROOT list --format json`` (``null`` when empty or absent)."""
    outcome = await cli(binary, root, "list", "--format", "json", env=env)
    if outcome.returncode != 0:
        raise SandboxSetupError(
            f"cannot list the containers under {root}",
            tail(outcome.stderr.decode("utf-8", "replace")),
            f"run `{binary} --root {root} list` to see why",
        )
    data = json.loads(outcome.stdout or b"null")
    return list(data or [])


async def delete_container(binary: str, root: Path, cid: str, env: Mapping[str, str]) -> bool:
    """``delete --force``: kills what still runs, removes state and cgroups. True when gone."""
    outcome = await cli(binary, root, "delete", "--force", cid, env=env)
    if outcome.returncode == 0:
        return True
    return "does not exist" in outcome.stderr.decode("utf-8", "replace")


async def gc_oci(
    runtime: str = "runc",
    base: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    min_new_age_s: float = 300.0,
) -> list[str]:
    """Remove what dead fusion-oci processes left of the ``oci`` runtime; return the ids.

    A task directory whose ``lock`` is free belongs to no live process: every container in
    its runtime root that carries our ``io.fusion-oci.task-id`` annotation is deleted
    (``delete --force`` kills it first if it still runs), then the directory goes. Directories
    whose lock is held are in use and left alone. Half-made directories (``.new-*``) older
    than ``min_new_age_s`` are removed. Returns the removed container ids (and, for
    directories that held none, ``dir:NAME``).
    """
    env = dict(os.environ if env is None else env)
    base = base or state_base(env, os.geteuid())
    removed: list[str] = []
    if not base.is_dir():
        return removed
    for entry in sorted(base.iterdir()):
        if not entry.is_dir():
            continue
        if entry.name.startswith(NEW_DIR_PREFIX):
            with contextlib.suppress(OSError):
                if time.time() - entry.stat().st_mtime > min_new_age_s:
                    shutil.rmtree(entry, ignore_errors=True)
            continue
        try:
            fd = os.open(entry / "lock", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live process holds it
            removed.extend(await _gc_dir(entry, runtime, env))
        finally:
            os.close(fd)
    return removed


async def _gc_dir(entry: Path, runtime: str, env: Mapping[str, str]) -> list[str]:
    """Delete our containers of one unlocked task directory, then the directory."""
    binary = runtime
    with contextlib.suppress(OSError, ValueError):
        owner = json.loads((entry / "owner.json").read_text(encoding="utf-8"))
        binary = str(owner.get("runtime") or runtime)
    root = entry / "state"
    left = False
    gone: list[str] = []
    for container in await list_containers(binary, root, env):
        annotations = container.get("annotations") or {}
        cid = str(container.get("id"))
        if ANN_TASK not in annotations:
            left = True
            continue
        if await delete_container(binary, root, cid, env):
            gone.append(cid)
        else:
            left = True
    if left:
        return gone
    shutil.rmtree(entry, ignore_errors=True)
    return gone or [f"dir:{entry.name}"]
