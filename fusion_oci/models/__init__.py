"""The brief's section 4 interfaces as pydantic models.

YAML and JSON use the brief's camelCase names (``allowNetwork``); Python uses snake_case
(``allow_network``). Every model is frozen and rejects unknown keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    InstanceOf,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

# Re-exported (the one list is fusion_oci/models/backends.py).
from fusion_oci.models.backends import BACKEND_IDS as BACKEND_IDS
from fusion_oci.models.backends import BackendId as BackendId
from fusion_oci.models.stdin import StdinStream

if TYPE_CHECKING:
    from fusion_oci.models.hostservice import HostService
    from fusion_oci.models.publishport import PublishedPort

FailureMode = Literal["fail-hard", "fallback-native"]


class NetworkMode(StrEnum):
    """What the command may reach over the network.

    ``none``: no network at all, not even loopback services of the host.
    ``egress``: outbound connections work; the host's loopback services (the dashboard on
    127.0.0.1:4040, a database on 5432) stay unreachable.
    ``filtered``: outbound connections only through the task's egress proxy, to the hosts
    ``allowedDomains`` names and ``deniedDomains`` does not; nothing else is routable.
    ``host``: the host's network as it is; only by explicit choice.
    """

    NONE = "none"
    EGRESS = "egress"
    FILTERED = "filtered"
    HOST = "host"


class Model(BaseModel):
    """Base of every value model: camelCase on the wire, frozen, unknown keys rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="forbid",
    )


def _absolute(paths: list[str]) -> list[str]:
    for p in paths:
        if not Path(p).is_absolute():
            raise ValueError(f"'{p}' is not an absolute path; write it as an absolute host path")
    return paths


class CpuLimit(Model):
    max_cores: Annotated[float, Field(gt=0)] | None = None
    """CPU quota in cores (1.5 = one and a half cores). None: no quota."""
    max_ms: Annotated[int, Field(gt=0)] | None = None
    """CPU time the command may burn, in milliseconds (RLIMIT_CPU, rounded up to seconds).
    None: unlimited."""


DEFAULT_PROTECTED_PATHS: tuple[str, ...] = (
    ".fusion/",  # the project's settings and audit log: the command must not rewrite its
    # own policy or forge its audit trail
    ".git/hooks",  # a main worktree's hooks run on the host at the next git commit
    ".git/config",  # core.hooksPath, core.fsmonitor, aliases: code the host's git runs
    ".envrc",  # direnv runs it in the user's shell on `cd`
    ".vscode/",  # tasks.json / settings.json run commands when the editor opens the folder
    ".idea/",  # JetBrains run configurations and startup tasks
    ".mcp.json",  # MCP servers an agent client starts on the host
    ".claude/",  # agent settings and hooks run by the host's agent client
    ".gitmodules",  # submodule URLs and update commands the host's git follows
)
"""What stays read-only inside the sandbox even where the worktree is writable (relative to
the worktree, or absolute). Each entry says why above; a project lifts one by listing
``protectedPaths`` without it in its settings (never from inside the sandbox: the project's
settings are themselves protected)."""


class HostServiceGrant(Model):
    """A ``hostServices`` entry written as a mapping: the grant and whether it is meant even
    though it hands over the host (:func:`fusion_oci.models.hostservice.hands_over`)."""

    address: str
    """``127.0.0.1:PORT``, ``[::1]:PORT`` or ``unix:/PATH`` (as a plain string entry)."""
    dangerous: bool = False
    """True: grant it even though it gives away more than one service (an engine's API
    socket, an ssh or gpg agent, fusion-oci's own server, port 4040). False: such a grant is
    refused at load."""


class PublishPort(Model):
    """A ``publishPorts`` entry written as a mapping (fusion_oci.models.publishport): the only form
    that may name an address off the host's loopback."""

    port: Annotated[int, Field(gt=0, lt=65536)]
    """The TCP port a command listens on inside the sandbox (its own 127.0.0.1)."""
    host_port: Annotated[int, Field(gt=0, lt=65536)] | None = None
    """The host port it is published on. None: a free one, chosen at prepare and reported."""
    address: str = "127.0.0.1"
    """The host address the published port listens on: the loopback unless this says
    otherwise (``0.0.0.0``: every address of the host, the LAN included)."""


