"""The bubblewrap translation: a task spec (and a few host facts in :class:`BwrapHost`) to the
``bwrap`` command line of the task's sandbox, and a process spec to the agent's spawn frame of
each command, pure and golden-tested per policy (see :mod:`.bubblewrap` for the runtime around
it).

One sandbox per task: :func:`bwrap_argv` is the whole sandbox, all of the
:class:`~fusion_oci.oci.model.TaskSpec` (namespaces, mounts, protected paths, seccomp,
hostname) and the task's user, with the exec agent (fusion_oci/agent) as its PID 1
(``--as-pid-1``) on a socketpair fd. Each command is then one :func:`bwrap_spawn` frame to
that agent: the :class:`~fusion_oci.oci.model.ProcessSpec`'s args, env, cwd and rlimits. So
nothing that varies per command is in the bwrap command line.

The spec's mounts are replayed in order, because order is meaning: the git ``hooks/`` and
``config`` of a linked worktree's common directory are bound read-only *after* the read-write
parents they sit in.

At launch bwrap's options travel on ``--args FD`` (:func:`args_launch`): bwrap reads them
before it does anything else, so they stay out of the host's ``/proc/PID/cmdline`` and the
hard rlimits a command needs can be raised on the waiting bwrap with prlimit(2).
"""

from __future__ import annotations

import re
import resource
from collections.abc import Sequence
from dataclasses import dataclass

from fusion_oci.agent.protocol import EGRESS_AGENT, EGRESS_SOCKET, Spawn, forward_args
from fusion_oci.errors import BundleError, SandboxSetupError
from fusion_oci.models import NetworkMode
from fusion_oci.oci.model import Mount, ProcessSpec, Rlimit, TaskSpec, User
from fusion_oci.oci.seccomp import LIBSECCOMP_HINT, OCI_ARCHES, compile_bpf
from fusion_oci.runtimes.linux import cgroups
from fusion_oci.runtimes.linux.cgroups import CgroupLimits
from fusion_oci.runtimes.linux.egress import split_relays
from fusion_oci.runtimes.plans import PLAN_RUN_ID, spawn_of
from fusion_oci.services.inside import ServiceWiring, service_notes, service_wiring

INFO_FD = "<info-fd>"
BLOCK_FD = "<block-fd>"
SECCOMP_FD = "<seccomp-fd>"
AGENT_FD = "<agent-fd>"
AGENT_HELPER = "<fusion-oci-agent>"
AGENT_IN_SANDBOX = "/dev/fusion-oci-agent"
"""Where the static agent binary is bound, read-only, to be the sandbox's PID 1."""
RESOLV_PLACEHOLDER = "<egress-resolv.conf>"
EGRESS_PLACEHOLDER = "<egress-proxy.sock>"
"""The host path of the task's egress proxy socket in a plan (the proxy starts at prepare)."""

# The spec's rlimits bubblewrap applies (the agent's setrlimit(2) before each command's exec).
RLIMITS = {
    "RLIMIT_CPU": resource.RLIMIT_CPU,
    "RLIMIT_NOFILE": resource.RLIMIT_NOFILE,
    "RLIMIT_NPROC": resource.RLIMIT_NPROC,
    "RLIMIT_CORE": resource.RLIMIT_CORE,
    "RLIMIT_AS": resource.RLIMIT_AS,
    "RLIMIT_FSIZE": resource.RLIMIT_FSIZE,
}

# /dev sub-mounts of the OCI default that bwrap's --dev already provides (pts, shm).
_COVERED_BY_DEV = ("/dev/pts", "/dev/shm")


