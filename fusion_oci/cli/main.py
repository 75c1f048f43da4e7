"""``fusion-oci``: run, plan, doctor, bundle, settings, audit, dashboard, gc, images.

Exit status: the command's own; 124 on timeout; 125 when the sandbox could not be set up;
2 for bad settings or flags; 126/127 as a shell would (the command's own).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from fusion_oci.cli.options import (
    HELP_OPTIONS,
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
    _fail,
    _flags,
)

app = typer.Typer(
    name="fusion-oci",
    help="Run coding-agent executor commands inside a sandbox around the task's worktree.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion: the choices below complete in the shell
    pretty_exceptions_enable=False,
    context_settings=HELP_OPTIONS,
    rich_markup_mode=None,  # plain click help: rich's renderer alone doubles `--help`'s start-up
)
bundle_app = typer.Typer(
    help="Write OCI bundles.",
    no_args_is_help=True,
    context_settings=HELP_OPTIONS,
    rich_markup_mode=None,
)
settings_app = typer.Typer(
    help="Show and check the effective settings.",
    no_args_is_help=True,
    context_settings=HELP_OPTIONS,
    rich_markup_mode=None,
)
app.add_typer(bundle_app, name="bundle")
app.add_typer(settings_app, name="settings")


def _version(value: bool) -> None:
    if value:
        from fusion_oci import __version__

        typer.echo(f"fusion-oci {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Run coding-agent executor commands inside a sandbox around the task's worktree."""


# --- run: its own module (the fast front end and the resident server share its core) ------

from fusion_oci.cli.run import run  # noqa: E402

app.command(context_settings={"allow_interspersed_args": False})(run)

# --- plan -----------------------------------------------------------------------------------


def _grant_lines(
    grants: list[dict[str, Any]],
    services: list[dict[str, Any]],
    published: list[dict[str, Any]] | None = None,
) -> list[str]:
    """``plan``'s lines about the host services granted (what each gives away), the
    service containers (where the task reaches each) and the published ports."""
    from fusion_oci.services.show import publish_lines
    from fusion_oci.sidecars.show import service_lines

    return (
        service_lines(services)
        + [
            f"hostServices {g['grant']}: gives {g['gives']}"
            + (f"; HANDS OVER THE HOST: {g['handsOver']}" if g["handsOver"] else "")
            for g in grants
        ]
        + publish_lines(published or [])
    )


@app.command(context_settings={"allow_interspersed_args": False})
def plan(
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
    as_json: AsJson = False,
) -> None:
    """Dry run: the resolved policy, the bundle's config.json and the runtime's launch plan."""
    params = dict(locals())
    from fusion_oci.caller import caller_env, resolve_task
    from fusion_oci.errors import FusionOCIError

    try:
        flags = _flags(params)
        environ = caller_env()
        task = resolve_task(flags, environ)
        from fusion_oci.cli.dryrun import dry_run

        data = dry_run(task, _command(command), environ)
    except FusionOCIError as exc:
        _fail(exc, as_json)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    from rich.console import Console
    from rich.syntax import Syntax

    if not sys.stdout.isatty():
        # Piped: plain JSON sections, whole lines.
        sections = (
            (f"policy ({data['policyHash']})", "policy"),
            ("config.json", "config"),
            (f"launch plan: {data['backend']}", "launch"),
        )
        for title, key in sections:
            typer.echo(f"== {title}")
            typer.echo(json.dumps(data[key], indent=2))
            if key == "policy" and data["unenforced"]:
                typer.echo("not enforced by this backend: " + ", ".join(data["unenforced"]))
            if key == "policy":
                for line in _grant_lines(
                    data["hostServices"], data["services"], data["publishPorts"]
                ):
                    typer.echo(line)
        return
    console = Console()
    console.rule(f"policy ({data['policyHash']})")
    console.print(Syntax(json.dumps(data["policy"], indent=2), "json"))
    if data["unenforced"]:
        console.print("[yellow]not enforced by this backend:[/] " + ", ".join(data["unenforced"]))
    for line in _grant_lines(data["hostServices"], data["services"], data["publishPorts"]):
        console.print(line, markup=False)
    console.rule("config.json")
    console.print(Syntax(json.dumps(data["config"], indent=2), "json"))
    console.rule(f"launch plan: {data['backend']}")
    console.print(Syntax(json.dumps(data["launch"], indent=2), "json"))


