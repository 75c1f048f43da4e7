"""``fusion-oci audit``, ``dashboard`` and ``gc``: reading the audit log, cleaning up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, assert_never

import typer

from fusion_oci.cli.options import AsJson, ProjectDir, Worktree, _console, _fail

if TYPE_CHECKING:
    from rich.console import Console

    from fusion_oci.audit import AuditEvent


def audit(
    worktree: Worktree = None,
    project_dir: ProjectDir = None,
    audit_log: Annotated[
        Path | None,
        typer.Option(
            "--audit-log", help="Audit JSONL file (default: PROJECT/.fusion/sandbox-audit.jsonl)."
        ),
    ] = None,
    task: Annotated[str | None, typer.Option("--task", help="Only this task id.")] = None,
    limit: Annotated[int, typer.Option("--limit", help="Most recent N events.")] = 50,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Check the hash chain: report the first edited, removed or forged line (exit 1).",
        ),
    ] = False,
    summary: Annotated[
        bool,
        typer.Option(
            "--summary",
            help="The dashboard's summary (durations, end reasons, fallbacks, gates, "
            "chain) instead of events.",
        ),
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Show sandbox audit events as a table (``--json`` for machines)."""
    import os

    from fusion_oci.audit import default_audit_path, default_key_path, load_key, read_events
    from fusion_oci.audit import verify_chain as check_chain
    from fusion_oci.caller import find_project_dir
    from fusion_oci.policy.worktree import default_worktree

    where = (
        worktree.expanduser().absolute()
        if worktree is not None
        else default_worktree(Path.cwd().absolute())
    )
    path = audit_log or default_audit_path(find_project_dir(where, project_dir))
    if summary:
        from fusion_oci.dashboard.report import full_summary, render

        data = full_summary(path, task, load_key(default_key_path(os.environ), create=False))
        if as_json:
            typer.echo(json.dumps(data, indent=2))
        else:
            render(data)
            render_egress(data)
            render_credentials(data)
        return
    report = check_chain(path, load_key(default_key_path(os.environ), create=False))
    if verify:
        if as_json:
            typer.echo(
                json.dumps(
                    {
                        "path": str(path),
                        "ok": report.ok,
                        "lines": report.lines,
                        "firstBadLine": report.first_bad_line,
                        "reason": report.reason,
                        "keyed": report.keyed,
                    }
                )
            )
        elif report.ok:
            keyed = "hashes and MACs" if report.keyed else "hashes only (no audit key here)"
            typer.echo(f"{path}: {report.lines} lines, chain intact ({keyed})")
        else:
            typer.echo(f"{path}: chain broken at line {report.first_bad_line}: {report.reason}")
        raise typer.Exit(0 if report.ok else 1)
    if not report.ok:
        typer.echo(
            f"fusion-oci: warning: the audit chain of {path} is broken at line "
            f"{report.first_bad_line}: {report.reason} (see `fusion-oci audit --verify`)",
            err=True,
        )
    events = [e for e in read_events(path) if task is None or e.task_id == task][-limit:]
    if as_json:
        for event in events:
            typer.echo(event.model_dump_json(by_alias=True, exclude_none=True))
        return
    from rich.table import Table

    table = Table(title=str(path))
    for col in ("time", "event", "task", "run", "backend", "exit", "ms", "reason"):
        table.add_column(col, overflow="fold")
    for e in events:
        status, ms, reason = _columns(e)
        table.add_row(
            e.ts[11:23],
            e.type.removeprefix("sandbox:"),
            e.task_id,
            e.run_id,
            e.backend,
            "" if status is None else str(status),
            "" if ms is None else str(ms),
            reason[:120],
        )
    _console().print(table)


def _columns(e: AuditEvent) -> tuple[str | int | None, int | None, str]:
    """The table's exit, ms and reason cells of one event: how a run ended (its end reason
    unless it exited, then its exit code), how long the step took, and why (or, without a
    reason, what the sandbox did not enforce)."""
    from fusion_oci.audit import (
        CredentialEvent,
        DisposeEvent,
        EgressEvent,
        FailureEvent,
        FallbackEvent,
        GateEvent,
        InboundEvent,
        PrepareEvent,
        ProvisionEvent,
        RunEvent,
    )

    match e:
        case RunEvent():
            status = e.end_reason if e.end_reason not in (None, "exit") else e.exit_code
            return status, e.duration_ms, ", ".join(e.unenforced or [])
        case PrepareEvent():
            return None, e.duration_ms, ", ".join(e.unenforced or [])
        case FailureEvent() | FallbackEvent():
            return None, None, e.reason or ", ".join(e.unenforced or [])
        case DisposeEvent():
            return None, e.duration_ms, ""
        case ProvisionEvent() | GateEvent() | EgressEvent() | CredentialEvent() | InboundEvent():
            return None, e.duration_ms, e.reason or ""
        case _:
            assert_never(e)


