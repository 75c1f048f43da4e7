"""The ``fusion-oci images`` commands as functions: build, prebuild, pull, list, prune, bootstrap.

Each takes engine names (podman, podman-rootless, docker; empty = every engine that answers),
talks to them through the SDKs and returns plain data the CLI prints (or renders as JSON).
An explicit command is the person's consent, so it clears the ``ask`` gates; a ``deny`` in the
settings still wins.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusion_oci.audit import AuditLog
from fusion_oci.engines import EngineAdapter, EngineTarget, ImageInfo, engine_targets, open_target
from fusion_oci.errors import ProvisionError
from fusion_oci.images.bootstrap import BootstrapResult, bootstrap_base
from fusion_oci.images.context import context_hash as _context_hash
from fusion_oci.images.gates import AuditContext, GateName, ProvisionGate
from fusion_oci.images.npm_registry import Registry
from fusion_oci.images.progress import Reporter
from fusion_oci.images.provision import ProvisionedImage, ProvisionOptions, ensure_image
from fusion_oci.images.spec import (
    BASE_REF,
    CONTAINERFILE,
    LABEL_MANAGED,
    LABEL_NAME,
    LABEL_SOURCE,
    LOCAL_REPO,
    default_images_dir,
    image_context,
    resolve_image,
    takes_toolchain,
)
from fusion_oci.policy.settings import SandboxSettings

ENGINE_NAMES = ("podman", "podman-rootless", "docker", "docker-rootless")
PROJECT_IMAGE = "node"
"""What ``images build`` without a NAME builds: the task image, fitted to the worktree."""
EXPLICIT: frozenset[GateName] = frozenset({"sandbox_provision", "network_api"})


@dataclass
class Session:
    """What every command shares: env, settings, audit, progress."""

    env: Mapping[str, str]
    settings: SandboxSettings = field(default_factory=SandboxSettings)
    audit: AuditLog = field(default_factory=AuditLog)
    reporter: Reporter | None = None
    task_id: str = "images"
    run_id: str = field(default_factory=lambda: f"cli-{int(time.time())}-{os.getpid()}")
    settings_file: str = ".fusion/settings.yaml"
    project_dir: Path | None = None
    """The worktree whose files choose the ``node`` image's Node.js and package manager."""
    registry: Registry | None = None
    """The npm registry for toolchains (None: from ``env``)."""

    def ctx(self, backend: str = "images") -> AuditContext:
        return AuditContext(self.audit, self.task_id, self.run_id, backend)


@dataclass(frozen=True)
class EngineStatus:
    name: str
    url: str
    version: str | None
    error: str | None = None


def image_names(images_dir: Path | None = None) -> list[str]:
    """Every folder under ``images/`` with a Containerfile (``base`` comes from bootstrap)."""
    root = images_dir or default_images_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / CONTAINERFILE).is_file())


def probe_engines(names: Sequence[str], env: Mapping[str, str]) -> list[EngineStatus]:
    """Which of the named engines answer (empty ``names``: all of them)."""
    targets = engine_targets(env)
    out: list[EngineStatus] = []
    for name in names or ENGINE_NAMES:
        if name not in targets:
            raise ProvisionError(
                f"unknown engine '{name}'",
                "",
                "use podman, podman-rootless, docker or docker-rootless",
            )
        target = targets[name]
        try:
            with open_target(target) as client:
                out.append(EngineStatus(name, target.url, client.ping()))
        except ProvisionError as exc:
            out.append(EngineStatus(name, target.url, None, exc.why or str(exc)))
    return out


def select_targets(names: Sequence[str], env: Mapping[str, str]) -> list[EngineTarget]:
    """Named engines must answer; with no names, every engine that answers (at least one)."""
    statuses = probe_engines(names, env)
    down = [s for s in statuses if s.version is None]
    if names and down:
        raise ProvisionError(
            "engine not reachable: " + ", ".join(s.name for s in down),
            "; ".join(f"{s.name} at {s.url}: {s.error}" for s in down),
            "start it (scripts/services.sh start), or choose another with --engine",
        )
    up = [s for s in statuses if s.version is not None]
    if not up:
        raise ProvisionError(
            "no container engine answers",
            "; ".join(f"{s.name} at {s.url}: {s.error}" for s in statuses),
            "start podman or docker, or point podman.url / docker.url at it",
        )
    targets = engine_targets(env)
    # rootful podman first: the others load what it builds.
    order = {n: i for i, n in enumerate(ENGINE_NAMES)}
    return sorted((targets[s.name] for s in up), key=lambda t: order[t.name])


