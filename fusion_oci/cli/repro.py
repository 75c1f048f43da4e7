"""``fusion-oci repro`` and ``fusion-oci export``: replay a recorded run; write a file that
reproduces a task environment with an engine's own tools. Imports stay inside the commands
(start-up time of every other command)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from fusion_oci.export import ExportSource

Ident = Annotated[
    str, typer.Argument(help="A run id, or a task id (its last run).", show_default=False)
]
ProjectDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--project-dir",
        help="Project whose .fusion/ holds the audit log and the replay records "
        "(default: the project of the current directory's worktree).",
    ),
]
AuditLogOpt = Annotated[
    Path | None,
    typer.Option(
        "--audit-log", help="Audit JSONL file (default: PROJECT/.fusion/sandbox-audit.jsonl)."
    ),
]


def _project(project_dir: Path | None) -> Path:
    from fusion_oci.caller import find_project_dir
    from fusion_oci.policy.worktree import default_worktree

    if project_dir is not None:
        return project_dir.expanduser().absolute()
    return find_project_dir(default_worktree(Path.cwd().absolute()))


def _fail(exc: Exception, as_json: bool) -> None:
    from fusion_oci.cli.options import _fail as fail

    fail(exc, as_json)


def repro(
    ident: Ident,
    worktree: Annotated[
        Path | None,
        typer.Option("--worktree", help="Worktree to replay against (default: the recorded path)."),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option("--backend", help="Backend to replay on (default: the recorded one)."),
    ] = None,
    image: Annotated[
        str | None,
        typer.Option(
            "--image", help="Replay on this image instead of the recorded digest (reported)."
        ),
    ] = None,
    project_dir: ProjectDirOpt = None,
    audit_log: AuditLogOpt = None,
    allow_provision: Annotated[
        bool,
        typer.Option(
            "--allow-provision", help="Answer yes to `ask` gates (a backend's default image)."
        ),
    ] = False,
    ignore_chain: Annotated[
        bool,
        typer.Option(
            "--ignore-chain",
            help="Replay even when the audit log fails its integrity check (reported).",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report.")] = False,
) -> None:
    """Replay a recorded run here: the recorded outcome beside the new one; exits with the
    new one's status. A changed worktree, another backend or image, env not set here: listed."""
    import asyncio

    from fusion_oci.audit import AuditLog, default_audit_path
    from fusion_oci.caller import caller_env
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.images.gates import tty_ask
    from fusion_oci.repro import check_log, find_run, render, replay

    try:
        project = _project(project_dir)
        log_path = audit_log or default_audit_path(project)
        env = caller_env()
        try:
            note = check_log(log_path, env)
        except FusionOCIError as exc:
            if not ignore_chain:
                raise
            note = f"audit log integrity check failed (--ignore-chain): {exc.why}"
        commands = find_run(log_path, ident, project)
        report = asyncio.run(
            replay(
                commands,
                worktree=worktree,
                backend=backend,
                project_dir=project_dir,
                env=env,
                audit=AuditLog(log_path),
                image=image,
                ask=tty_ask(assume_yes=allow_provision),
            )
        )
        if note:
            report.differences.insert(0, note)
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


def export(
    ident: Annotated[
        str | None,
        typer.Argument(help="A run id or task id; none: the current settings.", show_default=False),
    ] = None,
    fmt: Annotated[
        str, typer.Option("--format", help="compose|devcontainer|kube|script")
    ] = "compose",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="File to write (default: stdout).")
    ] = None,
    worktree: Annotated[
        Path | None,
        typer.Option(
            "--worktree", help="Worktree (default: the recorded one, or the current one)."
        ),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option("--backend", help="Without a run id: the backend whose settings to export."),
    ] = None,
    image: Annotated[
        str | None,
        typer.Option("--image", help="Image to name (default: the recorded digest's reference)."),
    ] = None,
    command: Annotated[
        list[str] | None,
        typer.Option(
            "--command", help="Without a run id: the command (default: an interactive shell)."
        ),
    ] = None,
    project_dir: ProjectDirOpt = None,
    audit_log: AuditLogOpt = None,
) -> None:
    """Write a compose service, a devcontainer.json, a Kubernetes Pod or a podman script that
    reproduce the task environment; what the format cannot express is listed at its top and
    on stderr."""
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.export import EXPORT_FORMATS, export_run, source_from_record

    try:
        if fmt not in EXPORT_FORMATS:
            from fusion_oci.errors import FlagError

            raise FlagError(
                f"--format {fmt}", "not a known format", "use one of " + ", ".join(EXPORT_FORMATS)
            )
        if ident is not None:
            from fusion_oci.audit import default_audit_path
            from fusion_oci.repro import find_run

            project = _project(project_dir)
            commands = find_run(audit_log or default_audit_path(project), ident, project)
            source = source_from_record(
                commands[-1].record, commands[-1].event, worktree=worktree, image=image
            )
        else:
            source = source_from_settings(
                worktree=worktree,
                backend=backend,
                image=image,
                command=list(command or []),
                project_dir=project_dir,
            )
        text, unexpressed = export_run(source, fmt)
    except FusionOCIError as exc:
        _fail(exc, False)
        return
    for item in unexpressed:
        typer.echo(f"fusion-oci export: not expressed in {fmt}: {item}", err=True)
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text, encoding="utf-8")
        if fmt == "script":
            output.chmod(0o755)


def source_from_settings(
    *,
    worktree: Path | None,
    backend: str | None,
    image: str | None,
    command: list[str],
    project_dir: Path | None,
) -> ExportSource:
    """The environment the current settings give a command (nothing is created or run)."""
    from fusion_oci.caller import TaskFlags, caller_env, resolve_task
    from fusion_oci.cli.dryrun import dry_run
    from fusion_oci.export import default_image, read_spec, safe_name
    from fusion_oci.oci.environment import allowed_env
    from fusion_oci.oci.host import probe_host
    from fusion_oci.oci.model import ANN_HOST_ROOTFS

    environ = caller_env()
    task = resolve_task(
        TaskFlags(worktree=worktree, backend=backend, image=image, project_dir=project_dir), environ
    )
    argv: str | list[str] = command if len(command) != 1 else command[0]
    data = dry_run(task, argv or ["/bin/bash"], environ)
    spec = data["config"]
    host = probe_host()
    host_rootfs = spec.get("annotations", {}).get(ANN_HOST_ROOTFS) == "true"
    chosen = image or task.ctx.image or task.effective.settings.image or default_image()
    notes = (
        [
            f"root filesystem: backend {data['backend']} uses the host's system directories;"
            f" the export runs image {chosen} instead"
        ]
        if host_rootfs
        else []
    )
    system = [d for d, _ in host.system_mounts] + [f"/etc/{n}" for n in host.etc_entries]
    names = sorted(allowed_env(task.ctx.policy.env_allowlist, environ))
    return read_spec(
        spec,
        name=safe_name(f"fusion-oci-{task.ctx.task_id}"),
        image=chosen,
        image_digest=None,
        system_dests=system if host_rootfs else [],
        env_names=names,
        notes=notes,
        host_rlimits=host.rlimits,
    )


def register(app: Any) -> None:
    app.command("repro")(repro)
    app.command("export")(export)
