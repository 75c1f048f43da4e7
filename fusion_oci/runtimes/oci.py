"""The ``oci`` runtime: an OCI runtime CLI (runc; crun, runsc, youki elsewhere) on the bundle.

Each command is one container: the compiled spec is written as a bundle into the task's state
directory and run with ``RUNTIME --root STATE run --keep --pid-file P --bundle DIR ID``. The
runtime CLI is our child in its own process group; the container's processes live in their own
pid namespace and session, so ending them goes through the CLI: ``kill --all ID TERM``, a grace
period, ``kill ID KILL`` (pid 1 dying ends the whole namespace), and ``delete --force ID`` on
every path. ``--keep`` leaves the stopped container's cgroup in place until that delete, so the
OOM and pids counters can be read after the command ended.

Host-rootfs specs run on an empty ``rootfs/`` plus the spec's read-only binds of the system
directories. Image specs run on the image's root filesystem, exported once per image id from
podman's local storage (podman SDK ``images.get(ref).save()``) and unpacked into a read-only
cache shared by every container of that image.

Leftovers: each prepared task owns ``STATE_BASE/<task>-<run>-<nonce>/`` and holds an ``flock``
on its ``lock`` file until dispose. :func:`gc_oci` (also run by every ``prepare``) deletes the
containers of directories whose lock is free (their process is gone, ``kill -9`` included) and
removes the directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import IO, Any, Literal

from fusion_oci.errors import (
    FusionOCIError,
    PolicyNotEnforceableError,
    ProvisionError,
    SandboxSetupError,
)
from fusion_oci.models import (
    NetworkMode,
    PrepareContext,
    RunOptions,
    RunResult,
    SandboxCapabilities,
)
from fusion_oci.oci.bundle import write_bundle
from fusion_oci.oci.spec import ANN_HOST_ROOTFS, ANN_IMAGE, ANN_TASK, Spec, bind, spec_network
from fusion_oci.process import ProcessOutcome, run_process
from fusion_oci.runtimes.base import (
    Availability,
    LaunchPlan,
    LimitCounters,
    Requirement,
    SpecRuntime,
    classify,
    status_from_code,
)
from fusion_oci.runtimes.linux.cgroups import Cgroup

GRACE_S = 2.0
"""Between ``kill --all ID TERM`` and ``kill ID KILL`` on timeout, maxBuffer and abort."""
CONTROL_TIMEOUT_S = 30.0
"""For the runtime's own bookkeeping commands (kill, delete, list)."""
NEW_DIR_PREFIX = ".new-"
KEEP_FLAG_RUNTIMES = frozenset({"runc", "crun"})
"""Runtimes whose ``run`` takes ``--keep`` (the others delete the cgroup before we can read it)
and keep a container's state in ``ROOT/ID`` (so its absence proves nothing is left)."""

CgroupMode = Literal["v1", "hybrid", "v2", "none"]

EGRESS_HOOK_SCRIPT = 'cat >"$1" && read -r answer <"$2" && [ "$answer" = go ]'
"""The createRuntime hook of an egress container, run by the runtime on the host: it passes the
container state (with pid 1's host pid) to fusion-oci through one FIFO and waits on another
until slirp4netns is attached; anything but ``go`` fails the hook, so the command never starts
without its network path."""
EGRESS_HOOK_TIMEOUT_S = 30
GVISOR = "runsc"
RUNSC_EGRESS_SCRIPT = (
    'ip link set lo up && printf \'{"pid": %s}\\n\' "$$" >"$1" && read -r answer <"$2" && '
    '[ "$answer" = go ] && shift 2 && exec "$@"'
)
"""gVisor's egress launch: ``unshare --net`` gives the runtime CLI a fresh network namespace
and this script, its first process, reports its pid to fusion-oci through the same FIFOs as
runc's hook and waits there until slirp4netns (``--disable-host-loopback``) is attached; only
then does it exec ``runsc --network=host``, whose sandbox uses that namespace as its "host".
(runsc 20221219's own ``--network=sandbox`` cannot start on kernels that namespace
``net.core.rmem_default``: it takes every namespace for the root one.)"""


# --- pure parts: ids, argv, the bundle the runtime gets, exit statuses, reasons ---------------


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


def container_id(task_id: str, run_id: str, nonce: str, seq: int) -> str:
    """``TASK-RUN-NONCE-SEQ``: unique per command, and short enough to name a cgroup.

    The nonce keeps two processes that reuse a task and run id from sharing a cgroup path.
    """
    base = f"{task_id}-{run_id}"
    if len(base) > 160:
        base = f"{task_id[:80]}-{run_id[:60]}"
    return f"{base}-{nonce}-{seq}"


def task_dir_name(task_id: str, run_id: str, nonce: str) -> str:
    base = f"{task_id}-{run_id}"
    if len(base) > 160:
        base = f"{task_id[:80]}-{run_id[:60]}"
    return f"{base}-{nonce}"


def is_gvisor(runtime: str) -> bool:
    return Path(runtime).name == GVISOR


def runtime_flags(runtime: str, network: NetworkMode, *, rootless: bool = False) -> list[str]:
    """Global flags the runtime needs for this spec (before the subcommand). Pure.

    runsc decides networking by flag, not from the spec: ``none`` is its empty netstack;
    ``host`` and ``egress`` pass the sockets of the namespace it runs in through (for egress
    that is the namespace :data:`RUNSC_EGRESS_SCRIPT` prepared, never the host's).
    """
    if not is_gvisor(runtime):
        return []
    # --oci-seccomp: without it runsc ignores linux.seccomp (unshare, raw and packet sockets
    # would work inside its kernel).
    flags = ["--oci-seccomp",
             "--network=none" if network is NetworkMode.NONE else "--network=host"]
    if rootless:
        flags.append("--rootless")
    return flags


def run_argv(runtime: str, root: str, bundle: str, cid: str, pid_file: str, *,
             keep: bool = True, flags: list[str] | None = None) -> list[str]:
    """The one command line that runs a bundle. Pure (golden-tested)."""
    argv = [runtime, "--root", root, *(flags or []), "run"]
    if keep:
        argv.append("--keep")
    return [*argv, "--pid-file", pid_file, "--bundle", bundle, cid]


