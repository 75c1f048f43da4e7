"""``fusion-oci run``: one command in the sandbox, its output passed through as it comes.

The run itself is :func:`fusion_oci.caller.runrequest.execute`, shared with the per-user
resident server; here are the typer command, this process's I/O (:class:`LocalIO`) and
:func:`run_parser`, the parser the resident server is handed for its clients' argv.
"""

from __future__ import annotations

import contextvars
import functools
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fusion_oci.caller import Control, RunRequest, execute
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
    _flags,
)

if TYPE_CHECKING:
    from fusion_oci.images.gates import AskCallback
    from fusion_oci.models.stdin import StdinStream


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
        from fusion_oci.models.stdin import StdinStream

        if sys.stdin is None:  # started with fd 0 closed: nothing to feed
            return b""
        return StdinStream.from_fd(sys.stdin.fileno())


def run_here(req: RunRequest) -> int:
    """The run in this process: our signals end it (SIGTERM, SIGINT, SIGHUP: 128+N)."""
    import asyncio
    import signal

    from fusion_oci.caller import caller_env
    from fusion_oci.host.hardening import harden_owner

    # This process holds the caller's environment and, under network filtered, the task's
    # proxy, CA key and brokered tokens: no core of it, no /proc/PID/mem (issue #31).
    harden_owner()
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
capture: contextvars.ContextVar[Callable[[RunRequest], None] | None] = contextvars.ContextVar(
    "fusion_oci_run_capture", default=None
)


def run(
    command: Command,
    backend: Backend = None,
    worktree: Worktree = None,
    image: Image = None,
    network: Network = None,
    allow_path: AllowPath = None,
    writable_path: WritablePath = None,
    env: EnvName = None,
    memory_mb: MemoryMb = None,
    cpus: Cpus = None,
    cpu_time_ms: CpuTime = None,
    pids: Pids = None,
    timeout_ms: TimeoutMs = None,
    max_buffer: MaxBuffer = None,
    failure_mode: FailureMode = None,
    task_id: TaskId = None,
    run_id: RunId = None,
    task_prompt: TaskPrompt = None,
    cache_mode: CacheMode = None,
    host_ca: HostCa = None,
    project_dir: ProjectDir = None,
    unsafe_worktree: UnsafeWorktree = False,
    allow_provision: Annotated[
        bool,
        typer.Option(
            "--allow-provision",
            help="Answer yes to `ask` gates (image build/pull); a `deny` in settings still wins.",
        ),
    ] = False,
    audit_log: Annotated[
        Path | None,
        typer.Option(
            "--audit-log", help="Audit JSONL file (default: PROJECT/.fusion/sandbox-audit.jsonl)."
        ),
    ] = None,
    interactive: Annotated[
        bool,
        typer.Option(
            "-i",
            "--interactive",
            help="Feed this process's stdin to the command as it comes "
            "(container backends read it to its end first and take at most 96 KiB).",
        ),
    ] = False,
    tty: Annotated[
        bool,
        typer.Option(
            "-t",
            "--tty",
            help="Give the command a pseudo-terminal (util-linux `script` inside "
            "the sandbox): stdout and stderr then arrive merged, with CRLF line ends, as with "
            "`docker run -t`.",
        ),
    ] = False,
    cwd: Annotated[
        str | None,
        typer.Option(
            "--cwd",
            help="Working directory of the command: absolute inside the sandbox, or "
            "relative to the worktree (default: the worktree).",
        ),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Run COMMAND in the sandbox; its stdout/stderr pass through as they come, its exit
    status is ours. With --json nothing passes through: one result object is printed, its
    output kept up to --max-buffer.

    SIGTERM, SIGINT or SIGHUP end the command's whole tree, audit it as aborted and exit 128+N.
    """
    req = RunRequest(
        command=list(command),
        flags=_flags(dict(locals())),
        allow_provision=allow_provision,
        audit_log=audit_log,
        interactive=interactive,
        tty=tty,
        as_json=as_json,
    )
    taker = capture.get()
    if taker is not None:
        taker(req)
        return
    raise typer.Exit(run_here(req))


def run_parser(cli: Any) -> Callable[[list[str]], RunRequest | tuple[int, str, str]]:
    """The parser the resident server is handed (a
    :data:`fusion_oci.caller.runrequest.RunParser`): ``fusion-oci run ARGV`` parsed by
    ``cli``, the CLI's own click command (the root of the invocation that started the server,
    so this module needs no import of the CLI's app)."""
    return functools.partial(parse_run, cli)


def parse_run(cli: Any, argv: list[str]) -> RunRequest | tuple[int, str, str]:
    """``fusion-oci run ARGV`` parsed by the CLI's command ``cli``: the request, or what the
    CLI would have printed and its exit status (a usage error: 2)."""
    from fusion_oci.errors import FlagError

    taken: list[RunRequest] = []
    token = capture.set(taken.append)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        cli.main(args=["run", *argv], prog_name="fusion-oci", standalone_mode=False)
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.TyperException as exc:
        show = getattr(exc, "show", None)
        if "--json" in argv:
            fmt = getattr(exc, "format_message", None)
            message = fmt() if callable(fmt) else str(exc)
            out.write(
                json.dumps(FlagError(message, "", "see `fusion-oci --help`").to_json()) + "\n"
            )
        elif callable(show):
            show(file=err)
        code = getattr(exc, "exit_code", 2)
    finally:
        capture.reset(token)
    if taken:
        return taken[0]
    return code, out.getvalue(), err.getvalue()
