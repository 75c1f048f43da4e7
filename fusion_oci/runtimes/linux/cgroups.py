"""One leaf cgroup per command: the spec's limits in, which limit fired out, nothing left behind.

Three ways to get a cgroup, tried in this order by :func:`detect`:

* ``v2``  — a writable cgroup v2 directory whose ``cgroup.subtree_control`` offers the
  controllers: root on a unified host (the root cgroup is exempt from the no-internal-process
  rule), or a delegated subtree (leaves go beside our own cgroup, never inside it, because a v2
  cgroup that holds processes cannot have controller-enabled children).
* ``v1``  — the per-controller hierarchies (``memory``, ``pids``, ``cpu``), writable as root;
  leaves are made *inside* our own cgroup of each hierarchy so that the host's accounting and
  limits of the caller (a CI job, a service) still cover the sandbox.
* ``systemd-run`` — ``systemd-run --user --scope -p MemoryMax=...`` in front of the launcher,
  for an unprivileged user on a v2 host whose user manager has delegated the controllers.
  systemd removes the scope itself; which limit fired is not readable after the scope is gone,
  so results there say ``signal``/``exit`` rather than ``oom``/``pids``.

Leaves are named ``fusion-oci.<pid of the creator>.<token>``, so a leftover from a crashed
process can be recognised and swept without touching a live one.

The same module answers, for OCI runtime CLIs that make their own cgroups (runc), which
hierarchy this host has (:func:`probe_hierarchy`: ``v1``, ``hybrid``, ``v2``; crun refuses
hybrid) and what a cgroup the runtime made counted (:func:`read_events` on its directories).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fusion_oci.errors import SandboxSetupError

if TYPE_CHECKING:
    from fusion_oci.oci.model import TaskSpec

V1_CONTROLLERS = ("memory", "pids", "cpu")
LEAF_PREFIX = "fusion-oci."

Mode = Literal["v1", "v2", "systemd-run", "none"]
"""How we get a leaf cgroup (:func:`detect`)."""
Layout = Literal["v1", "hybrid", "v2", "none"]
"""Which hierarchy the host mounts (:func:`probe_hierarchy`): hybrid = v1 controllers plus a
cgroup2 mount beside them."""


@dataclass(frozen=True)
class CgroupLimits:
    """The cgroup part of a spec's ``linux.resources``. None = no limit of that kind."""

    memory_bytes: int | None = None
    memory_swap_bytes: int | None = None
    """OCI semantics: memory plus swap. Equal to memory_bytes means no swap at all."""
    pids: int | None = None
    cpu_quota_us: int | None = None
    cpu_period_us: int = 100_000

    @classmethod
    def from_task(cls, task: TaskSpec) -> CgroupLimits:
        """The limits of a task spec's ``linux.resources``."""
        res = task.resources
        mem, cpu = res.memory, res.cpu
        return cls(
            memory_bytes=mem.limit if mem else None,
            memory_swap_bytes=mem.swap if mem else None,
            pids=res.pids.limit if res.pids else None,
            cpu_quota_us=cpu.quota if cpu else None,
            cpu_period_us=cpu.period or 100_000 if cpu else 100_000,
        )

    def controllers(self) -> frozenset[str]:
        """The controllers these limits need (empty: no cgroup needed)."""
        need = set()
        if self.memory_bytes:
            need.add("memory")
        if self.pids:
            need.add("pids")
        if self.cpu_quota_us:
            need.add("cpu")
        return frozenset(need)


def v1_writes(limits: CgroupLimits, *, has_memsw: bool) -> list[tuple[str, str, str]]:
    """(controller, file, value) to write, in an order the kernel accepts. Pure."""
    out: list[tuple[str, str, str]] = []
    if limits.memory_bytes:
        out.append(("memory", "memory.limit_in_bytes", str(limits.memory_bytes)))
        if has_memsw and limits.memory_swap_bytes:
            # memsw must be >= the memory limit, so it is written second.
            swap = max(limits.memory_swap_bytes, limits.memory_bytes)
            out.append(("memory", "memory.memsw.limit_in_bytes", str(swap)))
    if limits.pids:
        out.append(("pids", "pids.max", str(limits.pids)))
    if limits.cpu_quota_us:
        out.append(("cpu", "cpu.cfs_period_us", str(limits.cpu_period_us)))
        out.append(("cpu", "cpu.cfs_quota_us", str(limits.cpu_quota_us)))
    return out