def dashboard(
    worktree: Worktree = None,
    project_dir: ProjectDir = None,
    audit_log: Annotated[
        Path | None,
        typer.Option(
            "--audit-log", help="Audit JSONL file (default: PROJECT/.fusion/sandbox-audit.jsonl)."
        ),
    ] = None,
    host: Annotated[
        str,
        typer.Option(
            "--host", help="Address to listen on; any but 127.0.0.1/localhost/::1 needs a token."
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option("--port", help="TCP port (default 0: a free one). 4040 is always refused."),
    ] = 0,
) -> None:
    """Serve a live page and JSON API of the audit log (Ctrl-C stops it)."""
    import os

    from fusion_oci.audit import default_audit_path
    from fusion_oci.caller import find_project_dir
    from fusion_oci.dashboard.chain import host_key
    from fusion_oci.dashboard.server import serve
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.policy.worktree import default_worktree

    try:
        where = (
            worktree.expanduser().absolute()
            if worktree is not None
            else default_worktree(Path.cwd().absolute())
        )
        path = audit_log or default_audit_path(find_project_dir(where, project_dir))
        serve(
            path.absolute(), host=host, port=port, echo=typer.echo, chain_key=host_key(os.environ)
        )
    except FusionOCIError as exc:
        _fail(exc)


def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would go.")] = False,
    include_caches: Annotated[
        bool, typer.Option("--include-caches", help="Also remove project cache volumes.")
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Remove what crashed or killed fusion-oci processes left behind: containers and volumes
    (podman, docker), pods and their objects on the cluster of ``KUBECONFIG`` (kubernetes) and
    OCI runtime state (runc), each labelled with a dead owner; and the
    package store's blobs no worktree links any more."""
    import asyncio
    import os

    from fusion_oci.gc import gc as gc_engines
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.runtimes.kubernetes.gc import gc_cluster
    from fusion_oci.runtimes.oci import gc_oci

    report = gc_engines(env=os.environ, include_caches=include_caches, dry_run=dry_run)
    report.merge(gc_cluster(SandboxSettings(), os.environ, task_id=None, dry_run=dry_run))
    oci_removed: list[str] = [] if dry_run else asyncio.run(gc_oci(env=os.environ))
    removed = report.removed + [f"oci {name}" for name in oci_removed]
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "removed": removed,
                    "kept": report.kept,
                    "errors": report.errors,
                    "engines": report.engines,
                },
                indent=2,
            )
        )
    else:
        verb = "would remove" if dry_run else "removed"
        for item in removed:
            typer.echo(f"{verb} {item}")
        for err in report.errors:
            typer.echo(f"error: {err}", err=True)
        typer.echo(
            f"{len(removed)} {'to remove' if dry_run else 'removed'}; engines: "
            + ", ".join(report.engines)
        )
    raise typer.Exit(1 if report.errors else 0)


def render_egress(s: dict[str, Any], console: Console | None = None) -> None:
    """The summary's egress part (``sandbox:egress``): per task, and the top denied hosts."""
    from rich.console import Console

    from fusion_oci.dashboard.report import _table

    console = console or Console()
    e = s["egress"]
    console.print(
        _table(
            f"egress per task ({e['allowed']} allowed, {e['denied']} denied; "
            f"{e['bytesUp']} bytes up, {e['bytesDown']} down)",
            [
                "task",
                "connections",
                "allowed",
                "denied",
                "bytes up",
                "bytes down",
                "hosts",
                "host services",
            ],
            [
                [
                    r["taskId"],
                    r["connections"],
                    r["allowed"],
                    r["denied"],
                    r["bytesUp"],
                    r["bytesDown"],
                    r["hosts"],
                    r.get("services", 0),
                ]
                for r in e["byTask"]
            ],
        )
    )
    console.print(
        _table(
            "top denied hosts",
            ["host", "count", "rule"],
            [[r["host"], r["count"], r["rule"]] for r in e["topDenied"]],
        )
    )


def render_credentials(s: dict[str, Any], console: Console | None = None) -> None:
    """The summary's credentials part (``sandbox:credential``): swaps per task, host and
    credential, and the latest refusals (names and hosts only, never a value)."""
    from rich.console import Console

    from fusion_oci.dashboard.report import _table

    console = console or Console()
    c = s["credentials"]
    console.print(
        _table(
            f"brokered credentials ({c['swaps']} swapped, {c['leakAttempts']} leak attempts)",
            ["task", "host", "credential", "swaps"],
            [[r["taskId"], r["host"], r["credential"], r["swaps"]] for r in c["byTask"]],
        )
    )
    console.print(
        _table(
            "credential refusals",
            ["task", "host", "credential", "reason"],
            [[r["taskId"], r["host"], r["credential"], r["reason"]] for r in c["recentRefused"]],
        )
    )
