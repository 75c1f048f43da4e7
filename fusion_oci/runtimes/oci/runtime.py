"""The ``oci`` runtime: an OCI runtime CLI (runc; crun, runsc, youki elsewhere) on the bundle.

One container per task, whose init is the exec agent (fusion_oci/agent), as the bubblewrap
and container-engine runtimes have one sandbox per task. At prepare the task spec goes through
the spec operations this host needs (:mod:`fusion_oci.oci.ops`, the agent as init:
:func:`~fusion_oci.runtimes.oci.launch.with_agent_init`), is written as the task's bundle
and started with ``RUNTIME --root STATE run --detach --pid-file P --bundle DIR ID``; the
runtime CLI is our child in its own process group, bounded by a timeout, and hands its stdin,
our end of a socketpair, through to the agent (no socket path anywhere). One builder
(:func:`~fusion_oci.runtimes.oci.launch.build_task`) makes that bundle and argv for both
:meth:`OciRuntime.plan` and :meth:`OciRuntime.prepare`.

Each command is a spawn frame to the agent (args, env, cwd, rlimits; the container's user,
capabilities and seccomp profile are the agent's own), with our pipes passed along, so output
comes straight here: no runtime CLI, no container set-up, no init per command. The agent's
keeper per command ends the command's whole tree on timeout, maxBuffer and abort, and whatever
the command left running when it exits; the container stays for the next command. The task's
cgroup counters (OOM kills, pids-limit hits) are read after each command; their growth during
the command is what :func:`~fusion_oci.runtimes.outcome.classify` gets. A command whose
process the agent cannot give it (another user, capabilities, no-new-privileges, a terminal)
is refused, never run in this container.

At dispose the connection is closed (the agent ends every tree and exits, which ends the
container), then ``delete --force ID``, the egress link and our cgroup (runsc) go, and the
task's state directory is removed. A process of ours that dies leaves the agent without its
connection, so it exits too; the state directory it leaves is unlocked, and the next prepare's
gc (:mod:`fusion_oci.runtimes.oci.state`) deletes the container and the directory.

Host-rootfs specs run on an empty ``rootfs/`` plus the spec's read-only binds of the system
directories. Image specs run on the image's root filesystem, exported once per image digest
by the engine (:mod:`fusion_oci.images.rootfs`) into a read-only cache shared by every
container of that image.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fusion_oci.runtimes.oci.launch as _launch
import fusion_oci.runtimes.oci.probe as probe
from fusion_oci.agent.client import Agent
from fusion_oci.errors import AgentLostError, FusionOCIError, SandboxSetupError
from fusion_oci.host.process import ProcessOutcome, kill_group
from fusion_oci.models import NetworkMode, RunOptions
from fusion_oci.oci.bundle import write_bundle
from fusion_oci.oci.model import ANN_RUN, ANN_TASK, ProcessSpec
from fusion_oci.runtimes.box import Box
from fusion_oci.runtimes.linux.cgroups import (
    Cgroup,
    CgroupEvents,
    Hierarchy,
    detect,
    probe_hierarchy,
    read_events,
)
from fusion_oci.runtimes.linux.egress import service_relays
from fusion_oci.runtimes.oci.egress import EgressLink
from fusion_oci.runtimes.oci.filtered import SOCKET_PLACEHOLDER
from fusion_oci.runtimes.oci.gvisor import GvisorFlags, gvisor_details
from fusion_oci.runtimes.oci.launch import (
    GRACE_S,
    OciPlan,
    TaskLaunch,
    is_gvisor,
    process_key,
    render,
)
from fusion_oci.runtimes.oci.state import (
    TaskState,
    cgroup_paths,
    delete_container,
    gc_oci,
    list_containers,
    open_task_dir,
    read_pid,
    state_base,
    tail,
    task_dir_name,
    wait_exit,
)
from fusion_oci.runtimes.outcome import LimitCounters, status_from_code
from fusion_oci.runtimes.plans import AgentPlan
from fusion_oci.runtimes.protocol import Availability
from fusion_oci.runtimes.requirements import SANDBOXED, Requirement
from fusion_oci.runtimes.skeleton import SpecRuntime

__all__ = ["OciRuntime", "exit_status", "limit_counters"]

if TYPE_CHECKING:
    from fusion_oci.resolve import ResolvedTask

STATE_JSON_RUNTIMES = frozenset({"runc"})
"""Runtimes whose ``ROOT/ID/state.json`` names the container's cgroup directories (the others'
counters stay 0: unknown, no claim)."""
START_TIMEOUT_S = 30.0
"""How long the runtime CLI may take to start the task's container (a busy host's runsc), and
then the agent to say hello."""
STOP_WAIT_S = 2.0
"""At dispose: how long the agent may take to end what runs and exit before delete --force."""


def exit_status(returncode: int | None, sig: str | None) -> tuple[int | None, str | None]:
    """A runtime's exit status -> (exit code, signal): runc reports a container whose
    process died by signal N as 128+N; the one rule is base.status_from_code. Pure."""
    return status_from_code(returncode, sig)


def limit_counters(events: CgroupEvents) -> LimitCounters:
    """A cgroup's counters for the one classifier."""
    return LimitCounters(oom_kills=events.oom_kills, pids_max=events.pids_max)