@dataclass(frozen=True)
class EgressHook:
    """Host paths the egress hook uses: the two FIFOs and slirp's resolv.conf."""

    request: str
    reply: str
    resolv_conf: str
    hook: bool = True
    """False for gVisor: the launch script, not a createRuntime hook, holds the command."""


def egress_launch_argv(unshare: str, hook: EgressHook, argv: list[str]) -> list[str]:
    """gVisor's egress launch (:data:`RUNSC_EGRESS_SCRIPT`) around ``argv``. Pure."""
    return [unshare, "--net", "--", "/bin/sh", "-c", RUNSC_EGRESS_SCRIPT, "fusion-oci-egress",
            hook.request, hook.reply, *argv]


INIT_IN_SANDBOX = "/dev/fusion-oci-init"
"""Where the init binary is bound: inside the container's own /dev tmpfs, so the mount point
is made there and nothing is left in the (shared, read-only) rootfs or on the host."""


def with_init(spec: Spec, init: str) -> Spec:
    """Run the command under a minimal init (tini), as ``docker run --init`` does. Pure.

    Without one the command is pid 1 of the container's pid namespace, and the kernel drops
    every signal pid 1 has no handler for: ``kill -TERM $$`` in a shell is a no-op there, and a
    shell command that exits by signal elsewhere exits 0 here. The init forwards signals, reaps
    orphans and exits 128+N when the command dies of signal N.
    """
    out = copy.deepcopy(spec)
    out["mounts"].append(bind(INIT_IN_SANDBOX, init, writable=False))
    out["process"]["args"] = [INIT_IN_SANDBOX, "--", *out["process"]["args"]]
    return out


def bundle_spec(spec: Spec, *, rootless_ids: tuple[int, int] | None = None,
                rootfs: str | None = None, egress: EgressHook | None = None,
                init: str | None = None) -> Spec:
    """The spec as the runtime gets it. Pure.

    ``init``: a static init binary on the host (tini-static) the command runs under
    (:func:`with_init`); None: the command is the container's pid 1.

    As root it is the compiled spec unchanged, apart from an image's unpacked rootfs path and,
    for egress, the hook that attaches slirp4netns before the command starts and a resolv.conf
    naming slirp's DNS forwarder (a host stub resolver on 127.0.0.53 is unreachable inside).
    Rootless (``rootless_ids`` = the caller's uid, gid): a user namespace mapping only the
    caller's ids, to root inside (files it writes stay the caller's), and no cgroup limits,
    which an unprivileged runtime cannot set without delegation; the lifecycle refuses
    policies that need them because :meth:`OciRuntime.enforces` leaves them out.
    """
    out = with_init(spec, init) if init is not None else copy.deepcopy(spec)
    if rootfs is not None:
        out["root"]["path"] = rootfs
    if egress is not None and egress.hook:
        out.setdefault("hooks", {}).setdefault("createRuntime", []).append({
            "path": "/bin/sh",
            "args": ["sh", "-c", EGRESS_HOOK_SCRIPT, "fusion-oci-egress",
                     egress.request, egress.reply],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "timeout": EGRESS_HOOK_TIMEOUT_S,
        })
    if egress is not None:
        out["mounts"].append(bind("/etc/resolv.conf", egress.resolv_conf, writable=False))
    if egress is not None and not egress.hook:
        # gVisor: the runtime CLI already runs in the task's own network namespace (see
        # RUNSC_EGRESS_SCRIPT); a spec namespace would be a second, empty one inside it.
        out["linux"]["namespaces"] = [ns for ns in out["linux"]["namespaces"]
                                      if ns["type"] != "network"]
    if rootless_ids is None:
        return out
    uid, gid = rootless_ids
    linux = out["linux"]
    if not any(ns["type"] == "user" for ns in linux["namespaces"]):
        linux["namespaces"].append({"type": "user"})
    # An unprivileged runtime can write one mapping line, and runc insists that it maps the
    # container's root: the caller becomes uid 0 inside (without capabilities: the bounding
    # set is empty), and what it writes is the caller's on the host.
    linux["uidMappings"] = [{"containerID": 0, "hostID": uid, "size": 1}]
    linux["gidMappings"] = [{"containerID": 0, "hostID": gid, "size": 1}]
    out["process"]["user"] = {"uid": 0, "gid": 0}
    ids = {f"uid={uid}": "uid=0", f"gid={gid}": "gid=0"}
    for mount in out["mounts"]:
        if mount.get("type") == "tmpfs":
            mount["options"] = [ids.get(o, o) for o in mount.get("options", [])]
    resources = linux.get("resources", {})
    for key in ("memory", "cpu", "pids"):
        resources.pop(key, None)
    if not any(ns["type"] == "network" for ns in linux["namespaces"]):
        # A user namespace that does not own the network namespace may not mount sysfs.
        out["mounts"] = [
            {"destination": "/sys", "type": "bind", "source": "/sys",
             "options": ["rbind", "nosuid", "noexec", "nodev", "ro"]}
            if m["destination"] == "/sys" else m
            for m in out["mounts"]
        ]
    return out


def exit_status(returncode: int | None, sig: str | None) -> tuple[int | None, str | None]:
    """The runtime's exit status -> (exit code, signal): runc reports a container whose
    process died by signal N as 128+N; the one rule is base.status_from_code. Pure."""
    return status_from_code(returncode, sig)


# runc logs in logfmt, so the quotes around the command arrive escaped (\").
_EXEC_FAILURE = re.compile(r'exec: \\?"(?P<cmd>.*?)\\?": (?P<why>[^"\n]*)')


# runsc: 'error finding executable "X" in PATH [...]: no such file or directory' and
# 'creating process: failed to load X: permission denied', after its own "running container:".
_GVISOR_EXEC_FAILURE = re.compile(
    r'^running container: .*starting sandbox: (?:error finding executable "(?P<cmd>.*?)" '
    r'in PATH \[.*?\]|creating process: failed to load (?P<path>.*?)): (?P<why>.*)$',
    re.MULTILINE)


def exec_failure_status(stderr: str) -> int | None:
    """127/126 when the runtime could not exec the command (as a shell would say), else None."""
    match = _EXEC_FAILURE.search(stderr) or _GVISOR_EXEC_FAILURE.search(stderr)
    if match is None:
        return None
    why = match["why"].lower()
    return 127 if ("no such file" in why or "not found" in why) else 126


