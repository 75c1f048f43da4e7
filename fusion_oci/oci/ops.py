"""Spec operations for OCI runtime CLIs (runc, runsc): each a pure function spec -> new spec.

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

The input is never changed; every operation returns a deep copy.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from fusion_oci.oci.spec import Spec, bind

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


def with_init(spec: Spec, init: str) -> Spec:
    """Run the command under the static init binary ``init`` (on the host). Pure.

    Without one the command is pid 1 of the container's pid namespace, and the kernel drops
    every signal pid 1 has no handler for: ``kill -TERM $$`` in a shell is a no-op there, and a
    shell command that exits by signal elsewhere exits 0 here. The init forwards signals, reaps
    orphans and exits 128+N when the command dies of signal N.
    """
    out = copy.deepcopy(spec)
    out["mounts"].append(bind(INIT_IN_SANDBOX, init, writable=False))
    out["process"]["args"] = [INIT_IN_SANDBOX, "--", *out["process"]["args"]]
    return out


def with_exec_status(spec: Spec, agent: str, status_dir: str) -> Spec:
    """Run the command under the static agent's ``--exec-status-file`` (bound read-only), which
    writes the command's own wait status into ``status_dir`` (a per-command host folder bound
    read-write). Pure.

    runc, runsc and an init all report death by signal N as 128+N, so without it a command's
    own ``exit 130`` reads as SIGINT. What the command could write there itself is only a claim
    about its own end, which it controls anyway."""
    out = copy.deepcopy(spec)
    out["mounts"].append(bind(EXEC_STATUS_IN_SANDBOX, agent, writable=False))
    out["mounts"].append(bind(STATUS_DIR_IN_SANDBOX, status_dir, writable=True))
    out["process"]["args"] = [
        EXEC_STATUS_IN_SANDBOX,
        "--exec-status-file",
        f"{STATUS_DIR_IN_SANDBOX}/status",
        "--",
        *out["process"]["args"],
    ]
    return out


def with_rootfs(spec: Spec, rootfs: str) -> Spec:
    """Run on ``rootfs`` (an image's unpacked root filesystem, shared read-only). Pure."""
    out = copy.deepcopy(spec)
    out["root"]["path"] = rootfs
    return out


def with_egress_hook(spec: Spec, hook: EgressHook) -> Spec:
    """Add the createRuntime hook that waits for slirp4netns (:data:`EGRESS_HOOK_SCRIPT`). Pure."""
    out = copy.deepcopy(spec)
    out.setdefault("hooks", {}).setdefault("createRuntime", []).append(
        {
            "path": "/bin/sh",
            "args": ["sh", "-c", EGRESS_HOOK_SCRIPT, "fusion-oci-egress", hook.request, hook.reply],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "timeout": EGRESS_HOOK_TIMEOUT_S,
        }
    )
    return out


def with_resolv_conf(spec: Spec, resolv_conf: str) -> Spec:
    """Bind ``resolv_conf`` (naming slirp's DNS forwarder) as /etc/resolv.conf. Pure.

    A host stub resolver on 127.0.0.53 is unreachable from the container's namespace."""
    out = copy.deepcopy(spec)
    out["mounts"].append(bind("/etc/resolv.conf", resolv_conf, writable=False))
    return out


def without_network_namespace(spec: Spec) -> Spec:
    """Drop the network namespace: the CLI already runs in the task's own one. Pure."""
    out = copy.deepcopy(spec)
    out["linux"]["namespaces"] = [
        ns for ns in out["linux"]["namespaces"] if ns["type"] != "network"
    ]
    return out


def without_cgroup_limits(spec: Spec) -> Spec:
    """Remove memory, cpu and pids from ``linux.resources``. Pure."""
    out = copy.deepcopy(spec)
    resources = out["linux"].get("resources", {})
    for key in CGROUP_RESOURCES:
        resources.pop(key, None)
    return out


def with_cgroups_path(spec: Spec, path: str) -> Spec:
    """Point ``linux.cgroupsPath`` at a cgroup of ours (relative: inside our own cgroup of each
    controller) and leave the limits to it. Pure."""
    out = without_cgroup_limits(spec)
    out["linux"]["cgroupsPath"] = path
    return out


def with_rootless(spec: Spec, uid: int, gid: int) -> Spec:
    """The spec as an unprivileged runtime can run it for the caller ``uid``/``gid``. Pure.

    A user namespace mapping only the caller's ids, to root inside (files it writes stay the
    caller's), and no cgroup limits, which an unprivileged runtime cannot set without
    delegation; the lifecycle refuses policies that need them because the runtime's
    ``enforces()`` leaves them out.
    """
    out = without_cgroup_limits(spec)
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
    if not any(ns["type"] == "network" for ns in linux["namespaces"]):
        # A user namespace that does not own the network namespace may not mount sysfs.
        out["mounts"] = [
            {
                "destination": "/sys",
                "type": "bind",
                "source": "/sys",
                "options": ["rbind", "nosuid", "noexec", "nodev", "ro"],
            }
            if m["destination"] == "/sys"
            else m
            for m in out["mounts"]
        ]
    return out