class ServiceContainer(Model):
    """A ``services`` entry: a container the task's commands use, as a CI system's services
    (``{name: db, image: postgres, env: {...}, port: 5432, ready: pg_isready}``). Started at
    prepare, one per task, on no network of its own; the task reaches it at
    ``127.0.0.1:PORT`` (and ``NAME:PORT``) through its relay, nothing else reaches it
    (fusion_oci.sidecars)."""

    name: str
    """The service's host name inside the sandbox (a DNS label: lower case, digits, '-')."""
    image: Annotated[str, Field(min_length=1)]
    """A folder under ``images/`` (``postgres``, ``redis``: built from Debian's packages,
    behind the sandbox_provision gate) or a full reference the engine can pull."""
    port: Annotated[int, Field(gt=0, lt=65536)]
    """The TCP port the service listens on inside its container; the task sees it at the
    same port of its own 127.0.0.1."""
    env: dict[str, str] = Field(default_factory=dict)
    """The service container's environment (``POSTGRES_PASSWORD``...). Audited by name only.
    Empty: the image's defaults."""
    ready: str | None = None
    """A shell command run inside the service container until it exits 0 (``pg_isready``,
    ``redis-cli ping``). None: ready once the port accepts a connection."""
    command: list[str] | None = None
    """The container's command (argv). None: the image's."""
    ready_timeout_s: Annotated[float, Field(gt=0, le=600)] = 60.0
    """How long prepare waits for ``ready`` before it fails (the container is removed)."""

    @field_validator("name")
    @classmethod
    def _dns_label(cls, name: str) -> str:
        import re

        if not re.fullmatch(r"[a-z][a-z0-9-]{0,62}", name) or name.endswith("-"):
            raise ValueError(
                f"service name {name!r} is not a host name: write a DNS label of lower-case "
                "letters, digits and '-', starting with a letter (db, cache, pg-main)"
            )
        if name == "localhost":
            raise ValueError("'localhost' is the sandbox's own name; call the service db or so")
        return name

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            if not name or "=" in name or "\0" in name or "\0" in value:
                raise ValueError(f"env name {name!r} is not an environment variable name")
        return env


