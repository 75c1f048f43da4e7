"""What the podman and docker runtimes share beyond the pure translation: the lifecycle of a
warm (or one-shot) task container.

Finding the engine, its SDK client and the boundary where SDK exceptions become fusion-oci
errors belong to the engines layer (:mod:`fusion_oci.engines`): an
:class:`~fusion_oci.engines.EngineAdapter` is a thin, synchronous layer over one SDK client.
:class:`ContainerRuntime` drives it from asyncio through a small thread pool of its own, so
that one task's blocked exec stream can never starve another task's calls (parallel prepares
of many tasks share nothing but the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import shutil
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from fusion_oci.agent.client import Agent, agent_binary, listen_socket
from fusion_oci.engines import (
    EngineAdapter,
    EngineInfo,
    engine_errors,
)
from fusion_oci.engines.base import ContainerPlan
from fusion_oci.engines.labels import current_owner
from fusion_oci.errors import (
    FusionOCIError,
    ProvisionError,
    RuntimeUnavailableError,
    SandboxSetupError,
)
from fusion_oci.gc import collect
from fusion_oci.host.scratch import make_scratch
from fusion_oci.models import (
    CacheMode,
    RunOptions,
    RunResult,
)
from fusion_oci.oci.model import ANN_RUN, ProcessSpec, TaskSpec
from fusion_oci.runtimes.engine.containers import (
    AGENT_PATH,
    AGENT_SOCKET,
    AgentMounts,
    ContainerMode,
    Engine,
    Target,
    container_name,
    limit_reason,
    parse_limit_counters,
    plan_container,
    plan_limit_probe,
    sandbox_user,
    seccomp_file,
    spec_image,
)
from fusion_oci.runtimes.engine.probe import EngineProbe, nproc_limit
from fusion_oci.runtimes.linux.egress import proxy_socket, service_relays
from fusion_oci.runtimes.outcome import LimitCounters, classify
from fusion_oci.runtimes.plans import AgentPlan, Plan, SandboxLaunch, own_plan, spawn_of
from fusion_oci.runtimes.requirements import SANDBOXED, Requirement

if TYPE_CHECKING:
    from fusion_oci.resolve import ResolvedTask

T = TypeVar("T")

DEFAULT_IMAGE = "node"
"""The task image when neither the prepare context nor sandbox.image names one: the
product's own ``images/node`` (provisioned, behind the sandbox_provision gate, if missing)."""
AGENT_CONNECT_S = 30.0
"""How long a started container's agent may take to connect (a busy host's runc)."""

# Seen on busy hosts: runc loses a race right after another container's removal and the new
# container fails to start, or its init cannot find the command in a rootfs that is fine the
# next time. Starting again is safe: nothing ran yet.
START_ATTEMPTS = 3


# --------------------------------------------------------------------------- runtime


