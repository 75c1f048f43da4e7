"""The two typed forms of the spec: :class:`TaskSpec` (the sandbox) and :class:`ProcessSpec`
(one command).

A task's commands share everything but their process, so the OCI ``config.json`` splits in two
where runc splits it: ``runc create`` takes the config (here without ``process``: the
:class:`TaskSpec`, compiled once per task), ``runc exec --process`` and the exec agent's spawn
frame take a ``process`` object (the :class:`ProcessSpec`, compiled per command). Both are
pydantic models whose aliases are the OCI JSON names, so :func:`config_json` of the pair is the
very ``config.json`` a bundle holds, and the tests validate it against the official schema.
Runtimes read fields, never dict paths.

Every field an OCI document may leave out is ``None`` here and left out of the JSON again
(``exclude_none``), so a spec read and written back is the same document.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from fusion_oci.models import CacheMode, NetworkMode

if TYPE_CHECKING:
    from fusion_oci.models import ServiceContainer
    from fusion_oci.models.hostservice import HostService
    from fusion_oci.models.publishport import PublishedPort


class OciModel(BaseModel):
    """OCI JSON names as aliases; unknown keys refused (a typo is not a silent no-op)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )

    def to_oci(self) -> dict[str, Any]:
        """The OCI JSON object (absent fields left out)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# ------------------------------------------------------------------------------ the process


class User(OciModel):
    uid: int
    gid: int
    umask: int | None = None
    additional_gids: list[int] | None = None


class Rlimit(OciModel):
    type: str
    soft: int
    hard: int


class Capabilities(OciModel):
    bounding: list[str] = Field(default_factory=list)
    effective: list[str] = Field(default_factory=list)
    inheritable: list[str] = Field(default_factory=list)
    permitted: list[str] = Field(default_factory=list)
    ambient: list[str] = Field(default_factory=list)


class ProcessSpec(OciModel):
    """The OCI ``process``: what one command is (argv, environment, cwd, limits, user)."""

    terminal: bool = False
    user: User
    args: list[str]
    env: list[str] = Field(default_factory=list)
    cwd: str
    capabilities: Capabilities | None = None
    rlimits: list[Rlimit] = Field(default_factory=list)
    no_new_privileges: bool = True

    def env_map(self) -> dict[str, str]:
        """The environment as a mapping (``NAME=value`` entries; the last one of a name wins,
        as in execve)."""
        return dict(item.split("=", 1) for item in self.env)

    def limits(self) -> list[tuple[str, int, int]]:
        """The rlimits as ``(RLIMIT_NAME, soft, hard)``: the one shape the agent's spawn frame
        and the reaper shim take (-1: unlimited)."""
        return [(r.type, r.soft, r.hard) for r in self.rlimits]

    def shown_limits(self) -> str:
        """The rlimits as a plan's note says them."""
        return "rlimits: " + ", ".join(f"{n}={s}/{h}" for n, s, h in self.limits())

    def rlimit(self, kind: str) -> Rlimit | None:
        """The ``RLIMIT_*`` entry of that type, if the process sets one."""
        return next((r for r in self.rlimits if r.type == kind), None)

    def kept_capabilities(self) -> list[str]:
        """The capabilities the process keeps (its bounding set), sorted."""
        return sorted(self.capabilities.bounding) if self.capabilities else []

    def with_args(self, args: list[str]) -> ProcessSpec:
        return self.model_copy(update={"args": list(args)})


# --------------------------------------------------------------------------------- the task


class Root(OciModel):
    path: str
    readonly: bool | None = None


class Mount(OciModel):
    destination: str
    type: str | None = None
    source: str | None = None
    options: list[str] | None = None

    @property
    def readonly(self) -> bool:
        return "ro" in (self.options or [])

    def option(self, prefix: str) -> str | None:
        """The value of the first ``prefix=value`` option (``size``, ``mode``), if any."""
        key = prefix + "="
        return next((o[len(key) :] for o in self.options or [] if o.startswith(key)), None)


class Namespace(OciModel):
    type: str
    path: str | None = None


class IdMapping(OciModel):
    container_id: int = Field(alias="containerID")
    host_id: int = Field(alias="hostID")
    size: int


class DeviceRule(OciModel):
    allow: bool
    type: str | None = None
    major: int | None = None
    minor: int | None = None
    access: str | None = None


class Memory(OciModel):
    limit: int | None = None
    reservation: int | None = None
    swap: int | None = None