class SandboxPolicy(Model):
    """What the sandboxed command may touch."""

    allow_network: bool = True
    """False: no network. True: outbound access (``network`` says which kind; default egress)."""
    network: NetworkMode | None = None
    """Explicit network mode. None: ``egress`` when allowNetwork is true, else ``none``."""
    allowed_domains: list[str] = Field(default_factory=list)
    """Host names the ``filtered`` network reaches (``example.com``, ``*.example.com``, with an
    optional ``:port``). Empty: only the built-in git/npm profile's hosts."""
    denied_domains: list[str] = Field(default_factory=list)
    """Host names the ``filtered`` network never reaches, whatever allows them (deny wins)."""
    host_services: list[str | HostServiceGrant] = Field(default_factory=list)
    """Services on the host's loopback or unix sockets the task may use, each where programs
    expect it inside (the same port on the sandbox's own 127.0.0.1 or ::1, the same socket
    path), through a per-task relay that connects to exactly that service
    (fusion_oci.services). Works with every network but ``host``. Empty: none; the host's
    loopback stays closed."""
    services: list[ServiceContainer] = Field(default_factory=list)
    """Per-task service containers (a database, a cache) the task's commands reach at
    ``127.0.0.1:PORT`` and by name, each on no network but the task's relay (see
    :class:`ServiceContainer`). Works with every network but ``host``. Empty: none."""
    publish_ports: list[str | PublishPort] = Field(default_factory=list)
    """Ports commands listen on inside the sandbox, published on the host as ``docker run
    -p`` writes them, host before sandbox (``"3000"``: a free host port; ``"8080:80"``),
    on the host's 127.0.0.1 unless a mapping's ``address`` says otherwise; never port 4040
    (fusion_oci.models.publishport, fusion_oci.services.publish). Empty: nothing inside is
    reachable from the host."""
    allowed_paths: list[str] = Field(default_factory=list)
    """Absolute host paths visible read-only inside the sandbox. Empty: only the worktree."""
    writable_paths: list[str] = Field(default_factory=list)
    """Absolute host paths visible read-write (beside the worktree, which always is)."""
    env_allowlist: list[str] = Field(default_factory=list)
    """Names of caller env vars passed through. Empty: only the fixed minimal set."""
    cpu_limit: CpuLimit | None = None
    """CPU quota and CPU time. None: no CPU limits."""
    memory_limit_mb: Annotated[int, Field(gt=0)] | None = None
    """Memory limit in MiB. None: unlimited."""
    pids_limit: Annotated[int, Field(gt=0)] | None = None
    """Most processes/threads at once. None: unlimited."""
    tmp_size_mb: Annotated[int, Field(gt=0)] | None = None
    """Size cap of the private ``/tmp`` and ``HOME`` (memory-backed) in MiB, so that filling
    them cannot exhaust the host's memory. None: the kernel's default (half of RAM; with
    memoryLimitMb set, what the command writes there counts against that limit)."""
    file_size_limit_mb: Annotated[int, Field(gt=0)] | None = None
    """Largest file the command may write, in MiB (RLIMIT_FSIZE: bounds a disk fill of the
    worktree one file at a time). None: unlimited."""

    protected_paths: list[str] = Field(default_factory=lambda: list(DEFAULT_PROTECTED_PATHS))
    """Globs (relative to the worktree, or absolute) kept read-only even inside the worktree
    and writablePaths; a writablePaths entry below one stays writable. Default:
    :data:`DEFAULT_PROTECTED_PATHS`. One that does not exist at prepare cannot be protected
    without leaving a mount point behind in the worktree: it is listed as unenforced."""

    @field_validator("allowed_domains", "denied_domains")
    @classmethod
    def _domains(cls, values: list[str], info: ValidationInfo) -> list[str]:
        # The egress proxy's own parser: a pattern it would reject never gets this far.
        from fusion_oci.models.hostpattern import parse_pattern

        key = to_camel(info.field_name or "allowedDomains")
        for i, value in enumerate(values):
            try:
                parse_pattern(value)
            except ValueError as exc:
                raise ValueError(
                    f"{key}[{i}] '{value}' is not a host pattern: {exc}; write an exact name "
                    "(registry.npmjs.org), a wildcard (*.example.com) or an address/range "
                    "(10.0.0.0/24), optionally with :PORT (github.com:22)"
                ) from None
        return values

    @field_validator("host_services")
    @classmethod
    def _host_services(cls, values: list[str | HostServiceGrant]) -> list[str | HostServiceGrant]:
        from fusion_oci.models.hostservice import hands_over, parse_grant

        seen: dict[str, int] = {}
        for i, value in enumerate(values):
            text = value if isinstance(value, str) else value.address
            dangerous = not isinstance(value, str) and value.dangerous
            try:
                grant = parse_grant(text)
            except ValueError as exc:
                raise ValueError(f"hostServices[{i}] {text!r}: {exc}") from None
            what = hands_over(grant)
            if what is not None and not dangerous:
                raise ValueError(
                    f"hostServices[{i}] {text!r} hands over the host ({what}); if that is "
                    f"meant, write it as {{address: {text!r}, dangerous: true}}"
                )
            where = str(grant)
            if where in seen:
                raise ValueError(
                    f"hostServices[{i}] {text!r} is granted already (hostServices[{seen[where]}])"
                )
            seen[where] = i
        return values

    @field_validator("publish_ports")
    @classmethod
    def _publish_ports(cls, values: list[str | PublishPort]) -> list[str | PublishPort]:
        from fusion_oci.models.publishport import make_published, parse_publish

        seen: dict[str, int] = {}
        for i, value in enumerate(values):
            try:
                entry = (
                    parse_publish(value)
                    if isinstance(value, str)
                    else make_published(value.port, value.host_port, value.address)
                )
            except ValueError as exc:
                raise ValueError(f"publishPorts[{i}] {value!r}: {exc}") from None
            if entry.host_port:
                where = entry.host()
                if where in seen:
                    raise ValueError(
                        f"publishPorts[{i}] {value!r}: host port {where} is taken by "
                        f"publishPorts[{seen[where]}]; publish on another one"
                    )
                seen[where] = i
        return values

    def published(self) -> list[PublishedPort]:
        """The parsed ``publishPorts``, in order."""
        from fusion_oci.models.publishport import make_published, parse_publish

        return [
            parse_publish(v)
            if isinstance(v, str)
            else make_published(v.port, v.host_port, v.address)
            for v in self.publish_ports
        ]

    def service_endpoints(self) -> list[HostService]:
        """Where each of :attr:`services` appears inside: ``127.0.0.1:PORT``, in order."""
        from fusion_oci.models.hostservice import HostService

        return [HostService("tcp", address="127.0.0.1", port=s.port) for s in self.services]

    def relayed(self) -> list[HostService]:
        """Every endpoint a relay serves inside the sandbox: the host-service grants, then
        the service containers' endpoints (the spec's host-services annotation)."""
        return [g for g, _ in self.grants()] + self.service_endpoints()

    def grants(self) -> list[tuple[HostService, bool]]:
        """The parsed ``hostServices``: each grant and its ``dangerous`` flag."""
        from fusion_oci.models.hostservice import parse_grant

        return [
            (parse_grant(v), False) if isinstance(v, str) else (parse_grant(v.address), v.dangerous)
            for v in self.host_services
        ]

    _check_allowed = field_validator("allowed_paths")(_absolute)
    _check_writable = field_validator("writable_paths")(_absolute)

    @field_validator("env_allowlist")
    @classmethod
    def _env_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"'{name}' is not an environment variable name")
        return names

    @model_validator(mode="after")
    def _network_consistent(self) -> SandboxPolicy:
        if not self.allow_network and self.network not in (None, NetworkMode.NONE):
            raise ValueError(
                f"allowNetwork is false but network is '{self.network}'; "
                "set allowNetwork: true or network: none"
            )
        if self.network is NetworkMode.FILTERED and any(
            g.kind == "tcp" and g.port == 3128 and g.family == 2 for g, _ in self.grants()
        ):
            raise ValueError(
                "hostServices grants port 3128 with network filtered: inside, 127.0.0.1:3128 "
                "is the proxy's forwarder; move the service to another port or use network "
                "none or egress"
            )
        self._services_consistent()
        if self.publish_ports and self.network_mode is NetworkMode.HOST:
            raise ValueError(
                "publishPorts with network host: a command's listener is on the host's network "
                "already, so there is nothing to publish; use network none, egress or filtered "
                "with publishPorts"
            )
        if self.host_services and self.network is NetworkMode.HOST:
            raise ValueError(
                "hostServices with network host: the host's network reaches every service "
                "already, so the grants would limit nothing; use network none, egress or "
                "filtered with hostServices"
            )
        return self

    def _services_consistent(self) -> None:
        from fusion_oci.models.hostservice import DASHBOARD_PORT

        if not self.services:
            return
        if self.network is NetworkMode.HOST:
            raise ValueError(
                "services with network host: a service container is reached through the "
                "task's own loopback, which network host does not have; use network none, "
                "egress or filtered with services"
            )
        granted = {str(g): i for i, (g, _) in enumerate(self.grants())}
        names: dict[str, int] = {}
        ports: dict[int, int] = {}
        for i, svc in enumerate(self.services):
            where = f"services[{i}] '{svc.name}'"
            if svc.name in names:
                raise ValueError(f"{where}: the name is taken by services[{names[svc.name]}]")
            if svc.port in ports:
                raise ValueError(
                    f"{where}: port {svc.port} is taken by services[{ports[svc.port]}]; each "
                    "service needs its own port on the task's 127.0.0.1"
                )
            if svc.port == DASHBOARD_PORT:
                raise ValueError(f"{where}: port {DASHBOARD_PORT} is the dashboard's; use another")
            if svc.port == 3128 and self.network is NetworkMode.FILTERED:
                raise ValueError(
                    f"{where}: with network filtered, 127.0.0.1:3128 is the proxy's forwarder; "
                    "move the service to another port"
                )
            endpoint = f"127.0.0.1:{svc.port}"
            if endpoint in granted:
                raise ValueError(
                    f"{where}: {endpoint} is granted already as a host service "
                    f"(hostServices[{granted[endpoint]}]); drop one of the two"
                )
            names[svc.name] = i
            ports[svc.port] = i

    @property
    def network_mode(self) -> NetworkMode:
        if self.network is not None:
            return self.network
        return NetworkMode.EGRESS if self.allow_network else NetworkMode.NONE

    def digest(self) -> str:
        """A short stable hash of the policy, for audit events and annotations."""
        data = self.model_dump(mode="json", by_alias=True)
        if not self.host_services:
            del data["hostServices"]  # the hash of every policy without grants stays as it was
        if not self.services:
            del data["services"]
        if not self.publish_ports:
            del data["publishPorts"]
        canon = json.dumps(data, sort_keys=True)
        return "sha256:" + hashlib.sha256(canon.encode()).hexdigest()[:16]

    def summary(self) -> str:
        parts = [f"network={self.network_mode.value}"]
        if self.allowed_paths:
            parts.append(f"ro={len(self.allowed_paths)}")
        if self.writable_paths:
            parts.append(f"rw={len(self.writable_paths)}")
        if self.env_allowlist:
            parts.append("env=" + ",".join(self.env_allowlist))
        if self.memory_limit_mb:
            parts.append(f"mem={self.memory_limit_mb}MiB")
        if self.cpu_limit and self.cpu_limit.max_cores:
            parts.append(f"cpus={self.cpu_limit.max_cores}")
        if self.cpu_limit and self.cpu_limit.max_ms:
            parts.append(f"cpuMs={self.cpu_limit.max_ms}")
        if self.pids_limit:
            parts.append(f"pids={self.pids_limit}")
        if self.file_size_limit_mb:
            parts.append(f"fsize={self.file_size_limit_mb}MiB")
        if self.host_services:
            parts.append(f"services={len(self.host_services)}")
        if self.publish_ports:
            parts.append("publish=" + ",".join(str(p) for p in self.published()))
        if self.services:
            parts.append("containers=" + ",".join(s.name for s in self.services))
        if self.protected_paths != list(DEFAULT_PROTECTED_PATHS):
            parts.append(f"protected={len(self.protected_paths)}")
        return " ".join(parts)