class ContainerRuntime(EngineProbe):
    """The lifecycle shared by the podman and docker runtimes (see containers.py for the
    layout of a task container and why a timeout kills exactly what the command started)."""

    default_image = DEFAULT_IMAGE
    streams_stdin = True  # the agent client writes a StdinStream's chunks as they come

    engine: Engine = "docker"

    def setup(self) -> None:
        self.mode: ContainerMode = self.settings.container_mode
        self._adapter: EngineAdapter | None = None
        self._info: EngineInfo | None = None
        self._probe_error: SandboxSetupError | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = asyncio.Lock()
        self._container: str | None = None
        self._container_plan: ContainerPlan | None = None
        """The warm container's create arguments (from prepare): what each plan shows."""
        self._task_volumes: list[str] = []
        self._owner = current_owner()
        self._counters: dict[str, dict[str, int]] = {}
        self._agents: dict[str, Agent] = {}
        """The exec agent of each running container (the warm one, or a one-shot's)."""
        self._scratch: Path | None = None
        """The sandbox's 0700 host folder: one subfolder per container for the agent's
        socket until it has connected; removed at dispose."""
        self.image_ref: str | None = None
        self._image_id: str | None = None
        self._egress_socket: str | None = None
        """``filtered``: the host path of the task's egress proxy socket (from prepare)."""
        self._service_relays: tuple[tuple[str, str], ...] | None = None
        """``hostServices``: the relays' sockets (from prepare)."""

    # -- engine-specific hooks (more in EngineProbe) ---------------------------------------

    def target(self) -> Target:
        info = self._info
        rootless = bool(info and info.rootless)
        return Target(
            self.engine,
            rootless,
            nproc_limit(self.host.rlimits),
            cgroup_limits=not (rootless and info is not None and info.cgroup_version == "v1"),
            seccomp_dir=str(self.cache_root / "seccomp"),
        )

    def enforces(self) -> frozenset[Requirement]:
        # filtered: the engine's `none` network and the agent's forwarder to the task's proxy
        # socket, rootful or rootless alike.
        # HOST_PROCESSES: the container's pid namespace hides every host process.
        need = {
            *SANDBOXED,
            Requirement.NETWORK_EGRESS,
            # publishPorts: handed to the agent of the task's one container; oneshot has none
            # between commands.
            *((Requirement.PUBLISHED_PORTS,) if self.mode == "warm" else ()),
        }
        try:
            _, info = self._probe(start=False)
        except SandboxSetupError:
            return frozenset(need)
        rootless_v1 = info.rootless and info.cgroup_version == "v1"
        if not rootless_v1:
            # Rootless containers on a cgroup v1 host get no cgroup of their own: podman
            # ignores the limits there, so they are not claimed (the policy is refused).
            need |= {Requirement.MEMORY, Requirement.CPU_QUOTA, Requirement.PIDS}
        return frozenset(need)

    def _plan(self, name: str, agent: AgentMounts | None = None) -> ContainerPlan:
        """The task's container: its spec, with the exec agent as the init process."""
        spec = self.task_spec
        return plan_container(
            spec,
            self._init_process(),
            self.target(),
            name=name,
            owner=self._owner,
            mode=self.mode,
            isolated_caches=spec.cache_mode is CacheMode.ISOLATED,
            agent=agent or AgentMounts(),
        )

    def _init_process(self) -> ProcessSpec:
        """The container's own process: the agent, as the sandbox user, with the task's
        rlimits (the engine's ulimits) and PATH."""
        return self.process([AGENT_PATH], RunOptions(env={}))

    def plan(self, process: ProcessSpec) -> AgentPlan:
        """The command's spawn frame to the agent of the task's container (whose create
        arguments are beside it: made at prepare, or with a placeholder name before)."""
        container = self._container_plan or self._plan(
            container_name(self.task_spec.task_id or "task", "<nonce>")
        )
        return AgentPlan(
            backend=self.id,
            spawn=spawn_of(process),
            sandbox=SandboxLaunch(sdk_call="containers.create", sdk_kwargs=container.create),
            notes=[
                *container.notes,
                *(f"volume {v.name} -> {v.destination} ({v.scope})" for v in container.volumes),
            ],
            process=process,
        )

    # -- async plumbing -------------------------------------------------------------------

    async def _call(self, what: str, fn: Callable[[], T], *, setup: bool = True) -> T:
        adapter = self._adapter
        assert adapter is not None

        def guarded() -> T:
            with engine_errors(self.engine, what, adapter.endpoint, setup=setup):
                return fn()

        return await asyncio.get_running_loop().run_in_executor(self._executor(), guarded)

    def _executor(self) -> ThreadPoolExecutor:
        # Per runtime: a task's blocked exec reader never waits for another task's thread.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix=f"fusion-{self.id}")
        return self._pool

    # -- lifecycle ------------------------------------------------------------------------

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        await self._call_probe()
        await super().prepare(task)
        self._egress_socket = proxy_socket(task)
        self._service_relays = service_relays(task)
        # The image the resolve step chose (context, settings, else this backend's default),
        # provisioned; the task then runs on its local reference.
        self.image_ref = await self._provision(spec_image(task.spec), task)
        self.set_image(self.image_ref)
        await asyncio.to_thread(self._write_seccomp, self.task_spec)
        await self._collect_own_garbage(task.spec.task_id)
        if self.mode == "warm":
            self._container = await self._start_container()
        return self.adopted()  # on the provisioned image

    def _write_seccomp(self, spec: TaskSpec) -> None:
        """podman takes the bundle's seccomp profile only as a file: write it where
        :func:`seccomp_file` names it (atomically; the same profile is the same file)."""
        if self.engine != "podman" or spec.linux.seccomp is None:
            return
        profile = spec.linux.seccomp.to_oci()
        path_text, text = seccomp_file(profile, str(self.cache_root / "seccomp"))
        path = Path(path_text)
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        # Unique per call: parallel prepares in one process write the same profile at once.
        tmp = path.with_suffix(f".{os.getpid()}.{secrets.token_hex(4)}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)

    async def image_digest(self) -> str | None:
        """The id (``sha256:...``) of the image this task's containers run (None before
        prepare): the audit pins it so a replay runs that very image."""
        adapter, ref = self._adapter, self.image_ref
        if adapter is None or ref is None:
            return None
        if self._image_id is None:
            info = await self._call("image inspect", lambda: adapter.image(ref))
            if info is None:
                raise ProvisionError(
                    f"image '{ref}' is gone from {self.engine}",
                    "it was removed after prepare",
                    "prepare the task again",
                )
            self._image_id = info.id
        return self._image_id

    async def _call_probe(self) -> None:
        def probe() -> None:
            self._probe()

        await asyncio.get_running_loop().run_in_executor(self._executor(), probe)

    async def _provision(self, image: str, task: ResolvedTask) -> str:
        adapter = self._adapter
        assert adapter is not None
        if await self._call("image lookup", lambda: adapter.image_exists(image)):
            return image
        return await provision_image(self, image, task)

    async def _collect_own_garbage(self, task_id: str) -> None:
        adapter = self._adapter
        assert adapter is not None
        try:
            await self._call("gc", lambda: collect(adapter, task_id=task_id))
        except RuntimeUnavailableError:
            raise
        except SandboxSetupError:
            # Someone else's broken object (podman cannot list at all while one container's
            # network namespace is gone) must not block this task: gc is tidying, not a
            # precondition (as for the oci runtime's state gc); `fusion-oci gc` says why.
            pass

    async def _start_container(self) -> str:
        """Create and start a task container whose init is the exec agent, and take the
        agent's one connection (see containers.py for the layout)."""
        adapter = self._adapter
        assert adapter is not None
        task_id = self.task_spec.task_id
        binary = str(agent_binary())
        for attempt in range(1, START_ATTEMPTS + 1):
            nonce = secrets.token_hex(4)
            run_dir, listener = self._agent_listener(nonce)
            plan = self._plan(
                container_name(task_id, nonce),
                AgentMounts(
                    binary,
                    str(run_dir),
                    self._egress_socket or AgentMounts.egress_socket,
                    self._service_relays,
                ),
            )
            cid: str | None = None
            try:
                for volume in plan.volumes:
                    await self._call(
                        "volume create", functools.partial(adapter.ensure_volume, volume)
                    )
                    if volume.scope == "task" and volume.name not in self._task_volumes:
                        self._task_volumes.append(volume.name)
                cid = await self._call("container create", functools.partial(adapter.create, plan))
                try:
                    await self._call("container start", functools.partial(adapter.start, cid))
                except RuntimeUnavailableError:
                    raise
                except SandboxSetupError:
                    if attempt == START_ATTEMPTS:
                        raise
                    await asyncio.shield(self._remove(cid))
                    await asyncio.sleep(0.2 * attempt)  # the race is with a busy host's runc
                    continue
                pid = await self._call(
                    "container inspect", functools.partial(_init_pid, adapter, cid)
                )
                self._agents[cid] = await Agent.accept(
                    listener, expect_pid=pid, timeout_s=AGENT_CONNECT_S
                )
                if self.mode == "warm":
                    self._container_plan = plan
                return cid
            except BaseException:
                if cid is not None:
                    await asyncio.shield(self._remove(cid))
                raise
            finally:
                listener.close()  # accept closed it already; before that, nothing may connect
                shutil.rmtree(run_dir, ignore_errors=True)
        raise AssertionError("unreachable")

    def _agent_listener(self, nonce: str) -> tuple[Path, socket.socket]:
        """A 0700 folder in the sandbox's scratch with the socket the agent connects to.

        Owned by the sandbox user (so the container's user can reach it: the same uid inside
        with keep-id, rootless, or a non-root caller of a rootful engine); only this one
        container has it mounted, and accept() removes the socket once the agent is in.
        """
        if self._scratch is None:
            self._scratch = make_scratch(self.id, self.task_spec.task_id)
        run_dir = self._scratch / f"agent-{nonce}"
        run_dir.mkdir(mode=0o700)
        listener = listen_socket(run_dir / AGENT_SOCKET, mode=0o600)
        uid, gid = sandbox_user(self._init_process())
        if (uid, gid) != (os.geteuid(), os.getegid()) and os.geteuid() == 0:
            for path in (run_dir, run_dir / AGENT_SOCKET):
                os.chown(path, uid, gid)
        return run_dir, listener

    async def _remove(self, cid: str) -> None:
        agent = self._agents.pop(cid, None)
        if agent is not None:
            await agent.close()  # the agent ends what runs and exits
        self._counters.pop(cid, None)
        adapter = self._adapter
        if adapter is None:
            return
        with contextlib.suppress(FusionOCIError):
            await self._call("container remove", lambda: adapter.remove(cid))

    async def execute(self, plan: Plan, opts: RunOptions) -> RunResult:
        process = own_plan(self, plan, AgentPlan).process
        async with self._lock:
            if self.mode == "warm":
                if self._container is None:
                    raise SandboxSetupError(
                        f"runtime '{self.id}' was not prepared",
                        "run() came before prepare()",
                        "call prepare(ctx) first",
                    )
                # An agent that is gone fails this run and every later one (AgentLostError),
                # never silently replaced: what the task's earlier commands left is gone too.
                return await self._exec(self._container, process, opts)
            cid = await self._start_container()
            try:
                return await self._exec(cid, process, opts)
            finally:
                await asyncio.shield(self._remove(cid))

    async def _exec(self, cid: str, process: ProcessSpec, opts: RunOptions) -> RunResult:
        """One command through the container's agent: the host's pipes, timeout, maxBuffer,
        stdin and the whole-tree kill are the agent client's (Agent.run)."""
        agent = self._agents[cid]
        command = spawn_of(process)
        outcome = await agent.run_command(command, opts)
        # The agent reports the command's own wait status: a real `exit 130` stays an exit,
        # death by SIGINT a signal (no launcher's 128+N in between to read back).
        counters = LimitCounters()
        if outcome.returncode != 0 and not outcome.truncated:
            counters = await self._limit_counters(cid, process)
        return self.result(outcome, process, classify(outcome, process, counters))

    async def _limit_counters(self, cid: str, process: ProcessSpec) -> LimitCounters:
        """After a failed command: did the container's pids or memory limit hold it?

        The container's own cgroup counters, read through the agent as the sandbox user (one
        more spawn, paid only on failure); those of a new container start at zero.
        """
        probe = plan_limit_probe(process)
        try:
            outcome = await self._agents[cid].run(
                probe.argv, env=probe.env, cwd=probe.cwd, timeout_s=10.0, max_buffer=65536
            )
        except FusionOCIError:
            return LimitCounters()  # unknown: no claim either way
        after = parse_limit_counters(outcome.stdout.decode(errors="replace"))
        before = self._counters.get(cid, {})
        self._counters[cid] = after
        return limit_reason(before, after)

    async def dispose(self) -> None:
        adapter = self._adapter
        try:
            if self._container is not None:
                cid, self._container = self._container, None
                await self._remove(cid)
            for cid in list(self._agents):
                await self._remove(cid)
            if adapter is not None:
                for name in self._task_volumes:
                    with contextlib.suppress(FusionOCIError):
                        await self._call(
                            "volume remove", functools.partial(adapter.remove_volume, name)
                        )
                self._task_volumes = []
        finally:
            self._egress_socket = None
            self._service_relays = None
            self._container_plan = None
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None
            await super().dispose()
            self.close()

    def close(self) -> None:
        """Drop the client and anything the runtime started (a podman service)."""
        if self._adapter is not None:
            with contextlib.suppress(Exception):
                self._adapter.close()
            self._adapter = None
        self._info = None
        self.release_endpoint()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _init_pid(adapter: EngineAdapter, cid: str) -> int | None:
    """The container's init (the agent) as this host sees it: the peer the agent's one
    connection must come from. Both SDKs: ``State.Pid`` of the inspect."""
    pid = adapter.client.containers.get(cid).attrs.get("State", {}).get("Pid")
    return int(pid) if pid else None


async def provision_image(runtime: ContainerRuntime, image: str, task: ResolvedTask) -> str:
    """The image is not in the engine: provision it (gates, retries, audit; issue 5), for the
    task its spec names."""
    from fusion_oci.audit import AuditLog
    from fusion_oci.images.provision import ProvisionOptions, ensure_image

    adapter = runtime._adapter
    assert adapter is not None
    # The worktree's .nvmrc / package.json choose the node image's Node.js and package manager.
    provisioned = await ensure_image(
        runtime.engine,
        adapter.borrowed(),
        image,
        runtime.settings,
        runtime.audit or AuditLog(),
        task.spec.task_id,
        task.spec.annotations.get(ANN_RUN, ""),
        ask=runtime.ask,
        options=ProvisionOptions(project_dir=Path(task.layout.worktree)),
    )
    return provisioned.ref


__all__ = ["DEFAULT_IMAGE", "START_ATTEMPTS", "ContainerRuntime", "provision_image"]
