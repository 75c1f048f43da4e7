"""OCI spec → container-engine SDK arguments, shared by the podman and docker runtimes. Pure.

One translation, two dialects: :func:`plan_container` turns a compiled spec into the keyword
arguments of ``client.containers.create(**kwargs)`` for the ``docker`` or the ``podman`` SDK,
plus the named cache volumes the container needs; :func:`plan_exec` turns the spec of one
command into an exec; :func:`plan_kill` is the exec that ends everything a command started.

How a warm container is laid out (and why):

- pid 1 is the engine's init (docker-init/tini, podman's catatonit) with ``sleep infinity`` as
  its one child, the *keeper*, both in session 1. Commands are execs; the engine puts each in
  a new session, and no descendant of theirs can ever join session 1 (``setsid`` only makes new
  sessions, and the keeper never forks). So "every process whose session is not 1" is exactly
  what commands started, daemonized and double-forked ones included: :data:`KILL_SCRIPT`
  kills those, and the init reaps them. The container runs as the sandbox user (the caller's
  uid:gid) with no capabilities, so it can signal its own processes and nothing else.
- Every command runs under :data:`EXEC_WRAPPER`, which runs it and then kills what it left
  behind (as the native runtime's reaper does), so no background process outlives its run.
  A task's commands therefore run one at a time in its container.
- The container's own environment is only PATH: each exec carries the command's whole
  environment, so nothing of one run's environment leaks into the next one's.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fusion_oci.errors import BundleError
from fusion_oci.models import NetworkMode
from fusion_oci.oci.spec import (
    ANN,
    ANN_HOST_ROOTFS,
    ANN_IMAGE,
    ANN_TASK,
    SANDBOX_PATH,
    Spec,
    spec_capabilities,
    spec_env,
    spec_network,
)
from fusion_oci.policy.layout import CACHE_ROOT_IN_SANDBOX
from fusion_oci.runtimes.base import LimitCounters, status_from_code

Engine = Literal["podman", "docker"]
ContainerMode = Literal["warm", "oneshot"]

LABEL_KIND = ANN + "kind"
"""``container`` or ``cache``: what gc looks for (every object we create carries it)."""
LABEL_MODE = ANN + "mode"
LABEL_OWNER_PID = ANN + "owner-pid"
LABEL_OWNER_START = ANN + "owner-start"
"""Start time of the owner pid (clock ticks since boot), so a reused pid is not "alive"."""
LABEL_OWNER_BOOT = ANN + "owner-boot"
LABEL_OWNER_HOST = ANN + "owner-host"
LABEL_CACHE = ANN + "cache"
LABEL_CACHE_SCOPE = ANN + "cache-scope"
"""``project`` (kept across tasks, gc keeps it unless asked) or ``task`` (removed with it)."""
LABEL_CACHE_KEY = ANN + "cache-key"
LABEL_CACHE_DIR = ANN + "cache-dir"
"""The host directory a cache volume is bound to; gc drops the volume once it is gone."""

KEEPER_CMD = ("sleep", "infinity")

# SIGKILL every process outside session 1 but this shell, until none is left (a fork racing
# the loop is caught by the next pass). Shell builtins only: it must not fork, and it must
# work in any image with a POSIX sh. Zombies are skipped: the init reaps them.
KILL_SCRIPT = (
    "me=$$; n=0; while [ $n -lt 50 ]; do n=$((n+1)); hit=; "
    "for f in /proc/[0-9]*/stat; do "
    'read -r l 2>/dev/null < "$f" || continue; p=${f#/proc/}; p=${p%/stat}; '
    'set -- ${l##*) }; '
    '[ "$4" = 1 ] || [ "$p" = "$me" ] || [ "$1" = Z ] && continue; '
    'kill -9 "$p" 2>/dev/null && hit=1; '
    'done; [ -z "$hit" ] && break; done'
)

# Runs "$@", then ends whatever it left running. stdin arrives base64-encoded in an env var
# because neither SDK can feed an exec's stdin without hijacking the HTTP connection.
EXEC_WRAPPER = (
    'if [ -n "${FUSION_OCI_STDIN+x}" ]; then '
    'printf %s "$FUSION_OCI_STDIN" | base64 -d | { unset FUSION_OCI_STDIN; "$@"; }; '
    'else "$@" </dev/null; fi; '
    "rc=$?; " + KILL_SCRIPT + "; exit $rc"
)
KILL_ALL = ("/bin/sh", "-c", KILL_SCRIPT + "; exit 0")
STDIN_ENV = "FUSION_OCI_STDIN"
STDIN_MAX = 96 * 1024
"""Largest stdin passed to a container command (an env var is capped at 128 KiB)."""

# Mounts every engine makes itself (with the same or stricter options than the spec's).
_ENGINE_MOUNTS = {"/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys"}

_RLIMIT_NAMES = {
    "RLIMIT_NOFILE": "nofile", "RLIMIT_CPU": "cpu", "RLIMIT_NPROC": "nproc",
    "RLIMIT_CORE": "core", "RLIMIT_AS": "as", "RLIMIT_FSIZE": "fsize",
}


@dataclass(frozen=True)
class Owner:
    """The fusion-oci process that owns a container (gc removes what no live owner holds)."""

    pid: int
    start: str
    boot: str
    host: str

    def labels(self) -> dict[str, str]:
        return {
            LABEL_OWNER_PID: str(self.pid),
            LABEL_OWNER_START: self.start,
            LABEL_OWNER_BOOT: self.boot,
            LABEL_OWNER_HOST: self.host,
        }


@dataclass(frozen=True)
class Target:
    """What the translation needs to know about the engine on the other end."""

    engine: Engine
    rootless: bool = False
    nproc: tuple[int, int] | None = None
    """The caller's RLIMIT_NPROC (soft, hard); rootful podman's default exceeds some hosts'."""
    cgroup_limits: bool = True
    """False for rootless containers on a cgroup v1 host: no memory/cpu/pids limits there."""
    seccomp_dir: str = "<seccomp-dir>"
    """podman: the directory the bundle's seccomp profile is written to as a file (see
    :func:`seccomp_file`; the podman SDK takes a profile only by path). The runtime passes
    its own; the placeholder default is for plans only (podman refuses a missing file)."""