def v2_writes(limits: CgroupLimits) -> list[tuple[str, str]]:
    """(file, value) for a cgroup v2 leaf. Pure."""
    out: list[tuple[str, str]] = []
    if limits.memory_bytes:
        out.append(("memory.max", str(limits.memory_bytes)))
        if limits.memory_swap_bytes is not None:
            # v2 counts swap separately from memory.
            out.append(
                ("memory.swap.max", str(max(0, limits.memory_swap_bytes - limits.memory_bytes)))
            )
    if limits.pids:
        out.append(("pids.max", str(limits.pids)))
    if limits.cpu_quota_us:
        out.append(("cpu.max", f"{limits.cpu_quota_us} {limits.cpu_period_us}"))
    return out


def systemd_properties(limits: CgroupLimits) -> list[str]:
    """``-p`` values for ``systemd-run --scope``. Pure."""
    out: list[str] = []
    if limits.memory_bytes:
        out.append(f"MemoryMax={limits.memory_bytes}")
        if limits.memory_swap_bytes is not None:
            out.append(f"MemorySwapMax={max(0, limits.memory_swap_bytes - limits.memory_bytes)}")
    if limits.pids:
        out.append(f"TasksMax={limits.pids}")
    if limits.cpu_quota_us:
        pct = max(1, round(100 * limits.cpu_quota_us / limits.cpu_period_us))
        out.append(f"CPUQuota={pct}%")
    return out


def systemd_run_prefix(systemd_run: str, unit: str, limits: CgroupLimits) -> list[str]:
    """The argv put in front of the launcher in ``systemd-run`` mode. Pure."""
    argv = [systemd_run, "--user", "--scope", "--quiet", "--collect", f"--unit={unit}"]
    for prop in systemd_properties(limits):
        argv += ["-p", prop]
    return [*argv, "--"]


@dataclass(frozen=True)
class CgroupEvents:
    """What the kernel counted while the command ran."""

    oom_kills: int = 0
    """Processes the OOM killer ended inside the cgroup."""
    pids_max: int = 0
    """fork/clone calls refused because pids.max was reached."""


def parse_flat_keyed(text: str) -> dict[str, int]:
    """``key value`` lines (memory.events, pids.events, memory.oom_control). Pure."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


@dataclass(frozen=True)
class CgroupSupport:
    """How (and whether) this host gives us cgroups, for which controllers."""

    mode: Mode
    controllers: frozenset[str] = frozenset()
    parents: Mapping[str, str] = field(default_factory=dict)
    """v1: controller → parent directory; v2: ``"unified"`` → parent directory."""
    detail: str = ""
    systemd_run: str | None = None

    def describe(self) -> str:
        ctl = ",".join(sorted(self.controllers)) or "none"
        return f"{self.mode} ({ctl}){': ' + self.detail if self.detail else ''}"


def parse_mountinfo(text: str) -> list[tuple[str, str, frozenset[str]]]:
    """(mount point, fs type, super options) of cgroup mounts. Pure."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        fstype = rfields[0]
        if fstype in ("cgroup", "cgroup2"):
            out.append((fields[4], fstype, frozenset(rfields[2].split(","))))
    return out


_KNOWN_V1 = frozenset(
    {
        "memory",
        "pids",
        "cpu",
        "cpuacct",
        "cpuset",
        "blkio",
        "devices",
        "freezer",
        "net_cls",
        "net_prio",
        "perf_event",
        "hugetlb",
        "rdma",
        "misc",
    }
)


@dataclass(frozen=True)
class Hierarchy:
    """The host's cgroup hierarchy and the controllers it mounts (whoever may write them)."""

    layout: Layout
    controllers: frozenset[str]


def hierarchy_of(
    mounts: Iterable[tuple[str, str, frozenset[str]]], v2_controllers: str = ""
) -> Hierarchy:
    """:func:`parse_mountinfo` output (+ the root ``cgroup.controllers`` text) → Hierarchy.
    Pure."""
    v1: set[str] = set()
    has_v2 = False
    for _, fstype, options in mounts:
        if fstype == "cgroup":
            v1.update(options & _KNOWN_V1)
        else:
            has_v2 = True
    if v1:
        return Hierarchy("hybrid" if has_v2 else "v1", frozenset(v1))
    if has_v2:
        return Hierarchy("v2", frozenset(v2_controllers.split()))
    return Hierarchy("none", frozenset())