@dataclass(frozen=True)
class CgroupCounters:
    """What the container's cgroup recorded. None: could not be read (no claim either way)."""

    oom_kills: int | None = None
    pids_max_hits: int | None = None


def parse_counter(text: str, key: str) -> int | None:
    """``key N`` lines (memory.events, memory.oom_control, pids.events) → N. Pure."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value.strip())
    return None


def limit_counters(counters: CgroupCounters) -> LimitCounters:
    """The container cgroup's counters for the one classifier (unknown counts as none)."""
    return LimitCounters(oom_kills=counters.oom_kills or 0,
                         pids_max=counters.pids_max_hits or 0)


@dataclass(frozen=True)
class CgroupHost:
    """Which cgroup hierarchy this host has and which controllers it offers."""

    mode: CgroupMode
    controllers: frozenset[str]


_V1_CONTROLLERS = frozenset({"memory", "pids", "cpu", "cpuacct", "cpuset", "blkio", "devices",
                             "freezer", "net_cls", "net_prio", "perf_event", "hugetlb", "rdma",
                             "misc"})


def parse_cgroup_mounts(mountinfo: str, v2_controllers: str = "") -> CgroupHost:
    """``/proc/self/mountinfo`` (+ the root ``cgroup.controllers`` text) → CgroupHost. Pure.

    hybrid = v1 controllers plus a cgroup2 mount beside them (crun refuses that layout).
    """
    v1: set[str] = set()
    has_v2 = False
    for line in mountinfo.splitlines():
        _, sep, tail = line.partition(" - ")
        if not sep:
            continue
        parts = tail.split()
        if len(parts) < 3:
            continue
        fstype, options = parts[0], parts[2].split(",")
        if fstype == "cgroup":
            v1.update(o for o in options if o in _V1_CONTROLLERS)
        elif fstype == "cgroup2":
            has_v2 = True
    if v1:
        return CgroupHost("hybrid" if has_v2 else "v1", frozenset(v1))
    if has_v2:
        return CgroupHost("v2", frozenset(v2_controllers.split()))
    return CgroupHost("none", frozenset())


def gvisor_details(rootless: bool, limits: frozenset[Requirement]) -> dict[str, str]:
    """What runsc (gVisor) enforces, for doctor. Pure."""
    kvm = Path("/dev/kvm").exists()
    return {
        "kernel": "gVisor: the command's system calls are served by a userspace kernel (the "
                  "Sentry), not the host's",
        "platform": "ptrace (runsc's default; /dev/kvm is " + ("present" if kvm else "absent")
                    + ", --platform=kvm is not used)",
        "network": "none: gVisor's own netstack, loopback only; host: --network=host; egress: "
                   "a fresh network namespace with slirp4netns --disable-host-loopback, "
                   "runsc --network=host inside it",
        "limits": ", ".join(sorted(r.value for r in limits)) + " (cgroups of the sandbox); "
                  "pidsLimit: not enforced (gVisor's processes are not host processes)"
                  if limits else "none: " + ("rootless, no cgroup delegation" if rootless
                                             else "no cgroup controllers"),
        "seccomp": "the bundle's profile, applied inside gVisor (--oci-seccomp)",
        "tmpSizeMb": "not enforced: gVisor's tmpfs ignores size=",
        "rootless": "unavailable (see reason)" if rootless else "rootful",
    }


def gvisor_cgroup(spec: Spec, env: Mapping[str, str]) -> tuple[Cgroup | None, Spec]:
    """A cgroup of ours holding the spec's memory and CPU limits, for runsc to join.

    runsc removes the cgroups it creates when the sandbox ends, taking the OOM counter with
    them; a cgroup that already exists it only joins. So we make the leaf (inside our own
    cgroup of each controller, where a relative ``cgroupsPath`` points), read its OOM count
    after the run and remove it. pids stays out (see :func:`gvisor_details`).
    """
    from fusion_oci.runtimes.linux.cgroups import Cgroup, CgroupLimits, detect

    limits = CgroupLimits.from_spec(spec)
    limits = replace(limits, pids=None)
    if not limits.controllers():
        return None, spec
    group = Cgroup.create(detect(env), limits)
    out = copy.deepcopy(spec)
    out["linux"]["cgroupsPath"] = next(iter(group.dirs.values())).name
    for key in ("memory", "cpu", "pids"):
        out["linux"].get("resources", {}).pop(key, None)
    return group, out


# --- host probes ------------------------------------------------------------------------------


def probe_cgroups() -> CgroupHost:
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text(encoding="utf-8")
    except OSError:
        return CgroupHost("none", frozenset())
    try:
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").read_text(encoding="utf-8")
    except OSError:
        v2 = ""
    return parse_cgroup_mounts(mountinfo, v2)


def read_counters(state_root: Path, cid: str) -> CgroupCounters:
    """The stopped (``--keep``) container's OOM kills and pids-limit hits.

    The cgroup directories come from runc's ``state.json``; for a runtime that keeps no such
    file the counters stay unknown and the reason falls back to the exit status.
    """
    try:
        state = json.loads((state_root / cid / "state.json").read_text(encoding="utf-8"))
        paths: dict[str, str] = state.get("cgroup_paths") or {}
    except (OSError, ValueError):
        return CgroupCounters()

    def read(controller: str, v1_file: str, v2_file: str, key: str) -> int | None:
        for base, name in ((paths.get(controller), v1_file), (paths.get(""), v2_file)):
            if not base:
                continue
            try:
                value = parse_counter(Path(base, name).read_text(encoding="utf-8"), key)
            except OSError:
                continue
            if value is not None:
                return value
        return None

    return CgroupCounters(
        oom_kills=read("memory", "memory.oom_control", "memory.events", "oom_kill"),
        pids_max_hits=read("pids", "pids.events", "pids.events", "max"),
    )


async def _wait_exit(pid: int, timeout_s: float) -> bool:
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


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:]) or "no output"


# --- image root filesystems -------------------------------------------------------------------

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


def podman_url(env: Mapping[str, str], uid: int, settings_url: str | None = None) -> str:
    """The podman API socket the image is exported from: ``sandbox.podmanUrl``, then the
    environment, then podman's default socket for this user. Pure."""
    if settings_url:
        return settings_url
    for name in ("FUSION_OCI_PODMAN_URL", "CONTAINER_HOST"):
        if env.get(name):
            return env[name]
    if uid == 0:
        return "unix:///run/podman/podman.sock"
    runtime_dir = env.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
    return f"unix://{runtime_dir}/podman/podman.sock"