async def build_images(
    session: Session,
    names: Sequence[str],
    engines: Sequence[str] = (),
    *,
    base: str | None = None,
    force: bool = False,
    mirrors: Sequence[str] = (),
    images_dir: Path | None = None,
) -> list[tuple[str, ProvisionedImage]]:
    """Build (or load, when another engine has it) each image into each engine.

    No ``names``: the ``node`` task image with the toolchain the session's project asks for.
    """
    wanted = list(names) or [PROJECT_IMAGE]
    if image_context(wanted[0], images_dir) is None and not names:
        root = images_dir or default_images_dir()
        raise ProvisionError(
            "nothing to build",
            f"no {PROJECT_IMAGE} folder under {root}",
            f"add images/{PROJECT_IMAGE}/Containerfile, or name an image",
        )
    targets = select_targets(engines, session.env)
    out: list[tuple[str, ProvisionedImage]] = []
    for name in wanted:
        first: ProvisionedImage | None = None
        for target in targets:
            if force and first is not None:
                # --force rebuilds once (on the first engine, rootful podman when selected);
                # the others drop their copy and load the new one.
                with open_target(target) as client:
                    client.remove_image(first.ref, force=True)
            opts = ProvisionOptions(
                engine_name=target.name,
                base=base,
                images_dir=images_dir,
                env=session.env,
                reporter=session.reporter,
                allow=EXPLICIT,
                force=force and first is None,
                settings_file=session.settings_file,
                project_dir=session.project_dir,
                registry=session.registry,
            )
            image = await ensure_image(
                target.kind,
                target.url,
                name,
                session.settings,
                session.audit,
                session.task_id,
                session.run_id,
                mirrors=list(mirrors),
                options=opts,
            )
            first = first or image
            out.append((target.name, image))
    return out


async def pull_images(
    session: Session,
    refs: Sequence[str],
    engines: Sequence[str] = (),
    *,
    mirrors: Sequence[str] = (),
) -> list[tuple[str, ProvisionedImage]]:
    out: list[tuple[str, ProvisionedImage]] = []
    for target in select_targets(engines, session.env):
        for ref in refs:
            opts = ProvisionOptions(
                engine_name=target.name,
                env=session.env,
                reporter=session.reporter,
                allow=EXPLICIT,
                settings_file=session.settings_file,
            )
            image = await ensure_image(
                target.kind,
                target.url,
                ref,
                session.settings,
                session.audit,
                session.task_id,
                session.run_id,
                mirrors=list(mirrors),
                options=opts,
            )
            out.append((target.name, image))
    return out


def referenced_images(settings: SandboxSettings) -> list[str]:
    """The images a project's effective settings name: ``sandbox.image``, then each
    service container's (``sandbox.policy.services``), once each."""
    named = [settings.image] if settings.image else []
    named += [s.image for s in settings.policy.services]
    return list(dict.fromkeys(named))


async def prebuild(
    session: Session,
    engines: Sequence[str] = (),
    *,
    base: str | None = None,
    mirrors: Sequence[str] = (),
    images_dir: Path | None = None,
) -> list[tuple[str, ProvisionedImage]]:
    """Provision every image the settings reference (for a CI job before the first task)."""
    refs = referenced_images(session.settings)
    if not refs:
        return []
    default = {
        "podman": ("podman",) if os.geteuid() == 0 else ("podman-rootless",),
        "docker": ("docker",),
    }.get(session.settings.backend, ())
    out: list[tuple[str, ProvisionedImage]] = []
    for name in refs:
        out += await build_images(
            session, [name], engines or default, base=base, mirrors=mirrors, images_dir=images_dir
        )
    return out


