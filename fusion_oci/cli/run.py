"""``fusion-oci run``: one command in the sandbox, its output passed through as it comes.

The run itself (:func:`execute`) is shared by the in-process CLI and the per-user resident
server (``fusion_oci.server.resident``), which the fast front end (``fusion_oci.cli.fast``)
talks to: both resolve the same settings from the caller's cwd and environment, print the same
notes and errors, and end with the same exit status. Only where the bytes go differs (a
:class:`RunIO`).
"""

from __future__ import annotations

import contextvars
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Protocol

import typer

from fusion_oci.cli.options import (
    AllowPath,
    AsJson,
    Backend,
    CacheMode,
    Command,
    Cpus,
    CpuTime,
    EnvName,
    FailureMode,
    HostCa,
    Image,
    MaxBuffer,
    MemoryMb,
    Network,
    Pids,
    ProjectDir,
    RunId,
    TaskId,
    TaskPrompt,
    TimeoutMs,
    UnsafeWorktree,
    Worktree,
    WritablePath,
    _command,
    _flags,
)

if TYPE_CHECKING:
    from fusion_oci.cli.task import TaskFlags
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.images.gates import AskCallback
    from fusion_oci.models import RunResult
    from fusion_oci.stdin import StdinStream


@dataclass
class RunRequest:
    """`run`'s flags, parsed (by the typer command, in this process or in the server)."""

    command: list[str]
    flags: TaskFlags
    allow_provision: bool = False
    audit_log: Path | None = None
    interactive: bool = False
    tty: bool = False
    as_json: bool = False


class RunIO(Protocol):
    """Where a run's output, notes and questions go."""

    stdout_tty: bool
    terminal_size: tuple[int, int] | None
    """(columns, lines) of the caller's terminal; None: not a terminal."""

    def write(self, stream: str, chunk: bytes) -> bool | Awaitable[None]:
        """Pass a chunk through; False when stdout's reader has gone (`run ... | head`).
        An awaitable: wait for it before reading more of the command (backpressure)."""

    def echo(self, text: str, err: bool = False) -> None:
        """A line of ours (a note, an error, the --json result)."""

    def ask(self, assume_yes: bool) -> AskCallback:
        """The callback answering `ask` gates."""

    def stdin(self) -> bytes | StdinStream:
        """What -i feeds the command."""


@dataclass
class Control:
    """A run's signals: the first one received decides the exit status (128+N)."""

    received: list[int] = field(default_factory=list)
    on_signal: Callable[[int], None] | None = None

    def signal(self, signum: int) -> None:
        if self.on_signal is not None:
            self.on_signal(signum)
        else:
            self.received.append(signum)


def tty_command(command: list[str], size: tuple[int, int] | None) -> list[str]:
    """COMMAND under `script`, which gives it a pseudo-terminal inside the sandbox (so it works
    on every backend) and exits with its status; the size of our terminal, when we have one."""
    import shlex

    line = command[0] if len(command) == 1 else shlex.join(command)
    if size is not None:
        line = f"stty cols {size[0]} rows {size[1]} 2>/dev/null; {line}"
    return ["script", "-qec", line, "/dev/null"]


def error_lines(exc: Exception, as_json: bool) -> tuple[int, str, bool]:
    """An error as the CLI reports it: (exit status, the line, on stderr?)."""
    from fusion_oci.errors import FusionOCIError

    code = exc.exit_code if isinstance(exc, FusionOCIError) else 125
    if as_json:
        body = exc.to_json() if isinstance(exc, FusionOCIError) else {"error": {
            "kind": "setup-failed", "what": str(exc), "why": "", "hint": "", "unenforced": []}}
        return code, json.dumps(body), False
    return code, f"fusion-oci: {exc}", True


