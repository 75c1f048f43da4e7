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
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fusion_oci.engines import (
    ContainerGoneError,
    Endpoint,
    EngineAdapter,
    EngineInfo,
    ExecStream,
    Found,
    engine_errors,
)
from fusion_oci.errors import (
    FusionOCIError,
    ProvisionError,
    RuntimeUnavailableError,
    SandboxSetupError,
)
from fusion_oci.models import (
    CacheMode,
    PrepareContext,
    RunOptions,
    RunResult,
)
from fusion_oci.oci.spec import Spec, spec_cache_mode
from fusion_oci.process import ProcessOutcome
from fusion_oci.runtimes.base import (
    LaunchPlan,
    LimitCounters,
    Requirement,
    classify,
)
from fusion_oci.runtimes.containers import (
    KEEPER_CMD,
    ContainerMode,
    ContainerPlan,
    Engine,
    Target,
    container_name,
    exit_status,
    limit_reason,
    parse_limit_counters,
    plan_container,
    plan_exec,
    plan_kill,
    plan_limit_probe,
    seccomp_file,
    spec_image,
)
from fusion_oci.runtimes.engine_probe import EngineProbe, current_owner, nproc_limit

if TYPE_CHECKING:
    from fusion_oci.resolve import ResolvedTask

T = TypeVar("T")

DEFAULT_IMAGE = "node"
"""The task image when neither the prepare context nor sandbox.image names one: the
product's own ``images/node`` (provisioned, behind the sandbox_provision gate, if missing)."""
DRAIN_AFTER_KILL_S = 10.0

# Seen on busy hosts: runc loses a race right after another container's removal and the new
# container fails to start, or its init cannot find the command in a rootfs that is fine the
# next time. Starting again is safe: nothing ran yet.
START_ATTEMPTS = 3


# --------------------------------------------------------------------------- runtime


