"""What every export format reads: the parts of a resolved spec a foreign format can carry
(:class:`ExportSource`), from a spec or from a recorded run."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusion_oci.audit import RunEvent
    from fusion_oci.oci.model import ProcessSpec, TaskSpec
    from fusion_oci.replay import ReplayRecord

ENGINE_MOUNTS = frozenset({"/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys"})
"""Mounts every engine makes itself (from its own defaults)."""
RLIMIT_KEYS = {
    "RLIMIT_NOFILE": "nofile",
    "RLIMIT_NPROC": "nproc",
    "RLIMIT_CPU": "cpu",
    "RLIMIT_FSIZE": "fsize",
    "RLIMIT_CORE": "core",
}


@dataclass(frozen=True)
class Mount:
    target: str
    kind: str
    """``bind`` or ``tmpfs``."""
    source: str = ""
    read_only: bool = False
    size: str | None = None
    mode: str | None = None
    uid: str | None = None
    gid: str | None = None
    is_file: bool = False


@dataclass(frozen=True)
class ExportSource:
    """What every format needs, read from a resolved spec. ``env`` values None: the caller's
    variable of that name, passed through (its value is never recorded)."""

    name: str
    image: str
    image_digest: str | None
    argv: list[str]
    cwd: str
    env: dict[str, str | None]
    uid: int
    gid: int
    mounts: list[Mount]
    network: str
    memory_bytes: int | None = None
    cpus: float | None = None
    pids: int | None = None
    rlimits: dict[str, tuple[int, int]] = field(default_factory=dict)
    read_only_root: bool = True
    no_new_privileges: bool = True
    capabilities: list[str] = field(default_factory=list)
    seccomp: dict[str, Any] | None = None
    masked_paths: list[str] = field(default_factory=list)
    readonly_paths: list[str] = field(default_factory=list)
    hostname: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """Already known differences (e.g. a host-rootfs run exported onto an image)."""
    typed: tuple[TaskSpec, ProcessSpec] | None = None
    """The spec itself, for a writer that translates it whole (kube: the Pod mapping the
    kubernetes runtime uses). None: built by hand, without a spec."""
    skipped: tuple[str, ...] = ()
    """Destinations of the spec the image replaces (``system_dests``)."""


def _bytes_size(options: Sequence[str]) -> str | None:
    for opt in options:
        if opt.startswith("size="):
            return opt[5:]
    return None


def _opt(options: Sequence[str], key: str) -> str | None:
    return next((o.split("=", 1)[1] for o in options if o.startswith(key + "=")), None)


def read_spec(
    spec: Mapping[str, Any],
    *,
    name: str,
    image: str,
    image_digest: str | None,
    system_dests: Sequence[str],
    env_names: Sequence[str],
    notes: Sequence[str] = (),
    host_rlimits: Mapping[str, Sequence[int]] | None = None,
) -> ExportSource:
    """The spec's parts that a foreign format can carry. Pure.

    ``system_dests``: destinations of the host's system directories (a host-rootfs spec);
    those are replaced by the image. ``env_names``: variables passed from the caller.
    """
    from pydantic import ValidationError

    from fusion_oci.errors import BundleError
    from fusion_oci.oci.model import ANN, ANN_NETWORK, split

    try:
        task, proc = split(spec)
    except (ValidationError, KeyError) as exc:
        raise BundleError(
            "the recorded spec cannot be exported",
            str(exc).splitlines()[0],
            "export a run recorded by this version of fusion-oci",
        ) from exc
    passed = set(env_names)
    env: dict[str, str | None] = {}
    for item in proc.env:
        key, eq, value = item.partition("=")
        env[key] = None if (key in passed or not eq) else value
    skip = set(system_dests) | ENGINE_MOUNTS
    mounts: list[Mount] = []
    for m in task.mounts:
        if m.destination in skip:
            continue
        options = m.options or []
        if m.type == "tmpfs":
            mounts.append(
                Mount(
                    m.destination,
                    "tmpfs",
                    size=_bytes_size(options),
                    mode=m.option("mode"),
                    uid=m.option("uid"),
                    gid=m.option("gid"),
                )
            )
        elif m.type == "bind" or "bind" in options or "rbind" in options:
            src = m.source or m.destination
            mounts.append(
                Mount(m.destination, "bind", src, m.readonly, is_file=Path(src).is_file())
            )
    res = task.resources
    cpu = res.cpu
    cpus = cpu.quota / (cpu.period or 100_000) if cpu is not None and cpu.quota else None
    rlimits = {RLIMIT_KEYS[r.type]: (r.soft, r.hard) for r in proc.rlimits if r.type in RLIMIT_KEYS}
    # A process the sandbox starts inherits the caller's RLIMIT_NPROC; an engine would apply
    # its own default instead (podman's for root exceeds some hosts' hard limit), so say it.
    if "nproc" not in rlimits and host_rlimits is not None:
        from fusion_oci.runtimes.engine.probe import nproc_limit

        limits = {k: (int(v[0]), int(v[1])) for k, v in host_rlimits.items()}
        rlimits["nproc"] = nproc_limit(limits) or (-1, -1)
    ann = task.annotations
    containers = task.service_containers
    # The services' own endpoints are relayed as grants are: named apart from the grants.
    ours = {f"127.0.0.1:{port}" for _, port in containers}
    granted = [str(g) for g in task.host_services if str(g) not in ours]
    linux = task.linux
    return ExportSource(
        name=name,
        image=image,
        image_digest=image_digest,
        argv=list(proc.args),
        cwd=proc.cwd,
        env=env,
        uid=proc.user.uid,
        gid=proc.user.gid,
        mounts=mounts,
        network=ann.get(ANN_NETWORK, "none"),
        memory_bytes=res.memory.limit if res.memory else None,
        cpus=cpus,
        pids=res.pids.limit if res.pids else None,
        rlimits=rlimits,
        read_only_root=bool(task.root.readonly),
        no_new_privileges=proc.no_new_privileges,
        capabilities=proc.kept_capabilities(),
        seccomp=linux.seccomp.to_oci() if linux.seccomp is not None else None,
        masked_paths=list(linux.masked_paths or []),
        readonly_paths=list(linux.readonly_paths or []),
        hostname=task.hostname,
        typed=(task, proc),
        skipped=tuple(system_dests),
        labels={k: v for k, v in ann.items() if k.startswith(ANN)},
        notes=[
            *notes,
            # The grants are served by fusion-oci's per-task relays, which no format has.
            *(
                [
                    "hostServices: the run was granted "
                    + ", ".join(granted)
                    + " (fusion-oci's per-task relays); the export grants none, so its "
                    "sandbox reaches no host service"
                ]
                if granted
                else []
            ),
            *(
                [
                    "services: the run had service containers "
                    + ", ".join(f"{name} on 127.0.0.1:{port}" for name, port in containers)
                    + " (fusion-oci starts them per task); the export starts none"
                ]
                if containers
                else []
            ),
        ],
    )


def safe_name(text: str) -> str:
    import re

    out = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return (out or "task")[:50].rstrip("-")


def source_from_record(
    record: ReplayRecord,
    event: RunEvent | None,
    *,
    worktree: Path | None = None,
    image: str | None = None,
) -> ExportSource:
    """A recorded run's environment (its redacted spec; caller env by name)."""
    from fusion_oci.oci.model import ANN_HOST_ROOTFS

    spec = json.loads(json.dumps(record.spec))
    notes: list[str] = []
    host_rootfs = spec.get("annotations", {}).get(ANN_HOST_ROOTFS) == "true"
    system = [m[0] for m in record.host.get("system_mounts", [])]
    system += [f"/etc/{n}" for n in record.host.get("etc_entries", [])]
    chosen = image or record.image_ref or record.image
    if chosen is None:
        chosen = default_image()
    if host_rootfs:
        notes.append(
            f"root filesystem: the run used the host's system directories "
            f"(backend {record.backend}); the export runs image {chosen} instead"
        )
    if worktree is not None and str(worktree) != record.worktree:
        spec = _move_worktree(spec, record.worktree, str(worktree.absolute()))
    digest = event.image_digest if event is not None else None
    return read_spec(
        spec,
        name=safe_name(f"fusion-oci-{record.task_id}"),
        image=chosen,
        image_digest=None if image else digest,
        system_dests=system if host_rootfs else [],
        env_names=record.env_names,
        notes=notes,
        host_rlimits=record.host.get("rlimits"),
    )


def _move_worktree(spec: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    def move(path: str) -> str:
        return new + path[len(old) :] if path == old or path.startswith(old + "/") else path

    for m in spec.get("mounts", []):
        m["destination"] = move(m["destination"])
        if "source" in m:
            m["source"] = move(m["source"])
    spec["process"]["cwd"] = move(spec["process"].get("cwd", "/"))
    return spec


def default_image() -> str:
    from fusion_oci.images.provision import default_image_ref
    from fusion_oci.runtimes.engine import DEFAULT_IMAGE

    try:
        return default_image_ref(DEFAULT_IMAGE)
    except Exception:  # no images/ at all: name it, the user points --image elsewhere
        return DEFAULT_IMAGE