async def execute(req: RunRequest, io: RunIO, environ: dict[str, str], cwd: Path,
                  control: Control) -> int:
    """Resolve the task as the CLI does (from ``cwd`` and ``environ``), run it, report; the
    exit status. Signals arrive through ``control``."""
    import asyncio
    import signal

    from fusion_oci.audit import AuditLog, default_audit_path
    from fusion_oci.cli.task import host_path, resolve_task
    from fusion_oci.errors import FlagError, FusionOCIError
    from fusion_oci.otel import attach_from_env
    from fusion_oci.sandbox import Sandbox

    received = control.received
    main = asyncio.current_task()
    preparing = True
    sandbox: Sandbox | None = None

    def on_signal(signum: int) -> None:
        received.append(signum)
        if preparing and main is not None:
            main.cancel()  # nothing runs yet: stop the prepare, then dispose
        elif sandbox is not None:
            sandbox.abort()

    control.on_signal = on_signal

    def fail(exc: FusionOCIError) -> int:
        code, line, err = error_lines(exc, req.as_json)
        io.echo(line, err)
        return code

    try:
        flags = req.flags
        if req.interactive and flags.task_prompt is not None and str(flags.task_prompt) == "-":
            raise FlagError("--interactive with --task-prompt -", "both read stdin",
                            "pass the task prompt as a file")
        task = resolve_task(flags, environ, cwd=cwd)
        audit_path = (host_path(req.audit_log, cwd, environ) if req.audit_log is not None
                      else default_audit_path(task.project_dir))
        audit = AuditLog(audit_path)
        attach_from_env(audit, environ)  # OpenTelemetry, when OTEL_* asks for it
        opts = task.opts
        if req.interactive:
            opts = opts.model_copy(update={"stdin": io.stdin()})
        sandbox = Sandbox(task.effective.settings, audit=audit, env=environ,
                          ask=io.ask(req.allow_provision))

        def pass_through(stream: str, chunk: bytes) -> Awaitable[None] | None:
            # Like a shell pipeline: the reader of our stdout gone ends the command (SIGPIPE).
            ok = io.write(stream, chunk)
            if ok is False and not received:
                received.append(int(signal.SIGPIPE))
                assert sandbox is not None
                sandbox.abort()
            return None if isinstance(ok, bool) else ok

        run_opts = opts if req.as_json else opts.model_copy(
            update={"on_output": pass_through, "keep_output": False})
        command: str | list[str] = (tty_command(req.command, io.terminal_size) if req.tty
                                    else _command(req.command))
        async with sandbox:
            await sandbox.prepare(task.ctx)
            preparing = False
            if not req.as_json and sandbox.runtime is not None \
                    and sandbox.runtime.id == "native" and not sandbox.fell_back:
                io.echo("fusion-oci: note: the native backend isolates nothing (the command "
                        "runs on the host as you)", err=True)
            result: RunResult = await sandbox.run(command, run_opts)
    except FusionOCIError as exc:
        return fail(exc)
    except (KeyboardInterrupt, asyncio.CancelledError):
        if not received:
            raise
        if main is not None:
            main.uncancel()
        return 128 + received[0]
    if req.as_json:
        io.echo(result.model_dump_json(by_alias=True))
    else:
        if result.timed_out:
            io.echo(f"fusion-oci: timed out after {task.opts.timeout_ms} ms", err=True)
        elif result.reason not in ("exit", "signal") and received != [signal.SIGPIPE]:
            io.echo(f"fusion-oci: command ended: {result.reason}", err=True)
        if result.fell_back:
            io.echo("fusion-oci: fell back to the native runtime (see audit)", err=True)
    if result.reason == "aborted" and received:
        return 128 + received[0]
    return result.shell_status


# --- in this process ------------------------------------------------------------------------