@dataclass(frozen=True)
class CacheVolume:
    """A named volume that replaces a cache bind mount of the spec.

    It is a local-driver volume bound to the spec's host cache directory (``o=bind``): a
    named, labelled object per project (or per task) that ``volume ls`` and gc see, whose
    files are the caller's on the host like the worktree's, and which the native and
    bubblewrap runtimes share. A plain engine-managed volume would be root-owned and need a
    privileged chown container before a non-root sandbox user could write to it.
    """

    name: str
    destination: str
    device: str
    labels: dict[str, str]
    scope: Literal["project", "task"]

    @property
    def driver_opts(self) -> dict[str, str]:
        return {"type": "none", "o": "bind", "device": self.device}


@dataclass(frozen=True)
class ContainerPlan:
    name: str
    image: str
    create: dict[str, Any]
    """Keyword arguments of ``client.containers.create(**create)`` for the target's SDK."""
    volumes: tuple[CacheVolume, ...] = ()
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ExecPlan:
    cmd: list[str]
    environment: dict[str, str]
    workdir: str
    user: str

    def to_json(self) -> dict[str, Any]:
        return {"cmd": self.cmd, "environment": self.environment, "workdir": self.workdir,
                "user": self.user}


def container_name(task_id: str, nonce: str) -> str:
    """Unique per sandbox; the task id is in it so ``docker ps`` says what it is."""
    return f"fusion-oci-{task_id}-{nonce}"


def sandbox_user(spec: Spec) -> tuple[int, int]:
    user = spec["process"]["user"]
    return int(user["uid"]), int(user["gid"])


def spec_image(spec: Spec) -> str:
    image = spec["annotations"].get(ANN_IMAGE)
    if not image or spec["annotations"].get(ANN_HOST_ROOTFS) == "true":
        raise BundleError(
            "container runtimes need an image",
            "the spec shares the host's system directories instead of naming an image",
            "set sandbox.image (e.g. `image: node`) or pass an image in the prepare context",
        )
    return str(image)


def labels_for(spec: Spec, owner: Owner, mode: ContainerMode) -> dict[str, str]:
    """Every io.fusion-oci.* annotation of the spec, plus what gc needs."""
    labels = {k: str(v) for k, v in spec["annotations"].items() if k.startswith(ANN)}
    labels.update(owner.labels())
    labels[LABEL_KIND] = "container"
    labels[LABEL_MODE] = mode
    return labels


