"""The ``oci`` runtime: an OCI runtime CLI (runc; crun, runsc, youki elsewhere) on the bundle.

Each command is one container: the compiled spec goes through the spec operations this host
needs (:mod:`fusion_oci.oci.ops`), is written as a bundle into the task's state directory and
run with ``RUNTIME --root STATE run [--keep] --pid-file P --bundle DIR ID``; one builder
(:func:`~fusion_oci.runtimes.ocicli.launch.build_launch`) makes that bundle and argv for both
:meth:`OciRuntime.plan` and :meth:`OciRuntime.execute`. The runtime CLI is our child in its
own process group; the container's processes live in their own pid namespace and session, so
ending them goes through the CLI: ``kill --all ID TERM``, a grace period, ``kill ID KILL``
(pid 1 dying ends the whole namespace), and ``delete --force ID`` on every path. ``--keep``
leaves the stopped container's cgroup in place until that delete, so the OOM and pids
counters can be read after the command ended.

Host-rootfs specs run on an empty ``rootfs/`` plus the spec's read-only binds of the system
directories. Image specs run on the image's root filesystem, exported once per image digest
by the engine (:mod:`fusion_oci.images.rootfs`) into a read-only cache shared by every
container of that image. State directories and gc: :mod:`fusion_oci.runtimes.ocicli.state`.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import stat
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_oci.agent.protocol import parse_exec_status
from fusion_oci.errors import FusionOCIError, SandboxSetupError
from fusion_oci.models import NetworkMode, RunOptions, RunResult, SandboxCapabilities
from fusion_oci.oci.bundle import write_bundle
from fusion_oci.oci.model import ANN_IMAGE, ANN_RUN, ANN_TASK, ProcessSpec, config_json
from fusion_oci.oci.ops import EgressHook, with_init
from fusion_oci.oci.spec import Spec
from fusion_oci.process import ProcessOutcome, run_process
from fusion_oci.runtimes.linux.cgroups import (
    Cgroup,
    CgroupEvents,
    Hierarchy,
    detect,
    probe_hierarchy,
)
from fusion_oci.runtimes.ocicli import launch as _launch
from fusion_oci.runtimes.ocicli import probe
from fusion_oci.runtimes.ocicli.egress import EgressLink
from fusion_oci.runtimes.ocicli.filtered import SOCKET_PLACEHOLDER
from fusion_oci.runtimes.ocicli.gvisor import gvisor_details
from fusion_oci.runtimes.ocicli.launch import (
    GRACE_S,
    Launch,
    OciLaunchPlan,
    bundle_spec,
    egress_launch_argv,
    exec_failure_status,
    is_gvisor,
    run_argv,
    runtime_flags,
)
from fusion_oci.runtimes.ocicli.state import (
    TaskState,
    container_id,
    delete_container,
    gc_oci,
    list_containers,
    open_task_dir,
    read_counters,
    state_base,
    stop_container,
    tail,
    task_dir_name,
)
from fusion_oci.runtimes.outcome import LimitCounters, classify, status_from_code
from fusion_oci.runtimes.plans import Plan, own_plan
from fusion_oci.runtimes.protocol import Availability
from fusion_oci.runtimes.requirements import Requirement
from fusion_oci.runtimes.skeleton import SpecRuntime

__all__ = [  # the names other modules and tests import from here
    "EgressHook", "OciRuntime", "bundle_spec", "container_id", "egress_launch_argv",
    "exec_failure_status", "exit_status", "gc_oci", "list_containers", "run_argv",
    "runtime_flags", "state_base", "with_init",
]

if TYPE_CHECKING:
    from fusion_oci.oci.host import HostInfo
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.resolve import ResolvedTask

KEEP_FLAG_RUNTIMES = frozenset({"runc", "crun"})
"""Runtimes whose ``run`` takes ``--keep`` (the others delete the cgroup before we can read it)
and keep a container's state in ``ROOT/ID`` (so its absence proves nothing is left)."""


def read_exec_status(status_dir: Path | None) -> tuple[int | None, str | None] | None:
    """The command's own wait status, as the agent inside wrote it (None: not written)."""
    if status_dir is None:
        return None
    # The folder is writable from inside: the command may have put a FIFO (a read would block
    # us), a symlink to a host file or a huge file there. Only a regular file's first bytes.
    try:
        fd = os.open(status_dir / "status", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, 64).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_exec_status(text)


