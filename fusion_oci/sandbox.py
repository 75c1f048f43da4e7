"""The lifecycle an executor uses: check the inputs, pick the runtime, apply the failure mode,
run, abort, audit.

Inputs first: a bad worktree, a missing policy path or CA file is the caller's mistake
(:class:`SettingsError`, exit 2) in every failure mode; nothing runs and nothing falls back.

Failure mode (brief 4.4) applies to exactly two things: the chosen backend is unavailable here
(:class:`RuntimeUnavailableError`), or it cannot enforce this policy here
(:class:`PolicyNotEnforceableError`). With ``fallback-native`` the command then runs natively,
audited as ``sandbox:fallback``, and every unenforced part is listed in the result and the
event; with ``fail-hard`` the error is raised. Any other setup failure is raised as it is.

Every runtime, a plugin's too, is driven the same way: at prepare the task is resolved once
(:func:`fusion_oci.resolve.resolve`: its typed task spec), checked once (``runtime.check``)
before anything is set up, and prepared (``runtime.prepare``); per command
(:meth:`Sandbox.run`) its process is compiled (:meth:`ResolvedTask.process`), planned
(``runtime.plan``), and that plan is executed (``runtime.execute``); the whole config (task
spec and process) is what a replay record keeps.

Abort: cancelling the task that awaits :meth:`Sandbox.run` (or :meth:`Sandbox.abort`, or
:meth:`SyncSandbox.abort` from another thread) ends the whole process tree, audits
``sandbox:run`` with end reason ``aborted``; a cancelled caller gets the CancelledError back,
an ``abort()`` gets an aborted :class:`RunResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from fusion_oci.audit import (
    AuditLog,
    DisposeEvent,
    FailureEvent,
    FallbackEvent,
    PrepareEvent,
    RunEvent,
    SandboxEvent,
)
from fusion_oci.egress.credentials import Broker, credential_layout, make_broker
from fusion_oci.egress.task import start_task_proxy, stop_task_proxy
from fusion_oci.errors import (
    FusionOCIError,
    PolicyNotEnforceableError,
    RuntimeUnavailableError,
    SandboxSetupError,
    SettingsError,
)
from fusion_oci.host.hardening import harden_owner
from fusion_oci.host.scratch import gc_scratch
from fusion_oci.models import (
    CacheMode,
    NetworkMode,
    OutputStream,
    PrepareContext,
    RunOptions,
    RunResult,
)
from fusion_oci.models.stdin import StdinStream
from fusion_oci.oci.host import HostInfo, probe_host
from fusion_oci.oci.model import config_json
from fusion_oci.policy.gitlinks import QUARANTINE_DIR, GitGuard
from fusion_oci.policy.layout import task_project
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.policy.worktree import check_inputs
from fusion_oci.replay import record_run, worktree_state
from fusion_oci.resolve import ResolvedTask, compile_spec, resolve_for
from fusion_oci.runtimes.protocol import Runtime
from fusion_oci.runtimes.registry import create_runtime
from fusion_oci.services import TaskRelays, start_relays, stop_relays
from fusion_oci.services.publish import TaskPorts, attach_ports, bind_ports, stop_ports
from fusion_oci.sidecars import TaskServices, services_missing
from fusion_oci.store import StoreLinker, task_linker

if TYPE_CHECKING:
    from fusion_oci.egress import EgressProxy
    from fusion_oci.images.gates import AskCallback


class Sandbox:
    """One task's sandbox: ``prepare`` once, ``run`` many commands, ``dispose``.

    Use as ``async with Sandbox(settings) as sb: await sb.prepare(ctx); await sb.run(cmd)``,
    or through :class:`SyncSandbox` from synchronous code.
    """

    def __init__(
        self,
        settings: SandboxSettings,
        *,
        audit: AuditLog | None = None,
        env: Mapping[str, str] | None = None,
        cache_root: Path | None = None,
        host: HostInfo | None = None,
        ask: AskCallback | None = None,
    ) -> None:
        """``ask`` answers gates configured as ``ask`` (brief 4.3); None: such gates deny."""
        self.settings = settings
        self.ask = ask
        self.audit = audit or AuditLog()
        self.env = dict(os.environ if env is None else env)
        self.cache_root = cache_root
        self.host = host
        self.runtime: Runtime | None = None
        self.ctx: PrepareContext | None = None
        self.task: ResolvedTask | None = None
        """The task as the runtime prepared it: what every command's spec is compiled from."""
        """The spec of the latest command (what a replay record keeps)."""
        self.fell_back = False
        self.unenforced: list[str] = []
        self.egress: EgressProxy | None = None
        """The task's egress proxy while prepared with ``network: filtered``."""
        self.services: TaskRelays | None = None
        """The task's host-service relays while prepared with ``hostServices`` or
        ``services``."""
        self.sidecars: TaskServices | None = None
        """The task's service containers while prepared with ``services``."""
        self.ports: TaskPorts | None = None
        """The task's published ports while prepared with ``publishPorts``
        (:meth:`published` reports them)."""
        self._running: set[asyncio.Task[RunResult]] = set()
        self._gitguard: GitGuard | None = None
        """The watch over repositories inside the worktree that the host's git would enter
        (fusion_oci.policy.gitlinks); None where nothing is isolated."""
        self._profile: dict[str, object] | None = None
        """The egress profile's pin as the prepare event records it (filtered only)."""
        self.linker: StoreLinker | None = None
        """Host-side hard links of node_modules to the shared blob store (fusion_oci.store),
        or None where they cannot be shared safely (``store_links`` in the prepare event)."""

    def _create(self, backend: str) -> Runtime:
        # Every runtime, a plugin's too, gets the audit log and the gate callback.
        return create_runtime(
            backend,
            self.settings,
            self.env,
            cache_root=self.cache_root,
            host=self.host,
            audit=self.audit,
            ask=self.ask,
        )

    def _event(self, kind: type[SandboxEvent], **fields: Any) -> None:
        ctx = self.ctx
        assert ctx is not None
        self.audit.emit(
            kind(
                task_id=ctx.task_id,
                run_id=ctx.run_id,
                backend=self.runtime.id if self.runtime else self.settings.backend,
                policy_hash=ctx.policy.digest(),
                policy_summary=ctx.policy.summary(),
                **fields,
            )
        )

    def _check(self, runtime: Runtime, task: ResolvedTask) -> None:
        """The one check, against the task spec (the spec is the contract): a part it asks
        for that the runtime does not enforce is refused. A runtime that does not isolate
        (native) lists what it leaves out instead."""
        missing = runtime.check(task)
        if task.spec.service_containers and not runtime.runs_services:
            wanted = services_missing(True, runtime.isolates, self.settings, self.env, runtime.id)
            missing = sorted([*missing, *wanted])
        if not runtime.isolates:
            self.unenforced = missing
            return
        if missing:
            raise PolicyNotEnforceableError(runtime.id, missing)

    def _resolve(
        self,
        runtime: Runtime,
        ctx: PrepareContext,
        *,
        create: bool,
        checked: ResolvedTask | None = None,
    ) -> ResolvedTask:
        """The one resolve step, for the chosen runtime's default image (``checked``: the
        dry resolve the check read, whose spec is kept where nothing changed)."""
        assert self.host is not None
        return resolve_for(
            runtime,
            self.settings,
            ctx,
            self.host,
            env=self.env,
            cache_root=self.cache_root,
            create=create,
            checked=checked,
        )

    async def _start(self, backend: str, ctx: PrepareContext) -> Runtime:
        if self.host is None:
            self.host = probe_host()  # once per sandbox; the runtime gets the same facts
        runtime = self._create(backend)
        self.runtime = runtime
        try:
            availability = runtime.availability()
            if not availability.available:
                raise RuntimeUnavailableError(runtime.id, availability.reason, availability.hint)
            # Before anything is made (a cache folder, an image provisioned): what the task
            # spec asks for, resolved without creating anything.
            checked = self._resolve(runtime, ctx, create=False)
            self._check(runtime, checked)
            resolved = self._resolve(runtime, ctx, create=True, checked=checked)
            if self.settings.credentials or resolved.network is NetworkMode.FILTERED:
                # Before a token or the task's CA key is in this process: no core of it, no
                # /proc/PID/mem of it for the caller's other processes (issue #31).
                harden_owner()
            broker = await self._broker(resolved)
            if resolved.network is NetworkMode.FILTERED:
                # Before prepare: the runtime binds the proxy's socket into the sandbox.
                # landlock has no network namespace and reaches it over host TCP instead.
                self.egress, profile = await start_task_proxy(
                    ctx,
                    self.env,
                    audit=self.audit,
                    backend=runtime.id,
                    tcp=runtime.egress_via_tcp,
                    broker=broker,
                )
                self._profile = profile.audit()
                resolved = resolved.with_egress(self.egress)
                if broker is not None:
                    resolved = resolved.with_layout(
                        credential_layout(
                            resolved.layout,
                            resolved.host.ca_bundle,
                            broker,
                            self.egress.unix_socket.parent,
                        )
                    )
            if resolved.spec.service_containers and runtime.isolates and not runtime.runs_services:
                # Before the relays: each service's relay connects into its container.
                self.sidecars = TaskServices(
                    list(ctx.policy.services),
                    task_id=ctx.task_id,
                    run_id=ctx.run_id,
                    settings=self.settings,
                    env=self.env,
                    audit=self.audit,
                    ask=self.ask,
                    prefer=runtime.id,
                )
                await self.sidecars.start()
                # Their names on the task's own 127.0.0.1 (the runtimes with a mount
                # namespace bind it at /etc/hosts; landlock keeps the host's).
                hosts = self.sidecars.write_hosts(resolved.spec.hostname or "localhost")
                resolved = resolved.with_layout(replace(resolved.layout, hosts_file=hosts))
            # A runtime that runs the services beside the task serves their endpoints itself.
            endpoints = [] if runtime.runs_services else ctx.policy.service_endpoints()
            grants = [*ctx.policy.grants(), *((e, False) for e in endpoints)]
            if grants and runtime.isolates:
                # Before prepare too: the runtime binds the relays' sockets into the sandbox
                # (landlock's connect supervisor redirects to their host listeners).
                self.services = await start_relays(
                    task_id=ctx.task_id,
                    grants=grants,
                    upstreams=self.sidecars.upstreams() if self.sidecars else None,
                    audit=self.audit,
                    tcp=runtime.egress_via_tcp,
                    backend=runtime.id,
                    policy_hash=ctx.policy.digest(),
                    run_id=ctx.run_id,
                )
                resolved = resolved.with_services(self.services)
            if resolved.spec.published_ports and runtime.isolates:
                # Listening before the sandbox exists: a named host port that is taken fails
                # prepare before anything starts; the runtime binds each port's relay into the
                # sandbox, whose agent takes it before any command runs.
                self.ports = await bind_ports(
                    task_id=ctx.task_id,
                    entries=list(resolved.spec.published_ports),
                    audit=self.audit,
                    backend=runtime.id,
                    policy_hash=ctx.policy.digest(),
                    run_id=ctx.run_id,
                )
                resolved = resolved.with_ports(self.ports)
            self.task = await runtime.prepare(resolved)
            if self.ports is not None:
                await attach_ports(self.ports)
        except BaseException:
            self.runtime = None
            self.task = None
            with contextlib.suppress(Exception):
                await asyncio.shield(runtime.dispose())
            with contextlib.suppress(Exception):
                await asyncio.shield(self._stop_egress())
            raise
        return runtime

    async def _broker(self, resolved: ResolvedTask) -> Broker | None:
        """The task's brokered credentials (``sandbox.credentials``), read on the host."""
        if not self.settings.credentials:
            return None
        if resolved.network is not NetworkMode.FILTERED:
            raise SettingsError(
                "settings error at sandbox.credentials",
                f"credentials are brokered by the egress proxy, and the network is "
                f"'{resolved.network.value}'",
                "set sandbox.policy.network: filtered (and allow the credentials' hosts)",
            )
        return await make_broker(self.settings.credentials, self.env)

    def published(self) -> list[dict[str, Any]]:
        """The task's published ports while prepared: ``port`` (inside), ``hostPort`` (the
        named or chosen one), ``address``, ``url``; empty: none."""
        return self.ports.report() if self.ports is not None else []

    async def _stop_ports(self) -> None:
        ports, self.ports = self.ports, None
        if ports is not None:
            await stop_ports(ports)

    async def _stop_egress(self) -> None:
        await self._stop_ports()
        proxy, self.egress = self.egress, None
        relays, self.services = self.services, None
        sidecars, self.sidecars = self.sidecars, None
        try:
            if proxy is not None:
                await stop_task_proxy(proxy)
        finally:
            try:
                if relays is not None:
                    await stop_relays(relays)
            finally:
                # After the relays: no connection into a container outlives it.
                if sidecars is not None:
                    await sidecars.stop()

    async def prepare(self, ctx: PrepareContext) -> None:
        """Check the inputs, choose and check the runtime, prepare it (the failure mode
        applies to an unavailable backend or an unenforceable policy only)."""
        self.ctx = ctx
        start = time.monotonic()
        try:
            check_inputs(ctx, self.settings.host_ca, self.env)
        except FusionOCIError as exc:
            self._event(FailureEvent, reason=exc.render(), details={"kind": exc.kind})
            raise
        await asyncio.to_thread(gc_scratch)  # what a kill -9'd owner left in the temp dir
        try:
            runtime = await self._start(self.settings.backend, ctx)
        except (RuntimeUnavailableError, PolicyNotEnforceableError) as exc:
            unenforced = getattr(exc, "unenforced", None)
            self._event(
                FailureEvent,
                reason=exc.render(),
                unenforced=unenforced,
                details={"kind": exc.kind},
            )
            if self.settings.failure_mode != "fallback-native" or self.settings.backend == "native":
                raise
            self.fell_back = True
            runtime = await self._start("native", ctx)
            self._event(
                FallbackEvent,
                reason=exc.render(),
                fell_back=True,
                unenforced=self.unenforced or None,
                details={"from": self.settings.backend, "kind": exc.kind},
            )
        except FusionOCIError as exc:
            self._event(FailureEvent, reason=exc.render(), details={"kind": exc.kind})
            raise
        assert self.task is not None
        if runtime.isolates and self.task.layout.unprotected:
            # Listed, not refused: protecting a path that does not exist would leave a mount
            # point behind in the worktree.
            self.unenforced = self.task.unprotected()
        self.linker, links = task_linker(
            # a remote sandbox (kubernetes) has no view of the host's store or worktree files
            blobs=self.task.layout.blobs if runtime.shares_host_files else None,
            host_uid=os.getuid(),
            isolating=runtime.capabilities().filesystem_isolation != "none",
            worktree=Path(self.task.layout.worktree),
            # A tree is shared like the pnpm store it stands for: per project with
            # ``cacheMode: shared``, never from another task with ``isolated``.
            tree_context=(
                f"{runtime.id}\0{self.task.image or ''}"
                if self.task.cache_mode is CacheMode.SHARED
                else None
            ),
        )
        if runtime.isolates and self.task.layout.git is not None:
            self._gitguard = GitGuard(
                Path(self.task.layout.worktree),
                self.task.layout.git,
                task_project(ctx) / ".fusion" / QUARANTINE_DIR,
                self.env,
            )
            await self._gitguard.prepare()
        details: dict[str, Any] = {"store_links": "on" if links.ok else links.reason}
        if self._profile is not None:
            details["egress_profile"] = self._profile
        if self.sidecars is not None:
            details["services"] = [one.audit() for one in self.sidecars.started]
        elif runtime.services_started:
            details["services"] = [dict(one) for one in runtime.services_started]
        if self.ports is not None:
            details["published"] = self.ports.report()
        if self.linker is not None:
            details["store_tree"] = (await asyncio.to_thread(self.linker.place)).audit()
        self._event(
            PrepareEvent,
            details=details,
            duration_ms=int((time.monotonic() - start) * 1000),
            fell_back=self.fell_back,
            unenforced=self.unenforced or None,
            env_names=sorted(ctx.policy.env_allowlist) or None,
        )

    def abort(self) -> None:
        """End every command this sandbox is running (each ``run`` returns an aborted
        result). Safe to call at any time; use :meth:`SyncSandbox.abort` from another thread."""
        for task in list(self._running):
            task.cancel()

    def _aborted(self, shown: str, started: float) -> RunResult:
        duration = int((time.monotonic() - started) * 1000)
        backend = self.runtime.id if self.runtime else self.settings.backend
        self._event(
            RunEvent,
            command=shown[:200],
            duration_ms=duration,
            signal="SIGTERM",
            end_reason="aborted",
            fell_back=self.fell_back,
            unenforced=self.unenforced or None,
        )
        return RunResult(
            stdout="",
            stderr="",
            exit_code=None,
            signal="SIGTERM",
            duration_ms=duration,
            backend=backend,
            fell_back=self.fell_back,
            reason="aborted",
            unenforced=self.unenforced,
        )

    def spec_for(
        self, command: str | Sequence[str], opts: RunOptions | None = None
    ) -> dict[str, Any]:
        """The ``config.json`` :meth:`run` would launch for ``command`` (the one compile
        step)."""
        if self.task is None:
            raise SandboxSetupError(
                "sandbox was not prepared", "run() came before prepare()", "call prepare(ctx) first"
            )
        return compile_spec(self.task, command, opts or RunOptions()).to_oci()

    async def run(self, command: str | Sequence[str], opts: RunOptions | None = None) -> RunResult:
        if self.runtime is None or self.ctx is None or self.task is None:
            raise SandboxSetupError(
                "sandbox was not prepared", "run() came before prepare()", "call prepare(ctx) first"
            )
        runtime, task_ = self.runtime, self.task
        opts = opts or RunOptions()
        shown = command if isinstance(command, str) else " ".join(command)
        # Replay records go beside a persistent audit log (fusion_oci.replay); the worktree's
        # state is read before the command can change it.
        recording = self.audit.path is not None
        state = (
            await asyncio.to_thread(worktree_state, Path(self.ctx.worktree_path))
            if recording
            else None
        )
        hashers: dict[str, Any] | None = None
        if recording and not opts.keep_output:
            # Streamed and not kept (the CLI's pass-through): the record's output digests come
            # from the chunks as they pass, not from the (empty) result.
            hashers = {"stdout": hashlib.sha256(), "stderr": hashlib.sha256()}
            inner = opts.on_output

            def tee(stream: OutputStream, chunk: bytes) -> Awaitable[None] | None:
                hashers[stream].update(chunk)
                return inner(stream, chunk) if inner is not None else None

            opts = opts.model_copy(update={"on_output": tee})
        if isinstance(opts.stdin, StdinStream) and not self.runtime.streams_stdin:
            # This runtime takes stdin as one value (containers: an env var): read it all.
            opts = opts.model_copy(update={"stdin": await opts.stdin.read_all()})
        placed = None
        if self.linker is not None and self.linker.wants_placement():
            # node_modules went since prepare (``rm -rf node_modules``, then an install):
            # placed again, as at prepare, before the command that will install.
            placed = await asyncio.to_thread(self.linker.place)
        started = time.monotonic()
        try:
            # compile -> plan; execute runs that plan (plan == what runs).
            process = task_.process(command, opts)
            plan = runtime.plan(process)
        except SandboxSetupError as exc:
            self._event(
                FailureEvent,
                reason=exc.render(),
                command=shown[:200],
                unenforced=getattr(exc, "unenforced", None),
                details={"kind": exc.kind},
            )
            raise
        task = asyncio.ensure_future(runtime.execute(plan, opts))
        self._running.add(task)
        try:
            # A cancelled caller cancels the task too; the runtime ends the tree (SIGTERM,
            # grace, SIGKILL) before the task finishes.
            result = await task
        except asyncio.CancelledError:
            # The tree is ended: what it left for the host's git is looked at all the same.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._guard_git())
            aborted = self._aborted(shown, started)
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            return aborted
        except SandboxSetupError as exc:
            self._event(
                FailureEvent,
                reason=exc.render(),
                command=shown[:200],
                details={"kind": exc.kind},
            )
            raise
        finally:
            self._running.discard(task)
        if self.linker is not None:
            # After the command, before its result: the next command (or task) sees links.
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self.linker.after_command)
        quarantined = await self._guard_git()
        note = _quarantine_note(quarantined) if quarantined else ""
        if note and opts.on_output is not None:  # a streamed run: its reader sees it too
            pending = opts.on_output("stderr", note.encode())
            if pending is not None:
                await pending
        result = result.model_copy(
            update={
                "fell_back": self.fell_back,
                "unenforced": self.unenforced,
                "stderr": result.stderr + note,
            }
        )
        replay: dict[str, Any] = {}
        if recording:
            try:
                spec = config_json(task_.spec, process)
                replay = await record_run(
                    runtime,
                    task_,
                    spec,
                    self.ctx,
                    self.settings,
                    command,
                    opts,
                    state,
                    result.stdout,
                    result.stderr,
                )
                if hashers is not None:
                    replay["stdout_digest"] = "sha256:" + hashers["stdout"].hexdigest()
                    replay["stderr_digest"] = "sha256:" + hashers["stderr"].hexdigest()
            except (OSError, FusionOCIError) as exc:
                replay = {"details": {"replay_error": str(exc)}}
        if self.linker is not None and (links := self.linker.last.audit()) is not None:
            replay["details"] = {**replay.get("details", {}), "store_links": links}
        if placed is not None and placed.packages:
            replay["details"] = {**replay.get("details", {}), "store_tree": placed.audit()}
        if quarantined:
            moved = [{"path": what, "to": where} for what, where in quarantined]
            replay["details"] = {**replay.get("details", {}), "git_quarantined": moved}
        self._event(
            RunEvent,
            command=shown[:200],
            duration_ms=result.duration_ms,
            exit_code=result.exit_code,
            signal=result.signal,
            timed_out=result.timed_out,
            end_reason=result.reason,
            fell_back=self.fell_back,
            unenforced=self.unenforced or None,
            **replay,
        )
        return result

    async def _guard_git(self) -> list[tuple[str, str]]:
        """After a command: repositories the host's git would enter, new or changed, moved to
        the quarantine (fusion_oci.policy.gitlinks)."""
        if self._gitguard is None or self.ctx is None:
            return []
        return await self._gitguard.after_command(self.ctx.run_id)

    async def dispose(self) -> None:
        if self.runtime is None:
            return
        runtime, self.runtime = self.runtime, None
        self.task = None
        start = time.monotonic()
        try:
            await self._stop_ports()  # before the sandbox: no connection comes in meanwhile
            await runtime.dispose()
        finally:
            await self._stop_egress()  # after the sandbox: nothing is left to connect
        if self.ctx is not None:
            self.runtime = runtime  # for the event's backend id
            self._event(DisposeEvent, duration_ms=int((time.monotonic() - start) * 1000))
            self.runtime = None

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.shield(self.dispose())


