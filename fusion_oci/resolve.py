"""The one resolve step: settings + prepare context + host facts -> :class:`ResolvedTask`.

Everything a task's commands share is decided here, once: the image, the host CA bundle, the
caches, the git layout, the protected paths, the network mode. :func:`compile_spec` then
turns a resolved task and one command into the spec (pure). The lifecycle (``Sandbox``
resolves at prepare and compiles each command before the runtime checks, plans and executes
it), ``fusion-oci plan``, ``fusion-oci bundle create`` and the server all go through these two
functions, so the bundle one of them shows is the bundle another runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from fusion_oci.host.cachedir import default_cache_root
from fusion_oci.models import CacheMode, NetworkMode, PrepareContext, RunOptions
from fusion_oci.oci.host import HostInfo
from fusion_oci.oci.model import ConfigSpec, ProcessSpec, Rlimit, TaskSpec, User
from fusion_oci.oci.spec import compile_process, compile_task, process_rlimits, with_image
from fusion_oci.policy.layout import TaskLayout, resolve_ca, resolve_layout
from fusion_oci.policy.settings import SandboxSettings

if TYPE_CHECKING:
    from fusion_oci.egress import EgressProxy
    from fusion_oci.services import TaskRelays
    from fusion_oci.services.publish import TaskPorts


@dataclass(frozen=True)
class ResolvedTask:
    """What every command of one task shares; the input of :func:`compile_spec`."""

    ctx: PrepareContext
    """The caller's context with the image decided (``ctx.image``: None means the host's
    system directories)."""
    layout: TaskLayout
    """Host paths: worktree, git directories, caches, CA bundle, protected paths."""
    host: HostInfo
    env: Mapping[str, str]
    """Where the env allowlist draws from when a command's ``RunOptions.env`` is None."""
    egress: EgressProxy | None = None
    """The task's egress proxy (``network: filtered``; started by the sandbox before the
    runtime's prepare, which binds ``egress.unix_socket`` into the sandbox). None: the
    network is not filtered, or nothing started one (plan, bundle create)."""
    services: TaskRelays | None = None
    """The task's host-service relays (``policy.hostServices``; started by the sandbox before
    the runtime's prepare, which makes each appear inside). None: no grants, or nothing
    started them (plan, bundle create)."""
    ports: TaskPorts | None = None
    """The task's published ports (``policy.publishPorts``; bound by the sandbox before the
    runtime's prepare, which binds each port's relay into the sandbox for its agent). None:
    none, or nothing bound them (plan, bundle create)."""

    @cached_property
    def spec(self) -> TaskSpec:
        """The task's sandbox (the OCI config without ``process``), compiled once, when first
        read, and carried by every copy that leaves it as it is (:meth:`_keeping`)."""
        return compile_task(self.ctx, self.layout, self.host)

    def _keeping(self, out: ResolvedTask, spec: TaskSpec | None = None) -> ResolvedTask:
        """``out`` (a copy of this task) with ``spec``, else this task's spec if it was
        compiled: a copy that changes nothing the spec is made of does not compile it again."""
        if spec is None and "spec" in self.__dict__:
            spec = self.spec
        if spec is not None:
            # cached_property keeps its value in the instance's __dict__ (frozen or not).
            out.__dict__["spec"] = spec
        return out

    @property
    def rlimits(self) -> list[Rlimit]:
        """The rlimits every command of the task runs under (the policy's, clamped to the
        host's hard limits): with :attr:`spec`, all that the task asks a runtime to enforce."""
        cpu = self.ctx.policy.cpu_limit
        return process_rlimits(
            self.host, cpu.max_ms if cpu else None, self.ctx.policy.file_size_limit_mb
        )

    @property
    def user(self) -> User:
        """Who every command of the task runs as: the caller's ids."""
        return User(uid=self.host.uid, gid=self.host.gid)

    def process(self, command: str | Sequence[str], opts: RunOptions) -> ProcessSpec:
        """One command's OCI ``process`` (the env allowlist draws from ``opts.env``, else the
        task's environment). Pure."""
        source = opts.env if opts.env is not None else self.env
        return compile_process(self.ctx, self.layout, self.host, command, opts, source)

    @property
    def image(self) -> str | None:
        return self.ctx.image

    @property
    def network(self) -> NetworkMode:
        return self.ctx.policy.network_mode

    @property
    def cache_mode(self) -> CacheMode:
        return self.ctx.cache_mode

    @property
    def ca_bundle(self) -> str | None:
        return self.layout.ca_bundle

    def unprotected(self) -> list[str]:
        """protectedPaths entries that cannot be protected, as unenforced parts."""
        return [f"protectedPaths: {p}" for p in self.layout.unprotected]

    def with_egress(self, proxy: EgressProxy | None) -> ResolvedTask:
        """The same task with its egress proxy (the spec is the same: kept, not compiled)."""
        return self._keeping(replace(self, egress=proxy))

    def with_services(self, relays: TaskRelays | None) -> ResolvedTask:
        """The same task with its host-service relays (the spec is kept)."""
        return self._keeping(replace(self, services=relays))

    def with_ports(self, ports: TaskPorts | None) -> ResolvedTask:
        """The same task with its published ports (the spec is kept)."""
        return self._keeping(replace(self, ports=ports))

    def with_layout(self, layout: TaskLayout) -> ResolvedTask:
        """The same task on another layout (its spec compiled again, where the layout differs:
        mounts and env follow)."""
        out = replace(self, layout=layout)
        return self._keeping(out) if layout == self.layout else out

    def with_image(self, image: str | None) -> ResolvedTask:
        """The same task on another image reference (a provisioned image's local name). From
        one image to another only the image annotation changes: the spec's op, no compile."""
        out = replace(self, ctx=self.ctx.model_copy(update={"image": image}))
        if image and self.ctx.image and "spec" in self.__dict__:
            return self._keeping(out, with_image(self.spec, image))
        return out


