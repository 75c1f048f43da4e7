"""The server's methods: one :class:`Session` per client, holding its sandboxes and runs.

Everything a session started ends with it: :meth:`Session.close` cancels every run (which ends
each process tree, as cancelling ``Sandbox.run`` does) and disposes every sandbox.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from fusion_oci import __version__
from fusion_oci.errors import FlagError, error_body
from fusion_oci.models import (
    BackendId,
    FailureMode,
    Model,
    OutputStream,
    RunOptions,
    RunResult,
)
from fusion_oci.server.rpc import INVALID_PARAMS, Connection, Handler, Params, RequestId, RpcError

if TYPE_CHECKING:
    from fusion_oci.policy.settings import Layer

PROTOCOL_VERSION = "1.0"
"""major.minor: a client refuses a server of another major version (docs/protocol.md)."""


class ContextParams(Model):
    """The brief's SandboxPrepareContext."""

    task_id: str
    run_id: str
    worktree_path: str
    policy: dict[str, Any] | None = None
    """The brief's SandboxPolicy: the top settings layer for the policy. None: the settings'."""
    unsafe_worktree: bool = False
    """True: accept a worktree that is not the top of a git work tree (or is / or $HOME)."""


class PrepareParams(Model):
    context: ContextParams
    sandbox_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """The client's name for the sandbox (an ``ask`` during prepare carries it). None: the
    server picks one."""
    project_dir: str | None = None
    """Where .fusion/settings.yaml is read from. None: found from the worktree, as the CLI."""
    task_prompt: str | None = None
    """The task prompt text (its ``**Sandbox:** X`` line picks the backend)."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Inline settings (the ``sandbox:`` mapping), above the files, below the task prompt."""
    backend: BackendId | None = None
    failure_mode: FailureMode | None = None
    ask: bool = False
    """True: the client answers ``ask`` gates (server -> client ``ask`` requests)."""
    env: dict[str, str] | None = None
    """The environment the policy's envAllowlist draws from. None: the server's."""


class RunParamOptions(Model):
    cwd: str | None = None
    timeout_ms: int | None = Field(default=None, gt=0)
    max_buffer: int | None = Field(default=None, gt=0)
    env: dict[str, str] | None = None
    stdin: str | None = None
    """Base64 of the bytes fed to stdin. None: stdin is closed."""
    stream: bool = True
    """False: no ``output`` notifications, only the result."""


class RunParams(Model):
    sandbox_id: str
    command: str | list[str]
    exec_id: str | None = None
    """The client's name for this run: ``output`` notifications carry it, ``cancel`` takes it.
    None: the request id."""
    options: RunParamOptions = Field(default_factory=RunParamOptions)