def _inside(root: Path, rel: PurePosixPath) -> Path | None:
    """``root/rel`` with its parent resolved, or None when the parent leads outside root.

    Whiteouts and replaced entries are removed through this, so a symlink planted by a lower
    layer cannot point a removal at the host.
    """
    real_root = os.path.realpath(root)
    parent = os.path.realpath(root.joinpath(*rel.parent.parts))
    if parent != real_root and not parent.startswith(real_root + os.sep):
        return None
    if rel.name in ("", ".", ".."):
        return None
    return Path(parent) / rel.name


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _member_path(name: str) -> PurePosixPath:
    return PurePosixPath(*[p for p in PurePosixPath(name.lstrip("/")).parts if p != "."])


def apply_layer(layer: tarfile.TarFile, root: Path) -> None:
    """Apply one image layer (a tar with OCI/AUFS whiteouts) on top of ``root``.

    Whiteouts first (they only hide lower layers), then entries that change type replace what
    was there, then extraction with the ``tar`` filter: nothing outside ``root``, no
    setuid bits, numeric owners.
    """
    members = layer.getmembers()
    keep: list[tarfile.TarInfo] = []
    for member in members:
        rel = _member_path(member.name)
        if rel.name == OPAQUE:
            target = _inside(root, rel.parent / "x")
            if target is not None and target.parent.is_dir():
                for child in target.parent.iterdir():
                    _remove(child)
        elif rel.name.startswith(WHITEOUT):
            target = _inside(root, rel.parent / rel.name[len(WHITEOUT):])
            if target is not None:
                _remove(target)
        else:
            keep.append(member)
    for member in keep:
        target = _inside(root, _member_path(member.name))
        if target is None or not (target.exists() or target.is_symlink()):
            continue
        if not (member.isdir() and target.is_dir() and not target.is_symlink()):
            _remove(target)
    _extract(layer, keep, root)


_UNSAFE_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWGRP | stat.S_IWOTH


def _extract(layer: tarfile.TarFile, members: list[tarfile.TarInfo], root: Path) -> None:
    """Extract with the ``tar`` filter's rules; by hand where Python predates filters
    (3.11.0-3.11.3, e.g. Debian 12's 3.11.2)."""
    if hasattr(tarfile, "tar_filter"):
        layer.extractall(root, members=members, numeric_owner=True, filter="tar")
        return
    real_root = os.path.realpath(root)

    def inside(path: str) -> bool:
        # Resolved now, so symlinks extracted from earlier members are followed.
        real = os.path.realpath(path)
        return real == real_root or real.startswith(real_root + os.sep)

    for original in members:
        member = copy.copy(original)
        member.name = member.name.lstrip("/")
        if not inside(str(Path(real_root, member.name))):
            raise tarfile.TarError(f"{original.name!r} would be extracted outside {root}")
        if member.islnk() and not inside(str(Path(real_root, member.linkname.lstrip("/")))):
            raise tarfile.TarError(f"hard link {original.name!r} points outside {root}")
        if member.islnk():
            member.linkname = member.linkname.lstrip("/")
        member.mode &= ~_UNSAFE_BITS
        layer.extract(member, root, numeric_owner=True)


def unpack_docker_archive(archive: IO[bytes], root: Path) -> None:
    """A ``docker-archive`` tar (what podman's image save returns) → a root filesystem."""
    root.mkdir(parents=True)
    with tarfile.open(fileobj=archive, mode="r:") as outer:
        manifest_file = outer.extractfile("manifest.json")
        if manifest_file is None:
            raise ProvisionError("image archive has no manifest.json", "not a docker-archive")
        manifest = json.load(manifest_file)
        for name in manifest[0]["Layers"]:
            layer_file = outer.extractfile(name)
            if layer_file is None:
                raise ProvisionError("image archive is incomplete", f"layer {name} is missing")
            with tarfile.open(fileobj=layer_file, mode="r:*") as layer:
                apply_layer(layer, root)


@contextlib.contextmanager
def _podman_errors(ref: str, url: str) -> Iterator[None]:
    """podman SDK and HTTP errors → ProvisionError, at the one boundary that calls the SDK."""
    import requests
    from podman.errors import ImageNotFound, PodmanError

    try:
        yield
    except ImageNotFound as exc:
        raise ProvisionError(
            f"image '{ref}' is not in podman's local storage", str(exc),
            "provision it first (backend podman, `podman build`, or `podman load`)",
        ) from exc
    except (PodmanError, requests.RequestException) as exc:
        raise ProvisionError(
            f"cannot export image '{ref}' from podman at {url}", str(exc),
            "start the podman API service (`podman system service --time=0`) or point "
            "FUSION_OCI_PODMAN_URL at its socket",
        ) from exc


