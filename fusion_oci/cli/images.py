"""``fusion-oci images …``: a typer sub-app the main CLI mounts (``app.add_typer(images_app,
name="images")``). Thin: parsing and printing only; the work is in :mod:`fusion_oci.images.ops`.

Exit status: 0; 125 when provisioning failed or a gate denied it; 2 for bad settings.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

from fusion_oci.cli.choices import choice

if TYPE_CHECKING:
    from fusion_oci.images.ops import Session
    from fusion_oci.images.provision import ProvisionedImage

images_app = typer.Typer(
    help="Build, pull, list and prune task images.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode=None,
)
app = images_app
"""The name fusion_oci.cli.main mounts."""

T = TypeVar("T")

EngineOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--engine",
        help="An engine to use (repeatable; default: every engine that answers).",
        **choice("--engine", ("podman", "podman-rootless", "docker", "docker-rootless")),
    ),
]
BaseOpt = Annotated[
    str | None,
    typer.Option(
        "--base",
        help="BASE for images/ builds: a reference, or 'offline' for "
        "localhost/fusion-oci/base:bookworm (default: the public base if it can be had).",
    ),
]
MirrorOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--mirror", help="Registry mirror tried before the image's own registry (repeatable)."
    ),
]
ProjectOpt = Annotated[
    Path | None,
    typer.Option(
        "--project", help="Project directory whose .fusion/settings.yaml applies (default: cwd)."
    ),
]
ImagesDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--images-dir", help="Folder of image build contexts (default: fusion-oci's images/)."
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _fail(exc: Exception) -> NoReturn:
    from fusion_oci.errors import FusionOCIError

    code = exc.exit_code if isinstance(exc, FusionOCIError) else 125
    typer.echo(f"fusion-oci: {exc}", err=True)
    raise typer.Exit(code)


def _guarded(fn: Callable[[], T]) -> T:
    from fusion_oci.errors import FusionOCIError

    try:
        return fn()
    except FusionOCIError as exc:
        _fail(exc)


def _run(coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return _guarded(lambda: asyncio.run(coro()))


def _session(project: Path | None) -> Session:
    from fusion_oci.audit import AuditLog, default_audit_path
    from fusion_oci.images.ops import Session
    from fusion_oci.images.progress import default_reporter
    from fusion_oci.policy.settings import load_settings, project_settings_path

    project_dir = (project or Path.cwd()).resolve()
    env = dict(os.environ)
    effective = _guarded(lambda: load_settings(project_dir=project_dir, env=env))
    has_project = (project_dir / ".fusion").is_dir()
    audit = AuditLog(default_audit_path(project_dir) if has_project else None)
    return Session(
        env=env,
        settings=effective.settings,
        audit=audit,
        reporter=default_reporter(sys.stderr),
        settings_file=str(project_settings_path(project_dir)),
        project_dir=project_dir,
    )


def _check_names(names: list[str], images_dir: Path | None) -> None:
    """A NAME that is no folder under images/ is a usage error (exit 2), with the known ones."""
    from fusion_oci.errors import FlagError
    from fusion_oci.images.spec import CONTAINERFILE, SELF_IMAGE, default_images_dir

    root = images_dir or default_images_dir()
    known = (
        sorted(p.name for p in root.iterdir() if (p / CONTAINERFILE).is_file())
        if root.is_dir()
        else []
    )
    for name in names:
        if name != SELF_IMAGE and name not in known:
            import difflib

            near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
            _fail(
                FlagError(
                    f"images build {name}",
                    f"there is no image folder {root / name}",
                    (f"did you mean {near[0]}? " if near else "")
                    + f"images here: {', '.join(known) or 'none'}",
                )
            )


def _base(value: str | None) -> str | None:
    from fusion_oci.images.spec import BASE_REF

    return BASE_REF if value == "offline" else value


def _print_provisioned(rows: list[tuple[str, ProvisionedImage]], as_json: bool) -> None:
    if as_json:
        typer.echo(
            json.dumps(
                [
                    {
                        "engine": e,
                        "reference": p.ref,
                        "digest": p.digest,
                        "action": p.action,
                        "seconds": round(p.seconds, 3),
                        **({"why": p.why} if p.why else {}),
                    }
                    for e, p in rows
                ],
                indent=2,
            )
        )
        return
    said: set[str] = set()
    for engine, p in rows:
        if p.why and p.ref not in said:
            said.add(p.ref)
            typer.echo(p.why)
        typer.echo(f"{engine:16} {p.action:8} {p.ref}  {p.digest[:19]}  {p.seconds:.1f}s")


@images_app.command("build")
def build(
    names: Annotated[
        list[str] | None,
        typer.Argument(
            help="Folders under images/ (default: the node task image, with the Node.js and "
            "package manager the project declares).",
            show_default=False,
        ),
    ] = None,
    engine: EngineOpt = None,
    base: BaseOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Build even when the tag exists.")] = False,
    mirror: MirrorOpt = None,
    project: ProjectOpt = None,
    images_dir: ImagesDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Build images from images/NAME (tag = content hash of what goes in; unchanged = no build).

    Without NAME: the node image for the project (--project, default the current directory):
    Node.js from .nvmrc, .node-version or package.json engines.node (else the current LTS),
    the package manager from packageManager (else pnpm); the first line says which and why.
    """
    from fusion_oci.images.ops import build_images

    _check_names(names or [], images_dir)
    session = _session(project)
    rows = _run(
        lambda: build_images(
            session,
            names or [],
            engine or [],
            base=_base(base),
            force=force,
            mirrors=mirror or [],
            images_dir=images_dir,
        )
    )
    _print_provisioned(rows, as_json)


