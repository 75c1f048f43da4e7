"""The one launch builder of the ``oci`` runtime: what ``plan`` shows is what ``execute`` runs.

:func:`build_launch` is a pure function of the spec and the host facts the runtime found
(binary, init, state directory, caller ids, image rootfs): it returns the bundle the runtime
CLI gets, its argv, env and cwd, and the side parts execute must set up around it (egress
rendezvous paths, a cgroup of ours for runsc). :meth:`OciRuntime.plan` renders it;
:meth:`OciRuntime.execute` writes that bundle and runs that argv, nothing else.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fusion_oci.models import NetworkMode
from fusion_oci.oci import ops
from fusion_oci.oci.model import ANN_NETWORK, ANN_RUN, ANN_TASK, ProcessSpec, TaskSpec
from fusion_oci.oci.ops import EgressHook
from fusion_oci.oci.seccomp import without_errno_ret
from fusion_oci.oci.spec import Spec
from fusion_oci.runtimes.linux.cgroups import CgroupLimits, leaf_name
from fusion_oci.runtimes.ocicli.filtered import RUNSC_FLAGS as RUNSC_FILTERED_FLAGS
from fusion_oci.runtimes.ocicli.filtered import SOCKET_PLACEHOLDER, with_egress_forwarder
from fusion_oci.runtimes.ocicli.state import cli_env, container_id
from fusion_oci.runtimes.plans import ArgvPlan

GRACE_S = 2.0
"""Between ``kill --all ID TERM`` and ``kill ID KILL`` on timeout, maxBuffer and abort."""
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


def network_of(spec: Spec) -> NetworkMode:
    """The spec's network, in one place. Pure.

    OCI says it first: no network namespace is the host's network. A namespace of its own is
    ``none`` unless the ``io.fusion-oci.network`` annotation asks for ``egress`` (a path out
    through slirp4netns, which OCI has no word for).
    """
    if not any(ns["type"] == "network" for ns in spec["linux"]["namespaces"]):
        return NetworkMode.HOST
    said = spec["annotations"].get(ANN_NETWORK)
    if said in (NetworkMode.EGRESS.value, NetworkMode.FILTERED.value):
        return NetworkMode(said)
    return NetworkMode.NONE


def runtime_flags(runtime: str, network: NetworkMode, *, rootless: bool = False) -> list[str]:
    """Global flags the runtime needs for this spec (before the subcommand). Pure.

    runsc decides networking by flag, not from the spec: ``none`` is its empty netstack;
    ``host`` and ``egress`` pass the sockets of the namespace it runs in through (for egress
    that is the namespace :data:`RUNSC_EGRESS_SCRIPT` prepared, never the host's); ``filtered``
    is the empty netstack with host unix sockets connectable (the proxy's, bound in: see
    :mod:`fusion_oci.runtimes.ocicli.filtered`).
    """
    if not is_gvisor(runtime):
        return []
    # --oci-seccomp: without it runsc ignores linux.seccomp (unshare, raw and packet sockets
    # would work inside its kernel).
    flags = ["--oci-seccomp"]
    if network is NetworkMode.FILTERED:
        flags += RUNSC_FILTERED_FLAGS
    else:
        flags.append("--network=none" if network is NetworkMode.NONE else "--network=host")
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


def egress_launch_argv(unshare: str, hook: EgressHook, argv: list[str]) -> list[str]:
    """gVisor's egress launch (:data:`RUNSC_EGRESS_SCRIPT`) around ``argv``. Pure."""
    return [unshare, "--net", "--", "/bin/sh", "-c", RUNSC_EGRESS_SCRIPT, "fusion-oci-egress",
            hook.request, hook.reply, *argv]


def bundle_spec(spec: Spec, *, rootless_ids: tuple[int, int] | None = None,
                rootfs: str | None = None, egress: EgressHook | None = None,
                init: str | None = None, cgroup_leaf: str | None = None,
                exec_status: tuple[str, str] | None = None,
                egress_proxy: tuple[str, str] | None = None,
                errno_ret: bool = True) -> Spec:
    """The spec as the runtime CLI gets it: the compiled one through the ops this host needs.
    Pure.

    As root it is the compiled spec unchanged, apart from an image's unpacked rootfs, the init
    and, for egress, the rendezvous (runc: a createRuntime hook; runsc: its launch script, so
    no second network namespace) and slirp's DNS. ``cgroup_leaf``: limits held by a cgroup of
    ours that the runtime joins (runsc). ``egress_proxy`` (``filtered``: the proxy's socket and
    the agent binary, host paths): :func:`~fusion_oci.runtimes.ocicli.filtered.
    with_egress_forwarder`. Rootless: :func:`fusion_oci.oci.ops.with_rootless`.
    ``errno_ret=False``: the runtime answers every errno rule with EPERM (runsc), so the
    seccomp profile is said without ``errnoRet``
    (:func:`~fusion_oci.oci.seccomp.without_errno_ret`).
    """
    out = copy.deepcopy(spec)  # the ops copy too; this one guarantees a copy when none applies
    if exec_status is not None:  # (agent binary, status folder): inside the init
        out = ops.with_exec_status(out, *exec_status)
    if egress_proxy is not None:
        out = with_egress_forwarder(out, *egress_proxy)
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
    if not errno_ret and "seccomp" in out["linux"]:
        out["linux"]["seccomp"] = without_errno_ret(out["linux"]["seccomp"])
    return out


@dataclass(frozen=True)
class Host:
    """What the runtime found on this host and in its prepared task (the builder's input)."""

    binary: str
    """The runtime CLI to exec (its path once found, else the configured name)."""
    task_dir: Path
    nonce: str
    env: dict[str, str]
    rootless_ids: tuple[int, int] | None = None
    init: str | None = None
    exec_status: str | None = None
    """The static agent binary that reports the command's own wait status (ops.with_exec_status)."""
    rootfs: str | None = None
    unshare: str = "unshare"
    cgroup_pid: int = 0
    """The pid a runsc cgroup leaf is named after (:func:`leaf_name`): ours."""
    keep: bool = False
    egress_socket: str = SOCKET_PLACEHOLDER
    """``filtered``: the host path of the task's egress proxy socket (from prepare)."""


@dataclass(frozen=True)
class Launch:
    """One command's launch, exactly: what to write, what to run, what to set up around it."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    bundle: Spec
    bundle_dir: Path
    pid_file: Path
    cid: str
    network: NetworkMode
    status_dir: Path | None = None
    """Where the command's own wait status is written (``exit N`` / ``signal N``)."""
    egress: EgressHook | None = None
    cgroup: CgroupLimits | None = None
    """runsc: limits of a cgroup of ours named ``cgroup_leaf``, which the runtime joins."""
    cgroup_leaf: str | None = None
    keep: bool = False
    notes: list[str] = field(default_factory=list)

    def plan(self, backend: str, process: ProcessSpec) -> OciLaunchPlan:
        return OciLaunchPlan(backend=backend, argv=self.argv, env=self.env, cwd=self.cwd,
                             notes=self.notes, bundle=self.bundle, process=process, launch=self)


@dataclass(frozen=True)
class OciLaunchPlan(ArgvPlan):
    """A launch plan that also carries the bundle (config.json) the runtime CLI gets, and the
    :class:`Launch` it renders (what execute sets up and runs; not in :meth:`to_json`)."""

    bundle: Spec = field(kw_only=True)
    launch: Launch = field(kw_only=True, repr=False, compare=False)

    def _body(self) -> dict[str, Any]:
        return {**super()._body(), "bundle": self.bundle}


def build_launch(spec: Spec, host: Host, seq: int) -> Launch:
    """Spec + host facts → the launch of command number ``seq`` of the task. Pure."""
    ann = spec["annotations"]
    cid = container_id(str(ann.get(ANN_TASK, "task")), str(ann.get(ANN_RUN, "run")),
                       host.nonce, seq)
    bundles = host.task_dir / "bundles"
    bundle_dir, pid_file = bundles / str(seq), bundles / f"{seq}.pid"
    status_dir = bundles / f"{seq}.status" if host.exec_status else None
    network = network_of(spec)
    gvisor = is_gvisor(host.binary)
    egress = None
    if network is NetworkMode.EGRESS:
        egress = EgressHook(str(bundles / f"{seq}.egress-request"),
                            str(bundles / f"{seq}.egress-reply"),
                            str(host.task_dir / "resolv.conf"), hook=not gvisor)
    limits = leaf = None
    if gvisor and host.rootless_ids is None:
        # runsc removes the cgroups it creates when the sandbox ends, taking the OOM counter
        # with them; one that already exists it only joins. pids stays out (gVisor's
        # processes are not host processes).
        wanted = replace(CgroupLimits.from_task(TaskSpec.model_validate(
            {k: v for k, v in spec.items() if k != "process"})), pids=None)
        if wanted.controllers():  # Cgroup.create refuses (fail closed) what the host lacks
            limits, leaf = wanted, leaf_name(f"{host.nonce}{seq}", host.cgroup_pid)
    bundle = bundle_spec(spec, rootless_ids=host.rootless_ids, rootfs=host.rootfs,
                         egress=egress, init=host.init,
                         cgroup_leaf=leaf,
                         exec_status=(host.exec_status, str(status_dir))
                         if host.exec_status and status_dir else None,
                         egress_proxy=(host.egress_socket, host.exec_status or "")
                         if network is NetworkMode.FILTERED else None,
                         errno_ret=not gvisor)
    flags = runtime_flags(host.binary, network, rootless=host.rootless_ids is not None)
    argv = run_argv(host.binary, str(host.task_dir / "state"), str(bundle_dir), cid,
                    str(pid_file), keep=host.keep, flags=flags)
    if egress is not None and gvisor:
        argv = egress_launch_argv(host.unshare, egress, argv)
    return Launch(argv=argv, env=cli_env(host.env), cwd=str(bundle_dir), bundle=bundle,
                  bundle_dir=bundle_dir, pid_file=pid_file, cid=cid, network=network,
                  status_dir=status_dir,
                  egress=egress, cgroup=limits, cgroup_leaf=leaf, keep=host.keep,
                  notes=notes(spec, host, network))


_NETWORK_NOTES = {
    NetworkMode.NONE: "network none: an empty network namespace (loopback only)",
    NetworkMode.HOST: "network host: no network namespace",
    NetworkMode.EGRESS: "network egress: a createRuntime hook holds the container until "
                        "slirp4netns --disable-host-loopback is attached to its network "
                        "namespace; /etc/resolv.conf names slirp's DNS (refused where "
                        "slirp4netns or /dev/net/tun is unusable: see doctor)",
    NetworkMode.FILTERED: "network filtered: an empty network namespace (loopback only); the "
                          "agent's forwarder on 127.0.0.1:3128 for the command's life, to the "
                          "task's egress proxy socket bound at /run/fusion-oci/egress.sock",
}
_GVISOR_NETWORK_NOTES = {
    NetworkMode.NONE: "network none: gVisor's netstack with loopback only (--network=none)",
    NetworkMode.HOST: "network host: gVisor passes the host's sockets through "
                      "(--network=host)",
    NetworkMode.EGRESS: "network egress: runsc runs in a fresh network namespace "
                        "(unshare --net) held until slirp4netns --disable-host-loopback is "
                        "attached, then --network=host uses that namespace; /etc/resolv.conf "
                        "names slirp's DNS",
    NetworkMode.FILTERED: "network filtered: gVisor's netstack with loopback only "
                          "(--network=none); the agent's forwarder on 127.0.0.1:3128 inside "
                          "it, to the task's egress proxy socket bound at "
                          "/run/fusion-oci/egress.sock (--host-uds=open: the gofer may "
                          "connect to host unix sockets)",
}


def notes(spec: Spec, host: Host, network: NetworkMode) -> list[str]:
    """What the plan says in words next to the argv and bundle. Pure."""
    from fusion_oci.oci.model import ANN_HOST_ROOTFS, ANN_IMAGE

    ann = spec["annotations"]
    if ann.get(ANN_IMAGE):
        rootfs = (f"image {ann[ANN_IMAGE]}: root filesystem exported by podman from a created "
                  "(never started) container, read-only and shared per image digest")
    elif ann.get(ANN_HOST_ROOTFS):
        rootfs = "empty rootfs/ plus read-only binds of the host's system directories"
    else:
        rootfs = "rootfs/ of the bundle"
    gvisor = is_gvisor(host.binary)
    resources = spec["linux"].get("resources", {})
    limits = [k for k in ops.CGROUP_RESOURCES if k in resources]
    out = [
        f"one container per command; {rootfs}",
        (_GVISOR_NETWORK_NOTES if gvisor else _NETWORK_NOTES)[network],
        "timeout/maxBuffer/abort: kill --all ID TERM, "
        f"{GRACE_S:g}s grace, kill ID KILL; delete --force ID whenever state is left",
        "exit status 128+N (N a signal) is read as death by signal N, as a shell reports it",
    ]
    if host.rootless_ids is not None:
        out.append("rootless: user namespace mapping only the caller's uid/gid; cgroup "
                   "limits dropped (" + (", ".join(limits) or "none set") + ")")
    elif gvisor and limits:
        out.append("cgroup limits held by a cgroup of ours that runsc joins (cgroupsPath): "
                   + ", ".join(k for k in limits if k != "pids")
                   + ("; pids not enforced under gVisor" if "pids" in limits else ""))
    elif limits:
        out.append("cgroup limits applied by the runtime: " + ", ".join(limits))
    return out


# runc logs in logfmt, so the quotes around the command arrive escaped (\").
_EXEC_FAILURE = re.compile(r'exec: \\?"(?P<cmd>.*?)\\?": (?P<why>[^"\n]*)')
# runsc: 'error finding executable "X" in PATH [...]: no such file or directory' and
# 'creating process: failed to load X: permission denied', after its own "running container:".
_GVISOR_EXEC_FAILURE = re.compile(
    r'^running container: .*starting sandbox: (?:error finding executable "(?P<cmd>.*?)" '
    r'in PATH \[.*?\]|creating process: failed to load (?P<path>.*?)): (?P<why>.*)$',
    re.MULTILINE)


def exec_failure_status(stderr: str) -> int | None:
    """127/126 when the runtime (runc or runsc) could not exec the command, as a shell would
    say; else None. Pure."""
    match = _EXEC_FAILURE.search(stderr) or _GVISOR_EXEC_FAILURE.search(stderr)
    if match is None:
        return None
    why = match["why"].lower()
    return 127 if ("no such file" in why or "not found" in why) else 126
