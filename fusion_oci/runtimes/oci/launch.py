"""The one launch builder of the ``oci`` runtime: what ``plan`` shows is what runs.

One container per task, whose init (pid 1) is the exec agent (fusion_oci/agent) on the other
end of the host's socketpair, handed over as the runtime CLI's stdin (runc passes a detached
container's stdio through; runsc passes it through in both modes): :func:`build_task` is a
pure function of the task's spec and the host facts the runtime found (binary, agent, state
directory, caller ids, image rootfs) and returns that container's bundle (``config.json``), the
``RUNTIME run`` argv, its env and cwd, and the side parts prepare sets up around it (the
egress rendezvous, a cgroup of ours for runsc). Each command is then a spawn frame to the
agent (:func:`command_spawn`). :meth:`OciRuntime.plan` renders both;
:meth:`OciRuntime.prepare` writes that bundle and runs that argv, :meth:`OciRuntime.execute`
sends that frame, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fusion_oci.agent.protocol import Spawn
from fusion_oci.models import NetworkMode
from fusion_oci.oci import ops
from fusion_oci.oci.model import ANN_RUN, ANN_TASK, ConfigSpec, ProcessSpec, Seccomp, TaskSpec
from fusion_oci.oci.ops import EgressHook
from fusion_oci.oci.seccomp import without_errno_ret
from fusion_oci.oci.spec import bind, with_linux, with_mounts
from fusion_oci.runtimes.linux.cgroups import CgroupLimits, leaf_name
from fusion_oci.runtimes.linux.egress import split_relays
from fusion_oci.runtimes.oci.filtered import (
    AGENT_INIT_IN_SANDBOX,
    SOCKET_PLACEHOLDER,
    runsc_service_flags,
    with_egress_forwarder,
    with_service_relays,
)
from fusion_oci.runtimes.oci.filtered import RUNSC_FLAGS as RUNSC_FILTERED_FLAGS
from fusion_oci.runtimes.oci.state import cli_env, task_dir_name
from fusion_oci.runtimes.plans import PLAN_RUN_ID, AgentPlan, SandboxLaunch, spawn_of
from fusion_oci.services.inside import ServiceWiring, service_notes, service_wiring

GRACE_S = 2.0
"""A command's timeout, maxBuffer and abort: SIGTERM to its whole tree, this grace, SIGKILL."""
AGENT_IN_SANDBOX = AGENT_INIT_IN_SANDBOX
"""Where the agent binary is bound: inside the container's own /dev tmpfs, so the mount point
is made there and nothing is left in the (shared, read-only) rootfs or on the host."""
AGENT_FD = "0"
"""The agent's connection inside: its stdin, the host's socketpair end (see the docstring)."""
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


def is_gvisor(runtime: str) -> bool:
    return Path(runtime).name == GVISOR


def runtime_flags(
    runtime: str, network: NetworkMode, *, rootless: bool = False, directfs: bool = False
) -> list[str]:
    """Global flags the runtime needs for this spec (before the subcommand). Pure.

    ``directfs``: this runsc has ``--directfs``, which is turned off (the gofer serves every
    file: see :class:`~fusion_oci.runtimes.oci.gvisor.GvisorFlags`).

    runsc decides networking by flag, not from the spec: ``none`` is its empty netstack;
    ``host`` and ``egress`` pass the sockets of the namespace it runs in through (for egress
    that is the namespace :data:`RUNSC_EGRESS_SCRIPT` prepared, never the host's); ``filtered``
    is the empty netstack with host unix sockets connectable (the proxy's, bound in: see
    :mod:`fusion_oci.runtimes.oci.filtered`).
    """
    if not is_gvisor(runtime):
        return []
    # --oci-seccomp: without it runsc ignores linux.seccomp (unshare, raw and packet sockets
    # would work inside its kernel).
    flags = ["--oci-seccomp"]
    if directfs:
        # Read-only binds (.fusion/, git hooks and config) hold only through the gofer.
        flags.append("--directfs=false")
    if network is NetworkMode.FILTERED:
        flags += RUNSC_FILTERED_FLAGS
    else:
        flags.append("--network=none" if network is NetworkMode.NONE else "--network=host")
    if rootless:
        flags.append("--rootless")
    return flags