@dataclass(kw_only=True)
class _Box(Box[TaskLaunch, EgressLink]):
    """The task's running container."""

    key: tuple[object, ...]
    """:func:`process_key` of the init: what a command's process must share."""
    pid: int | None
    """The agent (the container's init) as this host sees it."""


class OciRuntime(SpecRuntime):
    """Any OCI runtime CLI (``sandbox.oci.runtime``: runc, crun, runsc, youki) on the bundle."""

    id = "oci"
    streams_stdin = True  # run_process writes a StdinStream's chunks as they come

    plan_type = OciPlan
    runs_in = "its container"
    box: _Box | None
    _task: TaskState | None = None
    _rootfs: str | None = None
    _binary: str | None = None
    _agent: str | None = None
    _unshare: str | None = None
    _version: str | None = None
    _gvisor_flags: GvisorFlags | None = None
    _cgroups: Hierarchy | None = None
    _egress: tuple[bool, str] | None = None
    _egress_socket: str | None = None
    """``filtered``: the host path of the task's egress proxy socket (from prepare)."""
    _service_relays: tuple[tuple[str, str], ...] | None = None
    """``hostServices``: the relays' sockets (from prepare)."""

    def setup(self) -> None:
        self.runtime_name: str = self.settings.oci.runtime
        self.uid = os.geteuid()
        self.gid = os.getegid()
        self.state_base = state_base(self.env, self.uid)
        self.nonce = secrets.token_hex(3)
        """Names the next task directory (and its container): chosen now so a plan made
        before prepare shows the paths the run will use."""
        self.pid = os.getpid()
        """Names runsc cgroup leaves (see cgroups.leaf_name)."""
        self.gc_removed: list[str] = []
        """Containers of dead tasks that the last prepare removed (for the audit)."""

    # -- what it offers

    @property
    def rootless(self) -> bool:
        return self.uid != 0

    def _find_binary(self) -> str | None:
        if self._binary is None:
            self._binary = shutil.which(self.runtime_name, path=self.env.get("PATH"))
        return self._binary

    def _gvisor(self, binary: str) -> GvisorFlags:
        """What the runsc at ``binary`` offers (one ``runsc flags`` per runtime object)."""
        if self._gvisor_flags is None:
            self._gvisor_flags = probe.gvisor_flags(binary)
        return self._gvisor_flags

    def _find_agent(self) -> str:
        """The static exec agent (fusion_oci.agent), the task container's init; a clear setup
        error when it is missing."""
        if self._agent is None:
            from fusion_oci.agent.client import agent_binary

            self._agent = str(agent_binary())
        return self._agent

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
            self._egress = probe.egress_status(
                self.runtime_name, self.rootless, self.env.get("PATH")
            )
        return self._egress

    def host_capabilities(self) -> dict[str, str]:
        return {} if self._limits() else {"resource_limits": "basic"}

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
            "commands": "one container per task, the exec agent its init; a spawn frame per "
            "command",
            "egress": (
                f"slirp4netns ({egress_why}) --disable-host-loopback, attached "
                + (
                    "before runsc starts (unshare --net)"
                    if is_gvisor(binary)
                    else "by a createRuntime hook"
                )
                if egress_ok
                else f"not enforced: {egress_why}"
            ),
            "filtered": "the container's empty network namespace; the agent's (init's) "
            "forwarder (127.0.0.1:3128) to the task's egress proxy socket"
            + (", connectable from gVisor with --host-uds=open" if is_gvisor(binary) else ""),
        }
        if self.rootless:
            details["limits"] = (
                "memory, pids and cpu quota are not enforced: rootless, no cgroup delegation"
            )
        if is_gvisor(binary):
            details.update(gvisor_details(self.rootless, self._limits(), self._gvisor(binary)))
        if self._version is None:
            self._version = probe.runtime_version(binary) or ""
        return Availability(
            True, version=self._version or None, rootless=self.rootless, details=details
        )

    def enforces(self) -> frozenset[Requirement]:
        # NETWORK_FILTERED: the container's own empty netns and the agent's (init's)
        # forwarder (filtered.py).
        # CPU_TIME: the agent's setrlimit on each command, inside the sandbox; under gVisor
        # (20221219) only such a call arms RLIMIT_CPU (a spec rlimit shows in `ulimit -t` yet
        # never fires), which the agent as the task's init makes for every command.
        # HOST_PROCESSES: the spec's pid namespace hides every host process.
        # publishPorts: the agent (the container's init) is handed each inbound connection;
        # under gVisor, which drops SCM_RIGHTS from the host, it dials the relay back for each
        # (services/publish.py).
        out = set(SANDBOXED) | {Requirement.PUBLISHED_PORTS}
        if is_gvisor(self.runtime_name):
            out.discard(Requirement.TMP_SIZE)  # gVisor's tmpfs ignores size= (seen: 20221219)
        if self.egress_status()[0]:
            out.add(Requirement.NETWORK_EGRESS)
        return frozenset(out) | self._limits()

    # -- the one translation

    def _launch_host(self) -> _launch.Host:
        task_dir = self._task.dir if self._task is not None else None
        binary = self._find_binary()
        return _launch.Host(
            binary=binary or self.runtime_name,
            task_dir=task_dir or self.state_base / "<task-dir>",
            nonce=self.nonce,
            env=self.env,
            agent=self._find_agent(),
            rootless_ids=(self.uid, self.gid) if self.rootless else None,
            rootfs=self._rootfs,
            unshare=self._find_unshare(),
            cgroup_pid=self.pid,
            egress_socket=self._egress_socket or SOCKET_PLACEHOLDER,
            service_relays=self._service_relays,
            gvisor_directfs=binary is not None
            and is_gvisor(binary)
            and self._gvisor(binary).directfs,
        )

    def init_process(self) -> ProcessSpec:
        """The task container's init as the task's commands would run (its user,
        capabilities, no-new-privileges, rlimits); :func:`~fusion_oci.runtimes.oci.launch.
        with_agent_init` makes it the agent."""
        return self.process(["true"], RunOptions(env={}))

    def _task_launch(self) -> TaskLaunch:
        """The adopted task's container (before prepare: the paths this runtime's next
        prepare will use, the image's digest a placeholder)."""
        task = self.task_spec
        host = self._launch_host()
        if self._task is None:
            ann = task.annotations
            task_dir = self.state_base / task_dir_name(
                ann.get(ANN_TASK, "task"), ann.get(ANN_RUN, "run"), self.nonce
            )
            rootfs = None
            if task.image:
                # Not prepared: the digest is the engine's answer at prepare time.
                rootfs = str(self.cache_root / "oci-rootfs" / "<image-digest>" / "rootfs")
            host = replace(host, task_dir=task_dir, rootfs=rootfs)
        return _launch.build_task(task, self.init_process(), host)

    def plan(self, process: ProcessSpec) -> OciPlan:
        """The command's spawn frame to the agent of the task's container, beside that
        container (its ``run`` argv and bundle: started at prepare): exactly what execute
        sends and prepare starts."""
        box = self.box
        launch = box.launch if box is not None else self._task_launch()
        return render(self.id, process, launch)

    def _find_unshare(self) -> str:
        if self._unshare is None:
            self._unshare = shutil.which("unshare", path=self.env.get("PATH")) or "unshare"
        return self._unshare

    # -- lifecycle

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        task = await super().prepare(task)
        spec = task.spec
        task_id, run_id = spec.task_id, spec.annotations.get(ANN_RUN, "")
        binary = self._find_binary()
        if binary is None:
            avail = self.availability()
            from fusion_oci.errors import RuntimeUnavailableError

            raise RuntimeUnavailableError(self.id, avail.reason, avail.hint)
        try:
            self.gc_removed = await gc_oci(binary, self.state_base, env=self.env)
        except (FusionOCIError, OSError):
            self.gc_removed = []  # someone else's leftovers must not block this task
        final = self.state_base / task_dir_name(task_id, run_id, self.nonce)
        self._task = open_task_dir(
            final, self.nonce, {"task": task_id, "run": run_id, "runtime": binary}
        )
        try:
            if task.spec.network is NetworkMode.FILTERED:
                if task.egress is None:
                    raise SandboxSetupError(
                        "network filtered needs the task's egress proxy",
                        "none was started for this task",
                        "prepare the task through fusion_oci.Sandbox",
                    )
                self._egress_socket = str(task.egress.unix_socket)
            self._service_relays = service_relays(task)
            if is_gvisor(binary):
                # gVisor drops SCM_RIGHTS from the host, and every dialer inside looks like
                # its init to the relays: nothing of the host's is handed in. Host services'
                # relays splice; published ports' dial back for each client.
                if task.services is not None:
                    task.services.hand_sockets = False
                if task.ports is not None:
                    task.ports.dial_back = True
            # The image the resolve step chose, read from the task spec (not the context).
            if image := task.spec.image:
                from fusion_oci.images.rootfs import export_image_rootfs, podman_url

                url = podman_url(self.env, self.uid, self.settings.podman.url)
                rootfs = await asyncio.to_thread(
                    export_image_rootfs, str(image), self.cache_root / "oci-rootfs", url
                )
                self._rootfs = str(rootfs)
            self.box = await self._start(self._task, binary)
        except BaseException:
            await self.dispose()
            raise
        return task

    async def _start(self, task: TaskState, binary: str) -> _Box:
        """Start the task's container, its init the agent on our socketpair; returns once the
        agent said hello. Whatever fails, what was started is ended by the caller's dispose
        (the container by its id) or here (the CLI's process group, the link, our cgroup)."""
        launch = self._task_launch()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        link = group = proc = None
        try:
            if launch.egress is not None:
                _write_resolv_conf(Path(launch.egress.resolv_conf))
            if launch.cgroup is not None:
                group = Cgroup.create(detect(self.env), launch.cgroup, name=launch.cgroup_leaf)
            write_bundle(launch.bundle, launch.bundle_dir)
            if launch.egress is not None:
                # Not enforceable here: check() said so and the lifecycle refused; if called
                # anyway, slirp4netns fails to attach and the hook keeps the agent from
                # starting.
                link = EgressLink(launch.egress, task.dir / "slirp.log")
                link.start(self.egress_status()[1])
            proc = await self._spawn_cli(launch, theirs)
            theirs.close()
            pid = None
            try:
                if launch.detach:
                    await self._wait_cli(launch, proc)
                    if link is not None and link.error is not None:
                        raise link.error
                    pid = read_pid(launch.pid_file)
                    # A socketpair: nothing else can be on the other end.
                    agent = await Agent.connected(ours, pid, START_TIMEOUT_S)
                else:
                    # The CLI stays: the agent's close waits for it (and ends its group if it
                    # hangs), as for bwrap.
                    agent = await Agent.over(ours, proc, START_TIMEOUT_S)
            except SandboxSetupError as exc:
                if link is not None and link.error is not None:
                    raise link.error from exc
                if not launch.detach:
                    await kill_group(proc)
                raise SandboxSetupError(
                    f"{self.runtime_name} could not start the task's container, or its exec "
                    "agent did not say hello",
                    _log_tail(launch.log) or str(exc),
                    "see the runtime's message above; `fusion-oci plan --backend oci` shows "
                    "the command line and the bundle",
                ) from exc
        except BaseException:
            ours.close()
            theirs.close()
            await kill_group(proc)
            if link is not None:
                await asyncio.shield(link.close())
            if group is not None:
                await asyncio.shield(self._delete(task, binary, launch.cid))
                group.remove()
            raise
        if group is not None:
            dirs = {k: str(v) for k, v in group.dirs.items()}
        elif Path(binary).name in STATE_JSON_RUNTIMES and not self.rootless:
            dirs = cgroup_paths(task.root, launch.cid)
        else:
            dirs = {}
        return _Box(
            agent=agent,
            launch=launch,
            key=process_key(self.init_process()),
            pid=pid,
            cgroup=dirs,
            group=group,
            link=link,
            events=read_events(dirs) if dirs else CgroupEvents(),
        )

    async def _spawn_cli(
        self, launch: TaskLaunch, stdin: socket.socket
    ) -> asyncio.subprocess.Process:
        """The runtime CLI's ``run``, in its own process group; its output (and the agent's
        last words) to the task's log."""
        log = os.open(launch.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            return await asyncio.create_subprocess_exec(
                *launch.argv,
                env=launch.env,
                cwd=launch.cwd,
                stdin=stdin.fileno(),
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        except OSError as exc:
            raise SandboxSetupError(
                f"{self.runtime_name} could not be started",
                str(exc),
                "check the host's process and file limits (ulimit -a)",
            ) from exc
        finally:
            os.close(log)

    async def _wait_cli(self, launch: TaskLaunch, proc: asyncio.subprocess.Process) -> None:
        """``run --detach`` to its end, bounded (a CLI that hangs is ended, group and all)."""
        try:
            code = await asyncio.wait_for(proc.wait(), START_TIMEOUT_S)
        except BaseException:
            await kill_group(proc)
            raise
        if code != 0:
            raise SandboxSetupError(
                f"{self.runtime_name} run exited {code}", _log_tail(launch.log) or "no output"
            )

    def check_plan(self, plan: AgentPlan, box: Box[Any, Any]) -> None:
        assert isinstance(plan, OciPlan) and isinstance(box, _Box)  # execute's own
        launch = plan.launch
        if launch is not box.launch and launch != box.launch:
            raise SandboxSetupError(
                "this command was planned for a container other than the task's",
                "its plan was made before prepare(), or for another task",
                "plan the command after prepare",
            )
        if process_key(plan.process) != box.key:
            raise SandboxSetupError(
                "this command needs a container other than the task's",
                "its process differs from the task's in more than args, env, cwd and rlimits "
                "(user, capabilities, no-new-privileges or a terminal), which the agent cannot "
                "give a command",
                "prepare a task with that policy for it",
            )

    async def run_spawn(
        self, box: Box[Any, Any], plan: AgentPlan, opts: RunOptions
    ) -> ProcessOutcome:
        assert isinstance(box, _Box)  # execute's own
        start = time.monotonic()
        try:
            return await box.agent.run_command(plan.spawn, opts, grace_s=GRACE_S)
        except AgentLostError:
            oom = self._oom_of_the_sandbox(box, start)
            if oom is None:
                raise
            return oom  # classified by the counters that saw it: oom

    def _oom_of_the_sandbox(self, box: _Box, start: float) -> ProcessOutcome | None:
        """The command's outcome when the agent was lost because the host's OOM killer took
        the whole sandbox (None: lost for another reason).

        Under gVisor the task's memory is the sentry's, one host process: at the limit the
        memory cgroup kills it, and every process of the sandbox with it. The command ends as
        an OOM kill (its output so far is lost with the sandbox); later commands of the task
        fail as agent-lost, the task's container is never silently replaced."""
        if not box.cgroup:
            return None
        if read_events(box.cgroup).oom_kills <= box.events.oom_kills:
            return None
        return ProcessOutcome(
            stdout=b"",
            returncode=None,
            signal="SIGKILL",
            timed_out=False,
            truncated=False,
            stderr=b"fusion-oci: the host's OOM killer ended the sandbox at its memory limit "
            b"(under gVisor that is the whole sandbox); the task's later commands "
            b"cannot run: prepare it again\n",
            duration_ms=int((time.monotonic() - start) * 1000),
        )

    async def _delete(self, task: TaskState, binary: str, cid: str) -> None:
        if await delete_container(binary, task.root, cid, self.env):
            task.leftovers.discard(cid)
        else:
            task.leftovers.add(cid)  # dispose tries again; gc after that

    async def dispose(self) -> None:
        box, self.box = self.box, None
        task, self._task = self._task, None
        binary = self._binary or self.runtime_name
        try:
            if box is not None:
                await box.agent.close()  # the agent ends every tree and exits
                if box.pid is not None and not is_gvisor(binary):
                    # runc's pid file names the init; runsc's names the sandbox, which stays
                    # until delete (which ends gVisor's every task at once).
                    await wait_exit(box.pid, STOP_WAIT_S)
                if box.link is not None:
                    await box.link.close()
            if task is not None:
                try:
                    # An empty runtime root holds no container (runsc removed its own when
                    # the agent exited): no CLI call to ask.
                    empty = not any(task.root.iterdir())
                except OSError:
                    empty = False
                try:
                    remaining = [] if empty else await list_containers(binary, task.root, self.env)
                except (FusionOCIError, OSError, ValueError):
                    remaining = [
                        {"id": c}
                        for c in {*task.leftovers, *([box.launch.cid] if box is not None else [])}
                    ]
                left = False
                for container in remaining:
                    if not await delete_container(
                        binary, task.root, str(container["id"]), self.env
                    ):
                        left = True
                os.close(task.lock_fd)
                if not left:
                    # Otherwise the unlocked directory is what gc_oci finds and retries.
                    shutil.rmtree(task.dir, ignore_errors=True)
                self.nonce = secrets.token_hex(3)  # a next prepare gets a directory of its own
        finally:
            if box is not None and box.group is not None:
                box.group.remove()
            self._rootfs = None
            self._egress_socket = None
            self._service_relays = None
            await super().dispose()


def _log_tail(path: Path) -> str:
    try:
        return tail(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return ""


def _write_resolv_conf(path: Path) -> None:
    """slirp's DNS forwarder as the task's resolv.conf."""
    from fusion_oci.runtimes.linux.egress import RESOLV_CONF

    path.write_text(RESOLV_CONF, encoding="utf-8")