def export_image_rootfs(ref: str, cache: Path, url: str) -> Path:
    """The image's root filesystem, unpacked once per image id under ``cache``.

    Blocking (SDK calls and tar extraction); call it in a thread. The tree is assembled in a
    temporary sibling and renamed into place, so a crash never leaves a half-unpacked rootfs.
    """
    from podman import PodmanClient

    with _podman_errors(ref, url), PodmanClient(base_url=url) as client:
        image = client.images.get(ref)
        image_id = str(image.id).removeprefix("sha256:")
        target = cache / image_id
        if target.is_dir():
            return target / "rootfs"
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{NEW_DIR_PREFIX}{image_id[:12]}.", dir=cache))
        try:
            with tempfile.TemporaryFile(dir=cache) as archive:
                for chunk in image.save():
                    archive.write(chunk)
                archive.seek(0)
                unpack_docker_archive(archive, tmp / "rootfs")
            tmp.chmod(0o755)
            try:
                tmp.rename(target)
            except OSError:
                if not target.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # a concurrent prepare won the race
        except (OSError, tarfile.TarError, KeyError, IndexError, ValueError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ProvisionError(f"cannot unpack image '{ref}'", str(exc),
                                 f"check free space under {cache}") from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target / "rootfs"


# --- the runtime CLI, and state directories ---------------------------------------------------


def _cli_env(env: Mapping[str, str]) -> dict[str, str]:
    """The runtime CLI's own environment (the container's is in config.json)."""
    out = {"PATH": env.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")}
    if env.get("XDG_RUNTIME_DIR"):
        out["XDG_RUNTIME_DIR"] = env["XDG_RUNTIME_DIR"]
    return out


async def _cli(binary: str, root: Path, *args: str, env: Mapping[str, str]) -> ProcessOutcome:
    return await run_process([binary, "--root", str(root), *args], env=_cli_env(env),
                             timeout_s=CONTROL_TIMEOUT_S)


async def list_containers(binary: str, root: Path, env: Mapping[str, str]
                          ) -> list[dict[str, Any]]:
    """``RUNTIME --root ROOT list --format json`` (``null`` when empty or absent)."""
    outcome = await _cli(binary, root, "list", "--format", "json", env=env)
    if outcome.returncode != 0:
        raise SandboxSetupError(
            f"cannot list the containers under {root}",
            _tail(outcome.stderr.decode("utf-8", "replace")),
            f"run `{binary} --root {root} list` to see why",
        )
    data = json.loads(outcome.stdout or b"null")
    return list(data or [])


async def delete_container(binary: str, root: Path, cid: str, env: Mapping[str, str]) -> bool:
    """``delete --force``: kills what still runs, removes state and cgroups. True when gone."""
    outcome = await _cli(binary, root, "delete", "--force", cid, env=env)
    if outcome.returncode == 0:
        return True
    return "does not exist" in outcome.stderr.decode("utf-8", "replace")


class _EgressLink:
    """One egress container's rendezvous: FIFOs for the hook, and the slirp4netns it waits on.

    Both FIFOs are opened read-write here, so neither side's open() blocks and the hook's
    read sees EOF (and fails) as soon as we close them, whatever state we are in.
    """

    def __init__(self, bundles: Path, seq: int, resolv_conf: Path, *, hook: bool = True
                 ) -> None:
        self.request = bundles / f"{seq}.egress-request"
        self.reply = bundles / f"{seq}.egress-reply"
        self.log = bundles / f"{seq}.slirp.log"
        self.hook = EgressHook(str(self.request), str(self.reply), str(resolv_conf), hook)
        self.error: SandboxSetupError | None = None
        self._fds: list[int] = []
        self._task: asyncio.Task[Any] | None = None

    def start(self, slirp: str) -> None:
        for fifo in (self.request, self.reply):
            os.mkfifo(fifo, 0o600)
            self._fds.append(os.open(fifo, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))
        self._task = asyncio.ensure_future(self._attach(slirp))

    async def _attach(self, slirp: str) -> Any:
        from fusion_oci.runtimes.linux.egress import Egress
        from fusion_oci.runtimes.linux.pipes import read_json

        state = await read_json(self._fds[0])
        try:
            if not state or not isinstance(state.get("pid"), int):
                raise SandboxSetupError("the egress hook sent no container pid",
                                        f"state: {state!r}")
            link = await Egress.attach(state["pid"], slirp=slirp, log=self.log)
        except SandboxSetupError as exc:
            self.error = exc
            os.write(self._fds[1], b"no\n")
            return None
        os.write(self._fds[1], b"go\n")
        return link

    async def close(self) -> None:
        link = None
        if self._task is not None:
            if not self._task.done():
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                link = await self._task
        if link is not None:
            await link.stop()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for path in (self.request, self.reply, self.log):
            path.unlink(missing_ok=True)


@dataclass
class _TaskState:
    dir: Path
    nonce: str
    lock_fd: int
    leftovers: set[str] = field(default_factory=set)

    @property
    def root(self) -> Path:
        """The runtime's ``--root``: its state of this task's containers."""
        return self.dir / "state"

    @property
    def bundles(self) -> Path:
        return self.dir / "bundles"


def _open_task_dir(base: Path, ctx: PrepareContext, binary: str) -> _TaskState:
    """Create and lock the task's state directory; it appears under its name already locked."""
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    nonce = secrets.token_hex(3)
    tmp = Path(tempfile.mkdtemp(prefix=NEW_DIR_PREFIX, dir=base))
    fd = os.open(tmp / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owner = {"pid": os.getpid(), "task": ctx.task_id, "run": ctx.run_id,
                 "runtime": binary, "created": time.time()}
        (tmp / "owner.json").write_text(json.dumps(owner) + "\n", encoding="utf-8")
        (tmp / "state").mkdir(mode=0o700)
        (tmp / "bundles").mkdir(mode=0o700)
        final = base / task_dir_name(ctx.task_id, ctx.run_id, nonce)
        tmp.rename(final)
    except BaseException:
        os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _TaskState(final, nonce, fd)


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
            binary = runtime
            with contextlib.suppress(OSError, ValueError):
                owner = json.loads((entry / "owner.json").read_text(encoding="utf-8"))
                binary = str(owner.get("runtime") or runtime)
            root = entry / "state"
            left = False
            gone_here: list[str] = []
            for container in await list_containers(binary, root, env):
                annotations = container.get("annotations") or {}
                cid = str(container.get("id"))
                if ANN_TASK not in annotations:
                    left = True
                    continue
                if await delete_container(binary, root, cid, env):
                    gone_here.append(cid)
                else:
                    left = True
            if not left:
                shutil.rmtree(entry, ignore_errors=True)
                removed.extend(gone_here or [f"dir:{entry.name}"])
            else:
                removed.extend(gone_here)
        finally:
            os.close(fd)
    return removed


# --- the runtime ------------------------------------------------------------------------------


class OciRuntime(SpecRuntime):
    """Any OCI runtime CLI (``sandbox.ociRuntime``: runc, crun, runsc, youki) on the bundle."""

    id = "oci"
    streams_stdin = True  # run_process writes a StdinStream's chunks as they come

    def __init__(self, settings: Any, env: Mapping[str, str],
                 cache_root: Path | None = None, host: Any = None) -> None:
        super().__init__(settings, env, cache_root=cache_root, host=host)
        self.runtime_name: str = settings.oci_runtime
        self.uid = os.geteuid()
        self.gid = os.getegid()
        self.state_base = state_base(self.env, self.uid)
        self._task: _TaskState | None = None
        self._rootfs: str | None = None
        self._seq = 0
        self._binary: str | None = None
        self._init: str | None = None
        self._version: str | None = None
        self._cgroups: CgroupHost | None = None
        self._egress: tuple[bool, str] | None = None
        self.gc_removed: list[str] = []
        """Containers of dead tasks that the last prepare removed (for the audit)."""

    # -- what it offers

    @property
    def rootless(self) -> bool:
        return self.uid != 0

    @property
    def known_layout(self) -> bool:
        return Path(self.runtime_name).name in KEEP_FLAG_RUNTIMES

    def keep_for(self, spec: Spec) -> bool:
        """``--keep`` only when there are cgroup counters worth reading (memory or pids
        limits): keeping costs a second runtime call (the delete) per command. Pure."""
        resources = spec.get("linux", {}).get("resources", {})
        return self.known_layout and not self.rootless and (
            "memory" in resources or "pids" in resources)

    def _state_left(self, root: Path, cid: str) -> bool:
        """Whether ``delete`` has anything to do: without --keep, a container that ended by
        itself is already gone, state directory and all. Unknown runtimes: assume yes."""
        if is_gvisor(self.runtime_name):
            return (root / f"{cid}_sandbox:{cid}.state").exists()
        return not self.known_layout or (root / cid).exists() or (root / cid).is_symlink()

    def _find_binary(self) -> str | None:
        if self._binary is None:
            self._binary = shutil.which(self.runtime_name, path=self.env.get("PATH"))
        return self._binary

    def _find_init(self) -> str | None:
        """A static init for the container's pid 1 (Debian's tini-static; docker.io's own
        dependency), found once; None: the command is pid 1 (see with_init)."""
        if self._init is None:
            found = shutil.which("tini-static", path=self.env.get("PATH") or "/usr/bin:/bin")
            self._init = found or ""
        return self._init or None

    def _cgroup_host(self) -> CgroupHost:
        if self._cgroups is None:
            self._cgroups = probe_cgroups()
        return self._cgroups

    def _limits(self) -> frozenset[Requirement]:
        """cgroup limits the runtime applies from linux.resources on this host."""
        if self.rootless:
            return frozenset()
        have = self._cgroup_host().controllers
        out = set()
        if "memory" in have:
            out.add(Requirement.MEMORY)
        if "pids" in have and not is_gvisor(self.runtime_name):
            # gVisor's processes are tasks inside its kernel: a host pids cgroup counts the
            # sandbox's own threads instead (and at a small limit stops gVisor starting).
            out.add(Requirement.PIDS)
        if "cpu" in have:
            out.add(Requirement.CPU_QUOTA)
        return frozenset(out)

    def egress_status(self) -> tuple[bool, str]:
        """(True, slirp4netns path) when ``egress`` is enforceable here, else (False, why).

        When it is not, ``enforces()`` leaves egress out and the lifecycle refuses the
        policy: the command never runs offline or on the host's network in its place.
        """
        if self._egress is None:
            from fusion_oci.runtimes.linux import egress

            slirp = shutil.which("slirp4netns", path=self.env.get("PATH"))
            path = self.env.get("PATH")
            if is_gvisor(self.runtime_name) and self.rootless:
                self._egress = (False, "rootless runsc: its network namespace cannot be "
                                "prepared without privilege (unshare --net needs root)")
            elif is_gvisor(self.runtime_name) and not (shutil.which("unshare", path=path)
                                                       and shutil.which("ip", path=path)):
                self._egress = (False, "unshare (util-linux) or ip (iproute2) is missing")
            elif slirp is None:
                self._egress = (False, "slirp4netns is not installed (apt-get install "
                                "slirp4netns)")
            elif not egress.tun_usable():
                self._egress = (False, "/dev/net/tun is missing or not read-writable "
                                "(chmod 666 /dev/net/tun)")
            else:
                self._egress = (True, slirp)
        return self._egress

    def capabilities(self) -> SandboxCapabilities:
        limits = self._limits()
        return SandboxCapabilities(
            filesystem_isolation="strong",
            network_policy="coarse",
            resource_limits="advanced" if limits else "basic",
            requires_install=True,
            supports_mac=False,
            supports_linux=True,
            supports_windows=False,
        )

    def availability(self) -> Availability:
        name = self.runtime_name
        if not sys.platform.startswith("linux"):
            return Availability(
                False, f"OCI runtimes such as {name} run Linux containers on a Linux host only",
                "use backend podman or docker (through their VM) on this platform",
            )
        binary = self._find_binary()
        if binary is None:
            return Availability(
                False, f"'{name}' was not found on PATH",
                f"install it (Debian/Ubuntu: apt-get install {Path(name).name}), or set "
                "sandbox.ociRuntime to an installed OCI runtime (runc, crun, runsc, youki)",
            )
        cgroups = self._cgroup_host()
        if Path(binary).name == "crun" and cgroups.mode == "hybrid":
            return Availability(
                False, "crun refuses cgroup v1/hybrid hosts ('cgroups in hybrid mode not "
                "supported'), and this host is hybrid",
                "set sandbox.ociRuntime: runc, or boot the host with the unified cgroup v2 "
                "hierarchy (systemd.unified_cgroup_hierarchy=1)",
            )
        if is_gvisor(binary) and self.rootless:
            return Availability(
                False, "runsc (gVisor) cannot start a sandbox for an unprivileged caller here: "
                "with a user namespace its gofer fails ('fork/exec /proc/self/exe: operation "
                "not permitted'), without one the sandbox never starts (seen with runsc "
                "release 20221219)",
                "run fusion-oci as root for runsc, or choose bubblewrap, landlock or rootless "
                "podman",
                rootless=True,
            )
        if self.rootless:
            try:
                userns = Path("/proc/sys/user/max_user_namespaces").read_text().strip()
            except OSError:
                userns = ""
            if userns == "0":
                return Availability(
                    False, "rootless OCI runtimes need user namespaces, and "
                    "user.max_user_namespaces is 0",
                    "sysctl -w user.max_user_namespaces=15000, or run as root",
                )
        egress_ok, egress_why = self.egress_status()
        details = {
            "binary": binary,
            "cgroups": cgroups.mode,
            "controllers": ",".join(sorted(cgroups.controllers)) or "none",
            "state": str(self.state_base),
            "egress": (f"slirp4netns ({egress_why}) --disable-host-loopback, attached "
                       + ("before runsc starts (unshare --net)" if is_gvisor(binary) else
                          "by a createRuntime hook")
                       if egress_ok else f"not enforced: {egress_why}"),
        }
        if self.rootless:
            details["limits"] = ("memory, pids and cpu quota are not enforced: rootless, "
                                 "no cgroup delegation")
        if is_gvisor(binary):
            details.update(gvisor_details(self.rootless, self._limits()))
        return Availability(True, version=self._runtime_version(binary),
                            rootless=self.rootless, details=details)

    def _runtime_version(self, binary: str) -> str | None:
        if self._version is None:
            try:
                done = subprocess.run([binary, "--version"], capture_output=True, text=True,
                                      timeout=10, check=False, stdin=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired):
                return None
            first = done.stdout.strip().splitlines()[:1]
            self._version = first[0] if first else None
        return self._version

    def enforces(self) -> frozenset[Requirement]:
        out = {Requirement.FILESYSTEM, Requirement.PROC_PATHS,
               Requirement.ENV, Requirement.NETWORK_NONE,
               Requirement.CPU_TIME, Requirement.TMP_SIZE, Requirement.FILE_SIZE}
        if is_gvisor(self.runtime_name):
            out.discard(Requirement.TMP_SIZE)  # gVisor's tmpfs ignores size= (seen: 20221219)
        if self.egress_status()[0]:
            out.add(Requirement.NETWORK_EGRESS)
        return frozenset(out) | self._limits()

    # -- the pure translation

    def plan(self, spec: Spec) -> LaunchPlan:
        task = self._task
        ann = spec.get("annotations", {})
        if task is not None and self.ctx is not None:
            seq = self._seq + 1
            root, bundle = str(task.root), str(task.bundles / str(seq))
            pid_file = str(task.bundles / f"{seq}.pid")
            cid = container_id(self.ctx.task_id, self.ctx.run_id, task.nonce, seq)
        else:
            root, bundle, pid_file = "<state>/state", "<state>/bundles/<seq>", \
                "<state>/bundles/<seq>.pid"
            cid = f"{ann.get(ANN_TASK, '<task>')}-{ann.get('io.fusion-oci.run-id', '<run>')}" \
                "-<nonce>-<seq>"
        network_mode = spec_network(spec)
        argv = run_argv(self.runtime_name, root, bundle, cid, pid_file,
                        keep=self.keep_for(spec), flags=self.flags_for(spec))
        if is_gvisor(self.runtime_name) and network_mode is NetworkMode.EGRESS:
            hook = EgressHook("<state>/bundles/<seq>.egress-request",
                              "<state>/bundles/<seq>.egress-reply", "<state>/resolv.conf",
                              hook=False)
            argv = egress_launch_argv("unshare", hook, argv)
        if ann.get(ANN_IMAGE):
            rootfs = (f"image {ann[ANN_IMAGE]}: root filesystem exported from podman's local "
                      f"storage and unpacked (read-only, shared) into "
                      f"{self._rootfs or str(self.cache_root / 'oci-rootfs') + '/<image-id>'}")
        elif ann.get(ANN_HOST_ROOTFS):
            rootfs = "empty rootfs/ plus read-only binds of the host's system directories"
        else:
            rootfs = "rootfs/ of the bundle"
        network = {
            NetworkMode.NONE: "network none: an empty network namespace (loopback only)",
            NetworkMode.HOST: "network host: no network namespace",
            NetworkMode.EGRESS: "network egress: a createRuntime hook holds the container until "
                                "slirp4netns --disable-host-loopback is attached to its network "
                                "namespace; /etc/resolv.conf names slirp's DNS (refused where "
                                "slirp4netns or /dev/net/tun is unusable: see doctor)",
        }[network_mode]
        if is_gvisor(self.runtime_name):
            network = {
                NetworkMode.NONE: "network none: gVisor's netstack with loopback only "
                                  "(--network=none)",
                NetworkMode.HOST: "network host: gVisor passes the host's sockets through "
                                  "(--network=host)",
                NetworkMode.EGRESS: "network egress: runsc runs in a fresh network namespace "
                                    "(unshare --net) held until slirp4netns "
                                    "--disable-host-loopback is attached, then "
                                    "--network=host uses that namespace; /etc/resolv.conf "
                                    "names slirp's DNS",
            }[network_mode]
        resources = spec.get("linux", {}).get("resources", {})
        limits = [k for k in ("memory", "pids", "cpu") if k in resources]
        notes = [
            f"one container per command; {rootfs}",
            network,
            "timeout/maxBuffer/abort: kill --all ID TERM, "
            f"{GRACE_S:g}s grace, kill ID KILL; delete --force ID whenever state is left",
            "exit status above 128 is read as signal N-128 (the runtime reports a signal "
            "death as 128+N)",
        ]
        if self.rootless:
            notes.append("rootless: user namespace mapping only the caller's uid/gid; cgroup "
                         "limits dropped (" + (", ".join(limits) or "none set") + ")")
        elif limits:
            notes.append("cgroup limits applied by the runtime: " + ", ".join(limits))
        return LaunchPlan(backend=self.id, argv=argv, cwd=bundle, notes=notes)

    def flags_for(self, spec: Spec) -> list[str]:
        return runtime_flags(self.runtime_name, spec_network(spec), rootless=self.rootless)

    # -- lifecycle

    async def prepare(self, ctx: PrepareContext) -> None:
        await super().prepare(ctx)
        binary = self._find_binary()
        if binary is None:
            avail = self.availability()
            from fusion_oci.errors import RuntimeUnavailableError

            raise RuntimeUnavailableError(self.id, avail.reason, avail.hint)
        try:
            self.gc_removed = await gc_oci(binary, self.state_base, env=self.env)
        except (FusionOCIError, OSError):
            self.gc_removed = []  # someone else's leftovers must not block this task
        self._task = _open_task_dir(self.state_base, ctx, binary)
        try:
            if ctx.policy.network_mode is NetworkMode.EGRESS:
                from fusion_oci.runtimes.linux.egress import RESOLV_CONF

                (self._task.dir / "resolv.conf").write_text(RESOLV_CONF, encoding="utf-8")
            if ctx.image:
                url = podman_url(self.env, self.uid, self.settings.podman_url)
                rootfs = await asyncio.to_thread(
                    export_image_rootfs, ctx.image, self.cache_root / "oci-rootfs", url)
                self._rootfs = str(rootfs)
        except BaseException:
            await self.dispose()
            raise

    def _require_task(self) -> tuple[_TaskState, PrepareContext, str]:
        if self._task is None or self.ctx is None or self._binary is None:
            raise SandboxSetupError(f"runtime '{self.id}' was not prepared",
                                    "run() came before prepare()", "call prepare(ctx) first")
        return self._task, self.ctx, self._binary

    async def execute(self, spec: Spec, opts: RunOptions) -> RunResult:
        task, ctx, binary = self._require_task()
        egress_ok, slirp = self.egress_status()
        wants_egress = spec_network(spec) is NetworkMode.EGRESS
        if wants_egress and not egress_ok:
            raise PolicyNotEnforceableError(self.id, [Requirement.NETWORK_EGRESS.value], slirp)
        self._seq += 1
        seq = self._seq
        cid = container_id(ctx.task_id, ctx.run_id, task.nonce, seq)
        bundle_dir = task.bundles / str(seq)
        pid_file = task.bundles / f"{seq}.pid"
        gvisor = is_gvisor(self.runtime_name)
        link = _EgressLink(task.bundles, seq, task.dir / "resolv.conf", hook=not gvisor) \
            if wants_egress else None
        rootless_ids = (self.uid, self.gid) if self.rootless else None
        group = None
        try:
            runtime_spec = bundle_spec(spec, rootless_ids=rootless_ids, rootfs=self._rootfs,
                                       egress=link.hook if link else None,
                                       init=self._find_init())
            if gvisor and not self.rootless:
                group, runtime_spec = gvisor_cgroup(runtime_spec, self.env)
            write_bundle(runtime_spec, bundle_dir)
            keep = self.keep_for(spec)
            argv = run_argv(binary, str(task.root), str(bundle_dir), cid, str(pid_file),
                            keep=keep, flags=self.flags_for(spec))
            if link is not None and gvisor:
                unshare = shutil.which("unshare", path=self.env.get("PATH")) or "unshare"
                argv = egress_launch_argv(unshare, link.hook, argv)

            async def stop() -> None:
                await self._stop(task, binary, cid, pid_file)

            if link is not None:
                link.start(slirp)
            outcome = await run_process(
                argv, env=_cli_env(self.env), cwd=str(bundle_dir), stdin=opts.stdin,
                timeout_s=opts.timeout_ms / 1000, max_buffer=opts.max_buffer,
                grace_s=GRACE_S, term_group=False, stop=stop, on_output=opts.on_output,
                keep_output=opts.keep_output,
            )
            counters = read_counters(task.root, cid) if keep else CgroupCounters()
            if group is not None:
                events = group.events()
                counters = CgroupCounters(oom_kills=events.oom_kills)
            started = pid_file.exists()
        finally:
            if group is not None:
                group.remove()
            # Kept, killed or failed containers are deleted here; ended ones are gone.
            if self._state_left(task.root, cid):
                await asyncio.shield(self._delete(task, binary, cid))
            if link is not None:
                await asyncio.shield(link.close())
            shutil.rmtree(bundle_dir, ignore_errors=True)
            pid_file.unlink(missing_ok=True)
        if link is not None and link.error is not None:
            raise link.error
        return self._result(outcome, spec, counters, started)

    async def _stop(self, task: _TaskState, binary: str, cid: str, pid_file: Path) -> None:
        """TERM to every process of the container, the grace period, then KILL to pid 1.

        pid 1 of a pid namespace ignores signals it has no handler for, so TERM alone may
        leave the container running; KILL to pid 1 tears the whole namespace down.
        """
        term = await _cli(binary, task.root, "kill", "--all", cid, "TERM", env=self.env)
        if term.returncode != 0:
            # --all needs the cgroup (rootless without delegation has none): pid 1 only.
            await _cli(binary, task.root, "kill", cid, "TERM", env=self.env)
        pid = _read_pid(pid_file)
        if pid is None or not await _wait_exit(pid, GRACE_S):
            await _cli(binary, task.root, "kill", cid, "KILL", env=self.env)

    async def _delete(self, task: _TaskState, binary: str, cid: str) -> None:
        if await delete_container(binary, task.root, cid, self.env):
            task.leftovers.discard(cid)
        else:
            task.leftovers.add(cid)  # dispose tries again; gc after that

    def _result(self, outcome: ProcessOutcome, spec: Spec, counters: CgroupCounters,
                started: bool) -> RunResult:
        if is_gvisor(self.runtime_name) and outcome.returncode == 128:
            # runsc reports a command it cannot exec as its own failure (status 128), after
            # the sandbox (and so the pid file) exists.
            code = exec_failure_status(outcome.stderr.decode("utf-8", "replace"))
            if code is not None:
                return self.result(replace(outcome, returncode=code, signal=None), spec,
                                   "exit")
        if not started and not outcome.timed_out and not outcome.truncated \
                and outcome.returncode != 0:
            stderr = outcome.stderr.decode("utf-8", "replace")
            code = exec_failure_status(stderr)
            if code is None:
                raise SandboxSetupError(
                    f"{self.runtime_name} could not start the container", _tail(stderr),
                    "see the runtime's message above; `fusion-oci plan --backend oci` shows "
                    "the command line and `fusion-oci bundle` the config.json",
                )
            # As a shell reports a command it cannot run.
            outcome = replace(outcome, returncode=code, signal=None)
        else:
            code_, sig = exit_status(outcome.returncode, outcome.signal)
            outcome = replace(outcome, returncode=code_, signal=sig)
        return self.result(outcome, spec,
                           classify(outcome, spec, limit_counters(counters)))

    async def dispose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            binary = self._binary or self.runtime_name
            try:
                remaining = await list_containers(binary, task.root, self.env)
            except (FusionOCIError, OSError, ValueError):
                remaining = [{"id": c} for c in task.leftovers]
            left = False
            for container in remaining:
                if not await delete_container(binary, task.root, str(container["id"]),
                                              self.env):
                    left = True
            os.close(task.lock_fd)
            if not left:
                # Otherwise the unlocked directory is what gc_oci finds and retries.
                shutil.rmtree(task.dir, ignore_errors=True)
        self._rootfs = None
        await super().dispose()