class Cpu(OciModel):
    shares: int | None = None
    quota: int | None = None
    period: int | None = None
    cpus: str | None = None


class Pids(OciModel):
    limit: int


class Resources(OciModel):
    devices: list[DeviceRule] | None = None
    memory: Memory | None = None
    cpu: Cpu | None = None
    pids: Pids | None = None


class SeccompArg(OciModel):
    index: int
    value: int
    value_two: int | None = None
    op: str


class Syscall(OciModel):
    names: list[str]
    action: str
    errno_ret: int | None = None
    args: list[SeccompArg] | None = None


class Seccomp(OciModel):
    default_action: str
    default_errno_ret: int | None = None
    architectures: list[str] | None = None
    flags: list[str] | None = None
    listener_path: str | None = None
    syscalls: list[Syscall] | None = None


class Linux(OciModel):
    namespaces: list[Namespace] = Field(default_factory=list)
    uid_mappings: list[IdMapping] | None = None
    gid_mappings: list[IdMapping] | None = None
    resources: Resources | None = None
    cgroups_path: str | None = None
    seccomp: Seccomp | None = None
    masked_paths: list[str] | None = None
    readonly_paths: list[str] | None = None
    sysctl: dict[str, str] | None = None


class Hook(OciModel):
    path: str
    args: list[str] | None = None
    env: list[str] | None = None
    timeout: int | None = None


class Hooks(OciModel):
    create_runtime: list[Hook] | None = None
    create_container: list[Hook] | None = None
    start_container: list[Hook] | None = None
    poststart: list[Hook] | None = None
    poststop: list[Hook] | None = None


# Annotations: what the OCI fields cannot say (docs/spec-annotations.md).
ANN = "io.fusion-oci."
ANN_TASK = ANN + "task-id"
ANN_RUN = ANN + "run-id"
ANN_POLICY = ANN + "policy-hash"
ANN_NETWORK = ANN + "network"
ANN_IMAGE = ANN + "image"
ANN_HOST_ROOTFS = ANN + "host-rootfs"
ANN_CACHE_MODE = ANN + "cache-mode"
ANN_HOST_SERVICES = ANN + "host-services"
ANN_SERVICES = ANN + "services"
ANN_SERVICE_DEFS = ANN + "service-definitions"
"""The service containers' definitions (``policy.services`` as JSON, env values included:
the settings' own, never the caller's): what a runtime that starts them itself reads."""
ANN_PUBLISH = ANN + "publish-ports"