_T = TypeVar("_T")


class SyncSandbox:
    """The synchronous facade: the same lifecycle on a private event loop, which runs in a
    thread of its own for the sandbox's life, not only during a call: what a task serves
    between commands keeps being served (a published port carried by its runtime, a pod's
    stream kept alive). Each call waits for its coroutine there; a KeyboardInterrupt while
    waiting cancels it (a running command's tree is ended, as for a cancelled ``run``)."""

    def __init__(self, settings: SandboxSettings, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="fusion-oci-sandbox", daemon=True
        )
        self._thread.start()
        self.sandbox = Sandbox(settings, **kwargs)

    def _call(self, coro: Awaitable[_T]) -> _T:
        async def on_loop() -> _T:
            return await coro

        with self._lock:
            if self._loop.is_closed():
                if asyncio.iscoroutine(coro):
                    coro.close()  # never started: no "never awaited" warning
                raise RuntimeError("this SyncSandbox is disposed")
            future = asyncio.run_coroutine_threadsafe(on_loop(), self._loop)
        try:
            return future.result()
        except BaseException:
            if not future.done():  # interrupted here: the coroutine ends as a cancelled one
                future.cancel()
                with contextlib.suppress(BaseException):
                    future.result(timeout=60)
            raise

    def prepare(self, ctx: PrepareContext) -> None:
        self._call(self.sandbox.prepare(ctx))

    def run(self, command: str | Sequence[str], opts: RunOptions | None = None) -> RunResult:
        return self._call(self.sandbox.run(command, opts))

    def abort(self) -> None:
        """From any thread: end the running command (its ``run`` returns reason aborted)."""
        with self._lock:
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self.sandbox.abort)

    def dispose(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.sandbox.dispose())
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        """Cancel what is left on the loop (as ``asyncio.run`` does), then stop and close it."""

        async def finish() -> None:
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
            await self._loop.shutdown_asyncgens()
            await self._loop.shutdown_default_executor()

        with contextlib.suppress(BaseException):
            asyncio.run_coroutine_threadsafe(finish(), self._loop).result(timeout=60)
        with self._lock:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=60)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> SyncSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.dispose()


def _quarantine_note(moved: list[tuple[str, str]]) -> str:
    lines = [
        f"fusion-oci: moved {what} to {where}: a git repository the host's git would enter "
        "(its config and hooks run outside the sandbox) was made or changed by this command"
        for what, where in moved
    ]
    return "\n" + "\n".join(lines) + "\n"