class _Kept:
    """What the server keeps of a run's output, for the result of an aborted run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: dict[OutputStream, list[bytes]] = {"stdout": [], "stderr": []}
        self.sizes: dict[OutputStream, int] = {"stdout": 0, "stderr": 0}

    def add(self, stream: OutputStream, chunk: bytes) -> None:
        room = self.limit - self.sizes[stream]
        if room > 0:
            self.parts[stream].append(chunk[:room])
            self.sizes[stream] += min(room, len(chunk))

    def text(self, stream: OutputStream) -> str:
        return b"".join(self.parts[stream]).decode("utf-8", errors="replace")


def _camel_result(result: RunResult) -> dict[str, Any]:
    return result.model_dump(mode="json", by_alias=True)


class Session:
    """One client's sandboxes and runs."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        from fusion_oci.sandbox import Sandbox

        self.env = dict(os.environ if env is None else env)
        self.sandboxes: dict[str, Sandbox] = {}
        self.runs: dict[str, asyncio.Task[RunResult]] = {}
        self.run_sandbox: dict[str, str] = {}
        """execId -> the sandboxId it runs in (dispose ends that sandbox's runs first)."""
        self.run_of_request: dict[str, str] = {}
        """JSON-RPC request id -> execId, for ``$/cancelRequest``."""
        self._ids = itertools.count(1)
        self.conn: Connection | None = None

    def handlers(self) -> dict[str, Handler]:
        return {
            "initialize": self.initialize,
            "prepare": self.prepare,
            "run": self.run,
            "cancel": self.cancel,
            "dispose": self.dispose,
            "doctor": self.doctor,
            "capabilities": self.capabilities,
            "$/cancelRequest": self.cancel_request,
        }

    async def initialize(self, params: Params, rid: RequestId | None) -> Any:
        return {
            "protocolVersion": PROTOCOL_VERSION,
            "serverVersion": __version__,
            "pid": os.getpid(),
        }

    # --- prepare ------------------------------------------------------------------------

    async def prepare(self, params: Params, rid: RequestId | None) -> Any:
        from fusion_oci.audit import AuditLog, default_audit_path
        from fusion_oci.caller import TaskRequest, front_door
        from fusion_oci.images.gates import GateRequest
        from fusion_oci.policy.settings import Layer
        from fusion_oci.sandbox import Sandbox

        p = PrepareParams.model_validate(params)
        env = dict(self.env if p.env is None else p.env)
        entry = front_door(
            TaskRequest(
                worktree=_worktree(p.context.worktree_path),
                task_id=p.context.task_id,
                run_id=p.context.run_id,
                env=env,
                context_error=_context_error,
                unsafe_worktree=p.context.unsafe_worktree,
                project_dir=Path(p.project_dir) if p.project_dir else None,
                prompt=lambda: p.task_prompt,
                layers=_client_layers(p),
                top=(
                    Layer("prepare context", {"policy": p.context.policy})
                    if p.context.policy
                    else None
                ),
            )
        )
        settings, ctx, project = entry.effective.settings, entry.ctx, entry.project_dir
        sandbox_id = p.sandbox_id or f"sb{next(self._ids)}"
        if sandbox_id in self.sandboxes:
            raise FlagError(
                f"sandboxId '{sandbox_id}'",
                "it is already in use",
                "give each sandbox its own id, or leave it out",
            )

        async def ask(request: GateRequest) -> bool:
            assert self.conn is not None
            try:
                answer = await self.conn.request(
                    "ask",
                    {
                        "sandboxId": sandbox_id,
                        "gate": request.gate,
                        "action": request.action,
                        "target": request.target,
                        "backend": request.backend,
                        "reason": request.reason,
                        "question": request.question(),
                    },
                )
            except (RpcError, ConnectionError):
                return False
            return bool(answer.get("allow")) if isinstance(answer, dict) else bool(answer)

        audit = AuditLog(default_audit_path(project))
        from fusion_oci.otel import attach_from_env

        attach_from_env(audit, os.environ)  # OpenTelemetry, when the server's OTEL_* asks
        sandbox = Sandbox(settings, audit=audit, env=env, ask=ask if p.ask else None)
        self.sandboxes[sandbox_id] = sandbox
        try:
            await sandbox.prepare(ctx)
        except BaseException:
            self.sandboxes.pop(sandbox_id, None)
            await asyncio.shield(sandbox.dispose())
            raise
        runtime = sandbox.runtime
        assert runtime is not None
        return {
            "sandboxId": sandbox_id,
            "backend": runtime.id,
            "fellBack": sandbox.fell_back,
            "unenforced": sandbox.unenforced,
            "capabilities": runtime.capabilities().model_dump(by_alias=True),
            # publishPorts: where each is reachable on the host (a free port chosen now).
            "published": sandbox.published(),
        }

    # --- run, cancel --------------------------------------------------------------------

    async def run(self, params: Params, rid: RequestId | None) -> Any:
        p = RunParams.model_validate(params)
        sandbox = self._sandbox(p.sandbox_id)
        exec_id = p.exec_id or str(rid)
        if exec_id in self.runs:
            raise RpcError(
                INVALID_PARAMS,
                f"execId '{exec_id}' is already running",
                error_body(
                    "bad-flags",
                    f"execId '{exec_id}' is in use",
                    hint="give each run its own execId",
                ),
            )
        o = p.options
        fields: dict[str, Any] = {"cwd": o.cwd, "env": o.env if o.env is not None else None}
        if o.timeout_ms is not None:
            fields["timeout_ms"] = o.timeout_ms
        if o.max_buffer is not None:
            fields["max_buffer"] = o.max_buffer
        if o.stdin is not None:
            try:
                fields["stdin"] = base64.b64decode(o.stdin, validate=True)
            except ValueError:
                raise FlagError(
                    "options.stdin", "it is not base64", "send stdin's bytes base64-encoded"
                ) from None
        probe = RunOptions(**fields)
        kept = _Kept(probe.max_buffer)
        conn = self.conn

        def on_output(stream: OutputStream, chunk: bytes) -> asyncio.Future[None] | None:
            kept.add(stream, chunk)
            if o.stream and conn is not None:
                conn.notify(
                    "output",
                    {"execId": exec_id, "stream": stream, "data": base64.b64encode(chunk).decode()},
                )
                return conn.writer.behind()  # a slow client: read no more until it catches up
            return None

        opts = probe.model_copy(update={"on_output": on_output})
        start = time.monotonic()
        task = asyncio.ensure_future(sandbox.run(p.command, opts))
        self.runs[exec_id] = task
        self.run_sandbox[exec_id] = p.sandbox_id
        if rid is not None:
            self.run_of_request[str(rid)] = exec_id
        try:
            result = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the session is closing (or the request was cancelled): no result
            # `cancel`: the runtime has ended the tree (and the sandbox audited the abort).
            runtime = sandbox.runtime
            result = RunResult(
                stdout=kept.text("stdout"),
                stderr=kept.text("stderr"),
                exit_code=None,
                signal="SIGTERM",
                duration_ms=int((time.monotonic() - start) * 1000),
                backend=runtime.id if runtime else "native",
                fell_back=sandbox.fell_back,
                reason="aborted",
                unenforced=sandbox.unenforced,
            )
        finally:
            self.runs.pop(exec_id, None)
            self.run_sandbox.pop(exec_id, None)
            if rid is not None:
                self.run_of_request.pop(str(rid), None)
        return _camel_result(result)

    async def cancel(self, params: Params, rid: RequestId | None) -> Any:
        exec_id = params.get("execId")
        if not isinstance(exec_id, str):
            raise FlagError("execId", "missing or not a string", "pass the run's execId")
        task = self.runs.get(exec_id)
        if task is None or task.done():
            return {"cancelled": False}
        task.cancel()
        return {"cancelled": True}

    async def cancel_request(self, params: Params, rid: RequestId | None) -> Any:
        """vscode-jsonrpc's cancellation: ``$/cancelRequest {id}`` aborts that run."""
        target = params.get("id")
        if isinstance(target, (int, str)) and not isinstance(target, bool):
            exec_id = self.run_of_request.get(str(target))
            task = self.runs.get(exec_id) if exec_id is not None else None
            if task is not None:
                task.cancel()
        return None

    # --- dispose, doctor, capabilities --------------------------------------------------

    async def dispose(self, params: Params, rid: RequestId | None) -> Any:
        sandbox_id = params.get("sandboxId")
        if not isinstance(sandbox_id, str):
            raise FlagError("sandboxId", "missing or not a string", "pass prepare's sandboxId")
        sandbox = self.sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            return {"disposed": False}
        runs = [t for e, t in self.runs.items() if self.run_sandbox.get(e) == sandbox_id]
        for task in runs:
            task.cancel()
        if runs:
            await asyncio.gather(*runs, return_exceptions=True)
        await asyncio.shield(sandbox.dispose())
        return {"disposed": True}

    async def doctor(self, params: Params, rid: RequestId | None) -> Any:
        from fusion_oci.doctor import backend_rows

        return {"backends": await asyncio.to_thread(backend_rows, self.env)}

    async def capabilities(self, params: Params, rid: RequestId | None) -> Any:
        from fusion_oci.policy.settings import SandboxSettings
        from fusion_oci.runtimes.registry import create_runtime

        sandbox_id = params.get("sandboxId")
        if isinstance(sandbox_id, str):
            runtime = self._sandbox(sandbox_id).runtime
            assert runtime is not None
        else:
            backend = params.get("backend", "native")
            try:
                settings = SandboxSettings.model_validate({"backend": backend})
            except ValueError:
                raise FlagError(
                    f"backend {backend!r}", "not a known backend id", "see `fusion-oci doctor`"
                ) from None
            runtime = create_runtime(settings.backend, settings, self.env)
        return {"backend": runtime.id, **runtime.capabilities().model_dump(by_alias=True)}

    def _sandbox(self, sandbox_id: str) -> Any:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None or sandbox.runtime is None:
            raise RpcError(
                INVALID_PARAMS,
                f"no sandbox '{sandbox_id}'",
                error_body(
                    "bad-flags",
                    f"no sandbox '{sandbox_id}'",
                    "it was never prepared here, or it was disposed",
                    "call prepare first and use the sandboxId it returned",
                ),
            )
        return sandbox

    async def close(self) -> None:
        """The client has gone: end every run (and its tree), dispose every sandbox."""
        runs = list(self.runs.values())
        for task in runs:
            task.cancel()
        if runs:
            await asyncio.gather(*runs, return_exceptions=True)
        sandboxes, self.sandboxes = list(self.sandboxes.values()), {}
        if sandboxes:
            await asyncio.gather(*(s.dispose() for s in sandboxes), return_exceptions=True)


def _worktree(path: str) -> Path:
    worktree = Path(path)
    if not worktree.is_absolute() or not worktree.is_dir():
        raise FlagError(
            f"context.worktreePath {worktree}",
            "it is not an existing absolute directory",
            "pass the task's worktree as an absolute path",
        )
    return worktree


def _client_layers(p: PrepareParams) -> list[Layer]:
    """The client's settings: above the files, below the task prompt."""
    from fusion_oci.policy.settings import Layer

    client: dict[str, Any] = dict(p.settings)
    if p.backend is not None:
        client["backend"] = p.backend
    if p.failure_mode is not None:
        client["failureMode"] = p.failure_mode
    return [Layer("client settings", client)] if client else []


def _context_error(exc: ValueError) -> FlagError:
    """An id or path of the context: the caller's argument."""
    return FlagError(
        "prepare context",
        str(exc).splitlines()[-1].strip(),
        "see docs/protocol.md, method prepare",
    )