@dataclass(frozen=True)
class BwrapHost:
    """The host facts the translation needs: tool paths and what this host supports."""

    bwrap: str = "bwrap"
    disable_userns: bool = True
    """bwrap >= 0.8: forbid nested user namespaces inside the sandbox."""
    cgroup_mode: cgroups.Mode = "v1"
    systemd_run: str | None = None
    egress_resolv_conf: str = RESOLV_PLACEHOLDER
    """Host file bound over /etc/resolv.conf in egress mode (slirp's DNS)."""
    path_kinds: tuple[tuple[str, str], ...] | None = None
    """``(path, "file" | "dir")`` for each of the spec's maskedPaths/readonlyPaths that exists
    on this host (bwrap cannot mount over a path that does not exist). None: assume every one
    exists with its usual kind (plans and goldens stay independent of the host)."""
    agent: str = AGENT_HELPER
    """The host path of the agent binary (fusion_oci.agent), the sandbox's PID 1."""
    egress_socket: str = EGRESS_PLACEHOLDER
    """``filtered``: the host path of the task's egress proxy socket (fusion_oci.egress)."""
    service_relays: tuple[tuple[str, str], ...] | None = None
    """``hostServices``: the relays' host sockets and unix grants' resolved paths
    (fusion_oci.runtimes.linux.egress.service_relays). None: placeholders (a plan)."""


@dataclass(frozen=True)
class LaunchFds:
    """The fds bwrap gets: it writes its child pid to ``info``, waits on ``block``, reads the
    compiled seccomp filter from ``seccomp``; ``agent`` is the agent's end of the socketpair."""

    info: int | str = INFO_FD
    block: int | str = BLOCK_FD
    seccomp: int | str = SECCOMP_FD
    agent: int | str = AGENT_FD


def _size_bytes(value: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)", value.lower())
    if not m:
        raise BundleError(
            f"tmpfs size '{value}' is not understood",
            "expected N, Nk, Nm or Ng",
            "fix the spec's tmpfs options",
        )
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[m.group(2)]


def mount_args(mount: Mount) -> tuple[list[str], str | None]:
    """One spec mount as bwrap options, or a note saying why it is skipped. Pure."""
    dest, kind = mount.destination, mount.type or "bind"
    opts = list(mount.options or [])
    if kind == "proc":
        return ["--proc", dest], None
    if dest == "/dev" and kind == "tmpfs":
        return ["--dev", "/dev"], None
    if dest in _COVERED_BY_DEV:
        return [], None
    if kind == "mqueue":
        return ["--mqueue", dest], None
    if kind == "sysfs":
        return [], f"{dest}: not mounted (bwrap cannot mount a fresh sysfs; the host's stays out)"
    if kind == "tmpfs":
        args: list[str] = []
        mode = mount.option("mode")
        if mode:
            args += ["--perms", mode.rjust(4, "0")]
        size = mount.option("size")
        if size:
            args += ["--size", str(_size_bytes(size))]
        return [*args, "--tmpfs", dest], None
    if kind == "bind" or "bind" in opts or "rbind" in opts:
        flag = "--ro-bind" if "ro" in opts else "--bind"
        return [flag, mount.source or dest, dest], None
    raise BundleError(
        f"mount type '{kind}' at {dest} is not supported by bubblewrap",
        "bwrap can bind, tmpfs, proc, dev and mqueue",
        "use a container backend for this spec",
    )


def _rootfs_args(task: TaskSpec) -> list[str]:
    if task.host_rootfs:
        return []  # the system directories come as ordinary read-only binds
    image = task.image or task.root.path
    if not image.startswith("/"):
        raise BundleError(
            f"bubblewrap cannot use image '{image}'",
            "it needs the host's system directories or an unpacked rootfs directory",
            "leave sandbox.image unset for bubblewrap, or set it to an absolute rootfs path",
        )
    return ["--ro-bind", image, "/"]


def agent_rlimits(rlimits: Sequence[Rlimit]) -> list[tuple[str, int, int, int]]:
    """``(name, resource, soft, hard)`` for each rlimit (of a process, or of the task's
    commands), refusing one the agent does not set. Pure."""
    out = []
    for item in rlimits:
        res = RLIMITS.get(item.type)
        if res is None:
            raise BundleError(
                f"rlimit {item.type} is not supported by bubblewrap",
                f"supported: {', '.join(RLIMITS)}",
                "drop it from the spec",
            )
        out.append((item.type, res, item.soft, item.hard))
    return out


# The usual kind of the OCI default maskedPaths/readonlyPaths (see oci/spec.py).
USUAL_KINDS = {
    "/proc/kcore": "file",
    "/proc/keys": "file",
    "/proc/latency_stats": "file",
    "/proc/timer_list": "file",
    "/proc/timer_stats": "file",
    "/proc/sched_debug": "file",
    "/proc/sysrq-trigger": "file",
}


