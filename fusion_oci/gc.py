"""``fusion-oci gc``: find and remove what a crashed or killed fusion-oci left in the engines.

Every container and volume fusion-oci creates carries ``io.fusion-oci.kind`` and, unless it
is a project cache meant to persist, the owner's pid, that pid's start time, the boot id and
the host name. Something is garbage when its owner is gone: another boot of this machine, or
no process with that pid and start time (a reused pid is not the owner). Objects made on
another machine that shares the engine are left alone: their owner cannot be checked here.

:func:`gc` goes over every engine that answers; :func:`collect` does one engine (the next
``prepare`` of a task calls it for its own task id). :func:`is_garbage` is the pure rule.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fusion_oci.engines import (
    Endpoint,
    EngineAdapter,
    EngineKind,
    Found,
    NotAnswering,
    connect,
    docker_endpoints,
    engine_errors,
    podman_endpoints,
)
from fusion_oci.engines.labels import (
    LABEL_CACHE_DIR,
    LABEL_CACHE_SCOPE,
    LABEL_KIND,
    LABEL_OWNER_BOOT,
    LABEL_OWNER_HOST,
    LABEL_OWNER_PID,
    LABEL_OWNER_START,
    LABEL_TASK,
)
from fusion_oci.errors import FusionOCIError
from fusion_oci.host.scratch import boot_id, process_start

if TYPE_CHECKING:
    from fusion_oci.policy.settings import SandboxSettings


@dataclass(frozen=True)
class Here:
    """This machine, and how to ask whether a pid with a given start time still runs."""

    host: str
    boot: str
    alive: Callable[[int, str], bool]
    exists: Callable[[str], bool] = os.path.isdir
    """Whether a host directory (a cache volume's) still exists."""


def here() -> Here:
    def alive(pid: int, start: str) -> bool:
        return process_start(pid) == start

    return Here(os.uname().nodename, boot_id(), alive)


def owner_state(labels: Mapping[str, str], at: Here) -> str:
    """``live``, ``dead`` or ``foreign`` (another machine's: not ours to judge). Pure."""
    host = labels.get(LABEL_OWNER_HOST)
    if host is not None and host != at.host:
        return "foreign"
    pid = labels.get(LABEL_OWNER_PID, "")
    if not pid.isdigit() or labels.get(LABEL_OWNER_BOOT) != at.boot:
        return "dead"
    return "live" if at.alive(int(pid), labels.get(LABEL_OWNER_START, "")) else "dead"


def is_garbage(
    found: Found, at: Here, *, task_id: str | None = None, include_caches: bool = False
) -> bool:
    """Whether gc removes this object. Pure given ``at``."""
    labels = found.labels
    if LABEL_KIND not in labels:
        return False
    if task_id is not None and labels.get(LABEL_TASK) != task_id:
        return False
    if labels[LABEL_KIND] == "cache" and labels.get(LABEL_CACHE_SCOPE) != "task":
        # A project's cache persists on purpose; it goes on request, or once the directory
        # it is bound to is gone (the volume could not be mounted again anyway).
        if task_id is not None:
            return False
        cache_dir = labels.get(LABEL_CACHE_DIR)
        ours = labels.get(LABEL_OWNER_HOST, at.host) == at.host
        return include_caches or bool(ours and cache_dir and not at.exists(cache_dir))
    return owner_state(labels, at) == "dead"


@dataclass
class GcReport:
    removed: list[str] = field(default_factory=list)
    """``engine container NAME`` / ``engine volume NAME`` entries that were (or, in a dry
    run, would be) removed."""
    kept: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    """Engines that were looked at, with their socket."""

    def merge(self, other: GcReport) -> None:
        self.removed += other.removed
        self.kept += other.kept
        self.errors += other.errors
        self.engines += other.engines


def collect(
    adapter: EngineAdapter,
    *,
    task_id: str | None = None,
    include_caches: bool = False,
    dry_run: bool = False,
    at: Here | None = None,
) -> GcReport:
    """Remove the garbage of one engine: containers first (they hold the volumes)."""
    at = at or here()
    report = GcReport(engines=[f"{adapter.engine} at {adapter.endpoint.url}"])
    selector = (LABEL_TASK, task_id) if task_id is not None else (LABEL_KIND, None)
    with engine_errors(adapter.engine, "list labelled objects", adapter.endpoint):
        found = adapter.list_labelled(*selector)
    found.sort(key=lambda f: f.kind != "container")
    for item in found:
        label = f"{adapter.engine} {item.kind} {item.name}"
        if not is_garbage(item, at, task_id=task_id, include_caches=include_caches):
            report.kept.append(label)
            continue
        report.removed.append(label)
        if dry_run:
            continue
        try:
            with engine_errors(adapter.engine, f"remove {item.kind} {item.name}", adapter.endpoint):
                if item.kind == "container":
                    adapter.remove(item.id)
                else:
                    adapter.remove_volume(item.name)
        except FusionOCIError as exc:
            report.errors.append(f"{label}: {exc.why or exc.what}")
    return report


def gc(
    *,
    settings: SandboxSettings | None = None,
    env: Mapping[str, str] | None = None,
    engines: Sequence[str] = ("podman", "docker"),
    task_id: str | None = None,
    include_caches: bool = False,
    dry_run: bool = False,
) -> GcReport:
    """Look at every engine that answers and remove what no live fusion-oci process owns.

    ``settings``: a :class:`~fusion_oci.policy.settings.SandboxSettings` (for ``podman.url``
    / ``docker.url``); None: defaults. An engine that does not answer is listed in ``errors``
    with its reason and skipped; for podman with no socket, a service of our own is started
    for the look (podman is daemonless: its containers exist without one). ``include_caches``
    also removes project cache volumes (their files stay in the fusion-oci cache directory).
    Scratch folders in the temp dir whose owner is gone (a ``kill -9``'d run's) go too, as
    at every prepare.
    """
    from fusion_oci.host.cachedir import default_cache_root
    from fusion_oci.host.scratch import gc_scratch
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.store import prune_stores

    chosen = settings or SandboxSettings()
    source = dict(os.environ if env is None else env)
    report = GcReport()
    for name in engines:
        if name not in ("podman", "docker"):
            continue
        kind: EngineKind = "podman" if name == "podman" else "docker"
        service = None
        adapter: EngineAdapter | None = None
        try:
            try:
                adapter = connect(kind, _endpoints(kind, chosen, source))
            except NotAnswering as exc:
                if kind == "docker":
                    tried = ", ".join(f"{e.url} ({e.source})" for e in exc.tried)
                    report.errors.append(f"docker: no docker service answers at {tried}")
                    continue
                from fusion_oci.engines.service import PodmanService

                service = PodmanService(source)
                adapter = service.start(exc.tried)
            report.merge(
                collect(adapter, task_id=task_id, include_caches=include_caches, dry_run=dry_run)
            )
        except FusionOCIError as exc:
            report.errors.append(f"{kind}: {exc.render()}")
        finally:
            if adapter is not None:
                with contextlib.suppress(Exception):
                    adapter.close()
            if service is not None:
                service.stop()
    if not dry_run:
        report.removed += [f"scratch folder {path}" for path in gc_scratch()]
    report.merge(GcReport(*prune_stores(default_cache_root(source), dry_run=dry_run)))
    return report


def _endpoints(
    kind: EngineKind, settings: SandboxSettings, env: Mapping[str, str]
) -> list[Endpoint]:
    uid = os.getuid()
    if kind == "podman":
        return podman_endpoints(settings.podman.url, env, uid)
    return docker_endpoints(settings.docker.url, env, uid)