class CacheMode(StrEnum):
    """How package caches (pnpm store, npm cache) are shared.

    ``shared``: one cache per project, reused across tasks (fast; a task can poison what the
    next one installs). ``isolated``: one cache per task (slow first install; no
    cross-task contamination). ``off``: no cache mount.
    """

    SHARED = "shared"
    ISOLATED = "isolated"
    OFF = "off"


OutputStream = Literal["stdout", "stderr"]
OutputCallback = Callable[[OutputStream, bytes], Awaitable[None] | None]
"""Called on the event loop with each chunk of output as it arrives (bytes as the command wrote
them; the whole chunk, also past maxBuffer, which bounds only what is kept). It may return an
awaitable: the command's output is not read further until it is done (backpressure for a slow
consumer, e.g. the server's client)."""


class RunOptions(Model):
    """How one command runs."""

    cwd: str | None = None
    """Working directory inside the sandbox. None: the worktree."""
    timeout_ms: Annotated[int, Field(gt=0)] = 600_000
    """Wall-clock limit; past it the whole process tree is ended (SIGTERM, grace, SIGKILL)."""
    max_buffer: Annotated[int, Field(gt=0)] = 10 * 1024 * 1024
    """Most bytes kept of stdout and of stderr each; more ends the command (``truncated``)."""
    env: dict[str, str] | None = None
    """Environment the allowlist draws from. None: the caller's process environment."""
    stdin: bytes | InstanceOf[StdinStream] | None = None
    """Bytes fed to the command's stdin, or a :class:`~fusion_oci.models.stdin.StdinStream` fed as
    it comes. None: stdin is closed."""
    on_output: OutputCallback | None = Field(default=None, exclude=True)
    """Streams output while the command runs (see :data:`OutputCallback`). None: output is
    only collected into the result."""
    keep_output: bool = True
    """False: output only streams to ``on_output``; nothing is kept (the result's stdout and
    stderr are empty) and maxBuffer ends nothing (the CLI's pass-through, like ``docker run``)."""


