"""Backend id → runtime class, imported lazily; third parties plug in through entry points.

Every backend id of the brief is known here. One whose module is not built, whose plugin is
not installed, or whose tools are missing on this host is *unavailable* with its reason, so
the settings' failure mode applies; no backend id is ever "unknown".

A plugin is a class implementing :class:`~fusion_oci.runtimes.protocol.Runtime`, constructed as
``cls(settings, env, cache_root=..., host=...)``. One that does not derive from
:class:`~fusion_oci.runtimes.protocol.RuntimeDefaults` gets its optional members from it here
(what the class defines wins). Whatever it derives from, the lifecycle's services reach it the
same way as a built-in runtime: before ``prepare`` its declared ``audit`` attribute is the
task's :class:`~fusion_oci.audit.AuditLog` and its ``ask`` attribute the gate callback
(:data:`~fusion_oci.images.gates.AskCallback`, None: ``ask`` gates deny).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_oci.models import BACKEND_IDS
from fusion_oci.runtimes.protocol import Runtime, RuntimeDefaults
from fusion_oci.runtimes.skeleton import UnavailableRuntime

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog
    from fusion_oci.images.gates import AskCallback
    from fusion_oci.oci.host import HostInfo
    from fusion_oci.policy.settings import SandboxSettings

ENTRY_POINT_GROUP = "fusion_oci.runtimes"
BUILTIN_GROUP = "fusion_oci.builtin_runtimes"
"""The built-ins are entry points too (pyproject.toml), loaded as a plugin is."""


@cache
def builtin_entry_points() -> dict[str, EntryPoint]:
    """The installed distribution's built-in runtimes, by backend id (read once)."""
    return {ep.name: ep for ep in entry_points(group=BUILTIN_GROUP)}


def with_defaults(cls: Any) -> Any:
    """``cls``, or for a plugin class that does not derive from :class:`RuntimeDefaults` a
    subclass of it and ``RuntimeDefaults`` (in that order: the plugin's own members win)."""
    if not isinstance(cls, type) or issubclass(cls, RuntimeDefaults):
        return cls
    return type(
        cls.__name__,
        (cls, RuntimeDefaults),
        {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "isolates": bool(getattr(cls, "isolates", True)),
        },
    )


def runtime_class(backend: str, settings: SandboxSettings) -> Any | UnavailableRuntime:
    """The class for a backend, or an :class:`UnavailableRuntime` saying why there is none."""
    if backend == "custom":
        name = settings.custom_runtime
        if not name:
            return UnavailableRuntime(
                "custom",
                "no custom runtime is named",
                "set sandbox.customRuntime to an entry point of group 'fusion_oci.runtimes'",
            )
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            return UnavailableRuntime(
                "custom",
                f"no runtime plugin named '{name}' is installed",
                f"install the package that provides entry point '{name}' in group "
                f"'{ENTRY_POINT_GROUP}'",
            )
        return with_defaults(found[0].load())
    target = builtin_entry_points().get(backend)
    if target is None:
        assert backend in BACKEND_IDS
        return UnavailableRuntime(
            backend,
            "not built into this version of fusion-oci",
            "reinstall fusion-oci (its entry points name the built-ins)",
        )
    try:
        return with_defaults(target.load())
    except (ImportError, AttributeError) as exc:
        return UnavailableRuntime(
            backend,
            f"not built into this version of fusion-oci ({exc})",
            "upgrade fusion-oci, or choose another backend",
        )


def create_runtime(
    backend: str,
    settings: SandboxSettings,
    env: Mapping[str, str],
    *,
    cache_root: Path | None = None,
    host: HostInfo | None = None,
    audit: AuditLog | None = None,
    ask: AskCallback | None = None,
) -> Runtime:
    """The runtime for ``backend``, handed the lifecycle's ``audit`` log and ``ask`` callback
    (see the module docstring): a plugin gets them exactly as a built-in runtime does."""
    cls = runtime_class(backend, settings)
    if isinstance(cls, UnavailableRuntime):
        return cls
    runtime: Runtime = cls(settings, env, cache_root=cache_root, host=host)
    try:
        runtime.audit = audit
        runtime.ask = ask
    except AttributeError as exc:  # __slots__ or a read-only property: the plugin's bug
        from fusion_oci.errors import SandboxSetupError

        raise SandboxSetupError(
            f"runtime '{backend}' ({cls.__module__}.{cls.__qualname__}) cannot take the "
            "lifecycle's audit log and gate callback",
            str(exc),
            "let the runtime class accept the attributes 'audit' and 'ask'",
        ) from exc
    return runtime


def known_backends() -> list[str]:
    """Every backend id, plus names of installed custom plugins as ``custom:NAME``."""
    ids = list(BACKEND_IDS)
    ids += [f"custom:{ep.name}" for ep in entry_points(group=ENTRY_POINT_GROUP)]
    return ids