def protected_proc_paths(task: TaskSpec) -> tuple[str, ...]:
    """Every maskedPaths/readonlyPaths entry of the spec, in order."""
    return (*(task.linux.masked_paths or []), *(task.linux.readonly_paths or []))


def proc_protection_args(task: TaskSpec, host: BwrapHost) -> tuple[list[str], list[str]]:
    """The spec's maskedPaths and readonlyPaths as bwrap options, and notes. Pure.

    Dropping them is not an option: as root, uid 0 passes /proc/sys's permission checks
    without any capability, so a writable /proc/sys/kernel/core_pattern is a host root escape.
    readonly: the path bound read-only over itself. masked: a file gets /dev/null, a directory
    an empty read-only tmpfs (what runc does). /sys is not mounted by bwrap at all, so its
    entries are hidden by absence.
    """
    masked = task.linux.masked_paths or []
    readonly = task.linux.readonly_paths or []
    kinds = (
        dict(host.path_kinds)
        if host.path_kinds is not None
        else {p: USUAL_KINDS.get(p, "dir") for p in (*masked, *readonly)}
    )
    # What bwrap really mounts (not sysfs: it cannot mount a fresh one, the host's stays out).
    mounted = {m.destination for m in task.mounts if mount_args(m)[0]}
    args: list[str] = []
    notes: list[str] = []
    for path in [*masked, *readonly]:
        if not any(path == d or path.startswith(d.rstrip("/") + "/") for d in mounted):
            notes.append(f"{path}: hidden (bwrap mounts nothing there)")
            continue
        kind = kinds.get(path)
        if kind is None:
            notes.append(f"{path}: absent on this host, nothing to protect")
        elif path in readonly:
            args += ["--ro-bind", path, path]
        elif kind == "file":
            args += ["--ro-bind", "/dev/null", path]
        else:
            args += ["--perms", "0555", "--tmpfs", path, "--remount-ro", path]
    return args, notes


def needs_launch_hooks(task: TaskSpec, host: BwrapHost) -> bool:
    """Whether bwrap must pause for us (cgroup move, slirp4netns) before the command runs."""
    direct_cgroup = host.cgroup_mode in ("v1", "v2")
    return task.network is NetworkMode.EGRESS or (
        direct_cgroup and bool(CgroupLimits.from_task(task).controllers())
    )


def bwrap_argv(
    task: TaskSpec, user: User, host: BwrapHost, fds: LaunchFds | None = None
) -> list[str]:
    """The whole launch command of the task's sandbox, run as ``user`` (each command's args,
    env, cwd and rlimits are its spawn frame). Pure: same spec and host, same argv."""
    network = task.network
    argv: list[str] = []
    limits = CgroupLimits.from_task(task)
    if host.cgroup_mode == "systemd-run" and host.systemd_run and limits.controllers():
        unit = "fusion-oci-" + task.annotations.get("io.fusion-oci.run-id", "run")
        argv += cgroups.systemd_run_prefix(host.systemd_run, unit, limits)
    argv += [host.bwrap, "--unshare-all", "--unshare-user"]
    if network is NetworkMode.HOST:
        argv.append("--share-net")
    # --as-pid-1: the agent is the pid namespace's init (no bwrap reaper beside it), as in a
    # container: its end ends every process of the sandbox, and the kernel drops SIGKILL and
    # SIGSTOP sent to it from inside.
    argv += ["--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL"]
    if host.disable_userns:
        argv.append("--disable-userns")
    argv += ["--uid", str(user.uid), "--gid", str(user.gid)]
    if task.hostname:
        argv += ["--hostname", task.hostname]
    argv += _rootfs_args(task)
    for mount in task.mounts:
        argv += mount_args(mount)[0]
    argv += ["--ro-bind", host.agent, AGENT_IN_SANDBOX]
    argv += proc_protection_args(task, host)[0]
    if network is NetworkMode.EGRESS:
        argv += ["--ro-bind", host.egress_resolv_conf, "/etc/resolv.conf"]
    if network is NetworkMode.FILTERED:
        # The network namespace stays empty (only lo, which bwrap brings up): the one way out
        # is the agent's forwarder to this socket, the task's proxy. Read-only binds: connect
        # needs no write access to the mount, and neither file can be replaced from inside.
        argv += [
            "--ro-bind",
            host.egress_socket,
            EGRESS_SOCKET,
            "--ro-bind",
            host.agent,
            EGRESS_AGENT,
        ]
    services = host_services(task, host)
    for source, dest in services.binds:
        # Each grant's relay socket: at /run/fusion-oci/services/N.sock for the agent's
        # listener on the sandbox's own loopback, or at the granted unix path itself.
        argv += ["--ro-bind", source, dest]
    if task.root.readonly is not False:
        # Last: mount points above were created in bwrap's tmpfs root; now nothing new can be.
        argv += ["--remount-ro", "/"]
    fds = fds or LaunchFds()
    if needs_launch_hooks(task, host):
        argv += ["--info-fd", str(fds.info), "--block-fd", str(fds.block)]
    if task.linux.seccomp is not None:
        # Applied by bwrap right before it execs the agent: the agent and every command run
        # under it (fork and exec keep a seccomp filter).
        argv += ["--seccomp", str(fds.seccomp)]
    # The agent gets no environment: each command's is its spawn frame's, whole.
    argv += [
        "--clearenv",
        "--chdir",
        "/",
        "--",
        *sandbox_command(
            fds.agent, filtered=network is NetworkMode.FILTERED, services=services.agent_args
        ),
    ]
    return argv


