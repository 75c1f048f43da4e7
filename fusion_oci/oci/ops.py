"""Spec operations for OCI runtime CLIs (runc, runsc): each a pure function of the typed
bundle config (:class:`~fusion_oci.oci.model.ConfigSpec`: the TaskSpec and its container's
ProcessSpec) to a changed copy, as containerd's ``oci.SpecOpts``.

The compiled spec (:mod:`fusion_oci.oci.spec`) says what the sandbox is; these say how one
runtime CLI on this host gets there, and each changes one thing:

* :func:`with_init` — the command under a minimal init (tini), as ``docker run --init``.
* :func:`with_rootfs` — an image's unpacked, shared root filesystem.
* :func:`with_egress_hook` — a createRuntime hook that holds the container until slirp4netns
  is attached to its network namespace (runc).
* :func:`with_resolv_conf` — slirp's DNS forwarder as /etc/resolv.conf.
* :func:`without_network_namespace` — for a CLI that already runs in the task's own network
  namespace (runsc's egress launch): a spec namespace would be a second, empty one inside it.
* :func:`with_rootless` — an unprivileged caller: a user namespace mapping only its ids, no
  cgroup limits, sysfs bound instead of mounted where the netns is the host's.
* :func:`without_cgroup_limits` / :func:`with_cgroups_path` — limits held by a cgroup of ours
  that the runtime joins (runsc) instead of one it makes.

The input is never changed (the models are frozen): every operation returns a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusion_oci.oci.model import ConfigSpec, Hook, Hooks, IdMapping, Mount, Namespace, User
from fusion_oci.oci.spec import bind, with_linux, with_mounts, with_resources

INIT_IN_SANDBOX = "/dev/fusion-oci-init"
EXEC_STATUS_IN_SANDBOX = "/dev/fusion-oci-exec-status"
STATUS_DIR_IN_SANDBOX = "/dev/fusion-oci-status"
"""Where the init binary is bound: inside the container's own /dev tmpfs, so the mount point
is made there and nothing is left in the (shared, read-only) rootfs or on the host."""

EGRESS_HOOK_SCRIPT = 'cat >"$1" && read -r answer <"$2" && [ "$answer" = go ]'
"""The createRuntime hook of an egress container, run by the runtime on the host: it passes the
container state (with pid 1's host pid) to fusion-oci through one FIFO and waits on another
until slirp4netns is attached; anything but ``go`` fails the hook, so the command never starts
without its network path."""
EGRESS_HOOK_TIMEOUT_S = 30
CGROUP_RESOURCES = ("memory", "cpu", "pids")
"""The ``linux.resources`` entries a cgroup holds (the others are not cgroup limits here)."""


@dataclass(frozen=True)
class EgressHook:
    """Host paths the egress rendezvous uses: the two FIFOs and slirp's resolv.conf."""

    request: str
    reply: str
    resolv_conf: str
    hook: bool = True
    """False for gVisor: the launch script, not a createRuntime hook, holds the command."""


def with_init(spec: ConfigSpec, init: str) -> ConfigSpec:
    """Run the command under the static init binary ``init`` (on the host). Pure.

    Without one the command is pid 1 of the container's pid namespace, and the kernel drops
    every signal pid 1 has no handler for: ``kill -TERM $$`` in a shell is a no-op there, and a
    shell command that exits by signal elsewhere exits 0 here. The init forwards signals, reaps
    orphans and exits 128+N when the command dies of signal N.
    """
    return ConfigSpec(
        with_mounts(spec.task, [bind(INIT_IN_SANDBOX, init, writable=False)]),
        spec.process.with_args([INIT_IN_SANDBOX, "--", *spec.process.args]),
    )


def with_exec_status(spec: ConfigSpec, agent: str, status_dir: str) -> ConfigSpec:
    """Run the command under the static agent's ``--exec-status-file`` (bound read-only), which
    writes the command's own wait status into ``status_dir`` (a per-command host folder bound
    read-write). Pure.

    runc, runsc and an init all report death by signal N as 128+N, so without it a command's
    own ``exit 130`` reads as SIGINT. What the command could write there itself is only a claim
    about its own end, which it controls anyway."""
    mounts = [
        bind(EXEC_STATUS_IN_SANDBOX, agent, writable=False),
        bind(STATUS_DIR_IN_SANDBOX, status_dir, writable=True),
    ]
    args = [
        EXEC_STATUS_IN_SANDBOX,
        "--exec-status-file",
        f"{STATUS_DIR_IN_SANDBOX}/status",
        "--",
        *spec.process.args,
    ]
    return ConfigSpec(with_mounts(spec.task, mounts), spec.process.with_args(args))


def with_rootfs(spec: ConfigSpec, rootfs: str) -> ConfigSpec:
    """Run on ``rootfs`` (an image's unpacked root filesystem, shared read-only). Pure."""
    root = spec.task.root.model_copy(update={"path": rootfs})
    return spec.with_task(spec.task.model_copy(update={"root": root}))


def with_egress_hook(spec: ConfigSpec, hook: EgressHook) -> ConfigSpec:
    """Add the createRuntime hook that waits for slirp4netns (:data:`EGRESS_HOOK_SCRIPT`). Pure."""
    wait = Hook(
        path="/bin/sh",
        args=["sh", "-c", EGRESS_HOOK_SCRIPT, "fusion-oci-egress", hook.request, hook.reply],
        env=["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
        timeout=EGRESS_HOOK_TIMEOUT_S,
    )
    hooks = spec.task.hooks or Hooks()
    hooks = hooks.model_copy(update={"create_runtime": [*(hooks.create_runtime or []), wait]})
    return spec.with_task(spec.task.model_copy(update={"hooks": hooks}))


def with_resolv_conf(spec: ConfigSpec, resolv_conf: str) -> ConfigSpec:
    """Bind ``resolv_conf`` (naming slirp's DNS forwarder) as /etc/resolv.conf. Pure.

    A host stub resolver on 127.0.0.53 is unreachable from the container's namespace."""
    mount = bind("/etc/resolv.conf", resolv_conf, writable=False)
    return spec.with_task(with_mounts(spec.task, [mount]))


def without_network_namespace(spec: ConfigSpec) -> ConfigSpec:
    """Drop the network namespace: the CLI already runs in the task's own one. Pure."""
    kept = [ns for ns in spec.task.linux.namespaces if ns.type != "network"]
    return spec.with_task(with_linux(spec.task, namespaces=kept))


def without_cgroup_limits(spec: ConfigSpec) -> ConfigSpec:
    """Remove memory, cpu and pids from ``linux.resources``. Pure."""
    if spec.task.linux.resources is None:
        return spec
    return spec.with_task(with_resources(spec.task, **dict.fromkeys(CGROUP_RESOURCES)))


def with_cgroups_path(spec: ConfigSpec, path: str) -> ConfigSpec:
    """Point ``linux.cgroupsPath`` at a cgroup of ours (relative: inside our own cgroup of each
    controller) and leave the limits to it. Pure."""
    out = without_cgroup_limits(spec)
    return out.with_task(with_linux(out.task, cgroups_path=path))


SYSFS_BIND = Mount(
    destination="/sys",
    type="bind",
    source="/sys",
    options=["rbind", "nosuid", "noexec", "nodev", "ro"],
)
"""/sys for a user namespace that does not own the network namespace (it may not mount
sysfs)."""


def with_rootless(spec: ConfigSpec, uid: int, gid: int) -> ConfigSpec:
    """The spec as an unprivileged runtime can run it for the caller ``uid``/``gid``. Pure.

    A user namespace mapping only the caller's ids, to root inside (files it writes stay the
    caller's), and no cgroup limits, which an unprivileged runtime cannot set without
    delegation; the lifecycle refuses policies that need them because the runtime's
    ``enforces()`` leaves them out.
    """
    task = without_cgroup_limits(spec).task
    namespaces = task.linux.namespaces
    if not task.has_namespace("user"):
        namespaces = [*namespaces, Namespace(type="user")]
    # An unprivileged runtime can write one mapping line, and runc insists that it maps the
    # container's root: the caller becomes uid 0 inside (without capabilities: the bounding
    # set is empty), and what it writes is the caller's on the host.
    task = with_linux(
        task,
        namespaces=namespaces,
        uid_mappings=[IdMapping(container_id=0, host_id=uid, size=1)],
        gid_mappings=[IdMapping(container_id=0, host_id=gid, size=1)],
    )
    ids = {f"uid={uid}": "uid=0", f"gid={gid}": "gid=0"}
    mounts = [
        m.model_copy(update={"options": [ids.get(o, o) for o in m.options or []]})
        if m.type == "tmpfs"
        else m
        for m in task.mounts
    ]
    if not task.has_namespace("network"):
        # A user namespace that does not own the network namespace may not mount sysfs.
        mounts = [SYSFS_BIND if m.destination == "/sys" else m for m in mounts]
    process = spec.process.model_copy(update={"user": User(uid=0, gid=0)})
    return ConfigSpec(task.model_copy(update={"mounts": mounts}), process)