class TaskSpec(OciModel):
    """The OCI config without ``process``: the sandbox every command of a task shares."""

    oci_version: str
    root: Root
    hostname: str | None = None
    mounts: list[Mount] = Field(default_factory=list)
    hooks: Hooks | None = None
    linux: Linux = Field(default_factory=Linux)
    annotations: dict[str, str] = Field(default_factory=dict)
    env_allowlist: tuple[str, ...] = Field(default=(), exclude=True)
    """The policy's ``envAllowlist`` (names or globs; empty: none set), for a runtime whose
    commands get the caller's environment instead of :attr:`ProcessSpec.env` (native's status
    quo). Not OCI, so left out of the ``config.json`` (every process's env is already narrowed
    by it): a spec read back from one has none."""

    @property
    def network(self) -> NetworkMode:
        """The network mode the spec asks for. The OCI data decides first: no network
        namespace is ``host``; a network namespace is ``none`` unless the annotation says
        ``egress`` or ``filtered`` (OCI has no word for "outbound but not the host's
        loopback"). An annotation that disagrees with the namespaces (``host`` with a
        namespace) reads as ``none``: closed, never open."""
        if not any(n.type == "network" for n in self.linux.namespaces):
            return NetworkMode.HOST
        said = self.annotations.get(ANN_NETWORK)
        if said in (NetworkMode.EGRESS.value, NetworkMode.FILTERED.value):
            return NetworkMode(said)
        return NetworkMode.NONE

    @property
    def host_services(self) -> tuple[HostService, ...]:
        """Every endpoint a relay of the task serves inside, canonical forms: the granted host
        services (``policy.hostServices``), then the service containers' ``127.0.0.1:PORT``
        (``policy.services``); empty: none. An entry that does not parse is dropped: closed,
        never open."""
        from fusion_oci.models.hostservice import parse_grant

        out = []
        for text in filter(None, self.annotations.get(ANN_HOST_SERVICES, "").split(" ")):
            try:
                out.append(parse_grant(text))
            except ValueError:
                continue
        return tuple(out)

    @property
    def published_ports(self) -> tuple[PublishedPort, ...]:
        """The ports published on the host (``policy.publishPorts``), canonical forms; empty:
        none. An entry that does not parse is dropped: closed, never open."""
        from fusion_oci.models.publishport import make_published

        out = []
        for text in filter(None, self.annotations.get(ANN_PUBLISH, "").split(" ")):
            address, _, ports = (
                text.rpartition("]:") if text.startswith("[") else (text.partition(":"))
            )
            host, _, port = ports.partition(":")
            try:
                out.append(make_published(int(port), int(host or 0) or None, address.lstrip("[")))
            except ValueError:
                continue
        return tuple(out)

    @property
    def service_containers(self) -> tuple[tuple[str, int], ...]:
        """The task's service containers (``policy.services``): (name, port) each, reached
        at 127.0.0.1:PORT through the relays of :attr:`host_services`; empty: none."""
        out = []
        for text in filter(None, self.annotations.get(ANN_SERVICES, "").split(" ")):
            name, _, port = text.partition("=")
            if name and port.isdigit():
                out.append((name, int(port)))
        return tuple(out)

    @property
    def service_definitions(self) -> tuple[ServiceContainer, ...]:
        """The service containers as ``policy.services`` defines them (image, env, ready
        command...), in the order of :attr:`service_containers`; empty: none, or a record
        that does not parse (then a runtime that starts them itself has none to start, and
        its check says so)."""
        import json

        from fusion_oci.models import ServiceContainer as Definition

        text = self.annotations.get(ANN_SERVICE_DEFS)
        if not text:
            return ()
        try:
            return tuple(Definition.model_validate(d) for d in json.loads(text))
        except ValueError:
            return ()

    @property
    def image(self) -> str | None:
        """The image reference the task runs on (None: the host's system directories)."""
        return self.annotations.get(ANN_IMAGE)

    @property
    def host_rootfs(self) -> bool:
        return self.annotations.get(ANN_HOST_ROOTFS) == "true"

    @property
    def cache_mode(self) -> CacheMode:
        """How the cache mounts are scoped. Missing: shared (the settings' default); a value
        not known here: isolated, the scope that shares nothing between tasks."""
        said = self.annotations.get(ANN_CACHE_MODE, CacheMode.SHARED.value)
        try:
            return CacheMode(said)
        except ValueError:
            return CacheMode.ISOLATED

    @property
    def task_id(self) -> str:
        return self.annotations.get(ANN_TASK, "")

    @property
    def resources(self) -> Resources:
        return self.linux.resources or Resources()

    def has_namespace(self, kind: str) -> bool:
        return any(n.type == kind for n in self.linux.namespaces)

    def tmpfs_sizes(self) -> dict[str, str]:
        """Sized tmpfs mounts other than /dev and /dev/shm (tmpSizeMb), by destination."""
        out = {}
        for m in self.mounts:
            size = m.option("size") if m.type == "tmpfs" else None
            if size and m.destination not in ("/dev", "/dev/shm"):
                out[m.destination] = size
        return out


def config_json(task: TaskSpec, process: ProcessSpec) -> dict[str, Any]:
    """The whole OCI ``config.json`` of one command of a task: what a bundle holds. The one
    place the typed pair becomes the JSON document."""
    out = task.to_oci()
    out["process"] = process.to_oci()
    return out


@dataclass(frozen=True)
class ConfigSpec:
    """One bundle's whole config, typed: the task's sandbox and the process its container runs
    (what :mod:`fusion_oci.oci.ops` change together, as containerd's ``SpecOpts`` change one
    ``*specs.Spec``). :meth:`to_oci` is :func:`config_json` of the pair."""

    task: TaskSpec
    process: ProcessSpec

    def to_oci(self) -> dict[str, Any]:
        return config_json(self.task, self.process)

    def with_task(self, task: TaskSpec) -> ConfigSpec:
        return ConfigSpec(task, self.process)

    def with_process(self, process: ProcessSpec) -> ConfigSpec:
        return ConfigSpec(self.task, process)


def split(config: Mapping[str, Any]) -> tuple[TaskSpec, ProcessSpec]:
    """A ``config.json`` read as its two typed halves (validated: a bad field is refused)."""
    data = dict(config)
    process = data.pop("process")
    return TaskSpec.model_validate(data), ProcessSpec.model_validate(process)