def run_argv(
    runtime: str,
    root: str,
    bundle: str,
    cid: str,
    pid_file: str,
    *,
    flags: list[str] | None = None,
    detach: bool = True,
) -> list[str]:
    """The one command line that starts the task's container. Pure (golden-tested).

    ``detach`` (runc): the CLI exits once its init, the agent, runs, and dispose deletes the
    container. Without (runsc): the CLI stays for the task's life and tears the sandbox down
    itself when the agent exits (in ~50 ms; a ``runsc delete`` of a detached sandbox takes
    over a second)."""
    return [
        runtime,
        "--root",
        root,
        *(flags or []),
        "run",
        *(["--detach"] if detach else []),
        "--pid-file",
        pid_file,
        "--bundle",
        bundle,
        cid,
    ]


def egress_launch_argv(unshare: str, hook: EgressHook, argv: list[str]) -> list[str]:
    """gVisor's egress launch (:data:`RUNSC_EGRESS_SCRIPT`) around ``argv``. Pure."""
    return [
        unshare,
        "--net",
        "--",
        "/bin/sh",
        "-c",
        RUNSC_EGRESS_SCRIPT,
        "fusion-oci-egress",
        hook.request,
        hook.reply,
        *argv,
    ]


def bundle_spec(
    spec: ConfigSpec,
    *,
    rootless_ids: tuple[int, int] | None = None,
    rootfs: str | None = None,
    egress: EgressHook | None = None,
    init: str | None = None,
    cgroup_leaf: str | None = None,
    exec_status: tuple[str, str] | None = None,
    agent: str | None = None,
    egress_proxy: tuple[str, str] | None = None,
    services: ServiceWiring | None = None,
    errno_ret: bool = True,
) -> ConfigSpec:
    """The spec as the runtime CLI gets it: the compiled one through the ops this host needs.
    Pure.

    As root it is the compiled spec unchanged, apart from an image's unpacked rootfs, the agent
    as init (``agent``: :func:`with_agent_init`, the task's container) and, for egress, the
    rendezvous (runc: a createRuntime hook; runsc: its launch script, so no second network
    namespace) and slirp's DNS. ``exec_status``/``init`` instead of ``agent``: a standalone
    container of one command under the agent's ``--exec-status-file`` and tini (what a test
    runs by hand, e.g. as another user). ``cgroup_leaf``: limits held by a cgroup of
    ours that the runtime joins (runsc). ``egress_proxy`` (``filtered``: the proxy's socket and
    the agent binary, host paths): :func:`~fusion_oci.runtimes.oci.filtered.
    with_egress_forwarder`. Rootless: :func:`fusion_oci.oci.ops.with_rootless`.
    ``errno_ret=False``: the runtime answers every errno rule with EPERM (runsc), so the
    seccomp profile is said without ``errnoRet``
    (:func:`~fusion_oci.oci.seccomp.without_errno_ret`).
    """
    out = spec  # frozen: an op that applies returns a changed copy
    if agent is not None:  # the task's container: the agent (host path) is its init
        out = with_agent_init(out, agent)
    if exec_status is not None:  # (agent binary, status folder): inside the init
        out = ops.with_exec_status(out, *exec_status)
    if egress_proxy is not None:
        out = with_egress_forwarder(out, *egress_proxy)
    if services:
        out = with_service_relays(out, services)
    if init is not None:
        out = ops.with_init(out, init)
    if rootfs is not None:
        out = ops.with_rootfs(out, rootfs)
    if egress is not None:
        out = ops.with_egress_hook(out, egress) if egress.hook else out
        out = ops.with_resolv_conf(out, egress.resolv_conf)
        if not egress.hook:
            out = ops.without_network_namespace(out)
    if cgroup_leaf is not None:
        out = ops.with_cgroups_path(out, cgroup_leaf)
    if rootless_ids is not None:
        out = ops.with_rootless(out, *rootless_ids)
    if not errno_ret and out.task.linux.seccomp is not None:
        profile = without_errno_ret(out.task.linux.seccomp.to_oci())
        out = out.with_task(with_linux(out.task, seccomp=Seccomp.model_validate(profile)))
    return out