def probe_hierarchy() -> Hierarchy:
    """This host's :class:`Hierarchy` (mountinfo and the root cgroup.controllers)."""
    return hierarchy_of(
        parse_mountinfo(_read("/proc/self/mountinfo") or ""),
        _read("/sys/fs/cgroup/cgroup.controllers") or "",
    )


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """controller → our cgroup path (v2's entry is under ``""``). Pure."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for ctl in parts[1].split(",") if parts[1] else [""]:
            out[ctl] = parts[2]
    return out


def _join(mount: str, path: str) -> str:
    return str(Path(mount) / path.lstrip("/"))


def plan_support(
    mounts: Iterable[tuple[str, str, frozenset[str]]],
    own: Mapping[str, str],
    *,
    uid: int,
    writable: Callable[[str], bool],
    read: Callable[[str], str | None],
    systemd_run: str | None,
    user_manager: bool,
) -> CgroupSupport:
    """Choose v2, v1, systemd-run or none from the host facts (callables make it testable)."""
    mounts = list(mounts)
    unified = next((m for m, t, _ in mounts if t == "cgroup2"), None)
    if unified is not None and "" in own:
        own_path = own[""]
        # Beside our own cgroup (v2 forbids controller children of a cgroup with processes);
        # the root cgroup is exempt, so there we go directly below it.
        parent = _join(unified, own_path if own_path == "/" else str(Path(own_path).parent))
        offered = set((read(_join(parent, "cgroup.subtree_control")) or "").split())
        if own_path == "/":
            offered |= set((read(_join(parent, "cgroup.controllers")) or "").split())
        usable = frozenset(offered & set(V1_CONTROLLERS))
        if usable and writable(parent):
            return CgroupSupport("v2", usable, {"unified": parent}, f"leaves under {parent}")
    parents: dict[str, str] = {}
    for name in V1_CONTROLLERS:
        mount = next((m for m, t, opts in mounts if t == "cgroup" and name in opts), None)
        if mount is None or name not in own:
            continue
        parent = _join(mount, own[name])
        if writable(parent):
            parents[name] = parent
    if parents:
        return CgroupSupport(
            "v1", frozenset(parents), parents, "leaves inside our own cgroup of each hierarchy"
        )
    if systemd_run and uid != 0 and user_manager and unified is not None:
        delegated = (
            read(
                _join(
                    unified,
                    f"user.slice/user-{uid}.slice/user@{uid}.service/cgroup.subtree_control",
                )
            )
            or ""
        )
        delegated_ctl = frozenset(set(delegated.split()) & set(V1_CONTROLLERS))
        if delegated_ctl:
            return CgroupSupport(
                "systemd-run",
                delegated_ctl,
                {},
                "scope via the user's systemd",
                systemd_run=systemd_run,
            )
    why = "no writable cgroup v2 subtree with controllers, no writable v1 hierarchy"
    if uid != 0:
        why += ", no systemd user manager with delegated controllers"
    return CgroupSupport("none", frozenset(), {}, why)


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def detect(env: Mapping[str, str] | None = None) -> CgroupSupport:
    """Look at this host (mountinfo, /proc/self/cgroup, permissions) and choose."""
    env = os.environ if env is None else env
    uid = os.geteuid()
    runtime_dir = env.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
    return plan_support(
        parse_mountinfo(_read("/proc/self/mountinfo") or ""),
        parse_proc_cgroup(_read("/proc/self/cgroup") or ""),
        uid=uid,
        writable=lambda p: Path(p).is_dir() and os.access(p, os.W_OK),
        read=_read,
        systemd_run=shutil.which("systemd-run"),
        user_manager=Path(runtime_dir, "systemd", "private").exists(),
    )


def leaf_name(token: str, pid: int | None = None) -> str:
    """``fusion-oci.<pid>.<token>``: the creator's pid lets :func:`sweep_stale` tell a crash's
    leftover from a live leaf. ``token`` must not contain a dot."""
    if "." in token:
        raise ValueError(f"cgroup leaf token {token!r} contains a dot")
    return f"{LEAF_PREFIX}{os.getpid() if pid is None else pid}.{token}"


class Cgroup:
    """A leaf cgroup (one directory per v1 controller, or one v2 directory)."""

    def __init__(self, mode: Mode, dirs: Mapping[str, Path]) -> None:
        self.mode = mode
        self.dirs = dict(dirs)

    @classmethod
    def create(
        cls, support: CgroupSupport, limits: CgroupLimits, *, name: str | None = None
    ) -> Cgroup:
        """Make the leaf and write the limits; on any failure nothing is left behind.

        ``name``: the leaf's name (from :func:`leaf_name`), when the caller must know it in
        advance (a runtime CLI joins it by path); default a random one."""
        need = limits.controllers()
        missing = need - support.controllers
        if support.mode not in ("v1", "v2") or missing:
            raise SandboxSetupError(
                "cannot create a cgroup for the resource limits",
                f"cgroups here: {support.describe()}; missing {sorted(missing) or need}",
                "run as root, or on a cgroup v2 host with delegated controllers",
            )
        sweep_stale(support)
        name = name or leaf_name(secrets.token_hex(4))
        if support.mode == "v2":
            parent = Path(support.parents["unified"])
            _enable_v2(parent, need)
            dirs = {"unified": parent / name}
        else:
            dirs = {ctl: Path(support.parents[ctl]) / name for ctl in sorted(need)}
        group = cls(support.mode, dirs)
        try:
            for d in dirs.values():
                d.mkdir()
            if support.mode == "v2":
                for fname, value in v2_writes(limits):
                    if (dirs["unified"] / fname).exists():
                        (dirs["unified"] / fname).write_text(value)
            else:
                has_memsw = (
                    "memory" in dirs and (dirs["memory"] / "memory.memsw.limit_in_bytes").exists()
                )
                for ctl, fname, value in v1_writes(limits, has_memsw=has_memsw):
                    (dirs[ctl] / fname).write_text(value)
        except OSError as exc:
            group.remove()
            raise SandboxSetupError(
                "cannot set up the command's cgroup",
                str(exc),
                "check that the cgroup controllers are writable",
            ) from exc
        return group

    def add(self, pid: int) -> None:
        """Move a process (and so all its future children) into the leaf."""
        try:
            for d in self.dirs.values():
                (d / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            raise SandboxSetupError(
                f"cannot move pid {pid} into its cgroup",
                str(exc),
                "check that the cgroup controllers are writable",
            ) from exc

    def events(self) -> CgroupEvents:
        return read_events(self.dirs)

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs.values():
            text = _read(str(d / "cgroup.procs")) or ""
            out.update(int(p) for p in text.split())
        return out

    def kill(self, timeout_s: float = 5.0) -> None:
        """SIGKILL everything inside until it is empty (a fork bomb cannot outrun this)."""
        kill_file = self.dirs.get("unified", Path("/nonexistent")) / "cgroup.kill"
        if kill_file.exists():
            with contextlib.suppress(OSError):
                kill_file.write_text("1")
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def remove(self) -> None:
        """Kill what is left and remove the leaf directories."""
        self.kill()
        for d in self.dirs.values():
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    # EBUSY while the last exiting tasks are still being released.
                    time.sleep(0.005)


def read_events(dirs: Mapping[str, str | Path]) -> CgroupEvents:
    """What a cgroup counted, from its directories: v1 ``memory``/``pids`` entries first, then
    the v2 one (``unified``, or ``""`` as runc's state.json names it). Unreadable counts 0."""

    def counter(candidates: tuple[tuple[str, str], ...], key: str) -> int:
        for ctl, fname in candidates:
            base = dirs.get(ctl)
            if not base:
                continue
            text = _read(str(Path(base) / fname))
            if text is not None and key in (values := parse_flat_keyed(text)):
                return values[key]
        return 0

    return CgroupEvents(
        oom_kills=counter(
            (("memory", "memory.oom_control"), ("unified", "memory.events"), ("", "memory.events")),
            "oom_kill",
        ),
        pids_max=counter(
            (("pids", "pids.events"), ("unified", "pids.events"), ("", "pids.events")), "max"
        ),
    )


def _enable_v2(parent: Path, need: frozenset[str]) -> None:
    ctl_file = parent / "cgroup.subtree_control"
    have = set((_read(str(ctl_file)) or "").split())
    missing = need - have
    if missing:
        with contextlib.suppress(OSError):
            ctl_file.write_text(" ".join(f"+{c}" for c in sorted(missing)))


def sweep_stale(support: CgroupSupport) -> list[Path]:
    """Remove empty leaves whose creating process is gone (left by a crash)."""
    removed: list[Path] = []
    for parent in support.parents.values():
        try:
            entries = list(Path(parent).iterdir())
        except OSError:
            continue
        for entry in entries:
            parts = entry.name.split(".")
            if not entry.name.startswith(LEAF_PREFIX) or len(parts) != 3:
                continue
            if not parts[1].isdigit() or Path(f"/proc/{parts[1]}").exists():
                continue
            with contextlib.suppress(OSError):
                entry.rmdir()
                removed.append(entry)
    return removed
