"""``fusion-oci doctor`` and ``fusion-oci settings show|validate``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from fusion_oci.cli.options import (
    AsJson,
    ProjectDir,
    TaskPrompt,
    UnsafeWorktree,
    Worktree,
    _console,
    _fail,
    _warn,
)


def doctor(
    worktree: Worktree = None, project_dir: ProjectDir = None, as_json: AsJson = False
) -> None:
    """For every known backend: available here?, version, rootless, capabilities, the fix.

    Reads the settings (global, project) and exits 1 when the configured backend is
    unavailable here, 2 when the settings are bad.
    """
    import os

    from fusion_oci.caller import find_project_dir
    from fusion_oci.doctor import backend_rows, kubernetes_facts
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.policy.settings import load_settings
    from fusion_oci.policy.worktree import default_worktree
    from fusion_oci.services.show import grant_summary, publish_lines, publish_summary
    from fusion_oci.sidecars.show import service_lines, service_summary

    where = (
        worktree.expanduser().absolute()
        if worktree is not None
        else default_worktree(Path.cwd().absolute())
    )
    project = find_project_dir(where, project_dir)
    try:
        effective = load_settings(project_dir=project, env=os.environ)
    except FusionOCIError as exc:
        _fail(exc, as_json)
    _warn(effective.warnings)
    configured = effective.settings.backend
    rows = backend_rows(os.environ, effective.settings, oci_variants=True)
    chosen = next(r for r in rows if r["backend"] == configured)
    summary = {
        "backend": configured,
        "source": effective.provenance.get("backend", "default"),
        "failureMode": effective.settings.failure_mode,
        "available": chosen["available"],
        "hostServices": grant_summary(effective.settings.policy),
        "services": service_summary(effective.settings.policy),
        "publishPorts": publish_summary(effective.settings.policy),
    }
    status = 0 if chosen["available"] else 1
    # The probe pod is made only for a user who wrote a kubernetes: section (never in a
    # cluster a kubeconfig merely happens to name).
    opted_in = any(k.startswith("kubernetes.") for k in effective.provenance)
    kube = kubernetes_facts(os.environ, effective.settings, probe_network=opted_in)
    if as_json:
        typer.echo(
            json.dumps({"configured": summary, "backends": rows, "kubernetes": kube}, indent=2)
        )
        raise typer.Exit(status)
    import shutil

    width = shutil.get_terminal_size((100, 24)).columns
    for line in backend_lines(rows, configured, width):
        _console().print(line, highlight=False, soft_wrap=True)
    for entry in summary["hostServices"]:
        _console().print(
            f"[bold]hostServices[/] {entry['grant']}: gives {entry['gives']}"
            + (f"; [red]hands over the host[/]: {entry['handsOver']}" if entry["handsOver"] else "")
        )
    for line in service_lines(summary["services"]):
        _console().print(line, markup=False)
    for line in publish_lines(summary["publishPorts"]):
        _console().print(line, markup=False)
    for line in kubernetes_lines(kube):
        _console().print(line, highlight=False)
    for row in rows:
        # landlock's: user namespaces are forbidden here, and landlock still isolates.
        if (row["details"] or {}).get("recommendation"):
            _console().print(f"[bold]{row['backend']}[/]: {row['details']['recommendation']}")
    if status:
        typer.echo(
            f"fusion-oci: the configured backend '{configured}' ({summary['source']}) "
            f"is unavailable here (failureMode {summary['failureMode']})",
            err=True,
        )
    raise typer.Exit(status)


def backend_lines(rows: list[dict[str, Any]], configured: str, width: int) -> list[str]:
    """The backends as ``flutter doctor`` shows its checks: a mark, the name and version on one
    line, then what it enforces or why it is unavailable and the fix, indented and wrapped at
    word boundaries to ``width`` (never a name broken in the middle). Pure."""
    import textwrap

    def detail(label: str, text: str) -> list[str]:
        indent = " " * 6
        return textwrap.wrap(
            f"{label}: {text}",
            width=max(width, 40),
            initial_indent=indent,
            subsequent_indent=indent + "  ",
            break_long_words=False,
            break_on_hyphens=False,
        )

    out = ["[bold]fusion-oci backends on this host[/]"]
    chosen = next((r for r in rows if r["backend"] == configured), None)
    for row in rows:
        name = str(row["backend"]) + (f" ({row['ociRuntime']})" if row.get("ociRuntime") else "")
        facts = [str(row["version"])] if row["version"] else []
        if row["rootless"] is not None:
            facts.append("rootless" if row["rootless"] else "rootful")
        if row is chosen:
            facts.append("[bold]configured[/]")
        mark = "[green]ok[/]" if row["available"] else "[red] x[/]"
        out.append(f"  {mark} [bold]{name}[/]" + (f"  {', '.join(facts)}" if facts else ""))
        if row["available"]:
            out += detail("enforces", ", ".join(row["enforces"]) or "-")
        else:
            out += detail("why", str(row["reason"]))
            if row.get("hint"):
                out += detail("fix", str(row["hint"]))
    return out


def kubernetes_lines(kube: dict[str, Any]) -> list[str]:
    """The doctor's cluster facts as a mark and a line each, details indented."""
    if not kube.get("configured"):
        return [f"[bold]kubernetes[/]: - not configured ({kube['why']})"]
    if not kube.get("reachable"):
        why = str(kube["why"]).replace("\n", "\n    ")
        return [
            f"[bold]kubernetes[/]: [red]x[/] {kube.get('source', '')} unreachable",
            f"    {why}",
        ]
    ok, bad = "[green]ok[/]", "[red]x[/]"
    out = [
        f"[bold]kubernetes[/]: {ok} {kube['server']} {kube['version']} "
        f"(namespace {kube['namespace']}, {kube['source']})",
        f"  {ok} mode: {kube['mode']} (agent-sandbox APIs: "
        + ", ".join(
            f"{k.split('/')[1]} {'yes' if v else 'no'}" for k, v in kube["agentSandbox"].items()
        )
        + ")",
    ]
    if kube.get("modeProblem"):
        out.append(f"  {bad} {kube['modeProblem']}")
    rbac = kube["rbac"]
    out.append(
        f"  {ok} RBAC: every permission of docs/kubernetes.md's Role"
        if rbac["ok"]
        else f"  {bad} RBAC: missing " + ", ".join(rbac["missing"]) + f"\n    hint: {rbac['hint']}"
    )
    net = kube["networkPolicy"]
    mark = {True: ok, False: bad, None: "[yellow]?[/]"}[net["enforced"]]
    out.append(f"  {mark} NetworkPolicy enforced: {net['how']}")
    if "runtimeClass" in kube:
        rc = kube["runtimeClass"]
        out.append(
            f"  {ok} RuntimeClass {rc['name']} (handler {rc['handler']})"
            if rc["exists"]
            else f"  {bad} RuntimeClass {rc['name']}: {rc['why']}"
        )
    return out


