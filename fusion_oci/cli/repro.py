"""``fusion-oci repro`` and ``fusion-oci export``: replay a recorded run; write a file that
reproduces a task environment with an engine's own tools. Imports stay inside the commands
(start-up time of every other command)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

Ident = Annotated[str, typer.Argument(help="A run id, or a task id (its last run).",
                                      show_default=False)]
ProjectDirOpt = Annotated[Path | None, typer.Option(
    "--project-dir", help="Project whose .fusion/ holds the audit log and the replay records "
    "(default: the project of the current directory's worktree).")]
AuditLogOpt = Annotated[Path | None, typer.Option(
    "--audit-log", help="Audit JSONL file (default: PROJECT/.fusion/sandbox-audit.jsonl).")]


def _project(project_dir: Path | None) -> Path:
    from fusion_oci.cli.task import find_project_dir
    from fusion_oci.policy.worktree import default_worktree

    if project_dir is not None:
        return project_dir.expanduser().absolute()
    return find_project_dir(default_worktree(Path.cwd().absolute()))


def _fail(exc: Exception, as_json: bool) -> None:
    from fusion_oci.cli.main import _fail as fail

    fail(exc, as_json)


def repro(
    ident: Ident,
    worktree: Annotated[Path | None, typer.Option(
        "--worktree", help="Worktree to replay against (default: the recorded path).")] = None,
    backend: Annotated[str | None, typer.Option(
        "--backend", help="Backend to replay on (default: the recorded one).")] = None,
    image: Annotated[str | None, typer.Option(
        "--image", help="Replay on this image instead of the recorded digest (reported).")
    ] = None,
    project_dir: ProjectDirOpt = None,
    audit_log: AuditLogOpt = None,
    allow_provision: Annotated[bool, typer.Option(
        "--allow-provision", help="Answer yes to `ask` gates (a backend's default image).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report.")] = False,
) -> None:
    """Replay a recorded run here: the recorded outcome beside the new one; exits with the
    new one's status. A changed worktree, another backend or image, env not set here: listed."""
    import asyncio

    from fusion_oci.audit import AuditLog, default_audit_path
    from fusion_oci.cli.task import caller_env
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.images.gates import tty_ask
    from fusion_oci.repro import find_run, render, replay

    try:
        project = _project(project_dir)
        log_path = audit_log or default_audit_path(project)
        commands = find_run(log_path, ident, project)
        env = caller_env()
        report = asyncio.run(replay(
            commands, worktree=worktree, backend=backend, project_dir=project_dir,
            env=env, audit=AuditLog(log_path), image=image,
            ask=tty_ask(assume_yes=allow_provision)))
    except FusionOCIError as exc:
        _fail(exc, as_json)
        return
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
    else:
        for c in report.commands:
            sys.stdout.write(c.result.stdout)
            sys.stderr.write(c.result.stderr)
        sys.stdout.flush()
        sys.stderr.write(render(report))
    raise typer.Exit(report.status)


def register(app: Any) -> None:
    app.command("repro")(repro)