# --- doctor, settings -----------------------------------------------------------------------

from fusion_oci.cli.doctor import doctor, settings_show, settings_validate  # noqa: E402

app.command()(doctor)

# --- serve ----------------------------------------------------------------------------------

from fusion_oci.cli.serve import serve as _serve  # noqa: E402  (only typer: cheap to import)

app.command("serve")(_serve)


# --- bundle ---------------------------------------------------------------------------------


@bundle_app.command("create", context_settings={"allow_interspersed_args": False})
def bundle_create(
    command: Command,
    output: Annotated[Path, typer.Option("-o", "--output", help="Bundle directory to write.")],
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
    task_id: TaskId = None,
    run_id: RunId = None,
    cache_mode: CacheMode = None,
    host_ca: HostCa = None,
    project_dir: ProjectDir = None,
    unsafe_worktree: UnsafeWorktree = False,
) -> None:
    """Write an OCI bundle (config.json + rootfs/) for COMMAND, atomically."""
    params = dict(locals())
    from fusion_oci.caller import caller_env, resolve_task
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.oci.bundle import write_bundle
    from fusion_oci.oci.host import probe_host
    from fusion_oci.resolve import compile_spec, resolve_for
    from fusion_oci.runtimes.registry import runtime_class

    try:
        target = output.absolute()
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            from fusion_oci.errors import FlagError

            raise FlagError(
                f"-o/--output {target}",
                "it exists and is not an empty directory",
                "choose a new directory, or remove the old bundle first",
            )
        flags = _flags(params)
        environ = caller_env()
        task = resolve_task(flags, environ)
        settings = task.effective.settings
        # The runtime's class is enough: the bundle written is the one that backend would run.
        runtime = runtime_class(settings.backend, settings)
        resolved = resolve_for(runtime, settings, task.ctx, probe_host(), env=environ)
        spec = compile_spec(resolved, _command(command), task.opts)
        bundle = write_bundle(spec, output)
    except FusionOCIError as exc:
        _fail(exc)
    typer.echo(str(bundle.path))


settings_app.command("show")(settings_show)
settings_app.command("validate")(settings_validate)


# --- audit, dashboard, gc -------------------------------------------------------------------

from fusion_oci.cli.audit import audit, dashboard, gc  # noqa: E402

app.command()(audit)
app.command()(dashboard)
app.command()(gc)


# repro and export (issue 15) live in their own module; it imports only typer at start-up.
from fusion_oci.cli.repro import register as _register_repro  # noqa: E402

_register_repro(app)


def _mount_images(argv: list[str]) -> None:
    """The `images` sub-app, mounted only when it can be asked for: its imports (SDKs, rich
    progress) would otherwise slow down every `fusion-oci run`."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first in (None, "images"):
        from fusion_oci.cli.images import app as images_app

        app.add_typer(images_app, name="images")


def main() -> None:
    _mount_images(sys.argv[1:])
    try:
        status = app(standalone_mode=False)
    except typer.Abort:
        sys.exit(130)
    except typer.TyperException as exc:
        # Usage errors (typer's own click): exit 2, and with --json one error object like
        # every other failure.
        show = getattr(exc, "show", None)
        if "--json" in sys.argv[1:]:
            from fusion_oci.errors import FlagError

            fmt = getattr(exc, "format_message", None)
            message = fmt() if callable(fmt) else str(exc)
            typer.echo(json.dumps(FlagError(message, "", "see `fusion-oci --help`").to_json()))
        elif callable(show):
            show()
        sys.exit(getattr(exc, "exit_code", 2))
    except SystemExit:
        raise
    except Exception as exc:  # the last line of defence: no traceback for users
        from fusion_oci.errors import FusionOCIError

        if isinstance(exc, FusionOCIError):
            _fail(exc)
        typer.echo(f"fusion-oci: internal error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(125)
    sys.exit(status if isinstance(status, int) else 0)


if __name__ == "__main__":
    main()