class ContainerRuntime(EngineProbe):
    """The lifecycle shared by the podman and docker runtimes (see containers.py for the
    layout of a task container and why a timeout kills exactly what the command started)."""

    default_image = DEFAULT_IMAGE

    engine: Engine = "docker"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mode: ContainerMode = self.settings.container_mode
        self._adapter: EngineAdapter | None = None
        self._info: EngineInfo | None = None
        self._probe_error: SandboxSetupError | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = asyncio.Lock()
        self._container: str | None = None
        self._task_volumes: list[str] = []
        self._owner = current_owner()
        self._counters: dict[str, dict[str, int]] = {}
        self.image_ref: str | None = None
        self._image_id: str | None = None

    # -- engine-specific hooks (more in EngineProbe) ---------------------------------------


    def target(self) -> Target:
        info = self._info
        rootless = bool(info and info.rootless)
        return Target(self.engine, rootless, nproc_limit(self.host.rlimits),
                      cgroup_limits=not (rootless and info is not None
                                         and info.cgroup_version == "v1"),
                      seccomp_dir=str(self.cache_root / "seccomp"))

    def enforces(self) -> frozenset[Requirement]:
        need = {Requirement.FILESYSTEM, Requirement.PROC_PATHS,
                Requirement.ENV, Requirement.NETWORK_NONE,
                Requirement.NETWORK_EGRESS, Requirement.CPU_TIME, Requirement.TMP_SIZE,
                Requirement.FILE_SIZE}
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

    def _plan(self, spec: Spec, name: str) -> ContainerPlan:
        return plan_container(spec, self.target(), name=name, owner=self._owner,
                              mode=self.mode, isolated_caches=self._isolated(spec))

    def _isolated(self, spec: Spec) -> bool:
        return spec_cache_mode(spec) is CacheMode.ISOLATED

    def plan(self, spec: Spec) -> LaunchPlan:
        plan = self._plan(spec, container_name(str(spec["annotations"].get(
            "io.fusion-oci.task-id", "task")), "<nonce>"))
        exec_plan = plan_exec(spec)
        return LaunchPlan(
            backend=self.id,
            sdk_call="containers.create",
            sdk_kwargs=plan.create,
            env=exec_plan.environment,
            cwd=exec_plan.workdir,
            argv=exec_plan.cmd,
            notes=[*plan.notes, *(f"volume {v.name} -> {v.destination} ({v.scope})"
                                  for v in plan.volumes)],
            spec=spec,
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
        ctx = task.ctx
        assert self.task_spec is not None
        # The image the resolve step chose (context, settings, else this backend's default),
        # provisioned; the task then runs on its local reference.
        self.image_ref = await self._provision(spec_image(self.task_spec), ctx)
        self.set_image(self.image_ref)
        await asyncio.to_thread(self._write_seccomp, self.task_spec)
        await self._collect_own_garbage(ctx.task_id)
        if self.mode == "warm":
            self._container = await self._start_container()
        assert self.resolved is not None
        return self.resolved  # on the provisioned image

    def _write_seccomp(self, spec: Spec) -> None:
        """podman takes the bundle's seccomp profile only as a file: write it where
        :func:`seccomp_file` names it (atomically; the same profile is the same file)."""
        profile = spec.get("linux", {}).get("seccomp")
        if self.engine != "podman" or profile is None:
            return
        path_text, text = seccomp_file(profile, str(self.cache_root / "seccomp"))
        path = Path(path_text)
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
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
                raise ProvisionError(f"image '{ref}' is gone from {self.engine}",
                                     "it was removed after prepare", "prepare the task again")
            self._image_id = info.id
        return self._image_id

    async def _call_probe(self) -> None:
        def probe() -> None:
            self._probe()

        await asyncio.get_running_loop().run_in_executor(self._executor(), probe)

    async def _provision(self, image: str, ctx: PrepareContext) -> str:
        adapter = self._adapter
        assert adapter is not None
        if await self._call("image lookup", lambda: adapter.image_exists(image)):
            return image
        return await provision_image(self, image, ctx)

    async def _collect_own_garbage(self, task_id: str) -> None:
        from fusion_oci.gc import collect

        adapter = self._adapter
        assert adapter is not None
        await self._call("gc", lambda: collect(adapter, task_id=task_id))

    async def _start_container(self) -> str:
        adapter = self._adapter
        assert adapter is not None and self.ctx is not None
        spec = self.compile(list(KEEPER_CMD), RunOptions())
        for attempt in range(1, START_ATTEMPTS + 1):
            plan = self._plan(spec, container_name(self.ctx.task_id, secrets.token_hex(4)))
            for volume in plan.volumes:
                await self._call("volume create", functools.partial(adapter.ensure_volume, volume))
                if volume.scope == "task" and volume.name not in self._task_volumes:
                    self._task_volumes.append(volume.name)
            cid = await self._call("container create", functools.partial(adapter.create, plan))
            try:
                await self._call("container start", functools.partial(adapter.start, cid))
            except RuntimeUnavailableError:
                await asyncio.shield(self._remove(cid))
                raise
            except SandboxSetupError:
                await asyncio.shield(self._remove(cid))
                if attempt == START_ATTEMPTS:
                    raise
                continue
            except BaseException:
                await asyncio.shield(self._remove(cid))
                raise
            return cid
        raise AssertionError("unreachable")

    async def _remove(self, cid: str) -> None:
        adapter = self._adapter
        if adapter is None:
            return
        with contextlib.suppress(FusionOCIError):
            await self._call("container remove", lambda: adapter.remove(cid))

    async def execute(self, plan: LaunchPlan, opts: RunOptions) -> RunResult:
        spec = plan.spec
        async with self._lock:
            if self.mode == "warm":
                if self._container is None:
                    raise SandboxSetupError(f"runtime '{self.id}' was not prepared",
                                            "run() came before prepare()",
                                            "call prepare(ctx) first")
                try:
                    return await self._exec(self._container, spec, opts)
                except ContainerGoneError:
                    # The exec was refused before anything ran (see START_ATTEMPTS): a fresh
                    # container, once. /tmp and HOME start empty again; the worktree stays.
                    await asyncio.shield(self._remove(self._container))
                    self._container = None
                    self._container = await self._start_container()
                    return await self._exec(self._container, spec, opts)
            for attempt in (1, 2):
                cid = await self._start_container()
                try:
                    return await self._exec(cid, spec, opts)
                except ContainerGoneError:
                    if attempt == 2:
                        raise
                finally:
                    await asyncio.shield(self._remove(cid))
            raise AssertionError("unreachable")

    async def _exec(self, cid: str, spec: Spec, opts: RunOptions) -> RunResult:
        adapter = self._adapter
        assert adapter is not None
        # Sandbox.run reads a StdinStream to its end first: containers take stdin as one value.
        plan = plan_exec(spec, opts.stdin if isinstance(opts.stdin, bytes) else None)
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        exec_id, stream = await self._call("exec", lambda: adapter.exec_start(cid, plan),
                                           setup=False)
        overflow = asyncio.Event()

        def on_overflow() -> None:
            loop.call_soon_threadsafe(overflow.set)

        sink = _Sink(opts.max_buffer, on_overflow)
        if opts.on_output is not None:
            callback = opts.on_output

            def forward(i: int, chunk: bytes) -> None:  # the pump's thread -> the loop
                loop.call_soon_threadsafe(callback, "stderr" if i else "stdout", chunk)

            sink.on_chunk = forward
        sink.keep = opts.keep_output
        pump: asyncio.Future[None] = loop.run_in_executor(self._executor(), sink.pump, stream)
        overflowed: asyncio.Future[bool] = asyncio.ensure_future(overflow.wait())
        timed_out = False
        try:
            waiters: set[asyncio.Future[Any]] = {pump, overflowed}
            done, _ = await asyncio.wait(waiters, timeout=opts.timeout_ms / 1000,
                                         return_when=asyncio.FIRST_COMPLETED)
            if pump not in done:
                timed_out = not done
                await self._kill(cid, spec, pump, stream)
        except asyncio.CancelledError:
            await asyncio.shield(self._kill(cid, spec, pump, stream))
            raise
        finally:
            overflowed.cancel()
            if pump.done():
                adapter.close_stream(stream)
        code = await self._call("exec inspect", lambda: adapter.exec_exit_code(exec_id),
                                setup=False)
        exit_code, signal = exit_status(code)
        outcome = ProcessOutcome(
            stdout=sink.data(0), stderr=sink.data(1), returncode=exit_code, signal=signal,
            timed_out=timed_out, truncated=sink.truncated,
            duration_ms=int((time.monotonic() - start) * 1000),
        )
        counters = LimitCounters()
        if exit_code != 0 and not sink.truncated:
            counters = await self._limit_counters(cid, spec)
        return self.result(outcome, spec, classify(outcome, spec, counters))

    async def _limit_counters(self, cid: str, spec: Spec) -> LimitCounters:
        """After a failed command: did the container's pids or memory limit hold it?

        The counters of a new container start at zero; one more exec, paid only on failure.
        """
        adapter = self._adapter
        assert adapter is not None
        probe = plan_limit_probe(spec)

        def read() -> str:
            _, out = adapter.exec_start(cid, probe)
            try:
                return b"".join(chunk for pair in out for chunk in pair if chunk).decode()
            finally:
                adapter.close_stream(out)

        try:
            text = await self._call("limit counters", read, setup=False)
        except FusionOCIError:
            return LimitCounters()  # unknown: no claim either way
        after = parse_limit_counters(text)
        before = self._counters.get(cid, {})
        self._counters[cid] = after
        return limit_reason(before, after)

    async def _kill(self, cid: str, spec: Spec, pump: asyncio.Future[None],
                    stream: ExecStream) -> None:
        """End everything the command started, then wait (bounded) for its stream to end."""
        adapter = self._adapter
        assert adapter is not None
        kill = plan_kill(spec)

        def run_kill() -> None:
            _, out = adapter.exec_start(cid, kill)
            try:
                for _ in out:
                    pass
            finally:
                adapter.close_stream(out)

        with contextlib.suppress(FusionOCIError):
            await self._call("kill", run_kill, setup=False)
        try:
            await asyncio.wait_for(asyncio.shield(pump), DRAIN_AFTER_KILL_S)
        except TimeoutError:
            adapter.close_stream(stream)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(pump), 2.0)

    async def dispose(self) -> None:
        adapter = self._adapter
        try:
            if self._container is not None:
                cid, self._container = self._container, None
                await self._remove(cid)
            if adapter is not None:
                for name in self._task_volumes:
                    with contextlib.suppress(FusionOCIError):
                        await self._call("volume remove",
                                         functools.partial(adapter.remove_volume, name))
                self._task_volumes = []
        finally:
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


