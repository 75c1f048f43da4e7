"""``fusion-oci``: run, plan, doctor, bundle, settings, audit, dashboard, gc, images.

Exit status: the command's own; 124 on timeout; 125 when the sandbox could not be set up;
2 for bad settings or flags; 126/127 as a shell would (the command's own).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from fusion_oci.cli.choices import choice as _choice

if TYPE_CHECKING:
    from fusion_oci.cli.task import TaskFlags

HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="fusion-oci",
    help="Run coding-agent executor commands inside a sandbox around the task's worktree.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion: the choices below complete in the shell
    pretty_exceptions_enable=False,
    context_settings=HELP_OPTIONS,
    rich_markup_mode=None,  # plain click help: rich's renderer alone doubles `--help`'s start-up
)
bundle_app = typer.Typer(help="Write OCI bundles.", no_args_is_help=True,
                         context_settings=HELP_OPTIONS, rich_markup_mode=None)
settings_app = typer.Typer(help="Show and check the effective settings.", no_args_is_help=True,
                           context_settings=HELP_OPTIONS, rich_markup_mode=None)
app.add_typer(bundle_app, name="bundle")
app.add_typer(settings_app, name="settings")


def _version(value: bool) -> None:
    if value:
        from fusion_oci import __version__

        typer.echo(f"fusion-oci {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Run coding-agent executor commands inside a sandbox around the task's worktree."""


BACKEND_CHOICES = ("native", "bubblewrap", "landlock", "oci", "podman", "docker", "sandbox-exec",
                   "custom")

# --- shared options -------------------------------------------------------------------------

Backend = Annotated[str | None, typer.Option(
    "--backend", help="The sandbox backend (default: the settings', else native).",
    **_choice("--backend", BACKEND_CHOICES))]
Worktree = Annotated[Path | None, typer.Option(
    "--worktree", help="The task's worktree (default: the top of the git work tree holding the "
    "current directory).")]
ProjectDir = Annotated[Path | None, typer.Option(
    "--project-dir", help="The project root whose .fusion/ holds settings and the audit log "
    "(default: a linked worktree's main repository, else the worktree).")]
UnsafeWorktree = Annotated[bool, typer.Option(
    "--unsafe-worktree", help="Accept a worktree that is /, $HOME or holds it, or is not the "
    "top of a git work tree.")]
Image = Annotated[str | None, typer.Option(
    "--image", help="Image for container backends (images/ name or reference).")]
Network = Annotated[str | None, typer.Option(
    "--network", help="none: no network; egress: outbound only, not the host's loopback "
    "services; host: the host's network.", **_choice("--network", ("none", "egress", "host")))]
AllowPath = Annotated[list[str] | None, typer.Option(
    "--allow-path", help="Host path visible read-only (repeatable).")]
WritablePath = Annotated[list[str] | None, typer.Option(
    "--writable-path", help="Host path visible read-write (repeatable).")]
EnvName = Annotated[list[str] | None, typer.Option(
    "--env", help="Name of a caller env var to pass through (repeatable).")]
MemoryMb = Annotated[int | None, typer.Option("--memory-mb", help="Memory limit in MiB.")]
Cpus = Annotated[float | None, typer.Option("--cpus", help="CPU quota in cores.")]
CpuTime = Annotated[int | None, typer.Option("--cpu-time-ms", help="CPU time limit (ms).")]
Pids = Annotated[int | None, typer.Option("--pids", help="Most processes at once.")]
TimeoutMs = Annotated[int | None, typer.Option("--timeout-ms", help="Wall-clock limit (ms).")]
MaxBuffer = Annotated[int | None, typer.Option(
    "--max-buffer", help="Most bytes kept of stdout and of stderr.")]
FailureMode = Annotated[str | None, typer.Option(
    "--failure-mode", help="When the backend is unavailable: fail (exit 125) or run natively.",
    **_choice("--failure-mode", ("fail-hard", "fallback-native")))]
TaskId = Annotated[str | None, typer.Option(
    "--task-id", help="The task's id, in audit events and container names (default: adhoc).")]
RunId = Annotated[str | None, typer.Option(
    "--run-id", help="The task run's id, in audit events (default: a new one).")]
TaskPrompt = Annotated[Path | None, typer.Option(
    "--task-prompt", help="File with the task prompt (may hold a **Sandbox:** override); "
    "- reads it from stdin.")]