def with_agent_init(spec: ConfigSpec, agent: str) -> ConfigSpec:
    """The task's container: the agent (host path ``agent``, bound read-only) is its init on
    fd :data:`AGENT_FD`, under the spec's user, capabilities, no-new-privileges and seccomp
    profile (every command it spawns runs under them too). Pure.

    Its environment is PATH only and its cwd ``/``: each command carries its own (the spawn
    frame). RLIMIT_CPU stays off the init, where it would charge the agent's own CPU time over
    the whole task: the agent sets it, with the other rlimits, on each command.
    """
    proc = spec.process
    path = proc.env_map().get("PATH")
    init = proc.model_copy(
        update={
            "args": [AGENT_IN_SANDBOX, "--fd", AGENT_FD],
            "env": [f"PATH={path}"] if path else [],
            "cwd": "/",
            "rlimits": [r for r in proc.rlimits if r.type != "RLIMIT_CPU"],
        }
    )
    return ConfigSpec(with_mounts(spec.task, [bind(AGENT_IN_SANDBOX, agent, writable=False)]), init)


def command_spawn(process: ProcessSpec, run_id: str = PLAN_RUN_ID) -> Spawn:
    """One command of the task, as the agent is asked to run it: its args, exactly its env,
    its cwd and its rlimits (the agent sets them before exec). The user, capabilities and
    seccomp profile are the container's (the agent runs under them). Pure."""
    return spawn_of(process, run_id=run_id)


def process_key(process: ProcessSpec) -> tuple[object, ...]:
    """What a command's process must share with the task's init for the agent to run it: all
    but its args, env, cwd and rlimits (the agent cannot change its own user, capabilities or
    no-new-privileges for a command, nor give it a terminal). Pure."""
    return (process.user, process.capabilities, process.no_new_privileges, process.terminal)


@dataclass(frozen=True)
class Host:
    """What the runtime found on this host and in its prepared task (the builder's input)."""

    binary: str
    """The runtime CLI to exec (its path once found, else the configured name)."""
    task_dir: Path
    nonce: str
    env: dict[str, str]
    agent: str
    """The static exec agent binary (the container's init)."""
    rootless_ids: tuple[int, int] | None = None
    rootfs: str | None = None
    unshare: str = "unshare"
    cgroup_pid: int = 0
    """The pid a runsc cgroup leaf is named after (:func:`leaf_name`): ours."""
    egress_socket: str = SOCKET_PLACEHOLDER
    """``filtered``: the host path of the task's egress proxy socket (from prepare)."""
    service_relays: tuple[tuple[str, str], ...] | None = None
    """``hostServices``: the relays' sockets and unix grants' resolved paths (from prepare);
    None: placeholders."""
    gvisor_directfs: bool = False
    """runsc: the binary has ``--directfs`` (probe.gvisor_flags), so it gets
    ``--directfs=false``."""