def host_services(task: TaskSpec, host: BwrapHost) -> ServiceWiring:
    """The task's granted host services as binds and agent listeners (placeholders in a
    plan). Pure."""
    sockets, targets = split_relays(host.service_relays)
    return service_wiring(task.host_services, sockets, targets, task.published_ports)


def sandbox_command(
    agent: int | str = AGENT_FD, *, filtered: bool = False, services: Sequence[str] = ()
) -> list[str]:
    """What bwrap execs: the agent on its end of the socketpair, with its egress forwarder
    when the network is ``filtered`` and a listener per granted TCP host service. Pure."""
    return [
        AGENT_IN_SANDBOX,
        *(forward_args() if filtered else []),
        *services,
        "--fd",
        str(agent),
    ]


def _command_len(argv: Sequence[str]) -> int:
    """How many of ``argv``'s last arguments are :func:`sandbox_command` (whatever options the
    agent got): everything after the last ``-- AGENT``."""
    for i in range(len(argv) - 2, -1, -1):
        if argv[i] == "--" and argv[i + 1] == AGENT_IN_SANDBOX:
            return len(argv) - i - 1
    return len(sandbox_command())


def bwrap_spawn(process: ProcessSpec, run_id: str = PLAN_RUN_ID) -> Spawn:
    """One command of the sandbox, as the agent is asked to run it: the process's args,
    exactly its env, its cwd and its rlimits (set by the agent before exec; each checked to be
    one bubblewrap's agent sets). The user is the sandbox's (bwrap's --uid/--gid). Pure."""
    agent_rlimits(process.rlimits)  # refuses an rlimit the agent does not set
    if process.kept_capabilities():
        # The sandbox drops every capability (--cap-drop ALL) and a spawned process cannot
        # gain one: refused, never silently run without.
        raise BundleError(
            "a process that keeps capabilities cannot run in bubblewrap",
            f"it asks for {', '.join(process.kept_capabilities())}",
            "run it with no capabilities, or on a container backend",
        )
    return spawn_of(process, run_id=run_id)


_TAIL = 5  # "--clearenv --chdir / --" + the agent, before the agent's "--fd N"