class PrepareContext(Model):
    """Everything a runtime needs to know about the task before its first command."""

    task_id: str
    run_id: str
    worktree_path: str
    policy: SandboxPolicy = Field(default_factory=SandboxPolicy)
    image: str | None = None
    """Container image reference for container runtimes. None: the host's system directories."""
    cache_mode: CacheMode = CacheMode.SHARED
    host_ca_bundle: str | None = None
    """Host CA bundle made visible (read-only) with the env vars tools read. None: not shared."""
    project_dir: str | None = None
    """Project root (settings, per-project caches, the audit log). None: a linked worktree's
    main repository, else the worktree itself (see fusion_oci.policy.worktree)."""
    unsafe_worktree: bool = False
    """True: accept a worktree that is ``/``, ``$HOME`` or an ancestor of it, or not the top of
    a git work tree. False (default): such a worktree is refused before anything runs."""
    _worktree_checked: tuple[str, bool] | None = PrivateAttr(default=None)
    """(worktree_path, unsafe_worktree) as the front door (fusion_oci.caller) checked them,
    naming them as its caller does: ``prepare`` does not check that worktree again. Private:
    no field, never read from the wire."""

    def mark_worktree_checked(self) -> PrepareContext:
        """This context (just built by the one who checked its worktree), so marked."""
        self._worktree_checked = (self.worktree_path, self.unsafe_worktree)
        return self

    @property
    def worktree_checked(self) -> bool:
        """True: this worktree, with this unsafe_worktree, was checked by the front door."""
        return self._worktree_checked == (self.worktree_path, self.unsafe_worktree)

    @field_validator("worktree_path")
    @classmethod
    def _worktree_absolute(cls, value: str) -> str:
        if not Path(value).is_absolute():
            raise ValueError(f"worktreePath '{value}' must be absolute")
        return value

    @field_validator("task_id", "run_id")
    @classmethod
    def _safe_id(cls, value: str) -> str:
        # Ids end up in container names, cgroup paths and labels: keep them to a safe alphabet.
        import re

        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", value):
            raise ValueError(
                f"'{value}' must be 1-128 characters of letters, digits, '.', '_' or '-'"
            )
        return value


