"""Running one CLI ``run`` request: resolve the task from the caller's cwd and environment, run
its command in a sandbox, report as the CLI does.

Shared by the in-process CLI (``fusion_oci.cli.run``) and the per-user resident server
(``fusion_oci.server.resident``), which the fast front end (``fusion_oci.cli.fast``) talks to:
both print the same notes and errors and end with the same exit status. Only where the bytes go
differs (a :class:`RunIO`), and who parses the argv (the CLI's typer command, handed to the
server as a :data:`RunParser`, so that ``server/`` never imports ``cli/``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fusion_oci.caller.flags import TaskFlags
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.images.gates import AskCallback
    from fusion_oci.models import RunResult
    from fusion_oci.models.stdin import StdinStream


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
    from fusion_oci.errors import FusionOCIError, error_json

    code = exc.exit_code if isinstance(exc, FusionOCIError) else 125
    if as_json:
        return code, json.dumps(error_json(exc)), False
    return code, f"fusion-oci: {exc}", True


async def execute(
    req: RunRequest, io: RunIO, environ: dict[str, str], cwd: Path, control: Control
) -> int:
    """Resolve the task as the CLI does (from ``cwd`` and ``environ``), run it, report; the
    exit status. Signals arrive through ``control``."""
    import asyncio
    import signal

    from fusion_oci.audit import AuditLog, default_audit_path
    from fusion_oci.caller.flags import host_path, resolve_task
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
            raise FlagError(
                "--interactive with --task-prompt -",
                "both read stdin",
                "pass the task prompt as a file",
            )
        task = resolve_task(flags, environ, cwd=cwd)
        audit_path = (
            host_path(req.audit_log, cwd, environ)
            if req.audit_log is not None
            else default_audit_path(task.project_dir)
        )
        audit = AuditLog(audit_path)
        attach_from_env(audit, environ)  # OpenTelemetry, when OTEL_* asks for it
        opts = task.opts
        if req.interactive:
            opts = opts.model_copy(update={"stdin": io.stdin()})
        sandbox = Sandbox(
            task.effective.settings, audit=audit, env=environ, ask=io.ask(req.allow_provision)
        )

        def pass_through(stream: str, chunk: bytes) -> Awaitable[None] | None:
            # Like a shell pipeline: the reader of our stdout gone ends the command (SIGPIPE).
            ok = io.write(stream, chunk)
            if ok is False and not received:
                received.append(int(signal.SIGPIPE))
                assert sandbox is not None
                sandbox.abort()
            return None if isinstance(ok, bool) else ok

        run_opts = (
            opts
            if req.as_json
            else opts.model_copy(update={"on_output": pass_through, "keep_output": False})
        )
        command: str | list[str] = (
            tty_command(req.command, io.terminal_size)
            if req.tty
            else req.command[0]
            if len(req.command) == 1
            else req.command
        )
        async with sandbox:
            await sandbox.prepare(task.ctx)
            preparing = False
            if (
                not req.as_json
                and sandbox.runtime is not None
                and not sandbox.runtime.isolates
                and not sandbox.fell_back
            ):
                io.echo(
                    f"fusion-oci: note: the {sandbox.runtime.id} backend isolates nothing "
                    "(the command runs on the host as you)",
                    err=True,
                )
            for port in sandbox.published():
                # Before the command starts: a dev server's user needs the free port chosen.
                io.echo(
                    f"fusion-oci: published the sandbox's port {port['port']} on {port['url']}",
                    err=True,
                )
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


RunParser = Callable[[list[str]], "RunRequest | tuple[int, str, str]"]
"""``fusion-oci run ARGV`` parsed: the request, or what the CLI would have printed (stdout,
stderr) and its exit status (a usage error: 2)."""