CacheMode = Annotated[str | None, typer.Option(
    "--cache-mode", help="Package caches: shared per project, isolated per task, or off.",
    **_choice("--cache-mode", ("shared", "isolated", "off")))]
HostCa = Annotated[str | None, typer.Option(
    "--host-ca", help="auto|off|PATH: share the host CA bundle.")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
Command = Annotated[list[str], typer.Argument(
    help="One argument: a shell command line. Several: an argv.", show_default=False)]


def _fail(exc: Exception, as_json: bool = False) -> NoReturn:
    """Report an error (one JSON object on stdout with ``--json``) and exit with its status."""
    from fusion_oci.errors import FusionOCIError

    code = exc.exit_code if isinstance(exc, FusionOCIError) else 125
    if as_json:
        body = exc.to_json() if isinstance(exc, FusionOCIError) else {"error": {
            "kind": "setup-failed", "what": str(exc), "why": "", "hint": "", "unenforced": []}}
        typer.echo(json.dumps(body))
    else:
        typer.echo(f"fusion-oci: {exc}", err=True)
    raise typer.Exit(code)


def _flags(params: dict[str, Any]) -> TaskFlags:
    """The command's own parameters (its ``locals()``) that are task flags."""
    import dataclasses

    from fusion_oci.cli.task import TaskFlags

    names = {f.name for f in dataclasses.fields(TaskFlags)}
    return TaskFlags(**{k: v for k, v in params.items() if k in names})


def _command(command: list[str]) -> str | list[str]:
    return command[0] if len(command) == 1 else command


def _tty(command: list[str]) -> list[str]:
    """COMMAND under `script`, which gives it a pseudo-terminal inside the sandbox (so it works
    on every backend) and exits with its status; the size of our terminal, when we have one."""
    import shlex

    line = command[0] if len(command) == 1 else shlex.join(command)
    if sys.stdout.isatty():
        import os

        size = os.get_terminal_size(sys.stdout.fileno())
        line = f"stty cols {size.columns} rows {size.lines} 2>/dev/null; {line}"
    return ["script", "-qec", line, "/dev/null"]


def _pass_through(stream: str, chunk: bytes) -> bool:
    """`run` without --json: the command's bytes as they come, in order, like `docker run`.
    False when our stdout's reader has gone (`run ... | head`)."""
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


def _warn(warnings: list[str]) -> None:
    for line in warnings:
        typer.echo(f"fusion-oci: warning: {line}", err=True)


def _console() -> Any:
    """rich's Console, without its 80-column limit when the output is not a terminal
    (`plan | less` must not cut JSON strings)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=100_000, soft_wrap=True)


# --- run ------------------------------------------------------------------------------------


@app.command(context_settings={"allow_interspersed_args": False})
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
        "-i", "--interactive", help="Feed this process's stdin to the command (read to its "
        "end first; container backends take at most 96 KiB).")] = False,
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
    params = dict(locals())
    import asyncio
    import signal

    from fusion_oci.audit import AuditLog, default_audit_path
    from fusion_oci.cli.task import caller_env, resolve_task
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.images.gates import tty_ask
    from fusion_oci.otel import attach_from_env
    from fusion_oci.sandbox import Sandbox

    received: list[int] = []

    async def go() -> Any:
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        sandbox = Sandbox(task.effective.settings, audit=audit, env=environ,
                          ask=tty_ask(assume_yes=allow_provision))
        preparing = True

        def on_signal(signum: int) -> None:
            received.append(signum)
            if preparing and main is not None:
                main.cancel()  # nothing runs yet: stop the prepare, then dispose
            else:
                sandbox.abort()

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, on_signal, int(sig))

        def pass_through(stream: str, chunk: bytes) -> None:
            # Like a shell pipeline: the reader of our stdout gone ends the command (SIGPIPE).
            if not _pass_through(stream, chunk) and not received:
                received.append(int(signal.SIGPIPE))
                sandbox.abort()

        run_opts = opts if as_json else opts.model_copy(
            update={"on_output": pass_through, "keep_output": False})
        async with sandbox:
            await sandbox.prepare(task.ctx)
            preparing = False
            if not as_json and sandbox.runtime is not None and sandbox.runtime.id == "native" \
                    and not sandbox.fell_back:
                sys.stderr.write("fusion-oci: note: the native backend isolates nothing (the "
                                 "command runs on the host as you)\n")
            return await sandbox.run(_tty(command) if tty else _command(command), run_opts)

    try:
        flags = _flags(params)
        if interactive and flags.task_prompt is not None and str(flags.task_prompt) == "-":
            from fusion_oci.errors import FlagError

            raise FlagError("--interactive with --task-prompt -", "both read stdin",
                            "pass the task prompt as a file")
        environ = caller_env()
        task = resolve_task(flags, environ)
        audit = AuditLog(audit_log or default_audit_path(task.project_dir))
        attach_from_env(audit, environ)  # OpenTelemetry, when OTEL_* asks for it
        opts = task.opts
        if interactive:
            opts = opts.model_copy(update={"stdin": sys.stdin.buffer.read()})
        result = asyncio.run(go())
    except FusionOCIError as exc:
        _fail(exc, as_json)
    except (KeyboardInterrupt, asyncio.CancelledError):
        raise typer.Exit(128 + (received[0] if received else signal.SIGINT)) from None
    if as_json:
        typer.echo(result.model_dump_json(by_alias=True))
    else:
        if result.timed_out:
            sys.stderr.write(f"fusion-oci: timed out after {task.opts.timeout_ms} ms\n")
        elif result.reason not in ("exit", "signal") and received != [signal.SIGPIPE]:
            sys.stderr.write(f"fusion-oci: command ended: {result.reason}\n")
        if result.fell_back:
            sys.stderr.write("fusion-oci: fell back to the native runtime (see audit)\n")
    if result.reason == "aborted" and received:
        raise typer.Exit(128 + received[0])
    raise typer.Exit(result.shell_status)


# --- plan -----------------------------------------------------------------------------------


@app.command(context_settings={"allow_interspersed_args": False})
def plan(
    command: Command,
    backend: Backend = None, worktree: Worktree = None, image: Image = None,
    network: Network = None, allow_path: AllowPath = None, writable_path: WritablePath = None,
    env: EnvName = None, memory_mb: MemoryMb = None, cpus: Cpus = None,
    cpu_time_ms: CpuTime = None, pids: Pids = None, timeout_ms: TimeoutMs = None,
    max_buffer: MaxBuffer = None, failure_mode: FailureMode = None, task_id: TaskId = None,
    run_id: RunId = None, task_prompt: TaskPrompt = None, cache_mode: CacheMode = None,
    host_ca: HostCa = None, project_dir: ProjectDir = None, unsafe_worktree: UnsafeWorktree = False,
    as_json: AsJson = False,
) -> None:
    """Dry run: the resolved policy, the bundle's config.json and the runtime's launch plan."""
    params = dict(locals())
    from fusion_oci.cli.task import caller_env, resolve_task
    from fusion_oci.errors import FusionOCIError

    try:
        flags = _flags(params)
        environ = caller_env()
        task = resolve_task(flags, environ)
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
        sections = ((f"policy ({data['policyHash']})", "policy"), ("config.json", "config"),
                    (f"launch plan: {data['backend']}", "launch"))
        for title, key in sections:
            typer.echo(f"== {title}")
            typer.echo(json.dumps(data[key], indent=2))
            if key == "policy" and data["unenforced"]:
                typer.echo("not enforced by this backend: " + ", ".join(data["unenforced"]))
        return
    console = Console()
    console.rule(f"policy ({data['policyHash']})")
    console.print(Syntax(json.dumps(data["policy"], indent=2), "json"))
    if data["unenforced"]:
        console.print("[yellow]not enforced by this backend:[/] " + ", ".join(data["unenforced"]))
    console.rule("config.json")
    console.print(Syntax(json.dumps(data["config"], indent=2), "json"))
    console.rule(f"launch plan: {data['backend']}")
    console.print(Syntax(json.dumps(data["launch"], indent=2), "json"))


def dry_run(task: Any, command: str | list[str], environ: dict[str, str]) -> dict[str, Any]:
    """Compile everything a run would, create nothing, start nothing: the same resolve step
    and compiler as a run (fusion_oci.resolve), with ``create=False``."""
    from fusion_oci.oci.host import probe_host
    from fusion_oci.resolve import compile_spec, resolve
    from fusion_oci.runtimes.base import check_spec, default_cache_root, unenforced_parts
    from fusion_oci.runtimes.registry import create_runtime

    settings = task.effective.settings
    host = probe_host()
    runtime = create_runtime(settings.backend, settings, environ, host=host)
    resolved = resolve(settings, task.ctx, host, env=environ,
                       cache_root=default_cache_root(environ),
                       default_image=getattr(runtime, "default_image", None), create=False)
    spec = compile_spec(resolved, command, task.opts)
    avail = runtime.availability()
    missing = unenforced_parts(runtime, task.ctx.policy)
    if runtime.id != "native":
        # What the lifecycle refuses: the policy's parts and the spec's (check_spec).
        missing = sorted(set(missing) | set(check_spec(runtime, spec)))
        missing += resolved.unprotected()
    close = getattr(runtime, "close", None)
    if callable(close):
        close()  # a probed engine client is dropped now, not whenever it is collected
    return {
        "backend": runtime.id,
        "available": avail.available,
        "availability": avail.reason or None,
        "policy": task.ctx.policy.model_dump(mode="json", by_alias=True),
        "policyHash": task.ctx.policy.digest(),
        "unenforced": missing,
        "config": spec,
        "launch": runtime.plan(spec).to_json(),
    }


# --- doctor ---------------------------------------------------------------------------------


@app.command()
def doctor(worktree: Worktree = None, project_dir: ProjectDir = None,
           as_json: AsJson = False) -> None:
    """For every known backend: available here?, version, rootless, capabilities, the fix.

    Reads the settings (global, project) and exits 1 when the configured backend is
    unavailable here, 2 when the settings are bad.
    """
    import os

    from fusion_oci.cli.task import find_project_dir
    from fusion_oci.doctor import backend_rows
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.policy.settings import load_settings
    from fusion_oci.policy.worktree import default_worktree

    where = (worktree.expanduser().absolute() if worktree is not None
             else default_worktree(Path.cwd().absolute()))
    project = find_project_dir(where, project_dir)
    try:
        effective = load_settings(project_dir=project, env=os.environ)
    except FusionOCIError as exc:
        _fail(exc, as_json)
    _warn(effective.warnings)
    configured = effective.settings.backend
    rows = backend_rows(os.environ, effective.settings, oci_variants=True)
    chosen = next(r for r in rows if r["backend"] == configured)
    summary = {"backend": configured,
               "source": effective.provenance.get("backend", "default"),
               "failureMode": effective.settings.failure_mode,
               "available": chosen["available"]}
    status = 0 if chosen["available"] else 1
    if as_json:
        typer.echo(json.dumps({"configured": summary, "backends": rows}, indent=2))
        raise typer.Exit(status)
    from rich.table import Table

    table = Table(title="fusion-oci backends on this host")
    for col in ("backend", "available", "version", "rootless", "enforces", "fix"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(
            str(row["backend"]) + (f" ({row['ociRuntime']})" if row.get("ociRuntime") else "")
            + (" (configured)" if row is chosen else ""),
            "[green]yes[/]" if row["available"] else "[red]no[/]",
            str(row["version"] or "-"),
            "-" if row["rootless"] is None else ("yes" if row["rootless"] else "no"),
            ", ".join(row["enforces"]) or "-",
            "" if row["available"] else f"{row['reason']}\n{row['hint'] or ''}".strip(),
        )
    _console().print(table)
    for row in rows:
        # landlock's: user namespaces are forbidden here, and landlock still isolates.
        if (row["details"] or {}).get("recommendation"):
            _console().print(f"[bold]{row['backend']}[/]: {row['details']['recommendation']}")
    if status:
        typer.echo(f"fusion-oci: the configured backend '{configured}' ({summary['source']}) "
                   f"is unavailable here (failureMode {summary['failureMode']})", err=True)
    raise typer.Exit(status)


# --- serve ----------------------------------------------------------------------------------

from fusion_oci.cli.serve import serve as _serve  # noqa: E402  (only typer: cheap to import)

app.command("serve")(_serve)


# --- bundle ---------------------------------------------------------------------------------


@bundle_app.command("create", context_settings={"allow_interspersed_args": False})
def bundle_create(
    command: Command,
    output: Annotated[Path, typer.Option("-o", "--output", help="Bundle directory to write.")],
    worktree: Worktree = None, image: Image = None, network: Network = None,
    allow_path: AllowPath = None, writable_path: WritablePath = None, env: EnvName = None,
    memory_mb: MemoryMb = None, cpus: Cpus = None, cpu_time_ms: CpuTime = None,
    pids: Pids = None, task_id: TaskId = None, run_id: RunId = None,
    cache_mode: CacheMode = None, host_ca: HostCa = None, project_dir: ProjectDir = None,
    unsafe_worktree: UnsafeWorktree = False,
) -> None:
    """Write an OCI bundle (config.json + rootfs/) for COMMAND, atomically."""
    params = dict(locals())
    from fusion_oci.cli.task import caller_env, resolve_task
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.oci.bundle import write_bundle
    from fusion_oci.oci.host import probe_host
    from fusion_oci.resolve import compile_spec, resolve
    from fusion_oci.runtimes.base import default_cache_root
    from fusion_oci.runtimes.registry import runtime_class

    try:
        target = output.absolute()
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            from fusion_oci.errors import FlagError

            raise FlagError(f"-o/--output {target}", "it exists and is not an empty directory",
                            "choose a new directory, or remove the old bundle first")
        flags = _flags(params)
        environ = caller_env()
        task = resolve_task(flags, environ)
        settings = task.effective.settings
        # The configured backend's default image, as `plan` and a run choose it: the bundle
        # written is the bundle that backend would run.
        default_image = getattr(runtime_class(settings.backend, settings), "default_image", None)
        resolved = resolve(settings, task.ctx, probe_host(), env=environ,
                           cache_root=default_cache_root(environ), default_image=default_image)
        spec = compile_spec(resolved, _command(command), task.opts)
        bundle = write_bundle(spec, output)
    except FusionOCIError as exc:
        _fail(exc)
    typer.echo(str(bundle.path))


# --- settings -------------------------------------------------------------------------------


def _load_for(worktree: Path | None, task_prompt: Path | None, project_dir: Path | None,
              unsafe_worktree: bool) -> Any:
    from fusion_oci.cli.task import TaskFlags, caller_env, resolve_task

    return resolve_task(TaskFlags(worktree=worktree, task_prompt=task_prompt,
                                  project_dir=project_dir, unsafe_worktree=unsafe_worktree),
                        caller_env())


@settings_app.command("show")
def settings_show(worktree: Worktree = None, task_prompt: TaskPrompt = None,
                  project_dir: ProjectDir = None, unsafe_worktree: UnsafeWorktree = False,
                  as_json: AsJson = False) -> None:
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
    rows = [{"key": key, "value": value, "source": prov.get(key, "default")}
            for key, value in values.items()]
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


@settings_app.command("validate")
def settings_validate(worktree: Worktree = None, task_prompt: TaskPrompt = None,
                      project_dir: ProjectDir = None,
                      unsafe_worktree: UnsafeWorktree = False) -> None:
    """Check the global and project settings files (exit 2 with the error when bad)."""
    from fusion_oci.errors import FusionOCIError

    try:
        task = _load_for(worktree, task_prompt, project_dir, unsafe_worktree)
    except FusionOCIError as exc:
        _fail(exc)
    _warn(task.effective.warnings)
    sources = sorted(set(task.effective.provenance.values())) or ["defaults only"]
    typer.echo("settings OK: " + ", ".join(sources))


# --- audit ----------------------------------------------------------------------------------


@app.command()
def audit(
    worktree: Worktree = None,
    project_dir: ProjectDir = None,
    audit_log: Annotated[Path | None, typer.Option(
        "--audit-log", help="Audit JSONL file (default: PROJECT/.fusion/sandbox-audit.jsonl).")
    ] = None,
    task: Annotated[str | None, typer.Option("--task", help="Only this task id.")] = None,
    limit: Annotated[int, typer.Option("--limit", help="Most recent N events.")] = 50,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Check the hash chain: report the first edited, removed or forged "
        "line (exit 1).")] = False,
    summary: Annotated[bool, typer.Option(
        "--summary", help="The dashboard's summary (durations, end reasons, fallbacks, gates, "
        "chain) instead of events.")] = False,
    as_json: AsJson = False,
) -> None:
    """Show sandbox audit events as a table (``--json`` for machines)."""
    import os

    from fusion_oci.audit import default_audit_path, default_key_path, load_key, read_events
    from fusion_oci.audit import verify_chain as check_chain
    from fusion_oci.cli.task import find_project_dir
    from fusion_oci.policy.worktree import default_worktree

    where = (worktree.expanduser().absolute() if worktree is not None
             else default_worktree(Path.cwd().absolute()))
    path = audit_log or default_audit_path(find_project_dir(where, project_dir))
    if summary:
        from fusion_oci.dashboard.report import full_summary, render

        data = full_summary(path, task, load_key(default_key_path(os.environ), create=False))
        if as_json:
            typer.echo(json.dumps(data, indent=2))
        else:
            render(data)
        return
    report = check_chain(path, load_key(default_key_path(os.environ), create=False))
    if verify:
        if as_json:
            typer.echo(json.dumps({"path": str(path), "ok": report.ok, "lines": report.lines,
                                   "firstBadLine": report.first_bad_line,
                                   "reason": report.reason, "keyed": report.keyed}))
        elif report.ok:
            keyed = "hashes and MACs" if report.keyed else "hashes only (no audit key here)"
            typer.echo(f"{path}: {report.lines} lines, chain intact ({keyed})")
        else:
            typer.echo(f"{path}: chain broken at line {report.first_bad_line}: {report.reason}")
        raise typer.Exit(0 if report.ok else 1)
    if not report.ok:
        typer.echo(f"fusion-oci: warning: the audit chain of {path} is broken at line "
                   f"{report.first_bad_line}: {report.reason} (see `fusion-oci audit --verify`)",
                   err=True)
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
        status = e.end_reason if e.end_reason not in (None, "exit") else e.exit_code
        table.add_row(e.ts[11:23], e.type.removeprefix("sandbox:"), e.task_id, e.run_id,
                      e.backend, "" if status is None else str(status),
                      "" if e.duration_ms is None else str(e.duration_ms),
                      (e.reason or ", ".join(e.unenforced or []))[:120])
    _console().print(table)


# --- dashboard ------------------------------------------------------------------------------


@app.command()
def dashboard(
    worktree: Worktree = None,
    project_dir: ProjectDir = None,
    audit_log: Annotated[Path | None, typer.Option(
        "--audit-log", help="Audit JSONL file (default: PROJECT/.fusion/sandbox-audit.jsonl).")
    ] = None,
    host: Annotated[str, typer.Option(
        "--host", help="Address to listen on; any but 127.0.0.1/localhost/::1 needs a token.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        "--port", help="TCP port (default 0: a free one). 4040 is always refused.")] = 0,
) -> None:
    """Serve a live page and JSON API of the audit log (Ctrl-C stops it)."""
    import os

    from fusion_oci.audit import default_audit_path
    from fusion_oci.cli.task import find_project_dir
    from fusion_oci.dashboard.chain import host_key
    from fusion_oci.dashboard.server import serve
    from fusion_oci.errors import FusionOCIError
    from fusion_oci.policy.worktree import default_worktree

    try:
        where = (worktree.expanduser().absolute() if worktree is not None
                 else default_worktree(Path.cwd().absolute()))
        path = audit_log or default_audit_path(find_project_dir(where, project_dir))
        serve(path.absolute(), host=host, port=port, echo=typer.echo,
              chain_key=host_key(os.environ))
    except FusionOCIError as exc:
        _fail(exc)


# --- gc -------------------------------------------------------------------------------------


@app.command()
def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would go.")] = False,
    include_caches: Annotated[bool, typer.Option(
        "--include-caches", help="Also remove project cache volumes.")] = False,
    as_json: AsJson = False,
) -> None:
    """Remove what crashed or killed fusion-oci processes left behind: containers and volumes
    (podman, docker) and OCI runtime state (runc), each labelled with a dead owner."""
    import asyncio
    import os

    from fusion_oci.gc import gc as gc_engines
    from fusion_oci.runtimes.oci import gc_oci

    report = gc_engines(env=os.environ, include_caches=include_caches, dry_run=dry_run)
    oci_removed: list[str] = [] if dry_run else asyncio.run(gc_oci(env=os.environ))
    removed = report.removed + [f"oci {name}" for name in oci_removed]
    if as_json:
        typer.echo(json.dumps({"removed": removed, "kept": report.kept,
                               "errors": report.errors, "engines": report.engines}, indent=2))
    else:
        verb = "would remove" if dry_run else "removed"
        for item in removed:
            typer.echo(f"{verb} {item}")
        for err in report.errors:
            typer.echo(f"error: {err}", err=True)
        typer.echo(f"{len(removed)} {'to remove' if dry_run else 'removed'}; engines: "
                   + ", ".join(report.engines))
    raise typer.Exit(1 if report.errors else 0)


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
