"""OCI spec → container-engine SDK arguments, shared by the podman and docker runtimes. Pure.

One translation, two dialects: :func:`plan_container` turns a compiled spec into the keyword
arguments of ``client.containers.create(**kwargs)`` for the ``docker`` or the ``podman`` SDK,
plus the named cache volumes the container needs; :func:`plan_exec` turns the spec of one
command into an exec; :func:`plan_kill` is the exec that ends everything a command started.

How a task container is laid out (and why):

- pid 1 is the fusion-oci exec agent (``fusion_oci/agent``), bind-mounted read-only from the
  host at :data:`AGENT_PATH`. At start it connects once to a unix socket the host listens on
  in a task-private host folder, bind-mounted read-only at :data:`AGENT_RUN_DIR`; the host
  accepts that one connection (checking the peer is the container's init), then closes the
  listener and unlinks the socket. Nothing in the container can reach the agent afterwards,
  nor replace its binary or socket (read-only mounts), nor trace it (it is not dumpable).
- Each command is a ``spawn`` over that connection with the host's pipes passed along
  (SCM_RIGHTS): output goes straight to the host, no engine exec, no ``conmon`` per command.
  The agent forks the command under the container's user, seccomp profile and capabilities
  (it runs under them itself), with the command's env, cwd and rlimits (:func:`plan_exec`);
  a keeper per command is its subreaper, so a timeout or abort ends the whole tree, daemons
  and double forks included, and what a command leaves running is ended when it exits (as
  the native runtime's reaper does). A task's commands run one at a time in its container.
- The container's own environment is only PATH: each command carries its whole environment,
  so nothing of one run's environment leaks into the next one's.
- ``network: filtered``: the engine's ``none`` network (only ``lo``), the task's egress proxy
  socket bound read-only at ``/run/fusion-oci/egress.sock`` and the agent (init) started with
  its forwarder (``--egress``), so 127.0.0.1:3128 inside is the one way out, through the
  proxy; the agent binary is also at ``/run/fusion-oci/agent`` for ssh's ProxyCommand.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fusion_oci.agent.protocol import EGRESS_AGENT, EGRESS_SOCKET, Spawn, forward_args
from fusion_oci.engines.base import CacheVolume, ContainerPlan
from fusion_oci.engines.labels import (
    LABEL_CACHE,
    LABEL_CACHE_DIR,
    LABEL_CACHE_KEY,
    LABEL_CACHE_SCOPE,
    LABEL_KIND,
    LABEL_MODE,
    LABEL_OWNER_HOST,
    Owner,
)
from fusion_oci.errors import BundleError
from fusion_oci.models import NetworkMode
from fusion_oci.oci.environment import SANDBOX_PATH
from fusion_oci.oci.model import ANN, ANN_TASK, Mount, ProcessSpec, TaskSpec
from fusion_oci.policy.layout import CACHE_ROOT_IN_SANDBOX
from fusion_oci.runtimes.linux.egress import split_relays
from fusion_oci.runtimes.outcome import LimitCounters
from fusion_oci.services.inside import ServiceWiring, service_notes, service_wiring

Engine = Literal["podman", "docker"]
ContainerMode = Literal["warm", "oneshot"]

AGENT_DIR = "/.fusion-oci"
AGENT_PATH = AGENT_DIR + "/agent"
"""The exec agent in the container (a read-only bind of the host's binary): the init."""
AGENT_RUN_DIR = AGENT_DIR + "/run"
"""The task-private host folder holding the agent's socket until it has connected."""
AGENT_SOCKET = "agent.sock"


@dataclass(frozen=True)
class AgentMounts:
    """Host paths of the agent's binary and of the task-private folder of its socket."""

    binary: str = "<fusion-oci-agent>"
    run_dir: str = "<task-private agent folder>"
    """Placeholders: what a plan (``--dry-run``, goldens) shows before prepare made them."""
    egress_socket: str = "<egress-proxy.sock>"
    """``filtered``: the host path of the task's egress proxy socket (started at prepare)."""
    service_relays: tuple[tuple[str, str], ...] | None = None
    """``hostServices``: the relays' host sockets and unix grants' resolved paths
    (fusion_oci.runtimes.linux.egress.service_relays); None: placeholders (a plan)."""


# Mounts every engine makes itself (with the same or stricter options than the spec's).
_ENGINE_MOUNTS = {"/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys"}

_RLIMIT_NAMES = {
    "RLIMIT_NOFILE": "nofile",
    "RLIMIT_CPU": "cpu",
    "RLIMIT_NPROC": "nproc",
    "RLIMIT_CORE": "core",
    "RLIMIT_AS": "as",
    "RLIMIT_FSIZE": "fsize",
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


def container_name(task_id: str, nonce: str) -> str:
    """Unique per sandbox; the task id is in it so ``docker ps`` says what it is."""
    return f"fusion-oci-{task_id}-{nonce}"


def sandbox_user(process: ProcessSpec) -> tuple[int, int]:
    return process.user.uid, process.user.gid


def as_userns_root(task: TaskSpec, init: ProcessSpec) -> tuple[TaskSpec, ProcessSpec]:
    """The spec as a rootless dockerd runs it for its own user. Pure.

    A rootless dockerd maps the container's root to the user it runs as (and uids 1 and up
    to that user's subordinate ids, which own nothing of the caller's). Docker has no
    ``keep-id``, so the caller's own uid, the one whose files the worktree holds and the
    command must write as, is uid 0 inside: the sandbox user becomes 0:0 there, with no
    capabilities (``cap_drop: ALL``, no new privileges), and the tmpfs owned by the caller
    (the private HOME) is owned by 0 inside. On the host that is the caller, as with rootless
    podman's keep-id and the rootless oci runtime (``ops.with_rootless``).
    """
    uid, gid = sandbox_user(init)
    ids = {f"uid={uid}": "uid=0", f"gid={gid}": "gid=0"}
    # A copy of only what changes (the rest, the seccomp profile above all, is shared).
    mounts = [
        m.model_copy(update={"options": [ids.get(o, o) for o in m.options or []]})
        if m.type == "tmpfs"
        else m
        for m in task.mounts
    ]
    return (
        task.model_copy(update={"mounts": mounts}),
        init.model_copy(update={"user": init.user.model_copy(update={"uid": 0, "gid": 0})}),
    )


def spec_image(spec: TaskSpec) -> str:
    image = spec.image
    if not image or spec.host_rootfs:
        raise BundleError(
            "container runtimes need an image",
            "the spec shares the host's system directories instead of naming an image",
            "set sandbox.image (e.g. `image: node`) or pass an image in the prepare context",
        )
    return image


def labels_for(spec: TaskSpec, owner: Owner, mode: ContainerMode) -> dict[str, str]:
    """Every io.fusion-oci.* annotation of the spec, plus what gc needs."""
    labels = {k: v for k, v in spec.annotations.items() if k.startswith(ANN)}
    labels.update(owner.labels())
    labels[LABEL_KIND] = "container"
    labels[LABEL_MODE] = mode
    return labels


def _is_cache(mount: Mount) -> bool:
    return (
        mount.type == "bind"
        and mount.source is not None
        and mount.destination.startswith(CACHE_ROOT_IN_SANDBOX + "/")
    )


def cache_volumes(spec: TaskSpec, owner: Owner, *, isolated: bool) -> tuple[CacheVolume, ...]:
    """One named volume per cache bind of the spec.

    The host cache directory (one per project, or per task when isolated) names the volume,
    so the same project gets the same volume in every task. Task-scoped volumes carry the
    task id and the owner, so dispose and gc remove them; project ones persist on purpose.
    """
    task = spec.task_id
    out = []
    for mount in spec.mounts:
        if not _is_cache(mount):
            continue
        source = mount.source or ""
        cache = mount.destination.rsplit("/", 1)[-1]
        key = hashlib.sha256(source.encode()).hexdigest()[:16]
        labels = {
            LABEL_KIND: "cache",
            LABEL_CACHE: cache,
            LABEL_CACHE_KEY: key,
            LABEL_CACHE_SCOPE: "task" if isolated else "project",
            LABEL_CACHE_DIR: source,
            LABEL_OWNER_HOST: owner.host,
        }
        if isolated:
            labels[ANN_TASK] = task
            labels.update(owner.labels())
        out.append(
            CacheVolume(
                f"fusion-oci-{cache}-{key}",
                mount.destination,
                source,
                labels,
                "task" if isolated else "project",
            )
        )
    return tuple(out)


def _opt(options: Sequence[str], prefix: str) -> str | None:
    return next((o.removeprefix(prefix) for o in options if o.startswith(prefix)), None)


def _tmpfs_options(options: Sequence[str]) -> list[str]:
    allowed = ("mode=", "uid=", "gid=", "size=")
    return [o for o in options if o in ("nosuid", "nodev", "noexec") or o.startswith(allowed)]


def _mounts(spec: TaskSpec, target: Target, volumes: Sequence[CacheVolume]) -> dict[str, Any]:
    by_dest = {v.destination: v for v in volumes}
    binds: list[dict[str, Any]] = []
    tmpfs: dict[str, str] = {}
    podman_tmpfs: list[dict[str, Any]] = []
    podman_volumes: dict[str, dict[str, Any]] = {}
    for mount in spec.mounts:
        dest = mount.destination
        options = list(mount.options or [])
        if dest in _ENGINE_MOUNTS:
            continue
        kind = mount.type
        if kind == "tmpfs":
            opts = _tmpfs_options(options)
            if target.engine == "docker":
                tmpfs[dest] = ",".join(opts)
            else:
                entry: dict[str, Any] = {
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "target": dest,
                    "mode": _opt(opts, "mode=") or "1777",
                }
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
                binds.append(
                    {"Target": dest, "Source": vol.name, "Type": "volume", "ReadOnly": False}
                )
            else:
                podman_volumes[vol.name] = {"bind": dest, "extended_mode": ["rw"]}
        elif kind == "bind":
            ro = "ro" in options
            if target.engine == "docker":
                binds.append(
                    {"Target": dest, "Source": mount.source or dest, "Type": "bind", "ReadOnly": ro}
                )
            else:
                source = mount.source or dest
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


def _ulimits(init: ProcessSpec, target: Target) -> list[dict[str, Any]]:
    limits = {
        _RLIMIT_NAMES[r.type]: (r.soft, r.hard) for r in init.rlimits if r.type in _RLIMIT_NAMES
    }
    if target.nproc is not None and "nproc" not in limits:
        soft, hard = target.nproc
        if hard >= 0:
            limits["nproc"] = (hard if soft < 0 else soft, hard)
    return [{"Name": n, "Soft": s, "Hard": h} for n, (s, h) in sorted(limits.items())]


def _network(spec: TaskSpec, target: Target) -> dict[str, Any]:
    mode = spec.network
    if mode is NetworkMode.NONE:
        return {"network_mode": "none"}
    if mode is NetworkMode.HOST:
        return {"network_mode": "host"}
    if mode is NetworkMode.FILTERED:
        # Only lo: the agent's forwarder to the proxy socket is the way out (_add_agent).
        return {"network_mode": "none"}
    if target.engine == "podman" and target.rootless:
        # slirp4netns gives outbound access; allow_host_loopback=false keeps 10.0.2.2 (the
        # host's loopback) closed.
        return {
            "network_mode": "slirp4netns",
            "network_options": {"slirp4netns": ["allow_host_loopback=false"]},
        }
    # A bridge: outbound is NATed; the host's 127.0.0.1 services are not reachable from it
    # (the bridge gateway is another address, and the container's own lo is its own).
    return {"network_mode": "bridge"}


def _resources(spec: TaskSpec) -> dict[str, Any]:
    res = spec.resources
    out: dict[str, Any] = {}
    if (mem := res.memory) is not None and mem.limit is not None:
        out["mem_limit"] = mem.limit
        out["memswap_limit"] = mem.swap if mem.swap is not None else mem.limit
    if (cpu := res.cpu) is not None and cpu.quota is not None:
        out["cpu_period"] = cpu.period or 100_000
        out["cpu_quota"] = cpu.quota
    if res.pids is not None:
        out["pids_limit"] = res.pids.limit
    return out


def plan_container(
    spec: TaskSpec,
    init: ProcessSpec,
    target: Target,
    *,
    name: str,
    owner: Owner,
    mode: ContainerMode = "warm",
    isolated_caches: bool = False,
    agent: AgentMounts = AgentMounts(),
) -> ContainerPlan:
    """The create arguments of the task's container (``init``: its process, the exec agent,
    whose user, PATH, rlimits and capabilities the container takes). Pure; golden-tested per
    engine."""
    notes: list[str] = []
    if target.engine == "docker" and target.rootless:
        caller = sandbox_user(init)
        spec, init = as_userns_root(spec, init)
        notes.append(
            f"rootless dockerd: the caller ({caller[0]}:{caller[1]} on the host) is "
            "0:0 inside, its user namespace's root without capabilities"
        )
    image = spec_image(spec)
    uid, gid = sandbox_user(init)
    volumes = cache_volumes(spec, owner, isolated=isolated_caches)
    kwargs: dict[str, Any] = {
        "image": image,
        "name": name,
        "hostname": spec.hostname or "fusion-sandbox",
        "user": f"{uid}:{gid}",
        "working_dir": "/",
        # Only PATH; each command carries its whole env (the agent needs none).
        "environment": {"PATH": init.env_map().get("PATH", SANDBOX_PATH)},
        "labels": labels_for(spec, owner, mode),
        "detach": True,
        "read_only": spec.root.readonly is not False,
        # The spec's capability set, not a fixed one: everything dropped, then what
        # process.capabilities.bounding lists (nothing, in every bundle compile_spec makes).
        "cap_drop": ["ALL"],
        "cap_add": engine_capabilities(init),
        "ulimits": _ulimits(init, target),
    }
    kwargs.update(_mounts(spec, target, volumes))
    sockets, targets = split_relays(agent.service_relays)
    services = service_wiring(spec.host_services, sockets, targets, spec.published_ports)
    _add_agent(
        kwargs, target, agent, filtered=spec.network is NetworkMode.FILTERED, services=services
    )
    kwargs.update(_network(spec, target))
    if target.engine == "docker" and any(g.family == 10 for g in spec.host_services):
        # Docker turns IPv6 off in a container's network namespace by default: the agent's
        # listener on the sandbox's own ::1 for a [::1] grant needs it on (its own lo only).
        kwargs["sysctls"] = {"net.ipv6.conf.lo.disable_ipv6": "0"}
    if target.cgroup_limits:
        kwargs.update(_resources(spec))
    nnp = init.no_new_privileges
    profile = spec.linux.seccomp.to_oci() if spec.linux.seccomp is not None else None
    if target.engine == "docker":
        security: list[str] = []
        if nnp:
            security.append("no-new-privileges")
        if profile is not None:
            # The docker CLI's --security-opt seccomp=FILE sends the file's JSON this way.
            security.append("seccomp=" + seccomp_json(profile))
        kwargs["security_opt"] = security
        notes.append(
            "masked/read-only /proc and /sys paths: the engine's defaults "
            "(a superset of the spec's)"
        )
    else:
        kwargs["no_new_privileges"] = nnp
        kwargs["masked_paths"] = list(spec.linux.masked_paths or [])
        if profile is not None:
            kwargs["seccomp_profile_path"] = seccomp_file(profile, target.seccomp_dir)[0]
        if target.rootless:
            # keep-id: the caller's uid is the same number inside, so worktree files stay
            # the caller's on the host.
            kwargs["userns_mode"] = "keep-id"
    notes.append(
        f"commands: spawned by the exec agent (pid 1) as {uid}:{gid}; a timeout or "
        "abort ends the command's whole tree"
    )
    if spec.network is NetworkMode.FILTERED:
        notes.append(
            "filtered: network none; the agent forwards 127.0.0.1:3128 to the task's "
            f"egress proxy socket, bound read-only at {EGRESS_SOCKET}"
        )
    notes += service_notes(spec)
    return ContainerPlan(name=name, image=image, create=kwargs, volumes=volumes, notes=notes)


def _add_agent(
    kwargs: dict[str, Any],
    target: Target,
    agent: AgentMounts,
    *,
    filtered: bool = False,
    services: ServiceWiring | None = None,
) -> None:
    """The exec agent as the container's init, and its two read-only mounts (``filtered``:
    with its forwarder, the proxy's socket and the agent again for ssh's ProxyCommand;
    ``services``: a listener per granted TCP host service, and each relay's socket)."""
    kwargs["entrypoint"] = [AGENT_PATH]
    kwargs["command"] = [
        *(forward_args() if filtered else []),
        *(services.agent_args if services else ()),
        "--connect",
        f"{AGENT_RUN_DIR}/{AGENT_SOCKET}",
    ]
    kwargs["init"] = False  # the agent is the init: it reaps, and ends trees on timeout
    # RLIMIT_CPU counts per process: on the container it would charge the agent's own CPU
    # time over the whole task; the agent sets it on each command (its spawn frame) instead.
    kwargs["ulimits"] = [u for u in kwargs["ulimits"] if u["Name"] != "cpu"]
    binds = ((agent.binary, AGENT_PATH), (agent.run_dir, AGENT_RUN_DIR))
    egress = (
        ((agent.egress_socket, EGRESS_SOCKET), (agent.binary, EGRESS_AGENT)) if filtered else ()
    ) + (services.binds if services else ())
    if target.engine == "docker":
        kwargs["mounts"] = [
            *kwargs["mounts"],
            *(
                {"Target": dest, "Source": source, "Type": "bind", "ReadOnly": True}
                for source, dest in (*binds, *egress)
            ),
        ]
    else:
        kwargs["volumes"] = {
            **kwargs["volumes"],
            **{
                source: {"bind": dest, "extended_mode": ["ro", "rbind", "nosuid", "nodev"]}
                for source, dest in binds
            },
        }
        # As mounts, not volumes: the SDK keys volumes by host path, and the agent's binary
        # is bound twice. Read-only: connecting to a socket needs no writable mount.
        kwargs["mounts"] = [
            *kwargs["mounts"],
            *(
                {"type": "bind", "source": source, "target": dest, "read_only": True}
                for source, dest in egress
            ),
        ]


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


def plan_limit_probe(process: ProcessSpec) -> Spawn:
    """Read the counters through the agent, as the sandbox user (no engine exec)."""
    return Spawn(
        id="limits",
        argv=["/bin/sh", "-c", LIMIT_PROBE],
        env={"PATH": process.env_map().get("PATH", SANDBOX_PATH)},
        cwd="/",
    )


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
    return LimitCounters(
        oom_kills=max(0, after.get("oom", 0) - before.get("oom", 0)),
        pids_max=max(0, after.get("pids", 0) - before.get("pids", 0)),
    )


def engine_capabilities(process: ProcessSpec) -> list[str]:
    """The process's capability set as engines name it (``CAP_NET_BIND_SERVICE`` ->
    ``NET_BIND_SERVICE``)."""
    return [c.removeprefix("CAP_") for c in process.kept_capabilities()]


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
