"""``ensure_image``: the provisioning path a container runtime's ``prepare`` goes through.

present? ─yes─► audit digest, return
   │no
   ▼
plan: load from a peer engine that has it │ build (here, or on rootful podman + load) │ pull
   ▼
gates: sandbox_provision (always), network_api (build, pull)   ── denied ─► GateDeniedError
   ▼
per-image lock (other tasks and processes wait, then find it present)
   ▼
build / pull with tenacity retries of transient failures, every attempt audited
   ▼
audit ``sandbox:provision`` with the digest, return ProvisionedImage

Why a peer: docker cannot receive build secrets through its SDK, and rootless podman builds on
vfs storage; building once on rootful podman and loading the archive was measured faster for
both (see the integration tests). A caller who cannot reach rootful podman builds in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fusion_oci.engines import (
    EngineAdapter,
    EngineOpError,
    EngineTarget,
    engine_targets,
    open_target,
)
from fusion_oci.errors import ProvisionError
from fusion_oci.host.cachedir import default_cache_root
from fusion_oci.images.build import build_image, host_ca_for_build
from fusion_oci.images.engine import open_engine
from fusion_oci.images.gates import AuditContext, GateName, GateRequest, ProvisionGate
from fusion_oci.images.progress import NullReporter, Reporter
from fusion_oci.images.pull import pull_image
from fusion_oci.images.retry import RetryPolicy
from fusion_oci.images.spec import (
    BASE_REF,
    PUBLIC_BASE,
    ImageSpec,
    image_context,
    is_short_name,
    resolve_image,
    takes_toolchain,
)

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog
    from fusion_oci.images.npm_registry import Registry
    from fusion_oci.images.recipe import ImageRecipe
    from fusion_oci.images.toolchain import Toolchain
    from fusion_oci.policy.settings import SandboxSettings

Engine = Literal["podman", "docker"]
"""Which SDK talks to the engine (rootless podman is ``podman`` with the user's socket URL)."""

AskCallback = Callable[[GateRequest], bool | Awaitable[bool]]


@dataclass(frozen=True)
class ProvisionedImage:
    ref: str
    """The reference to create containers from."""
    digest: str
    """Image id (``sha256:...``, the config digest) as the engine reports it; audited."""
    action: Literal["present", "built", "pulled", "loaded"]
    repo_digest: str | None = None
    """``registry/repo@sha256:…`` for pulled images (what a registry would serve again)."""
    seconds: float = 0.0
    why: str | None = None
    """For images built with a toolchain: what was chosen and from which project file
    (``node 22 (22.23.5) from .nvmrc, pnpm 9.15.0 from packageManager``)."""


@dataclass(frozen=True)
class ProvisionOptions:
    """The less common knobs of :func:`ensure_image` (all have working defaults)."""

    engine_name: str | None = None
    """podman, podman-rootless, docker or docker-rootless (audit, labels). None: guessed from
    the URL."""
    base: str | None = None
    """``BASE`` for images built from ``images/``. None: the public base if present or
    pullable, else :data:`~fusion_oci.images.spec.BASE_REF`."""
    images_dir: Path | None = None
    peers: Sequence[EngineTarget] | None = None
    """Other engines to load from / build on. None: the host's engines (from ``env``)."""
    env: Mapping[str, str] | None = None
    reporter: Reporter | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    allow: frozenset[GateName] = frozenset()
    """Gates the caller already cleared (a CLI flag, an explicit build command)."""
    force: bool = False
    """Build even when the tag is present (``images build --force``)."""
    lock_dir: Path | None = None
    sleep: Callable[[float], None] | None = None
    settings_file: str = ".fusion/settings.yaml"
    project_dir: Path | None = None
    """The worktree whose ``.nvmrc`` / ``.node-version`` / ``package.json`` decide the
    ``node`` image's toolchain. None (and no ``recipe``): the defaults."""
    recipe: ImageRecipe | None = None
    """An explicit recipe (wins over ``project_dir``)."""
    registry: Registry | None = None
    """The npm registry to resolve and fetch the toolchain from. None: from ``env``
    (:data:`~fusion_oci.images.npm_registry.REGISTRY_ENV`), cached under the cache root."""


async def ensure_image(
    engine: Engine,
    client_or_url: Any,
    image_name: str,
    settings: SandboxSettings,
    audit: AuditLog,
    task_id: str,
    run_id: str,
    *,
    ask: AskCallback | None = None,
    mirrors: list[str] | None = None,
    options: ProvisionOptions | None = None,
) -> ProvisionedImage:
    """Make ``image_name`` present in the engine and return its reference and digest.

    ``client_or_url``: an :class:`~fusion_oci.engines.EngineAdapter` (a runtime passes its own,
    borrowed), or a socket URL (``unix:///...``) for which one is opened and closed here.
    ``image_name`` is what ``settings.image`` says: a folder under ``images/`` (built, tag from
    the context hash) or a full reference (pulled). When missing, the ``sandbox_provision`` gate
    decides first (``ask`` is called for ``ask``; no callback → denied), then ``network_api``
    for builds and pulls; then build or pull with retries of transient failures. Emits
    ``sandbox:gate`` and ``sandbox:provision`` events (the last one with the digest). Raises
    :class:`~fusion_oci.errors.GateDeniedError` or :class:`~fusion_oci.errors.ProvisionError`.
    """
    opts = options or ProvisionOptions()
    env = dict(opts.env if opts.env is not None else os.environ)
    target = open_engine(engine, client_or_url, name=opts.engine_name)
    if opts.engine_name is None:
        target.name = _guess_name(engine, target.url, env)
    ctx = AuditContext(audit, task_id, run_id, backend=target.name)
    gate = ProvisionGate(
        settings.gates, ctx, ask, allow=opts.allow, settings_file=opts.settings_file
    )
    try:
        return await _Provisioner(
            target, settings, ctx, gate, list(mirrors or []), opts, env
        ).ensure(image_name)
    finally:
        target.close()


def default_image_ref(
    name: str,
    *,
    project_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    base: str | None = None,
) -> str:
    """The reference ``name`` (a folder under ``images/``, e.g. ``node``) is built under for
    ``project_dir`` (None: the defaults), without an engine: registry metadata (cached) decides
    the toolchain. For callers that name the image in a file (``export``)."""
    env = dict(os.environ if env is None else env)
    opts = ProvisionOptions(project_dir=project_dir, env=env)
    toolchain = toolchain_for(name, opts, default_registry(env))
    return resolve_image(name, base=base, toolchain=toolchain).ref


def _guess_name(engine: Engine, url: str, env: Mapping[str, str]) -> str:
    if engine == "docker":
        rootless = engine_targets(env)["docker-rootless"].url.rstrip("/")
        return (
            "docker-rootless"
            if url and (url.rstrip("/") == rootless or "/run/user/" in url)
            else "docker"
        )
    rootless = engine_targets(env)["podman-rootless"].url.rstrip("/")
    if url.rstrip("/") == rootless or "/run/user/" in url:
        return "podman-rootless"
    return "podman"


def candidate_specs(
    name: str, images_dir: Path | None, base: str | None, toolchain: Toolchain | None = None
) -> list[ImageSpec]:
    """The specs an image name may already be present as (explicit base, or either base)."""
    first = resolve_image(name, images_dir=images_dir, base=base, toolchain=toolchain)
    if first.kind == "pull" or base is not None:
        return [first]
    return [first, resolve_image(name, images_dir=images_dir, base=BASE_REF, toolchain=toolchain)]


def default_registry(env: Mapping[str, str], host_ca: str = "auto") -> Registry:
    """The npm registry from ``env``, its metadata and tarballs cached under the cache root."""
    from fusion_oci.images.npm_registry import Registry, registry_url

    return Registry(
        registry_url(env), default_cache_root(env) / "npm-registry", ca=host_ca_for_build(host_ca)
    )


def image_recipe(opts: ProvisionOptions) -> ImageRecipe:
    """The recipe the options name: explicit, else the project's files, else the defaults."""
    from fusion_oci.images.recipe import DEFAULT_RECIPE, read_project_files, recipe_for

    if opts.recipe is not None:
        return opts.recipe
    if opts.project_dir is not None:
        return recipe_for(read_project_files(opts.project_dir))
    return DEFAULT_RECIPE


def toolchain_for(name: str, opts: ProvisionOptions, registry: Registry) -> Toolchain | None:
    """The resolved toolchain when ``name`` is a folder that takes one (``node``), else None.
    Reads registry metadata (cached); raises RecipeError / RegistryError."""
    from fusion_oci.images.toolchain import resolve_toolchain

    context = image_context(name, opts.images_dir) if is_short_name(name) else None
    if context is None or not takes_toolchain(context):
        return None
    return resolve_toolchain(image_recipe(opts), registry)


@contextlib.contextmanager
def _file_lock(lock_dir: Path, key: str) -> Iterator[None]:
    """Serialise provisioning of one image on one engine across tasks and processes."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    path = lock_dir / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class _Provisioner:
    def __init__(
        self,
        target: EngineAdapter,
        settings: SandboxSettings,
        ctx: AuditContext,
        gate: ProvisionGate,
        mirrors: list[str],
        opts: ProvisionOptions,
        env: dict[str, str],
    ) -> None:
        self.target = target
        self.settings = settings
        self.ctx = ctx
        self.gate = gate
        self.mirrors = mirrors
        self.opts = opts
        self.env = env
        self.reporter: Reporter = opts.reporter or NullReporter()
        self.registry = opts.registry or default_registry(env, settings.host_ca)
        self.toolchain: Toolchain | None = None
        if opts.lock_dir is not None:
            self.lock_dir = opts.lock_dir
        else:
            self.lock_dir = default_cache_root(env) / "locks"

    async def ensure(self, name: str) -> ProvisionedImage:
        t0 = time.monotonic()
        self.toolchain = await asyncio.to_thread(toolchain_for, name, self.opts, self.registry)
        specs = await asyncio.to_thread(
            candidate_specs, name, self.opts.images_dir, self.opts.base, self.toolchain
        )
        if not self.opts.force:
            done = await asyncio.to_thread(self._present_done, specs, t0)
            if done is not None:
                return done
        plan = await asyncio.to_thread(self._plan, specs)
        spec, action, peer = plan
        alternative = (
            f"fusion-oci images build {spec.name} --engine {self.target.name}"
            if spec.kind == "build"
            else f"fusion-oci images pull {spec.ref} --engine {self.target.name}"
        )
        reason = f"{spec.ref} is not present on {self.target.name}"
        await self.gate.check(
            GateRequest(
                "sandbox_provision", action, spec.ref, self.target.name, reason, alternative
            )
        )
        if action in ("build", "pull"):
            await self.gate.check(
                GateRequest(
                    "network_api",
                    action,
                    spec.ref,
                    self.target.name,
                    "the build downloads packages" if action == "build" else "from a registry",
                    alternative,
                )
            )
        return await asyncio.to_thread(self._provision_locked, specs, spec, action, peer, t0)

    # -- blocking parts (worker thread)
    def _present(self, specs: Sequence[ImageSpec]) -> tuple[ImageSpec, str] | None:
        for spec in specs:
            info = self.target.image(spec.ref)
            if info is not None:
                return spec, info.id
        return None

    def _present_done(self, specs: Sequence[ImageSpec], t0: float) -> ProvisionedImage | None:
        found = self._present(specs)
        return None if found is None else self._done(found[0], found[1], "present", t0)

    def _peers(self) -> list[EngineTarget]:
        if self.opts.peers is not None:
            return list(self.opts.peers)
        mine = self.target.url.rstrip("/")
        targets = engine_targets(
            self.env, podman_url=self.settings.podman.url, docker_url=self.settings.docker.url
        )
        return [
            t
            for t in targets.values()
            if t.kind == "podman" and t.url.rstrip("/") != mine and t.name == "podman"
        ]

    def _reachable(self, target: EngineTarget) -> EngineAdapter | None:
        try:
            client = open_target(target)
            client.ping()
        except (ProvisionError, OSError):
            return None
        return client

    def _plan(self, specs: Sequence[ImageSpec]) -> tuple[ImageSpec, str, EngineTarget | None]:
        """(spec, action, peer): load from a peer that has it, build (maybe on a peer), pull."""
        if specs[0].kind == "pull":
            return specs[0], "pull", None
        # docker cannot take the CA secret and rootless podman builds slowly on vfs: those
        # build on the first reachable rootful podman and load the result.
        wants_builder = (
            not self.target.supports_build_secrets or self.target.name == "podman-rootless"
        )
        builder: tuple[ImageSpec, EngineTarget] | None = None
        for peer in self._peers():
            client = self._reachable(peer)
            if client is None:
                continue
            with client:
                if not self.opts.force:
                    for spec in specs:
                        if client.image(spec.ref) is not None:
                            return spec, "load", peer
                if builder is None and wants_builder:
                    builder = (self._local_base_spec(client, specs), peer)
        if builder is not None:
            return builder[0], "build", builder[1]
        return self._local_base_spec(self.target, specs), "build", None

    def _local_base_spec(self, builder: EngineAdapter, specs: Sequence[ImageSpec]) -> ImageSpec:
        """The spec for the base already on the builder, so the gate names the exact tag.

        When neither base is there the public one is tried at build time (after the gates:
        pulling it is part of what they allow).
        """
        if self.opts.base is not None or len(specs) < 2:
            return specs[0]
        if builder.image(PUBLIC_BASE) is None and builder.image(BASE_REF) is not None:
            return specs[1]
        return specs[0]

    def _provision_locked(
        self,
        specs: Sequence[ImageSpec],
        spec: ImageSpec,
        action: str,
        peer: EngineTarget | None,
        t0: float,
    ) -> ProvisionedImage:
        with _file_lock(self.lock_dir, f"{self.target.url}|{spec.name}|{spec.ref}"):
            if not self.opts.force:
                # Another task or process may have provisioned it while we waited.
                done = self._present_done(specs, t0)
                if done is not None:
                    return done
            if action == "pull":
                image_id = pull_image(
                    self.target,
                    spec.ref,
                    ctx=self.ctx,
                    mirrors=self.mirrors,
                    reporter=self.reporter,
                    policy=self.opts.retry,
                    sleep=self.opts.sleep,
                )
                return self._done(spec, image_id, "pulled", t0)
            if action == "load" and peer is not None:
                with open_target(peer) as source:
                    image_id = transfer_image(
                        source, self.target, spec.ref, ctx=self.ctx, reporter=self.reporter
                    )
                return self._done(spec, image_id, "loaded", t0, source=peer.name)
            if peer is not None:
                with open_target(peer) as builder:
                    built = self._build_on(builder, spec)
                    image_id = transfer_image(
                        builder, self.target, built.ref, ctx=self.ctx, reporter=self.reporter
                    )
                return self._done(built, image_id, "built", t0, built_on=peer.name)
            built = self._build_on(self.target, spec)
            info = self.target.image(built.ref)
            return self._done(built, info.id if info else "", "built", t0)

    def _build_on(self, builder: EngineAdapter, spec: ImageSpec) -> ImageSpec:
        if self.opts.base is None and spec.context is not None:
            base = self._choose_base(builder)
            spec = resolve_image(
                spec.name, images_dir=self.opts.images_dir, base=base, toolchain=spec.toolchain
            )
            if (
                builder is not self.target
                and builder.image(spec.ref) is not None
                and not self.opts.force
            ):
                return spec
        ca = host_ca_for_build(self.settings.host_ca)
        extra = None
        if spec.toolchain is not None:
            from fusion_oci.images.toolchain import fetch_toolchain

            # After the gates, before the engine: a tarball that does not match its integrity
            # hash stops here, and nothing is built.
            self.reporter.start(f"toolchain {spec.toolchain.why()}: fetch from {self.registry.url}")
            extra = fetch_toolchain(spec.toolchain, self.registry)
            self.reporter.finish(f"verified {len(extra)} tarballs against their integrity")
        build_image(
            builder,
            spec,
            ca=ca,
            ctx=self.ctx,
            reporter=self.reporter,
            policy=self.opts.retry,
            sleep=self.opts.sleep,
            extra=extra,
        )
        return spec

    def _choose_base(self, builder: EngineAdapter) -> str | None:
        """The public base when it is here or can be pulled, else the bootstrapped one."""
        if builder.image(PUBLIC_BASE) is not None:
            return None
        if builder.image(BASE_REF) is not None:
            return BASE_REF
        try:
            pull_image(
                builder,
                PUBLIC_BASE,
                ctx=self.ctx,
                mirrors=self.mirrors,
                reporter=self.reporter,
                policy=self.opts.retry,
                sleep=self.opts.sleep,
            )
        except EngineOpError as exc:
            raise ProvisionError(
                f"no base image for builds on {builder.name}",
                f"{PUBLIC_BASE} cannot be pulled ({exc.engine_message.splitlines()[0]}) and "
                f"{BASE_REF} does not exist",
                "make the offline base with `fusion-oci images bootstrap-base` (as root), or "
                "pass --base REF",
            ) from exc
        return None

    def _done(
        self,
        spec: ImageSpec,
        image_id: str,
        action: Literal["present", "built", "pulled", "loaded"],
        t0: float,
        **extra: object,
    ) -> ProvisionedImage:
        repo_digest = None
        if spec.kind == "pull":
            info = self.target.image(spec.ref)
            repo_digest = next(iter(info.repo_digests), None) if info else None
        seconds = time.monotonic() - t0
        self.ctx.emit(
            "sandbox:provision",
            f"{spec.ref} {action} on {self.target.name} ({image_id[:19]})",
            duration_ms=int(seconds * 1000),
            action=action,
            outcome="ok",
            image=spec.name,
            ref=spec.ref,
            digest=image_id,
            repo_digest=repo_digest,
            engine=self.target.name,
            base=spec.build_args.get("BASE"),
            context_hash=spec.context_hash,
            toolchain=spec.toolchain.why() if spec.toolchain else None,
            **extra,
        )
        return ProvisionedImage(
            spec.ref,
            image_id,
            action,
            repo_digest,
            seconds,
            spec.toolchain.why() if spec.toolchain else None,
        )


def transfer_image(
    source: EngineAdapter,
    dest: EngineAdapter,
    ref: str,
    *,
    ctx: AuditContext,
    reporter: Reporter | None = None,
    tmp_dir: Path | None = None,
) -> str:
    """Copy ``ref`` from one engine to another through a docker-archive (save → load)."""
    rep = reporter or NullReporter()
    rep.start(f"load {ref} from {source.name} into {dest.name}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fusion-oci-xfer-", dir=tmp_dir) as tmp:
        archive = Path(tmp) / "image.tar"
        source.save(ref, archive)
        t_save = time.monotonic() - t0
        dest.load(archive)
        size = archive.stat().st_size
    info = dest.image(ref)
    if info is None:
        raise ProvisionError(
            f"loading {ref} into {dest.name} did not produce it",
            "the archive from " + source.name + " held another name",
            "rebuild with `fusion-oci images build --force`",
        )
    seconds = time.monotonic() - t0
    ctx.emit(
        "sandbox:provision",
        f"{ref} loaded from {source.name} into {dest.name}",
        duration_ms=int(seconds * 1000),
        action="load",
        ref=ref,
        source=source.name,
        engine=dest.name,
        attempt=1,
        outcome="ok",
        bytes=size,
        save_ms=int(t_save * 1000),
        digest=info.id,
    )
    rep.finish(f"loaded {ref} into {dest.name} in {seconds:.1f}s ({size >> 20} MiB)")
    return info.id


def with_options(options: ProvisionOptions | None, **changes: Any) -> ProvisionOptions:
    """A copy of ``options`` (or the defaults) with some fields changed."""
    return replace(options or ProvisionOptions(), **changes)
