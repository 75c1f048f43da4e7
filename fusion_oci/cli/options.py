"""What several commands share: the option types, and how an error is reported."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from fusion_oci.cli.choices import choice as _choice
from fusion_oci.models.backends import BACKEND_IDS

if TYPE_CHECKING:
    from fusion_oci.caller import TaskFlags

HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}

BACKEND_CHOICES = BACKEND_IDS

# --- shared options -------------------------------------------------------------------------

Backend = Annotated[
    str | None,
    typer.Option(
        "--backend",
        help="The sandbox backend (default: the settings', else native).",
        **_choice("--backend", BACKEND_CHOICES),
    ),
]
Worktree = Annotated[
    Path | None,
    typer.Option(
        "--worktree",
        help="The task's worktree (default: the top of the git work tree holding the "
        "current directory).",
    ),
]
ProjectDir = Annotated[
    Path | None,
    typer.Option(
        "--project-dir",
        help="The project root whose .fusion/ holds settings and the audit log "
        "(default: a linked worktree's main repository, else the worktree).",
    ),
]
UnsafeWorktree = Annotated[
    bool,
    typer.Option(
        "--unsafe-worktree",
        help="Accept a worktree that is /, $HOME or holds it, or is not the "
        "top of a git work tree.",
    ),
]
Image = Annotated[
    str | None,
    typer.Option("--image", help="Image for container backends (images/ name or reference)."),
]
Network = Annotated[
    str | None,
    typer.Option(
        "--network",
        help="none: no network; egress: outbound only, not the host's loopback "
        "services; host: the host's network.",
        **_choice("--network", ("none", "egress", "host")),
    ),
]
AllowPath = Annotated[
    list[str] | None, typer.Option("--allow-path", help="Host path visible read-only (repeatable).")
]
WritablePath = Annotated[
    list[str] | None,
    typer.Option("--writable-path", help="Host path visible read-write (repeatable)."),
]
EnvName = Annotated[
    list[str] | None,
    typer.Option("--env", help="Name of a caller env var to pass through (repeatable)."),
]
MemoryMb = Annotated[int | None, typer.Option("--memory-mb", help="Memory limit in MiB.")]
Cpus = Annotated[float | None, typer.Option("--cpus", help="CPU quota in cores.")]
CpuTime = Annotated[int | None, typer.Option("--cpu-time-ms", help="CPU time limit (ms).")]
Pids = Annotated[int | None, typer.Option("--pids", help="Most processes at once.")]
TimeoutMs = Annotated[int | None, typer.Option("--timeout-ms", help="Wall-clock limit (ms).")]
MaxBuffer = Annotated[
    int | None, typer.Option("--max-buffer", help="Most bytes kept of stdout and of stderr.")
]
FailureMode = Annotated[
    str | None,
    typer.Option(
        "--failure-mode",
        help="When the backend is unavailable: fail (exit 125) or run natively.",
        **_choice("--failure-mode", ("fail-hard", "fallback-native")),
    ),
]
TaskId = Annotated[
    str | None,
    typer.Option(
        "--task-id", help="The task's id, in audit events and container names (default: adhoc)."
    ),
]
RunId = Annotated[
    str | None,
    typer.Option("--run-id", help="The task run's id, in audit events (default: a new one)."),
]
TaskPrompt = Annotated[
    Path | None,
    typer.Option(
        "--task-prompt",
        help="File with the task prompt (may hold a **Sandbox:** override); - reads it from stdin.",
    ),
]
CacheMode = Annotated[
    str | None,
    typer.Option(
        "--cache-mode",
        help="Package caches: shared per project, isolated per task, or off.",
        **_choice("--cache-mode", ("shared", "isolated", "off")),
    ),
]
HostCa = Annotated[
    str | None, typer.Option("--host-ca", help="auto|off|PATH: share the host CA bundle.")
]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
Command = Annotated[
    list[str],
    typer.Argument(
        help="One argument: a shell command line. Several: an argv.", show_default=False
    ),
]


def _fail(exc: Exception, as_json: bool = False) -> NoReturn:
    """Report an error (one JSON object on stdout with ``--json``) and exit with its status."""
    from fusion_oci.errors import FusionOCIError, error_json

    code = exc.exit_code if isinstance(exc, FusionOCIError) else 125
    if as_json:
        typer.echo(json.dumps(error_json(exc)))
    else:
        typer.echo(f"fusion-oci: {exc}", err=True)
    raise typer.Exit(code)


def _flags(params: dict[str, Any]) -> TaskFlags:
    """The command's own parameters (its ``locals()``) that are task flags."""
    import dataclasses

    from fusion_oci.caller import TaskFlags

    names = {f.name for f in dataclasses.fields(TaskFlags)}
    return TaskFlags(**{k: v for k, v in params.items() if k in names})


def _command(command: list[str]) -> str | list[str]:
    return command[0] if len(command) == 1 else command


def _warn(warnings: list[str]) -> None:
    for line in warnings:
        typer.echo(f"fusion-oci: warning: {line}", err=True)


def _console() -> Any:
    """rich's Console, without its 80-column limit when the output is not a terminal
    (`plan | less` must not cut JSON strings)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=100_000, soft_wrap=True)
