"""The lifecycle an executor uses: pick the runtime, check it, apply the failure mode, run, audit.

Failure mode (brief 4.4): an unavailable backend with ``fallback-native`` is audited as
``sandbox:fallback`` and the command runs natively; with ``fail-hard`` it is a
:class:`RuntimeUnavailableError`. A policy part the chosen runtime cannot enforce is refused
(:class:`PolicyNotEnforceableError`), except on native, chosen or fallen back to, where each
unenforced part is listed in the audit and in the result.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.errors import (
    PolicyNotEnforceableError,
    RuntimeUnavailableError,
    SandboxSetupError,
)
from fusion_oci.models import PrepareContext, RunOptions, RunResult
from fusion_oci.oci.host import HostInfo
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.base import Runtime, SpecRuntime, requirements
from fusion_oci.runtimes.registry import create_runtime

if TYPE_CHECKING:
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
        self.fell_back = False
        self.unenforced: list[str] = []

    def _create(self, backend: str) -> Runtime:
        runtime = create_runtime(backend, self.settings, self.env,
                                 cache_root=self.cache_root, host=self.host)
        if isinstance(runtime, SpecRuntime):
            runtime.audit = self.audit
            runtime.ask = self.ask
        return runtime

    def _event(self, type_: Any, **fields: Any) -> None:
        ctx = self.ctx
        assert ctx is not None
        self.audit.emit(AuditEvent(
            type=type_,
            task_id=ctx.task_id,
            run_id=ctx.run_id,
            backend=self.runtime.id if self.runtime else self.settings.backend,
            policy_hash=ctx.policy.digest(),
            policy_summary=ctx.policy.summary(),
            **fields,
        ))

    async def _fallback_or_raise(self, error: SandboxSetupError) -> Runtime:
        self._event("sandbox:failure", reason=error.render())
        if self.settings.failure_mode != "fallback-native" or self.settings.backend == "native":
            raise error
        self.fell_back = True
        native = self._create("native")
        self.runtime = native
        self._event("sandbox:fallback", reason=error.render(), fell_back=True,
                    details={"from": self.settings.backend})
        return native

    def _check(self, runtime: Runtime, ctx: PrepareContext) -> None:
        missing = sorted(r.value for r in requirements(ctx.policy) - runtime.enforces())
        if runtime.id == "native":
            self.unenforced = missing
            return
        if missing:
            raise PolicyNotEnforceableError(runtime.id, missing)

    async def prepare(self, ctx: PrepareContext) -> None:
        """Choose and check the runtime, then prepare it (the failure mode applies)."""
        self.ctx = ctx
        start = time.monotonic()
        runtime = self._create(self.settings.backend)
        self.runtime = runtime
        try:
            availability = runtime.availability()
            if not availability.available:
                raise RuntimeUnavailableError(runtime.id, availability.reason, availability.hint)
            self._check(runtime, ctx)
            await runtime.prepare(ctx)
        except PolicyNotEnforceableError as exc:
            self._event("sandbox:failure", reason=exc.render(), unenforced=exc.unenforced)
            self.runtime = None
            raise
        except SandboxSetupError as exc:
            await runtime.dispose()
            try:
                runtime = await self._fallback_or_raise(exc)
                self._check(runtime, ctx)
                await runtime.prepare(ctx)
            except BaseException:
                self.runtime = None
                raise
        self._event(
            "sandbox:prepare",
            duration_ms=int((time.monotonic() - start) * 1000),
            fell_back=self.fell_back,
            unenforced=self.unenforced or None,
            env_names=sorted(ctx.policy.env_allowlist) or None,
        )

    async def run(self, command: str | Sequence[str], opts: RunOptions | None = None) -> RunResult:
        if self.runtime is None or self.ctx is None:
            raise SandboxSetupError("sandbox was not prepared", "run() came before prepare()",
                                    "call prepare(ctx) first")
        opts = opts or RunOptions()
        shown = command if isinstance(command, str) else " ".join(command)
        try:
            result = await self.runtime.run(command, opts)
        except SandboxSetupError as exc:
            self._event("sandbox:failure", reason=exc.render(), command=shown[:200])
            raise
        result = result.model_copy(update={
            "fell_back": self.fell_back,
            "unenforced": self.unenforced,
        })
        self._event(
            "sandbox:run",
            command=shown[:200],
            duration_ms=result.duration_ms,
            exit_code=result.exit_code,
            signal=result.signal,
            timed_out=result.timed_out,
            end_reason=result.reason,
            fell_back=self.fell_back,
            unenforced=self.unenforced or None,
        )
        return result

    async def dispose(self) -> None:
        if self.runtime is None:
            return
        runtime, self.runtime = self.runtime, None
        start = time.monotonic()
        await runtime.dispose()
        if self.ctx is not None:
            self.runtime = runtime  # for the event's backend id
            self._event("sandbox:dispose", duration_ms=int((time.monotonic() - start) * 1000))
            self.runtime = None

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await asyncio.shield(self.dispose())


class SyncSandbox:
    """The synchronous facade: the same lifecycle on a private event loop."""

    def __init__(self, settings: SandboxSettings, **kwargs: Any) -> None:
        self._runner = asyncio.Runner()
        self.sandbox = Sandbox(settings, **kwargs)

    def prepare(self, ctx: PrepareContext) -> None:
        self._runner.run(self.sandbox.prepare(ctx))

    def run(self, command: str | Sequence[str], opts: RunOptions | None = None) -> RunResult:
        return self._runner.run(self.sandbox.run(command, opts))

    def dispose(self) -> None:
        try:
            self._runner.run(self.sandbox.dispose())
        finally:
            self._runner.close()

    def __enter__(self) -> SyncSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.dispose()