EndReason = Literal["exit", "signal", "timeout", "max-buffer", "oom", "pids", "cpu-time", "aborted"]


class RunResult(Model):
    """What one command did. ``exit_code`` is None when a signal ended it."""

    stdout: str
    stderr: str
    exit_code: int | None
    signal: str | None = None
    timed_out: bool = False
    truncated: bool = False
    duration_ms: int = 0
    backend: str = "native"
    fell_back: bool = False
    reason: EndReason = "exit"
    """Why the command ended: its own exit, a signal, or which limit ended it."""
    unenforced: list[str] = Field(default_factory=list)
    """Policy parts that were not enforced for this run (native by choice or by fallback)."""

    @property
    def shell_status(self) -> int:
        """The status a shell would report: 124 for a timeout, 128+N for signal N."""
        if self.timed_out:
            return 124
        if self.exit_code is not None:
            return self.exit_code
        import signal as _signal

        try:
            return 128 + int(_signal.Signals[self.signal or "SIGKILL"])
        except KeyError:
            return 137


class SandboxCapabilities(Model):
    """Exactly the brief's capability summary of a backend."""

    filesystem_isolation: Literal["none", "basic", "strong"]
    network_policy: Literal["none", "coarse", "fine"]
    resource_limits: Literal["none", "basic", "advanced"]
    requires_install: bool
    supports_mac: bool
    supports_linux: bool
    supports_windows: bool