def with_fds(argv: Sequence[str], fds: LaunchFds) -> list[str]:
    """:func:`bwrap_argv`'s command (made with the placeholder :class:`LaunchFds`) with the
    launch's own fds in place of the placeholders. Pure.

    By position, not by value (a policy path may read like a placeholder): the agent's fd is
    the last argument, the fd options sit right before the fixed ``--clearenv --chdir / --``.
    """
    out = list(argv)
    size = _command_len(out)
    if (
        len(out) < size + 4
        or out[-size] != AGENT_IN_SANDBOX
        or out[-2] != "--fd"
        or out[-size - 4 : -size] != ["--clearenv", "--chdir", "/", "--"]
    ):
        raise ValueError("the bwrap command line is not a sandbox launch")
    out[-1] = str(fds.agent)
    at = len(out) - size - 4
    if at >= 2 and out[at - 2] == "--seccomp" and out[at - 1] == SECCOMP_FD:
        out[at - 1] = str(fds.seccomp)
        at -= 2
    if (
        at >= 4
        and out[at - 4] == "--info-fd"
        and out[at - 3] == INFO_FD
        and out[at - 2] == "--block-fd"
        and out[at - 1] == BLOCK_FD
    ):
        out[at - 3], out[at - 1] = str(fds.info), str(fds.block)
    return out


def seccomp_program(task: TaskSpec) -> bytes | None:
    """The spec's seccomp profile as the classic BPF bwrap reads from ``--seccomp``, compiled
    by libseccomp (deterministic: same profile, same program)."""
    if task.linux.seccomp is None:
        return None
    profile = task.linux.seccomp.to_oci()
    listed = task.linux.seccomp.architectures or []
    arches = [a for a, names in OCI_ARCHES.items() if set(names) & set(listed)]
    if not arches:
        raise BundleError(
            "the seccomp profile cannot be compiled for bubblewrap",
            f"no supported architecture in {listed}",
            f"list one of {', '.join(n for v in OCI_ARCHES.values() for n in v)}",
        )
    try:
        return compile_bpf(profile, arches[0])
    except ValueError as exc:
        raise BundleError(
            "the seccomp profile cannot be compiled for bubblewrap",
            str(exc),
            "use a container backend for this seccomp profile",
        ) from exc
    except RuntimeError as exc:
        raise SandboxSetupError(
            "the seccomp profile cannot be compiled here", str(exc), LIBSECCOMP_HINT
        ) from exc


def plan_notes(task: TaskSpec, process: ProcessSpec, host: BwrapHost) -> list[str]:
    notes = [n for m in task.mounts if (n := mount_args(m)[1])]
    notes += proc_protection_args(task, host)[1]
    if task.linux.seccomp is not None:
        notes.append(
            "seccomp: the spec's profile compiled to classic BPF, read by bwrap from the seccomp fd"
        )
    network = task.network
    if network is NetworkMode.EGRESS:
        notes.append(
            "egress: slirp4netns --configure --disable-host-loopback on the child's "
            "network namespace before the command starts"
        )
    notes += service_notes(task)
    if network is NetworkMode.FILTERED:
        notes.append(
            "filtered: an empty network namespace (lo only); the agent forwards "
            "127.0.0.1:3128 to the task's egress proxy socket, bound at "
            f"{EGRESS_SOCKET}; the proxy allows or denies each connection"
        )
    limits = CgroupLimits.from_task(task)
    if limits.controllers():
        notes.append(f"cgroup ({host.cgroup_mode}): " + ", ".join(sorted(limits.controllers())))
    if rlimits := agent_rlimits(process.rlimits):
        notes.append(
            "rlimits, set by the agent with setrlimit(2) before the command's exec: "
            + ", ".join(f"{name}={soft}:{hard}" for name, _, soft, hard in rlimits)
        )
    notes.append(
        "one sandbox per task: this bwrap starts at prepare with the exec agent as its "
        "PID 1; each command is a spawn frame to it (spawn), whose keeper ends the "
        "command's whole tree"
    )
    return notes


def args_launch(argv: Sequence[str], host: BwrapHost, fd: int | str) -> tuple[list[str], bytes]:
    """:func:`bwrap_argv`'s command as launched: ``[prefix...] bwrap --args FD -- AGENT --fd
    N``, and the options bwrap reads from FD (NUL-separated). Pure."""
    start = list(argv).index(host.bwrap)
    command = list(argv[-_command_len(argv) :])
    end = len(argv) - len(command) - 1
    if end <= start or argv[end] != "--" or command[0] != AGENT_IN_SANDBOX or command[-2] != "--fd":
        raise ValueError("the bwrap command line does not end with -- and the agent")
    payload = b"".join(a.encode() + b"\0" for a in argv[start + 1 : end])
    return [*argv[: start + 1], "--args", str(fd), "--", *command], payload