class LocalIO:
    """This process's own stdin, stdout and stderr."""

    def __init__(self) -> None:
        self.stdout_tty = sys.stdout.isatty()
        self.terminal_size: tuple[int, int] | None = None
        if self.stdout_tty:
            import os

            size = os.get_terminal_size(sys.stdout.fileno())
            self.terminal_size = (size.columns, size.lines)

    def write(self, stream: str, chunk: bytes) -> bool:
        """`run` without --json: the command's bytes as they come, in order, like `docker
        run`. False when our stdout's reader has gone (`run ... | head`)."""
        out = sys.stdout if stream == "stdout" else sys.stderr
        try:
            out.buffer.write(chunk)
            out.buffer.flush()
        except BrokenPipeError:
            if stream != "stdout":
                return True
            import os

            # Nothing more can be said there; point fd 1 at /dev/null so exiting is quiet.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return False
        return True

    def echo(self, text: str, err: bool = False) -> None:
        typer.echo(text, err=err)

    def ask(self, assume_yes: bool) -> AskCallback:
        from fusion_oci.images.gates import tty_ask

        return tty_ask(assume_yes=assume_yes)

    def stdin(self) -> bytes | StdinStream:
        from fusion_oci.stdin import StdinStream

        if sys.stdin is None:  # started with fd 0 closed: nothing to feed
            return b""
        return StdinStream.from_fd(sys.stdin.fileno())


def run_here(req: RunRequest) -> int:
    """The run in this process: our signals end it (SIGTERM, SIGINT, SIGHUP: 128+N)."""
    import asyncio
    import signal

    from fusion_oci.cli.task import caller_env

    control = Control()

    async def go() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, control.signal, int(sig))
        return await execute(req, LocalIO(), caller_env(), Path.cwd(), control)

    try:
        return asyncio.run(go())
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 128 + (control.received[0] if control.received else signal.SIGINT)


# A parse of `run` whose request is taken, not run here (the resident server parses the
# client's argv with this very command, so both read flags alike).
capture: contextvars.ContextVar[Callable[[RunRequest], None] | None] = \
    contextvars.ContextVar("fusion_oci_run_capture", default=None)


def run(
    command: Command,
    backend: Backend = None, worktree: Worktree = None, image: Image = None,
    network: Network = None, allow_path: AllowPath = None, writable_path: WritablePath = None,
    env: EnvName = None, memory_mb: MemoryMb = None, cpus: Cpus = None,
    cpu_time_ms: CpuTime = None, pids: Pids = None, timeout_ms: TimeoutMs = None,
    max_buffer: MaxBuffer = None, failure_mode: FailureMode = None, task_id: TaskId = None,
    run_id: RunId = None, task_prompt: TaskPrompt = None, cache_mode: CacheMode = None,
    host_ca: HostCa = None, project_dir: ProjectDir = None, unsafe_worktree: UnsafeWorktree = False,
    allow_provision: Annotated[bool, typer.Option(
        "--allow-provision",
        help="Answer yes to `ask` gates (image build/pull); a `deny` in settings still wins.")
    ] = False,
    audit_log: Annotated[Path | None, typer.Option(
        "--audit-log", help="Audit JSONL file (default: PROJECT/.fusion/sandbox-audit.jsonl).")
    ] = None,
    interactive: Annotated[bool, typer.Option(
        "-i", "--interactive", help="Feed this process's stdin to the command as it comes "
        "(container backends read it to its end first and take at most 96 KiB).")] = False,
    tty: Annotated[bool, typer.Option(
        "-t", "--tty", help="Give the command a pseudo-terminal (util-linux `script` inside "
        "the sandbox): stdout and stderr then arrive merged, with CRLF line ends, as with "
        "`docker run -t`.")] = False,
    cwd: Annotated[str | None, typer.Option(
        "--cwd", help="Working directory of the command: absolute inside the sandbox, or "
        "relative to the worktree (default: the worktree).")] = None,
    as_json: AsJson = False,
) -> None:
    """Run COMMAND in the sandbox; its stdout/stderr pass through as they come, its exit
    status is ours. With --json nothing passes through: one result object is printed, its
    output kept up to --max-buffer.

    SIGTERM, SIGINT or SIGHUP end the command's whole tree, audit it as aborted and exit 128+N.
    """
    req = RunRequest(command=list(command), flags=_flags(dict(locals())),
                     allow_provision=allow_provision, audit_log=audit_log,
                     interactive=interactive, tty=tty, as_json=as_json)
    taker = capture.get()
    if taker is not None:
        taker(req)
        return
    raise typer.Exit(run_here(req))