def _is_cache(mount: Mapping[str, Any]) -> bool:
    return mount.get("type") == "bind" and str(mount["destination"]).startswith(
        CACHE_ROOT_IN_SANDBOX + "/"
    )


def cache_volumes(spec: Spec, owner: Owner, *, isolated: bool) -> tuple[CacheVolume, ...]:
    """One named volume per cache bind of the spec.

    The host cache directory (one per project, or per task when isolated) names the volume,
    so the same project gets the same volume in every task. Task-scoped volumes carry the
    task id and the owner, so dispose and gc remove them; project ones persist on purpose.
    """
    task = str(spec["annotations"].get(ANN_TASK, ""))
    out = []
    for mount in spec["mounts"]:
        if not _is_cache(mount):
            continue
        cache = str(mount["destination"]).rsplit("/", 1)[-1]
        key = hashlib.sha256(str(mount["source"]).encode()).hexdigest()[:16]
        labels = {LABEL_KIND: "cache", LABEL_CACHE: cache, LABEL_CACHE_KEY: key,
                  LABEL_CACHE_SCOPE: "task" if isolated else "project",
                  LABEL_CACHE_DIR: str(mount["source"]), LABEL_OWNER_HOST: owner.host}
        if isolated:
            labels[ANN_TASK] = task
            labels.update(owner.labels())
        out.append(CacheVolume(f"fusion-oci-{cache}-{key}", str(mount["destination"]),
                               str(mount["source"]), labels, "task" if isolated else "project"))
    return tuple(out)


def _opt(options: Sequence[str], prefix: str) -> str | None:
    return next((o.removeprefix(prefix) for o in options if o.startswith(prefix)), None)


def _tmpfs_options(options: Sequence[str]) -> list[str]:
    allowed = ("mode=", "uid=", "gid=", "size=")
    return [o for o in options if o in ("nosuid", "nodev", "noexec") or o.startswith(allowed)]


def _mounts(spec: Spec, target: Target, volumes: Sequence[CacheVolume]) -> dict[str, Any]:
    by_dest = {v.destination: v for v in volumes}
    binds: list[dict[str, Any]] = []
    tmpfs: dict[str, str] = {}
    podman_tmpfs: list[dict[str, Any]] = []
    podman_volumes: dict[str, dict[str, Any]] = {}
    for mount in spec["mounts"]:
        dest = str(mount["destination"])
        options = list(mount.get("options", []))
        if dest in _ENGINE_MOUNTS:
            continue
        kind = mount.get("type")
        if kind == "tmpfs":
            opts = _tmpfs_options(options)
            if target.engine == "docker":
                tmpfs[dest] = ",".join(opts)
            else:
                entry: dict[str, Any] = {"type": "tmpfs", "source": "tmpfs", "target": dest,
                                         "mode": _opt(opts, "mode=") or "1777"}
                if size := _opt(opts, "size="):
                    entry["size"] = size
                if _opt(opts, "uid="):
                    # The podman SDK passes no uid= option; U chowns the tmpfs to the
                    # container's user, which is the sandbox user (the spec's uid) here.
                    entry["chown"] = True
                podman_tmpfs.append(entry)
        elif kind == "bind" and dest in by_dest:
            vol = by_dest[dest]
            if target.engine == "docker":
                binds.append({"Target": dest, "Source": vol.name, "Type": "volume",
                              "ReadOnly": False})
            else:
                podman_volumes[vol.name] = {"bind": dest, "extended_mode": ["rw"]}
        elif kind == "bind":
            ro = "ro" in options
            if target.engine == "docker":
                binds.append({"Target": dest, "Source": str(mount["source"]), "Type": "bind",
                              "ReadOnly": ro})
            else:
                source = str(mount["source"])
                if source in podman_volumes:
                    raise BundleError(
                        f"host path {source} is mounted twice",
                        "the podman SDK keys bind mounts by host path",
                        "list each host path once in allowedPaths/writablePaths",
                    )
                flags = [o for o in options if o in ("ro", "rw", "nosuid", "nodev", "noexec")]
                podman_volumes[source] = {"bind": dest, "extended_mode": ["rbind", *flags]}
        else:
            raise BundleError(
                f"mount {dest} of type {kind!r} has no container equivalent",
                "only bind and tmpfs mounts are translated",
                "report this: the spec compiler made a mount the container runtimes lack",
            )
    if target.engine == "docker":
        return {"mounts": binds, "tmpfs": tmpfs}
    return {"mounts": podman_tmpfs, "volumes": podman_volumes}