@images_app.command("prebuild")
def prebuild(
    engine: EngineOpt = None,
    base: BaseOpt = None,
    mirror: MirrorOpt = None,
    project: ProjectOpt = None,
    images_dir: ImagesDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Provision every image the project's settings reference (sandbox.image, and each of
    sandbox.services), e.g. in CI.

    The node image is fitted to the project's files; when nothing changed, nothing is built.
    """
    from fusion_oci.images import ops

    session = _session(project)
    rows = _run(
        lambda: ops.prebuild(
            session, engine or [], base=_base(base), mirrors=mirror or [], images_dir=images_dir
        )
    )
    if not rows and not as_json:
        typer.echo("no image referenced by the settings (sandbox.image and services are unset)")
    _print_provisioned(rows, as_json)


@images_app.command("pull")
def pull(
    refs: Annotated[list[str], typer.Argument(help="Full image references.")],
    engine: EngineOpt = None,
    mirror: MirrorOpt = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Pull images with retries of transient failures (mirrors first, in order)."""
    from fusion_oci.images.ops import pull_images

    session = _session(project)
    rows = _run(lambda: pull_images(session, refs, engine or [], mirrors=mirror or []))
    _print_provisioned(rows, as_json)


@images_app.command("list")
def list_(
    engine: EngineOpt = None,
    project: ProjectOpt = None,
    images_dir: ImagesDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Images fusion-oci made: engine, name, reference, digest, and whether they are current."""
    from fusion_oci.images.ops import list_images

    session = _session(project)
    rows = _guarded(lambda: list_images(session, engine or [], images_dir=images_dir))
    if as_json:
        typer.echo(json.dumps([r.to_json() for r in rows], indent=2))
        return
    for r in rows:
        state = "current" if r.current else "stale"
        typer.echo(
            f"{r.engine:16} {r.name:8} {r.ref:48} {r.digest[:19]}  {state:7} {r.size >> 20} MiB"
        )


@images_app.command("prune")
def prune(
    engine: EngineOpt = None,
    everything: Annotated[
        bool,
        typer.Option(
            "--all", help="Remove every image fusion-oci made, current ones and the base too."
        ),
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only say what would go.")] = False,
    project: ProjectOpt = None,
    images_dir: ImagesDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove stale builds (tags the build contexts no longer hash to)."""
    from fusion_oci.images.ops import prune_images

    session = _session(project)
    rows = _guarded(
        lambda: prune_images(
            session, engine or [], everything=everything, dry_run=dry_run, images_dir=images_dir
        )
    )
    if as_json:
        typer.echo(json.dumps([r.to_json() for r in rows], indent=2))
        return
    verb = "would remove" if dry_run else "removed"
    for r in rows:
        typer.echo(f"{verb} {r.engine}: {r.ref}")
    if not rows:
        typer.echo("nothing to prune")


@images_app.command("bootstrap-base")
def bootstrap_base(
    engine: EngineOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Make it again even if present.")] = False,
    mirror: Annotated[
        str | None,
        typer.Option(
            "--debian-mirror", help="Debian archive (default http://deb.debian.org/debian)."
        ),
    ] = None,
    project: ProjectOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """debootstrap --variant=minbase bookworm and import it as localhost/fusion-oci/base:bookworm
    into each engine that lacks it (needs root)."""
    from fusion_oci.images.ops import bootstrap

    session = _session(project)
    result = _run(lambda: bootstrap(session, engine or [], force=force, mirror=mirror))
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "reference": result.ref,
                    "actions": result.actions,
                    "digests": result.ids,
                    "debootstrapSeconds": round(result.debootstrap_s, 1),
                },
                indent=2,
            )
        )
        return
    for name, action in result.actions.items():
        typer.echo(f"{name:16} {action:8} {result.ref}  {result.ids.get(name, '')[:19]}")
