"""Policy → the typed OCI spec (:class:`TaskSpec`, :class:`ProcessSpec`), as data.

A default spec plus small operations that each change one thing (runc/containerd style: each
takes the typed spec and returns a changed copy, never a dict). Everything here is pure: the
same inputs give the same spec, so the golden tests can compare it. The environment a command
sees is policy of its own (:mod:`fusion_oci.oci.environment`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from fusion_oci.models import (
    NetworkMode,
    PrepareContext,
    RunOptions,
    SandboxPolicy,
    ServiceContainer,
)
from fusion_oci.models.hostservice import HostService
from fusion_oci.models.publishport import PublishedPort
from fusion_oci.oci.environment import SANDBOX_HOME, SANDBOX_PATH, sandbox_env
from fusion_oci.oci.host import HostInfo
from fusion_oci.oci.model import (
    ANN_CACHE_MODE,
    ANN_HOST_ROOTFS,
    ANN_HOST_SERVICES,
    ANN_IMAGE,
    ANN_NETWORK,
    ANN_POLICY,
    ANN_PUBLISH,
    ANN_RUN,
    ANN_SERVICE_DEFS,
    ANN_SERVICES,
    ANN_TASK,
    Capabilities,
    Cpu,
    DeviceRule,
    Linux,
    Memory,
    Mount,
    Namespace,
    Pids,
    ProcessSpec,
    Resources,
    Rlimit,
    Root,
    Seccomp,
    TaskSpec,
    User,
)
from fusion_oci.policy.layout import CA_IN_SANDBOX, TaskLayout

OCI_VERSION = "1.0.2"

# The annotations (fusion_oci.oci.model) are listed, with what each means, in
# docs/spec-annotations.md: they say
# only what the OCI fields cannot (OCI has no "egress without host loopback", no image
# reference, no cache scope).

MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
READONLY_PATHS = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
)

DEFAULT_NOFILE = 65536


def default_task() -> TaskSpec:
    """The base every task starts from: runc's default config without ``process``."""
    return TaskSpec(
        oci_version=OCI_VERSION,
        root=Root(path="rootfs", readonly=True),
        hostname="fusion-sandbox",
        mounts=[
            Mount(
                destination="/proc",
                type="proc",
                source="proc",
                options=["nosuid", "noexec", "nodev"],
            ),
            Mount(
                destination="/dev",
                type="tmpfs",
                source="tmpfs",
                options=["nosuid", "strictatime", "mode=755", "size=65536k"],
            ),
            Mount(
                destination="/dev/pts",
                type="devpts",
                source="devpts",
                options=["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            ),
            Mount(
                destination="/dev/shm",
                type="tmpfs",
                source="shm",
                options=["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            ),
            Mount(
                destination="/dev/mqueue",
                type="mqueue",
                source="mqueue",
                options=["nosuid", "noexec", "nodev"],
            ),
            Mount(
                destination="/sys",
                type="sysfs",
                source="sysfs",
                options=["nosuid", "noexec", "nodev", "ro"],
            ),
        ],
        linux=Linux(
            namespaces=[Namespace(type=t) for t in ("pid", "ipc", "uts", "mount", "cgroup")],
            resources=Resources(devices=[DeviceRule(allow=False, access="rwm")]),
            masked_paths=list(MASKED_PATHS),
            readonly_paths=list(READONLY_PATHS),
        ),
        annotations={},
    )


def default_process() -> ProcessSpec:
    """The base every command starts from: runc's default ``process``, with no capabilities
    at all."""
    return ProcessSpec(
        terminal=False,
        user=User(uid=0, gid=0),
        args=["/bin/sh"],
        env=[f"PATH={SANDBOX_PATH}"],
        cwd="/",
        capabilities=Capabilities(),
        rlimits=[],
        no_new_privileges=True,
    )


def bind(dest: str, source: str, *, writable: bool) -> Mount:
    opts = ["rbind", "rw" if writable else "ro", "nosuid", "nodev"]
    return Mount(destination=dest, type="bind", source=source, options=opts)


def tmpfs(
    dest: str,
    *,
    mode: str = "1777",
    uid: int | None = None,
    gid: int | None = None,
    size: str | None = None,
) -> Mount:
    opts = ["nosuid", "nodev", f"mode={mode}"]
    if uid is not None:
        opts.append(f"uid={uid}")
    if gid is not None:
        opts.append(f"gid={gid}")
    if size:
        opts.append(f"size={size}")
    return Mount(destination=dest, type="tmpfs", source="tmpfs", options=opts)


# Every op returns a copy (model_copy: the models are frozen, and the lists they hold are
# never changed in place, only replaced), so an input spec is never changed.


def with_linux(spec: TaskSpec, **update: Any) -> TaskSpec:
    """``linux`` with the given fields (python names) replaced."""
    return spec.model_copy(update={"linux": spec.linux.model_copy(update=update)})


def with_resources(spec: TaskSpec, **update: Any) -> TaskSpec:
    """``linux.resources`` with the given fields replaced (None: the entry is left out)."""
    return with_linux(spec, resources=spec.resources.model_copy(update=update))


def with_mounts(spec: TaskSpec, mounts: Sequence[Mount]) -> TaskSpec:
    """Append mounts; later mounts cover earlier ones (order is meaning)."""
    return spec.model_copy(update={"mounts": [*spec.mounts, *mounts]})


def with_annotations(spec: TaskSpec, annotations: Mapping[str, str]) -> TaskSpec:
    return spec.model_copy(update={"annotations": {**spec.annotations, **annotations}})


def with_host_rootfs(spec: TaskSpec, host: HostInfo) -> TaskSpec:
    """Share the host's system directories read-only (no image: native, bubblewrap, runc)."""
    mounts = [bind(dest, src, writable=False) for dest, src in host.system_mounts]
    mounts += [bind(f"/etc/{n}", f"/etc/{n}", writable=False) for n in host.etc_entries]
    return with_annotations(with_mounts(spec, mounts), {ANN_HOST_ROOTFS: "true"})


def with_image(spec: TaskSpec, image: str) -> TaskSpec:
    return with_annotations(spec, {ANN_IMAGE: image})


def with_network(spec: TaskSpec, mode: NetworkMode) -> TaskSpec:
    """none and egress get their own network namespace; only host shares the host's.

    egress in plain OCI terms is an empty namespace: a runtime that cannot attach an outbound
    path (slirp4netns, a container network) leaves it closed rather than open.
    """
    ns = [n for n in spec.linux.namespaces if n.type != "network"]
    if mode is not NetworkMode.HOST:
        ns.append(Namespace(type="network"))
    return with_annotations(with_linux(spec, namespaces=ns), {ANN_NETWORK: mode.value})


def with_env_allowlist(spec: TaskSpec, names: Sequence[str]) -> TaskSpec:
    """The policy's env allowlist, carried for the runtimes that build a command's environment
    from the caller's (native) rather than from its process: never in the OCI JSON."""
    return spec.model_copy(update={"env_allowlist": tuple(names)})


def with_host_services(spec: TaskSpec, grants: Sequence[HostService]) -> TaskSpec:
    """The host services granted to the task, space-separated canonical forms (OCI has no
    field for them: each runtime serves them, or its check lists them unenforced)."""
    if not grants:
        return spec
    return with_annotations(spec, {ANN_HOST_SERVICES: " ".join(str(g) for g in grants)})


def with_published_ports(spec: TaskSpec, ports: Sequence[PublishedPort]) -> TaskSpec:
    """The ports published on the host, space-separated canonical forms
    (``127.0.0.1:8080:80``, ``127.0.0.1::3000`` for a free host port). OCI's ``ports`` are
    an engine's, not the runtime spec's: each runtime serves them, or its check lists them
    unenforced."""
    if not ports:
        return spec
    return with_annotations(spec, {ANN_PUBLISH: " ".join(str(p) for p in ports)})


def with_service_containers(spec: TaskSpec, services: Sequence[ServiceContainer]) -> TaskSpec:
    """The task's service containers: ``NAME=PORT`` space-separated (where each appears), and
    their definitions as JSON (what to start). OCI has no field for them: the lifecycle starts
    them and each runtime's relays make them appear inside, or a runtime starts them itself
    beside the task (kubernetes: in its pod)."""
    if not services:
        return spec
    text = " ".join(f"{s.name}={s.port}" for s in services)
    defs = json.dumps(
        [s.model_dump(mode="json", by_alias=True) for s in services], separators=(",", ":")
    )
    return with_annotations(spec, {ANN_SERVICES: text, ANN_SERVICE_DEFS: defs})


def with_memory_limit(spec: TaskSpec, mib: int | None) -> TaskSpec:
    if not mib:
        return spec
    limit = mib * 1024 * 1024
    # swap == limit: no swap beyond the memory limit.
    return with_resources(spec, memory=Memory(limit=limit, swap=limit))


def with_cpu_quota(spec: TaskSpec, cores: float | None, period_us: int = 100_000) -> TaskSpec:
    if not cores:
        return spec
    quota = max(1000, round(cores * period_us))
    return with_resources(spec, cpu=Cpu(quota=quota, period=period_us))


def with_pids_limit(spec: TaskSpec, pids: int | None) -> TaskSpec:
    if not pids:
        return spec
    return with_resources(spec, pids=Pids(limit=pids))


def _within_hard(value: int, hard: int) -> int:
    return value if hard < 0 else min(value, hard)


def process_rlimits(
    host: HostInfo, cpu_ms: int | None, file_size_mb: int | None = None
) -> list[Rlimit]:
    """RLIMIT_NOFILE, RLIMIT_CPU and RLIMIT_FSIZE, never above the host's current hard limits.

    Raising a limit past the hard limit is refused by the kernel (and makes runc fail), so
    every value is clamped to what this process may set. Pure.
    """
    _, nhard = host.rlimits.get("RLIMIT_NOFILE", (1024, 1024))
    hard = nhard if nhard >= 0 else DEFAULT_NOFILE
    limits = [Rlimit(type="RLIMIT_NOFILE", soft=_within_hard(DEFAULT_NOFILE, hard), hard=hard)]
    if cpu_ms:
        _, chard = host.rlimits.get("RLIMIT_CPU", (-1, -1))
        secs = max(1, math.ceil(cpu_ms / 1000))
        # SIGXCPU at the soft limit, SIGKILL one second later at the hard limit.
        limits.append(
            Rlimit(
                type="RLIMIT_CPU",
                soft=_within_hard(secs, chard),
                hard=_within_hard(secs + 1, chard),
            )
        )
    if file_size_mb:
        _, fhard = host.rlimits.get("RLIMIT_FSIZE", (-1, -1))
        size = _within_hard(file_size_mb * 1024 * 1024, fhard)
        limits.append(Rlimit(type="RLIMIT_FSIZE", soft=size, hard=size))
    return limits


@lru_cache(maxsize=4)
def seccomp_profile(arch: str) -> Seccomp:
    """The default seccomp profile of ``arch`` (see fusion_oci.oci.seccomp), typed once per
    process: it is the same for every task, and the model is frozen."""
    from fusion_oci.oci.seccomp import default_profile

    return Seccomp.model_validate(default_profile(arch))


def with_seccomp(spec: TaskSpec, arch: str) -> TaskSpec:
    """The default seccomp profile (see fusion_oci.oci.seccomp), shared by every runtime."""
    return with_linux(spec, seccomp=seccomp_profile(arch))


def task_mounts(layout: TaskLayout, policy: SandboxPolicy, host: HostInfo) -> list[Mount]:
    """The task's own mounts, in the order that gives read-only the last word where it must."""
    size = f"{policy.tmp_size_mb}m" if policy.tmp_size_mb else None
    mounts: list[Mount] = [
        tmpfs("/tmp", mode="1777", size=size),
        tmpfs(SANDBOX_HOME, mode="700", uid=host.uid, gid=host.gid, size=size),
    ]
    mounts += [bind(p, p, writable=False) for p in policy.allowed_paths]
    mounts += [bind(p, p, writable=True) for p in policy.writable_paths]
    mounts += [bind(c.sandbox_path, c.host_path, writable=True) for c in layout.caches]
    if layout.ca_bundle:
        mounts.append(bind(CA_IN_SANDBOX, layout.ca_bundle, writable=False))
    if layout.hosts_file:
        # After the system's /etc entries (with_host_rootfs): the services' names win.
        mounts.append(bind("/etc/hosts", layout.hosts_file, writable=False))
    mounts.append(bind(layout.worktree, layout.worktree, writable=True))
    git = layout.git
    dotgit = f"{layout.worktree.rstrip('/')}/.git"
    if git is not None:
        common = git.common_dir
        if git.kind == "linked":
            # The .git file names the git dir: read-only (and a mount point, so it cannot be
            # replaced by a .git/ folder of the command's making, with hooks of its own).
            mounts.append(bind(dotgit, dotgit, writable=False))
            # The common dir read-only, then only what commits need writable.
            mounts.append(bind(common, common, writable=False))
            for sub in ("objects", "refs", "logs"):
                mounts.append(bind(f"{common}/{sub}", f"{common}/{sub}", writable=True))
            mounts.append(bind(git.git_dir, git.git_dir, writable=True))
        else:
            # .git/ over itself: a mount point cannot be renamed, so the command cannot swap
            # in a .git/ of its own around the read-only hooks and config below.
            mounts.append(bind(dotgit, dotgit, writable=True))
        # Last word: hooks and config stay read-only, so nothing planted here runs on the host.
        mounts.append(bind(f"{common}/hooks", f"{common}/hooks", writable=False))
        mounts.append(bind(f"{common}/config", f"{common}/config", writable=False))
        if git.worktree_config:
            mounts.append(bind(git.worktree_config, git.worktree_config, writable=False))
    bound_ro = {m.destination for m in mounts if m.readonly}
    protected = [p for p in layout.protected if p not in bound_ro]
    mounts += [bind(p, p, writable=False) for p in protected]
    # A writablePaths entry inside a protected path (e.g. .fusion/fusion.db) stays writable.
    mounts += [
        bind(p, p, writable=True)
        for p in policy.writable_paths
        if any(p.startswith(q.rstrip("/") + "/") for q in protected)
    ]
    return mounts


def command_argv(command: str | Sequence[str]) -> list[str]:
    """One string is a shell command line (``/bin/sh -c``); a sequence is an argv."""
    if isinstance(command, str):
        return ["/bin/sh", "-c", command]
    return list(command)


def _cwd(cwd: str | None, worktree: str) -> str:
    if not cwd:
        return worktree
    return cwd if cwd.startswith("/") else f"{worktree.rstrip('/')}/{cwd}"


def compile_task(ctx: PrepareContext, layout: TaskLayout, host: HostInfo) -> TaskSpec:
    """The task's sandbox: the OCI config without ``process``, shared by every command. Pure.

    Built through the typed ops from :func:`default_task`: every step is a valid TaskSpec."""
    policy = ctx.policy
    cpu = policy.cpu_limit
    spec = default_task()
    spec = with_network(spec, policy.network_mode)
    # Service containers are served by relays as host services are: one annotation lists
    # every endpoint a relay serves inside; the services annotation names the containers.
    spec = with_host_services(spec, policy.relayed())
    spec = with_service_containers(spec, policy.services)
    spec = with_published_ports(spec, policy.published())
    spec = with_env_allowlist(spec, policy.env_allowlist)
    spec = with_memory_limit(spec, policy.memory_limit_mb)
    spec = with_cpu_quota(spec, cpu.max_cores if cpu else None)
    spec = with_pids_limit(spec, policy.pids_limit)
    spec = with_annotations(
        spec,
        {
            ANN_TASK: ctx.task_id,
            ANN_RUN: ctx.run_id,
            ANN_POLICY: policy.digest(),
            ANN_CACHE_MODE: ctx.cache_mode.value,
        },
    )
    spec = with_image(spec, ctx.image) if ctx.image else with_host_rootfs(spec, host)
    spec = with_mounts(spec, task_mounts(layout, policy, host))
    return with_seccomp(spec, host.arch)


def compile_process(
    ctx: PrepareContext,
    layout: TaskLayout,
    host: HostInfo,
    command: str | Sequence[str],
    opts: RunOptions,
    env_source: Mapping[str, str],
) -> ProcessSpec:
    """One command's OCI ``process``: argv, cwd, the sandbox environment, the policy's
    rlimits, the caller's ids, no capabilities. Pure."""
    policy = ctx.policy
    cpu = policy.cpu_limit
    env = sandbox_env(policy, layout, env_source)
    return default_process().model_copy(
        update={
            "user": User(uid=host.uid, gid=host.gid),
            "args": command_argv(command),
            "cwd": _cwd(opts.cwd, layout.worktree),
            "env": [f"{k}={v}" for k, v in sorted(env.items())],
            "rlimits": process_rlimits(
                host, cpu.max_ms if cpu else None, policy.file_size_limit_mb
            ),
        }
    )