def _ulimits(spec: Spec, target: Target) -> list[dict[str, Any]]:
    limits = {
        _RLIMIT_NAMES[r["type"]]: (int(r["soft"]), int(r["hard"]))
        for r in spec["process"].get("rlimits", [])
        if r["type"] in _RLIMIT_NAMES
    }
    if target.nproc is not None and "nproc" not in limits:
        soft, hard = target.nproc
        if hard >= 0:
            limits["nproc"] = (hard if soft < 0 else soft, hard)
    return [{"Name": n, "Soft": s, "Hard": h} for n, (s, h) in sorted(limits.items())]


def _network(spec: Spec, target: Target) -> dict[str, Any]:
    mode = spec_network(spec)
    if mode is NetworkMode.NONE:
        return {"network_mode": "none"}
    if mode is NetworkMode.HOST:
        return {"network_mode": "host"}
    if target.engine == "podman" and target.rootless:
        # slirp4netns gives outbound access; allow_host_loopback=false keeps 10.0.2.2 (the
        # host's loopback) closed.
        return {"network_mode": "slirp4netns",
                "network_options": {"slirp4netns": ["allow_host_loopback=false"]}}
    # A bridge: outbound is NATed; the host's 127.0.0.1 services are not reachable from it
    # (the bridge gateway is another address, and the container's own lo is its own).
    return {"network_mode": "bridge"}


def _resources(spec: Spec) -> dict[str, Any]:
    res = spec["linux"].get("resources", {})
    out: dict[str, Any] = {}
    if mem := res.get("memory"):
        out["mem_limit"] = int(mem["limit"])
        out["memswap_limit"] = int(mem.get("swap", mem["limit"]))
    if cpu := res.get("cpu"):
        out["cpu_period"] = int(cpu["period"])
        out["cpu_quota"] = int(cpu["quota"])
    if pids := res.get("pids"):
        out["pids_limit"] = int(pids["limit"])
    return out


def plan_container(
    spec: Spec,
    target: Target,
    *,
    name: str,
    owner: Owner,
    mode: ContainerMode = "warm",
    isolated_caches: bool = False,
) -> ContainerPlan:
    """The create arguments of the task's container. Pure; golden-tested per engine."""
    image = spec_image(spec)
    uid, gid = sandbox_user(spec)
    volumes = cache_volumes(spec, owner, isolated=isolated_caches)
    kwargs: dict[str, Any] = {
        "image": image,
        "command": list(KEEPER_CMD),
        "name": name,
        "hostname": spec.get("hostname", "fusion-sandbox"),
        "user": f"{uid}:{gid}",
        "working_dir": "/",
        # Only PATH (the init must find `sleep`); each exec carries its command's whole env.
        "environment": {"PATH": spec_env(spec).get("PATH", SANDBOX_PATH)},
        "labels": labels_for(spec, owner, mode),
        "init": True,
        "detach": True,
        "read_only": bool(spec.get("root", {}).get("readonly", True)),
        # The spec's capability set, not a fixed one: everything dropped, then what
        # process.capabilities.bounding lists (nothing, in every bundle compile_spec makes).
        "cap_drop": ["ALL"],
        "cap_add": engine_capabilities(spec),
        "ulimits": _ulimits(spec, target),
    }
    kwargs.update(_mounts(spec, target, volumes))
    kwargs.update(_network(spec, target))
    if target.cgroup_limits:
        kwargs.update(_resources(spec))
    notes: list[str] = []
    nnp = bool(spec["process"].get("noNewPrivileges", False))
    profile = spec.get("linux", {}).get("seccomp")
    if target.engine == "docker":
        security: list[str] = []
        if nnp:
            security.append("no-new-privileges")
        if profile is not None:
            # The docker CLI's --security-opt seccomp=FILE sends the file's JSON this way.
            security.append("seccomp=" + seccomp_json(profile))
        kwargs["security_opt"] = security
        notes.append("masked/read-only /proc and /sys paths: the engine's defaults "
                     "(a superset of the spec's)")
    else:
        kwargs["no_new_privileges"] = nnp
        kwargs["masked_paths"] = list(spec["linux"].get("maskedPaths", []))
        if profile is not None:
            kwargs["seccomp_profile_path"] = seccomp_file(profile, target.seccomp_dir)[0]
        if target.rootless:
            # keep-id: the caller's uid is the same number inside, so worktree files stay
            # the caller's on the host.
            kwargs["userns_mode"] = "keep-id"
    notes.append(f"commands: execs as {uid}:{gid} under the wrapper; timeout kills every "
                 "process outside session 1")
    return ContainerPlan(name=name, image=image, create=kwargs, volumes=volumes, notes=notes)