@dataclass(frozen=True)
class TaskLaunch:
    """The task's container, exactly: what to write, what to run, what to set up around it."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    bundle: ConfigSpec
    bundle_dir: Path
    pid_file: Path
    log: Path
    """The runtime CLI's and the agent's own stdout/stderr (read when the start fails)."""
    cid: str
    network: NetworkMode
    detach: bool = True
    """The CLI exits once the container runs (runc); False: it runs for the task (runsc)."""
    egress: EgressHook | None = None
    cgroup: CgroupLimits | None = None
    """runsc: limits of a cgroup of ours named ``cgroup_leaf``, which the runtime joins."""
    cgroup_leaf: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class OciPlan(AgentPlan):
    """An oci plan: the command's spawn frame to the agent (``spawn``) of the task's container
    (``sandbox``: the runtime CLI's argv, env and cwd, started at prepare; ``bundle``: its
    config.json). The :class:`TaskLaunch` it renders rides along (not in :meth:`to_json`)."""

    bundle: ConfigSpec = field(kw_only=True)
    launch: TaskLaunch = field(kw_only=True, repr=False, compare=False)

    def _body(self) -> dict[str, Any]:
        return {**super()._body(), "bundle": self.bundle.to_oci()}


def render(backend: str, process: ProcessSpec, launch: TaskLaunch) -> OciPlan:
    """The plan of one command: the task's container and the command's frame. Pure."""
    return OciPlan(
        backend=backend,
        spawn=command_spawn(process),
        sandbox=SandboxLaunch(argv=launch.argv, env=launch.env, cwd=launch.cwd),
        notes=launch.notes,
        bundle=launch.bundle,
        process=process,
        launch=launch,
    )


def build_task(task: TaskSpec, init: ProcessSpec, host: Host) -> TaskLaunch:
    """Task spec + the init's process (the task's user, capabilities, rlimits: the args are
    the agent's, :func:`with_agent_init`) + host facts → the launch of the task's container.
    Pure."""
    spec = ConfigSpec(task, init)
    cid = task_dir_name(
        task.annotations.get(ANN_TASK, "task"), task.annotations.get(ANN_RUN, "run"), host.nonce
    )
    bundle_dir, pid_file = host.task_dir / "bundle", host.task_dir / "init.pid"
    network = task.network
    gvisor = is_gvisor(host.binary)
    egress = None
    if network is NetworkMode.EGRESS:
        egress = EgressHook(
            str(host.task_dir / "egress-request"),
            str(host.task_dir / "egress-reply"),
            str(host.task_dir / "resolv.conf"),
            hook=not gvisor,
        )
    limits = leaf = None
    if gvisor and host.rootless_ids is None:
        # runsc removes the cgroups it creates when the sandbox ends, taking the OOM counter
        # with them; one that already exists it only joins. pids stays out (gVisor's
        # processes are not host processes).
        wanted = replace(CgroupLimits.from_task(task), pids=None)
        if wanted.controllers():  # Cgroup.create refuses (fail closed) what the host lacks
            limits, leaf = wanted, leaf_name(host.nonce, host.cgroup_pid)
    bundle = bundle_spec(
        spec,
        rootless_ids=host.rootless_ids,
        rootfs=host.rootfs,
        egress=egress,
        cgroup_leaf=leaf,
        agent=host.agent,
        egress_proxy=(host.egress_socket, host.agent) if network is NetworkMode.FILTERED else None,
        services=service_wiring(
            task.host_services, *split_relays(host.service_relays), task.published_ports
        ),
        errno_ret=not gvisor,
    )
    flags = runtime_flags(
        host.binary,
        network,
        rootless=host.rootless_ids is not None,
        directfs=gvisor and host.gvisor_directfs,
    )
    if gvisor and (task.host_services or task.published_ports):
        flags = runsc_service_flags(flags)
    argv = run_argv(
        host.binary,
        str(host.task_dir / "state"),
        str(bundle_dir),
        cid,
        str(pid_file),
        flags=flags,
        detach=not gvisor,
    )
    if egress is not None and gvisor:
        argv = egress_launch_argv(host.unshare, egress, argv)
    return TaskLaunch(
        argv=argv,
        env=cli_env(host.env),
        cwd=str(bundle_dir),
        bundle=bundle,
        bundle_dir=bundle_dir,
        pid_file=pid_file,
        log=host.task_dir / "runtime.log",
        cid=cid,
        network=network,
        detach=not gvisor,
        egress=egress,
        cgroup=limits,
        cgroup_leaf=leaf,
        notes=notes(task, host, network) + service_notes(task),
    )


_NETWORK_NOTES = {
    NetworkMode.NONE: "network none: an empty network namespace (loopback only)",
    NetworkMode.HOST: "network host: no network namespace",
    NetworkMode.EGRESS: "network egress: a createRuntime hook holds the container until "
    "slirp4netns --disable-host-loopback is attached to its network "
    "namespace (once per task); /etc/resolv.conf names slirp's DNS "
    "(refused where slirp4netns or /dev/net/tun is unusable: see doctor)",
    NetworkMode.FILTERED: "network filtered: an empty network namespace (loopback only); the "
    "agent's (init's) forwarder on 127.0.0.1:3128 to the task's egress "
    "proxy socket bound at /run/fusion-oci/egress.sock",
}
_GVISOR_NETWORK_NOTES = {
    NetworkMode.NONE: "network none: gVisor's netstack with loopback only (--network=none)",
    NetworkMode.HOST: "network host: gVisor passes the host's sockets through (--network=host)",
    NetworkMode.EGRESS: "network egress: runsc runs in a fresh network namespace "
    "(unshare --net) held until slirp4netns --disable-host-loopback is "
    "attached, then --network=host uses that namespace; /etc/resolv.conf "
    "names slirp's DNS",
    NetworkMode.FILTERED: "network filtered: gVisor's netstack with loopback only "
    "(--network=none); the agent's (init's) forwarder on 127.0.0.1:3128 "
    "inside "
    "it, to the task's egress proxy socket bound at "
    "/run/fusion-oci/egress.sock (--host-uds=open: the gofer may "
    "connect to host unix sockets)",
}


def notes(task: TaskSpec, host: Host, network: NetworkMode) -> list[str]:
    """What the plan says in words next to the argv and bundle. Pure."""
    if task.image:
        rootfs = (
            f"image {task.image}: root filesystem exported by podman from a created "
            "(never started) container, read-only and shared per image digest"
        )
    elif task.host_rootfs:
        rootfs = "empty rootfs/ plus read-only binds of the host's system directories"
    else:
        rootfs = "rootfs/ of the bundle"
    gvisor = is_gvisor(host.binary)
    resources = task.resources
    limits = [k for k in ops.CGROUP_RESOURCES if getattr(resources, k) is not None]
    start = (
        "run in the foreground for the task's life, which removes the sandbox when "
        "the agent exits at dispose"
        if gvisor
        else "run --detach; delete --force at dispose"
    )
    out = [
        "one container per task, started at prepare with the exec agent as its init on a "
        "socketpair (its stdin); each command is a spawn frame to it (sdkKwargs); "
        f"{start}; {rootfs}",
        (_GVISOR_NETWORK_NOTES if gvisor else _NETWORK_NOTES)[network],
        "timeout/maxBuffer/abort: the agent ends the command's whole tree (SIGTERM, "
        f"{GRACE_S:g}s grace, SIGKILL); the container stays for the next command",
        "exit status: the command's own wait status, as the agent reports it",
    ]
    if host.rootless_ids is not None:
        out.append(
            "rootless: user namespace mapping only the caller's uid/gid; cgroup "
            "limits dropped (" + (", ".join(limits) or "none set") + ")"
        )
    elif gvisor and limits:
        out.append(
            "cgroup limits held by a cgroup of ours that runsc joins (cgroupsPath): "
            + ", ".join(k for k in limits if k != "pids")
            + ("; pids not enforced under gVisor" if "pids" in limits else "")
        )
        if "memory" in limits:
            out.append(
                "memory: the sandbox's memory is the sentry's (one host process), so an "
                "OOM kill ends the whole sandbox: the command reads oom, the task's "
                "later commands fail (agent-lost)"
            )
    elif limits:
        out.append("cgroup limits applied by the runtime: " + ", ".join(limits))
    return out