def resolve_image(
    settings: SandboxSettings, ctx: PrepareContext, default_image: str | None = None
) -> str | None:
    """The task's image: the context's, else the settings', else the backend's default
    (None for backends that run on the host's system directories)."""
    return ctx.image or settings.image or default_image


def resolve_ca_bundle(settings: SandboxSettings, ctx: PrepareContext, host: HostInfo) -> str | None:
    """The host CA bundle shared read-only: the context's, else what ``sandbox.hostCa`` says
    (``auto``: the host's own bundle; ``off``: none; a path: that file)."""
    if ctx.host_ca_bundle is not None:
        return ctx.host_ca_bundle
    return resolve_ca(settings.host_ca, host.ca_bundle)


def resolve(
    settings: SandboxSettings,
    ctx: PrepareContext,
    host: HostInfo,
    *,
    env: Mapping[str, str],
    cache_root: Path,
    default_image: str | None = None,
    create: bool = True,
    checked: ResolvedTask | None = None,
) -> ResolvedTask:
    """Resolve a task once. Reads the host's paths; ``create=False`` (plan) creates nothing,
    else the cache directories, the project's ``.fusion/`` and git's mount points are made.

    ``checked``: the same task resolved before with ``create=False`` (the lifecycle checks it
    before making anything): its spec is kept where the context and layout came out the same,
    so a prepare compiles once (a ``.fusion/`` made just now is a new protected path, and
    a new spec)."""
    image = resolve_image(settings, ctx, default_image)
    resolved_ctx = ctx if image == ctx.image else ctx.model_copy(update={"image": image})
    ca_bundle = resolve_ca_bundle(settings, ctx, host)
    layout = resolve_layout(
        resolved_ctx,
        cache_root=cache_root,
        ca_bundle=ca_bundle,
        create=create,
        # The host's own system bundle (hostCa: auto, or a path naming it) is a whole store.
        ca_complete=ca_bundle is not None and ca_bundle == host.ca_bundle,
    )
    task = ResolvedTask(ctx=resolved_ctx, layout=layout, host=host, env=dict(env))
    if checked is not None and (checked.ctx, checked.layout, checked.host) == (
        task.ctx,
        task.layout,
        task.host,
    ):
        return checked._keeping(task)
    return task


class ImageDefault(Protocol):
    """A runtime, or its class: the image its backend runs when nobody names one."""

    @property
    def default_image(self) -> str | None: ...


def resolve_for(
    runtime: ImageDefault,
    settings: SandboxSettings,
    ctx: PrepareContext,
    host: HostInfo,
    *,
    env: Mapping[str, str],
    cache_root: Path | None = None,
    create: bool = True,
    checked: ResolvedTask | None = None,
) -> ResolvedTask:
    """:func:`resolve` for this backend's default image: the task a run prepares, the one
    ``plan`` shows and the bundle ``bundle create`` writes are the task that backend would
    run. ``cache_root`` None: the default one of ``env``; ``checked``: as :func:`resolve`'s."""
    return resolve(
        settings,
        ctx,
        host,
        env=env,
        cache_root=cache_root or default_cache_root(env),
        default_image=runtime.default_image,
        create=create,
        checked=checked,
    )


def compile_spec(
    resolved: ResolvedTask, command: str | Sequence[str], opts: RunOptions
) -> ConfigSpec:
    """The whole config of one command of a resolved task (a bundle, ``fusion-oci plan``): its
    task spec and the command's process (``.to_oci()``: the ``config.json``). Pure."""
    return ConfigSpec(resolved.spec, resolved.process(command, opts))