@dataclass
class _Sink:
    """Collects an exec's demuxed output up to maxBuffer per stream (as process.py does)."""

    limit: int
    on_overflow: Callable[[], None]
    chunks: tuple[list[bytes], list[bytes]] = field(default_factory=lambda: ([], []))
    sizes: list[int] = field(default_factory=lambda: [0, 0])
    truncated: bool = False
    on_chunk: Callable[[int, bytes], None] | None = None
    """Sees every chunk as it arrives (streaming), in the pump's thread."""
    keep: bool = True
    """False: keep nothing and never overflow (RunOptions.keep_output)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def pump(self, stream: ExecStream) -> None:
        with contextlib.suppress(Exception):  # a stream aborted after a kill just ends
            for pair in stream:
                for i, chunk in enumerate(pair):
                    if chunk:
                        self._add(i, chunk)

    def _add(self, i: int, chunk: bytes) -> None:
        if self.on_chunk is not None:
            self.on_chunk(i, chunk)
        if not self.keep:
            return
        with self._lock:
            room = self.limit - self.sizes[i]
            if room > 0:
                self.chunks[i].append(chunk[:room])
                self.sizes[i] += min(room, len(chunk))
            if len(chunk) > room and not self.truncated:
                self.truncated = True
                self.on_overflow()

    def data(self, i: int) -> bytes:
        with self._lock:
            return b"".join(self.chunks[i])


async def provision_image(runtime: ContainerRuntime, image: str, ctx: PrepareContext) -> str:
    """The image is not in the engine: provision it (gates, retries, audit; issue 5)."""
    from fusion_oci.audit import AuditLog
    from fusion_oci.images.provision import ensure_image

    adapter = runtime._adapter
    assert adapter is not None
    provisioned = await ensure_image(runtime.engine, adapter.borrowed(), image,
                                     runtime.settings, runtime.audit or AuditLog(),
                                     ctx.task_id, ctx.run_id, ask=runtime.ask)
    return provisioned.ref


__all__ = ["DEFAULT_IMAGE", "START_ATTEMPTS", "ContainerGoneError", "ContainerRuntime",
           "Endpoint", "EngineAdapter", "EngineInfo", "ExecStream", "Found", "current_owner",
           "nproc_limit", "provision_image"]