def exit_status(returncode: int | None, sig: str | None) -> tuple[int | None, str | None]:
    """The runtime's exit status -> (exit code, signal): runc reports a container whose
    process died by signal N as 128+N; the one rule is base.status_from_code. Pure."""
    return status_from_code(returncode, sig)


def limit_counters(events: CgroupEvents) -> LimitCounters:
    """The container cgroup's counters for the one classifier."""
    return LimitCounters(oom_kills=events.oom_kills, pids_max=events.pids_max)


class OciRuntime(SpecRuntime):
    """Any OCI runtime CLI (``sandbox.ociRuntime``: runc, crun, runsc, youki) on the bundle."""

    id = "oci"
    streams_stdin = True  # run_process writes a StdinStream's chunks as they come

    def __init__(self, settings: SandboxSettings, env: Mapping[str, str],
                 cache_root: Path | None = None, host: HostInfo | None = None) -> None:
        super().__init__(settings, env, cache_root=cache_root, host=host)
        self.runtime_name: str = settings.oci.runtime
        self.uid = os.geteuid()
        self.gid = os.getegid()
        self.state_base = state_base(self.env, self.uid)
        self.nonce = secrets.token_hex(3)
        """Names the next task directory (and the container ids in it): chosen now so a plan
        made before prepare shows the paths the run will use."""
        self.pid = os.getpid()
        """Names runsc cgroup leaves (see cgroups.leaf_name)."""
        self._task: TaskState | None = None
        self._rootfs: str | None = None
        self._seq = 0
        self._binary: str | None = None
        self._init: str | None = None
        self._exec_status: str | None = None
        self._unshare: str | None = None
        self._version: str | None = None
        self._cgroups: Hierarchy | None = None
        self._egress: tuple[bool, str] | None = None
        self._egress_socket: str | None = None
        """``filtered``: the host path of the task's egress proxy socket (from prepare)."""
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

    def _find_exec_status(self) -> str:
        """The static agent (fusion_oci.agent) that reports the command's own wait status;
        a clear setup error when it is missing (never a silent 128+N reading)."""
        if self._exec_status is None:
            from fusion_oci.agent.client import agent_binary

            self._exec_status = str(agent_binary())
        return self._exec_status

    def _cgroup_host(self) -> Hierarchy:
        if self._cgroups is None:
            self._cgroups = probe_hierarchy()
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
            self._egress = probe.egress_status(self.runtime_name, self.rootless,
                                               self.env.get("PATH"))
        return self._egress

    def capabilities(self) -> SandboxCapabilities:
        limits = self._limits()
        return SandboxCapabilities(
            filesystem_isolation="strong",
            network_policy="fine" if Requirement.NETWORK_FILTERED in self.enforces()
            else "coarse",
            resource_limits="advanced" if limits else "basic",
            requires_install=True,
            supports_mac=False,
            supports_linux=True,
            supports_windows=False,
        )

    def availability(self) -> Availability:
        binary = self._find_binary()
        cgroups = self._cgroup_host()
        refused = probe.refusal(self.runtime_name, binary, cgroups.layout, self.rootless)
        if refused is not None or binary is None:
            return refused or Availability(False, f"'{self.runtime_name}' was not found")
        egress_ok, egress_why = self.egress_status()
        details = {
            "binary": binary,
            "cgroups": cgroups.layout,
            "controllers": ",".join(sorted(cgroups.controllers)) or "none",
            "state": str(self.state_base),
            "egress": (f"slirp4netns ({egress_why}) --disable-host-loopback, attached "
                       + ("before runsc starts (unshare --net)" if is_gvisor(binary) else
                          "by a createRuntime hook")
                       if egress_ok else f"not enforced: {egress_why}"),
            "filtered": "the container's empty network namespace; the agent's forwarder "
                        "(127.0.0.1:3128) to the task's egress proxy socket"
                        + (", connectable from gVisor with --host-uds=open"
                           if is_gvisor(binary) else ""),
        }
        if self.rootless:
            details["limits"] = ("memory, pids and cpu quota are not enforced: rootless, "
                                 "no cgroup delegation")
        if is_gvisor(binary):
            details.update(gvisor_details(self.rootless, self._limits()))
        if self._version is None:
            self._version = probe.runtime_version(binary) or ""
        return Availability(True, version=self._version or None,
                            rootless=self.rootless, details=details)

    def enforces(self) -> frozenset[Requirement]:
        # NETWORK_FILTERED: the container's own empty netns and the agent's forwarder
        # (ocicli/filtered.py); the agent is required for every command anyway.
        out = {Requirement.FILESYSTEM, Requirement.PROC_PATHS,
               Requirement.ENV, Requirement.NETWORK_NONE, Requirement.NETWORK_FILTERED,
               Requirement.CPU_TIME, Requirement.TMP_SIZE, Requirement.FILE_SIZE}
        if is_gvisor(self.runtime_name):
            out.discard(Requirement.TMP_SIZE)  # gVisor's tmpfs ignores size= (seen: 20221219)
            # gVisor (20221219) arms RLIMIT_CPU only on a setrlimit call inside the sandbox:
            # the spec's rlimit shows in `ulimit -t` yet a busy loop runs on (tests/contract).
            out.discard(Requirement.CPU_TIME)
        if self.egress_status()[0]:
            out.add(Requirement.NETWORK_EGRESS)
        return frozenset(out) | self._limits()

    # -- the one translation

    def _launch(self, spec: Spec, seq: int) -> Launch:
        ann = spec["annotations"]
        task_dir = self._task.dir if self._task is not None else self.state_base / \
            task_dir_name(str(ann.get(ANN_TASK, "task")), str(ann.get(ANN_RUN, "run")),
                          self.nonce)
        rootfs = self._rootfs
        if rootfs is None and ann.get(ANN_IMAGE):
            # Not prepared: the digest is the engine's answer at prepare time.
            rootfs = str(self.cache_root / "oci-rootfs" / "<image-digest>" / "rootfs")
        host = _launch.Host(
            binary=self._find_binary() or self.runtime_name, task_dir=task_dir,
            nonce=self.nonce, env=self.env,
            rootless_ids=(self.uid, self.gid) if self.rootless else None,
            init=self._find_init(), exec_status=self._find_exec_status(), rootfs=rootfs,
            unshare=self._find_unshare(),
            cgroup_pid=self.pid, keep=self.keep_for(spec),
            egress_socket=self._egress_socket or SOCKET_PLACEHOLDER,
        )
        return _launch.build_launch(spec, host, seq)

    def plan(self, process: ProcessSpec) -> OciLaunchPlan:
        """Exactly what :meth:`execute` writes and runs for ``process``: the launch of the next
        command number, taken now, so two commands planned before either runs never share a
        container id or bundle directory."""
        self._seq += 1
        spec = config_json(self.task_spec, process)
        return self._launch(spec, self._seq).plan(self.id, process)

    def _find_unshare(self) -> str:
        if self._unshare is None:
            self._unshare = shutil.which("unshare", path=self.env.get("PATH")) or "unshare"
        return self._unshare

    # -- lifecycle

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        task = await super().prepare(task)
        ctx = task.ctx
        binary = self._find_binary()
        if binary is None:
            avail = self.availability()
            from fusion_oci.errors import RuntimeUnavailableError

            raise RuntimeUnavailableError(self.id, avail.reason, avail.hint)
        try:
            self.gc_removed = await gc_oci(binary, self.state_base, env=self.env)
        except (FusionOCIError, OSError):
            self.gc_removed = []  # someone else's leftovers must not block this task
        final = self.state_base / task_dir_name(ctx.task_id, ctx.run_id, self.nonce)
        self._task = open_task_dir(final, self.nonce, {"task": ctx.task_id, "run": ctx.run_id,
                                                        "runtime": binary})
        try:
            if task.spec.network is NetworkMode.FILTERED:
                if task.egress is None:
                    raise SandboxSetupError("network filtered needs the task's egress proxy",
                                            "none was started for this task",
                                            "prepare the task through fusion_oci.Sandbox")
                self._egress_socket = str(task.egress.unix_socket)
            # The image the resolve step chose, read from the task spec (not the context).
            if image := task.spec.image:
                from fusion_oci.images.rootfs import export_image_rootfs, podman_url

                url = podman_url(self.env, self.uid, self.settings.podman.url)
                rootfs = await asyncio.to_thread(
                    export_image_rootfs, str(image), self.cache_root / "oci-rootfs", url)
                self._rootfs = str(rootfs)
        except BaseException:
            await self.dispose()
            raise
        return task

    def _require_task(self) -> tuple[TaskState, str]:
        if self._task is None or self.ctx is None or self._binary is None:
            raise SandboxSetupError(f"runtime '{self.id}' was not prepared",
                                    "run() came before prepare()", "call prepare(ctx) first")
        return self._task, self._binary

    async def execute(self, plan: Plan, opts: RunOptions) -> RunResult:
        task, binary = self._require_task()
        spec, launch = plan.process, own_plan(self, plan, OciLaunchPlan).launch
        if not launch.bundle_dir.is_relative_to(task.dir):
            raise SandboxSetupError(f"runtime '{self.id}' was not prepared",
                                    "the plan was made before prepare()",
                                    "call prepare(ctx) first, then plan the command")
        link = None
        if launch.egress is not None:
            link = EgressLink(launch.egress, launch.bundle_dir.with_suffix(".slirp.log"))
        group = None
        try:
            if launch.egress is not None:
                _write_resolv_conf(Path(launch.egress.resolv_conf))
            if launch.cgroup is not None:
                group = Cgroup.create(detect(self.env), launch.cgroup, name=launch.cgroup_leaf)
            write_bundle(launch.bundle, launch.bundle_dir)
            if launch.status_dir is not None:
                launch.status_dir.mkdir(exist_ok=True)
                # Written by the command's user, whatever the user namespace maps it to; only
                # reachable through the task's own 0700 state folder and the bind mount.
                launch.status_dir.chmod(0o777)

            async def stop() -> None:
                await stop_container(binary, task.root, launch.cid, launch.pid_file, self.env,
                                     GRACE_S)

            if link is not None:
                # Not enforceable here: check() said so and the lifecycle refused; if called
                # anyway, slirp4netns fails to attach and the hook keeps the command from
                # starting.
                link.start(self.egress_status()[1])
            outcome = await run_process(
                launch.argv, env=launch.env, cwd=launch.cwd, stdin=opts.stdin,
                timeout_s=opts.timeout_ms / 1000, max_buffer=opts.max_buffer,
                grace_s=GRACE_S, term_group=False, stop=stop, on_output=opts.on_output,
                keep_output=opts.keep_output,
            )
            counters = read_counters(task.root, launch.cid) if launch.keep else CgroupEvents()
            if group is not None:
                counters = CgroupEvents(oom_kills=group.events().oom_kills)
            started = launch.pid_file.exists()
            said = read_exec_status(launch.status_dir)
        finally:
            if group is not None:
                group.remove()
            # Kept, killed or failed containers are deleted here; ended ones are gone.
            if self._state_left(task.root, launch.cid):
                await asyncio.shield(self._delete(task, binary, launch.cid))
            if link is not None:
                await asyncio.shield(link.close())
            shutil.rmtree(launch.bundle_dir, ignore_errors=True)
            if launch.status_dir is not None:
                shutil.rmtree(launch.status_dir, ignore_errors=True)
            launch.pid_file.unlink(missing_ok=True)
        if link is not None and link.error is not None:
            raise link.error
        if said is not None:  # the command's own wait status, from inside
            outcome = replace(outcome, returncode=said[0], signal=said[1])
            return self.result(outcome, spec, classify(outcome, spec, limit_counters(counters)))
        return self._result(outcome, spec, counters, started)

    async def _delete(self, task: TaskState, binary: str, cid: str) -> None:
        if await delete_container(binary, task.root, cid, self.env):
            task.leftovers.discard(cid)
        else:
            task.leftovers.add(cid)  # dispose tries again; gc after that

    def _result(self, outcome: ProcessOutcome, spec: ProcessSpec, counters: CgroupEvents,
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
                    f"{self.runtime_name} could not start the container", tail(stderr),
                    "see the runtime's message above; `fusion-oci plan --backend oci` shows "
                    "the command line and the bundle",
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
            self.nonce = secrets.token_hex(3)  # a next prepare gets a directory of its own
            self._seq = 0
        self._rootfs = None
        self._egress_socket = None
        await super().dispose()


def _write_resolv_conf(path: Path) -> None:
    """slirp's DNS forwarder as the task's resolv.conf, written once per task."""
    if not path.exists():
        from fusion_oci.runtimes.linux.egress import RESOLV_CONF

        path.write_text(RESOLV_CONF, encoding="utf-8")