def plan_exec(spec: Spec, stdin: bytes | None = None) -> ExecPlan:
    """The exec of one command: wrapper + argv, its whole env, cwd, and the sandbox user."""
    uid, gid = sandbox_user(spec)
    env = spec_env(spec)
    if stdin is not None:
        if len(stdin) > STDIN_MAX:
            raise BundleError(
                "stdin is too large for a container command",
                f"{len(stdin)} bytes; container runtimes pass at most {STDIN_MAX}",
                "write the input to a file in the worktree and read it from there",
            )
        env[STDIN_ENV] = base64.b64encode(stdin).decode()
    return ExecPlan(
        cmd=["/bin/sh", "-c", EXEC_WRAPPER, "fusion-oci", *spec["process"]["args"]],
        environment=env,
        workdir=str(spec["process"]["cwd"]),
        user=f"{uid}:{gid}",
    )


def plan_kill(spec: Spec) -> ExecPlan:
    """The exec that ends every process of the sandbox user in the container."""
    uid, gid = sandbox_user(spec)
    return ExecPlan(cmd=list(KILL_ALL), environment={}, workdir="/", user=f"{uid}:{gid}")


# Which cgroup limit held a command: the container's own cgroup counters, as the sandbox user
# sees them (cgroup v2 files first, then v1). Only read after a command failed.
LIMIT_PROBE = (
    "for f in /sys/fs/cgroup/pids.events /sys/fs/cgroup/pids/pids.events; do "
    '[ -r "$f" ] && { while read -r k v; do [ "$k" = max ] && echo "pids $v"; done < "$f"; '
    "break; }; done; "
    "for f in /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do "
    '[ -r "$f" ] && { while read -r k v; do [ "$k" = oom_kill ] && echo "oom $v"; '
    'done < "$f"; break; }; done; exit 0'
)


def plan_limit_probe(spec: Spec) -> ExecPlan:
    uid, gid = sandbox_user(spec)
    return ExecPlan(cmd=["/bin/sh", "-c", LIMIT_PROBE], environment={}, workdir="/",
                    user=f"{uid}:{gid}")


def parse_limit_counters(text: str) -> dict[str, int]:
    """``pids N`` / ``oom N`` lines → counters (missing files: no entry)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key in ("pids", "oom") and value.strip().isdigit():
            out[key] = int(value)
    return out


def limit_reason(before: Mapping[str, int], after: Mapping[str, int]) -> LimitCounters:
    """How much the container's oom and pids counters grew during the run. Pure."""
    return LimitCounters(oom_kills=max(0, after.get("oom", 0) - before.get("oom", 0)),
                         pids_max=max(0, after.get("pids", 0) - before.get("pids", 0)))


def engine_capabilities(spec: Spec) -> list[str]:
    """The spec's capability set as engines name it (``CAP_NET_BIND_SERVICE`` ->
    ``NET_BIND_SERVICE``)."""
    return [c.removeprefix("CAP_") for c in spec_capabilities(spec)]


def seccomp_json(profile: Mapping[str, Any]) -> str:
    """The spec's ``linux.seccomp`` as one canonical JSON text (engines read OCI's field
    names: defaultAction, architectures, syscalls with names/action/errnoRet/args)."""
    return json.dumps(profile, sort_keys=True, separators=(",", ":"))


def seccomp_file(profile: Mapping[str, Any], directory: str) -> tuple[str, str]:
    """(path, text) of the file that carries ``profile`` to podman: named by its digest, so
    the same profile is one file and a changed profile is a new one. Pure."""
    text = seccomp_json(profile)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{directory.rstrip('/')}/bundle-{digest}.json", text


def exit_status(code: int | None) -> tuple[int | None, str | None]:
    """Engine exec exit code -> (exit code, signal name): engines report death by signal N as
    128+N (base.status_from_code, the one rule); no code at all is a kill."""
    if code is None:
        return None, "SIGKILL"
    return status_from_code(code)