def _load_for(
    worktree: Path | None, task_prompt: Path | None, project_dir: Path | None, unsafe_worktree: bool
) -> Any:
    from fusion_oci.caller import TaskFlags, caller_env, resolve_task

    return resolve_task(
        TaskFlags(
            worktree=worktree,
            task_prompt=task_prompt,
            project_dir=project_dir,
            unsafe_worktree=unsafe_worktree,
        ),
        caller_env(),
    )


def settings_show(
    worktree: Worktree = None,
    task_prompt: TaskPrompt = None,
    project_dir: ProjectDir = None,
    unsafe_worktree: UnsafeWorktree = False,
    as_json: AsJson = False,
) -> None:
    """The effective settings, and where each value came from."""
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.policy.settings import flatten

    try:
        task = _load_for(worktree, task_prompt, project_dir, unsafe_worktree)
    except FusionOCIError as exc:
        _fail(exc, as_json)
    _warn(task.effective.warnings)
    values = flatten(task.effective.settings.model_dump(mode="json", by_alias=True))
    prov = task.effective.provenance
    rows = [
        {"key": key, "value": value, "source": prov.get(key, "default")}
        for key, value in values.items()
    ]
    from fusion_oci.caller import caller_env
    from fusion_oci.egress.show import egress_rows

    rows += egress_rows(task.ctx, caller_env())  # network filtered: the proxy's hosts, and why
    from fusion_oci.services.show import grant_rows

    rows += grant_rows(task.ctx.policy)  # hostServices: what each grant gives away
    from fusion_oci.services.show import publish_rows

    rows += publish_rows(task.ctx.policy)  # publishPorts: what each gives the host
    from fusion_oci.sidecars.show import service_rows

    rows += service_rows(task.ctx.policy)  # services: each container and where it is reached
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"effective sandbox settings (project {task.project_dir})")
    for col in ("key", "value", "source"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(f"sandbox.{row['key']}", json.dumps(row["value"]), row["source"])
    _console().print(table)


def settings_validate(
    worktree: Worktree = None,
    task_prompt: TaskPrompt = None,
    project_dir: ProjectDir = None,
    unsafe_worktree: UnsafeWorktree = False,
) -> None:
    """Check the global and project settings files (exit 2 with the error when bad)."""
    from fusion_oci.errors import FusionOCIError

    try:
        task = _load_for(worktree, task_prompt, project_dir, unsafe_worktree)
    except FusionOCIError as exc:
        _fail(exc)
    _warn(task.effective.warnings)
    sources = sorted(set(task.effective.provenance.values())) or ["defaults only"]
    typer.echo("settings OK: " + ", ".join(sources))