@dataclass(frozen=True)
class ListedImage:
    engine: str
    name: str
    ref: str
    digest: str
    current: bool
    """The tag is what the build context hashes to now (False: a stale build, prunable)."""
    size: int
    created: str

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "name": self.name,
            "reference": self.ref,
            "digest": self.digest,
            "current": self.current,
            "size": self.size,
            "created": self.created,
        }


def _current_refs(images_dir: Path | None) -> tuple[set[str], dict[str, set[str]]]:
    """Current tags, and for folders built with a toolchain the current source hashes (any
    project's Node.js of a current folder is current: other worktrees may use it)."""
    refs = {BASE_REF}
    sources: dict[str, set[str]] = {}
    for name in image_names(images_dir):
        context = image_context(name, images_dir)
        if context is not None and takes_toolchain(context):
            sources[name] = {
                _context_hash(context, CONTAINERFILE, args) for args in ({}, {"BASE": BASE_REF})
            }
            continue
        refs.add(resolve_image(name, images_dir=images_dir).ref)
        refs.add(resolve_image(name, images_dir=images_dir, base=BASE_REF).ref)
    return refs, sources


def _managed(client: EngineAdapter) -> list[ImageInfo]:
    return client.images(label=f"{LABEL_MANAGED}=true")


def list_images(
    session: Session, engines: Sequence[str] = (), *, images_dir: Path | None = None
) -> list[ListedImage]:
    """Every image fusion-oci made, per engine: name, reference, digest, current or stale."""
    current, sources = _current_refs(images_dir)
    out: list[ListedImage] = []
    for target in select_targets(engines, session.env):
        with open_target(target) as client:
            for info in _managed(client):
                name = info.labels.get(LABEL_NAME, "?")
                refs = [t for t in info.tags if t.startswith(LOCAL_REPO + "/")] or [info.id]
                fresh = info.labels.get(LABEL_SOURCE, "") in sources.get(name, set())
                for ref in refs:
                    out.append(
                        ListedImage(
                            target.name,
                            name,
                            ref,
                            info.id,
                            ref in current or fresh,
                            info.size,
                            info.created,
                        )
                    )
    return sorted(out, key=lambda i: (i.engine, i.name, i.ref))


def prune_images(
    session: Session,
    engines: Sequence[str] = (),
    *,
    everything: bool = False,
    dry_run: bool = False,
    images_dir: Path | None = None,
) -> list[ListedImage]:
    """Remove stale builds (tags no context hashes to any more); ``everything``: all ours,
    the base included. Returns what was (or, with ``dry_run``, would be) removed."""
    listed = list_images(session, engines, images_dir=images_dir)
    # Only builds of images this images/ folder defines are judged stale: an image another
    # checkout (or another images dir) made is not ours to call out of date.
    known = set(image_names(images_dir))
    doomed = [i for i in listed if everything or (not i.current and i.name in known)]
    targets = engine_targets(session.env)
    ctx = session.ctx()
    for item in doomed:
        if dry_run:
            continue
        with open_target(targets[item.engine]) as client:
            client.remove_image(item.ref, force=False)
        ctx.emit(
            "sandbox:provision",
            f"pruned {item.ref} from {item.engine}",
            action="prune",
            ref=item.ref,
            engine=item.engine,
            digest=item.digest,
            outcome="ok",
        )
    return doomed


async def bootstrap(
    session: Session,
    engines: Sequence[str] = (),
    *,
    force: bool = False,
    mirror: str | None = None,
    suite: str | None = None,
) -> BootstrapResult:
    """``images bootstrap-base`` into the named (or every answering) engine."""
    from fusion_oci.images.bootstrap import DEFAULT_MIRROR, DEFAULT_SUITE

    clients = [open_target(t) for t in select_targets(engines, session.env)]
    ctx = session.ctx("images")
    gate = ProvisionGate(
        session.settings.gates, ctx, None, allow=EXPLICIT, settings_file=session.settings_file
    )
    try:
        return await bootstrap_base(
            clients,
            ctx=ctx,
            gate=gate,
            force=force,
            mirror=mirror or DEFAULT_MIRROR,
            suite=suite or DEFAULT_SUITE,
            reporter=session.reporter,
        )
    finally:
        for client in clients:
            client.close()
