"""What every runtime offers, and the shared compile-then-execute skeleton.

A runtime's translation (:meth:`plan`) is a pure function from the spec to a printable launch
plan (argv or SDK arguments); :meth:`execute` is the thin step that runs it.
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fusion_oci.models import (
    EndReason,
    NetworkMode,
    PrepareContext,
    RunOptions,
    RunResult,
    SandboxCapabilities,
    SandboxPolicy,
)

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog
    from fusion_oci.images.gates import AskCallback
    from fusion_oci.oci.host import HostInfo
    from fusion_oci.oci.spec import Spec
    from fusion_oci.policy.layout import TaskLayout
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.process import ProcessOutcome
    from fusion_oci.resolve import ResolvedTask


class Requirement(StrEnum):
    """A part of a policy that some runtime must enforce."""

    FILESYSTEM = "filesystem isolation"
    PROC_PATHS = "maskedPaths/readonlyPaths"
    """The bundle's /proc and /sys protections (a writable /proc/sys is a root escape)."""
    NETWORK_NONE = "network none"
    NETWORK_EGRESS = "network egress without host loopback"
    MEMORY = "memoryLimitMb"
    CPU_QUOTA = "cpuLimit.maxCores"
    CPU_TIME = "cpuLimit.maxMs"
    PIDS = "pidsLimit"
    ENV = "envAllowlist"
    TMP_SIZE = "tmpSizeMb"
    FILE_SIZE = "fileSizeLimitMb"


def requirements(policy: SandboxPolicy) -> frozenset[Requirement]:
    """What enforcing this policy takes. Pure."""
    need = {Requirement.FILESYSTEM, Requirement.PROC_PATHS, Requirement.ENV}
    mode = policy.network_mode
    if mode is NetworkMode.NONE:
        need.add(Requirement.NETWORK_NONE)
    elif mode is NetworkMode.EGRESS:
        need.add(Requirement.NETWORK_EGRESS)
    if policy.memory_limit_mb:
        need.add(Requirement.MEMORY)
    if policy.pids_limit:
        need.add(Requirement.PIDS)
    if policy.cpu_limit and policy.cpu_limit.max_cores:
        need.add(Requirement.CPU_QUOTA)
    if policy.cpu_limit and policy.cpu_limit.max_ms:
        need.add(Requirement.CPU_TIME)
    if policy.tmp_size_mb:
        need.add(Requirement.TMP_SIZE)
    if policy.file_size_limit_mb:
        need.add(Requirement.FILE_SIZE)
    return frozenset(need)


def spec_requirements(spec: Spec) -> frozenset[Requirement]:
    """What enforcing this spec takes, read from its OCI fields (the network annotation only
    for egress versus none). Pure; equal to :func:`requirements` of the policy it was
    compiled from (tests/unit/test_resolve.py), so a runtime can be checked against the
    bundle it is handed as well as against a policy."""
    from fusion_oci.oci.spec import spec_network

    need = {Requirement.FILESYSTEM, Requirement.PROC_PATHS, Requirement.ENV}
    mode = spec_network(spec)
    if mode is NetworkMode.NONE:
        need.add(Requirement.NETWORK_NONE)
    elif mode is NetworkMode.EGRESS:
        need.add(Requirement.NETWORK_EGRESS)
    resources = spec.get("linux", {}).get("resources", {})
    for key, req in (("memory", Requirement.MEMORY), ("pids", Requirement.PIDS),
                     ("cpu", Requirement.CPU_QUOTA)):
        if key in resources:
            need.add(req)
    rlimits = {r["type"] for r in spec.get("process", {}).get("rlimits", [])}
    if "RLIMIT_CPU" in rlimits:
        need.add(Requirement.CPU_TIME)
    if "RLIMIT_FSIZE" in rlimits:
        need.add(Requirement.FILE_SIZE)
    if any(m.get("type") == "tmpfs" and any(o.startswith("size=") for o in m.get("options", []))
           and m.get("destination") not in ("/dev", "/dev/shm")
           for m in spec.get("mounts", [])):
        need.add(Requirement.TMP_SIZE)
    return frozenset(need)


def check_spec(runtime: Runtime, spec: Spec) -> list[str]:
    """The parts of ``spec`` that ``runtime`` does not enforce here, sorted (the protocol's
    ``check(spec)``; a runtime may offer its own ``check``)."""
    own = getattr(runtime, "check", None)
    if callable(own):
        return list(own(spec))
    return sorted(r.value for r in spec_requirements(spec) - runtime.enforces())


def unenforced_parts(runtime: Runtime, policy: SandboxPolicy) -> list[str]:
    """The requirements of ``policy`` that ``runtime`` does not enforce here, sorted.

    A runtime whose enforcement depends on the policy (native honours envAllowlist only when
    one is set) offers ``enforces_for(policy)``; any other runtime answers ``enforces()``.
    """
    enforces_for = getattr(runtime, "enforces_for", None)
    enforced = enforces_for(policy) if callable(enforces_for) else runtime.enforces()
    return sorted(r.value for r in requirements(policy) - enforced)


@dataclass(frozen=True)
class Availability:
    """Whether a runtime can work on this host, and what to do when it cannot."""

    available: bool
    reason: str = ""
    hint: str = ""
    version: str | None = None
    rootless: bool | None = None
    details: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchPlan:
    """How a runtime would start a spec: an argv, or SDK call arguments. Printable, golden."""

    backend: str
    argv: list[str] | None = None
    sdk_call: str | None = None
    sdk_kwargs: dict[str, Any] | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"backend": self.backend}
        for key, name in (("argv", "argv"), ("sdk_call", "sdkCall"), ("sdk_kwargs", "sdkKwargs"),
                          ("env", "env"), ("cwd", "cwd")):
            value = getattr(self, key)
            if value is not None:
                data[name] = value
        if self.notes:
            data["notes"] = self.notes
        return data


@runtime_checkable
class Runtime(Protocol):
    """The brief's SandboxBackend, in Python."""

    id: str

    def capabilities(self) -> SandboxCapabilities: ...

    def availability(self) -> Availability: ...

    def enforces(self) -> frozenset[Requirement]:
        """The requirements this runtime enforces on this host."""
        ...

    def plan(self, spec: Spec) -> LaunchPlan: ...

    async def prepare(self, ctx: PrepareContext) -> None: ...

    async def run(self, command: str | Sequence[str], opts: RunOptions) -> RunResult: ...

    async def dispose(self) -> None: ...


@dataclass(frozen=True)
class LimitCounters:
    """What a command's cgroup (or engine) counted while it ran; 0: nothing, or not known."""

    oom_kills: int = 0
    """Processes the OOM killer ended."""
    pids_max: int = 0
    """fork/clone calls refused at pidsLimit."""


def status_from_code(code: int | None, signal: str | None = None
                     ) -> tuple[int | None, str | None]:
    """The one 128+N rule: a launcher's (bwrap, runc, an engine's exec) status 128+N, N a real
    signal (1..64), is death by that signal, as a shell reports it. Pure.

    A command that itself exits 129..192 reads the same; ``shell_status`` is equal either way.
    """
    if code is not None and 128 < code <= 128 + 64:
        try:
            return None, _signal.Signals(code - 128).name
        except ValueError:
            return code, signal
    return code, signal


def classify(outcome: ProcessOutcome, spec: Spec,
             counters: LimitCounters = LimitCounters()) -> EndReason:
    """Why a command ended: one precedence for every runtime (they only supply counters). Pure.

    A cgroup limit that fired names the reason whenever the command did not succeed, before
    the timeout: a fork bomb held at pidsLimit until the timeout is ``pids`` (``timed_out``
    stays true), a build the OOM killer took is ``oom``; a command that survived a limit and
    exited 0 ended by its own exit. Then timeout, maxBuffer, CPU time (SIGXCPU, or SIGKILL
    with RLIMIT_CPU in the spec), another signal, the command's own exit.
    """
    succeeded = (outcome.returncode == 0 and outcome.signal is None and not outcome.timed_out
                 and not outcome.truncated)
    if not succeeded and counters.oom_kills:
        return "oom"
    if not succeeded and counters.pids_max:
        return "pids"
    if outcome.timed_out:
        return "timeout"
    if outcome.truncated:
        return "max-buffer"
    if outcome.signal is None:
        return "exit"
    has_cpu = any(r["type"] == "RLIMIT_CPU" for r in spec["process"].get("rlimits", []))
    if outcome.signal == _signal.Signals.SIGXCPU.name or (
        has_cpu and outcome.signal == "SIGKILL"
    ):
        return "cpu-time"
    return "signal"


class SpecRuntime:
    """Skeleton for runtimes that compile a spec per command and execute it.

    Subclasses provide ``id``, :meth:`capabilities`, :meth:`availability`, :meth:`enforces`,
    :meth:`plan` and :meth:`execute`; they may extend :meth:`prepare` and :meth:`dispose`.
    """

    id: str = "abstract"
    default_image: str | None = None
    """Image used when neither the task nor the settings name one (None: the host's system
    directories)."""

    def __init__(self, settings: SandboxSettings, env: Mapping[str, str],
                 cache_root: Path | None = None, host: HostInfo | None = None) -> None:
        self.settings = settings
        self.env = dict(env)
        self.cache_root = cache_root or default_cache_root(self.env)
        self._host = host
        self.ctx: PrepareContext | None = None
        self.layout: TaskLayout | None = None
        # Services the lifecycle hands over (Sandbox sets them): where provisioning and other
        # runtime-side events are audited, and who answers an `ask` gate.
        self.audit: AuditLog | None = None
        self.ask: AskCallback | None = None
        self.last_spec: Spec | None = None
        """The spec of the latest command (compiled by :meth:`run`)."""
        self.resolved: ResolvedTask | None = None
        """The resolved task (set by :meth:`prepare`)."""
        self.task_spec: Spec | None = None
        """The spec all of the task's commands share but for the process (set by
        :meth:`prepare`): what a runtime prepares from."""

    @property
    def host(self) -> HostInfo:
        if self._host is None:
            from fusion_oci.oci.host import probe_host

            self._host = probe_host()
        return self._host

    async def prepare(self, ctx: PrepareContext) -> None:
        """Resolve the task (fusion_oci.resolve, the one resolve step) and compile its task
        spec; subclasses take what they set up from :attr:`task_spec`, not from ``ctx``."""
        from fusion_oci.resolve import resolve, task_spec

        self.ctx = ctx
        self.resolved = resolve(self.settings, ctx, self.host, env=self.env,
                                cache_root=self.cache_root, default_image=self.default_image)
        self.ctx = self.resolved.ctx
        self.layout = self.resolved.layout
        self.task_spec = task_spec(self.resolved)

    def set_image(self, image: str) -> None:
        """After provisioning: the task runs on ``image`` (a local reference)."""
        from fusion_oci.resolve import task_spec

        assert self.resolved is not None
        self.resolved = self.resolved.with_image(image)
        self.ctx = self.resolved.ctx
        self.task_spec = task_spec(self.resolved)

    def compile(self, command: str | Sequence[str], opts: RunOptions) -> Spec:
        from fusion_oci.errors import SandboxSetupError
        from fusion_oci.resolve import compile_spec

        if self.resolved is None:
            raise SandboxSetupError(f"runtime '{self.id}' was not prepared",
                                    "run() came before prepare()", "call prepare(ctx) first")
        return compile_spec(self.resolved, command, opts)

    async def run(self, command: str | Sequence[str], opts: RunOptions) -> RunResult:
        spec = self.compile(command, opts)
        self.last_spec = spec  # what the lifecycle records for a replay (fusion_oci.replay)
        return await self.execute(spec, opts)

    async def execute(self, spec: Spec, opts: RunOptions) -> RunResult:
        raise NotImplementedError

    async def dispose(self) -> None:
        self.ctx = None
        self.layout = None
        self.resolved = None
        self.task_spec = None

    def result(self, outcome: ProcessOutcome, spec: Spec, reason: EndReason | None = None
               ) -> RunResult:
        return RunResult(
            stdout=outcome.stdout.decode("utf-8", errors="replace"),
            stderr=outcome.stderr.decode("utf-8", errors="replace"),
            exit_code=outcome.returncode,
            signal=outcome.signal,
            timed_out=outcome.timed_out,
            truncated=outcome.truncated,
            duration_ms=outcome.duration_ms,
            backend=self.id,
            reason=reason or classify(outcome, spec),
        )


def default_cache_root(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "/tmp")) / ".cache")
    return Path(base) / "fusion-oci"


class UnavailableRuntime:
    """Stands in for a backend that is known but cannot be used here (never "unknown")."""

    def __init__(self, backend: str, reason: str, hint: str = "") -> None:
        self.id = backend
        self._availability = Availability(False, reason, hint)

    def capabilities(self) -> SandboxCapabilities:
        return SandboxCapabilities(
            filesystem_isolation="none", network_policy="none", resource_limits="none",
            requires_install=True, supports_mac=False, supports_linux=False,
            supports_windows=False,
        )

    def availability(self) -> Availability:
        return self._availability

    def enforces(self) -> frozenset[Requirement]:
        return frozenset()

    def plan(self, spec: Spec) -> LaunchPlan:
        return LaunchPlan(self.id, notes=[f"unavailable: {self._availability.reason}"])

    async def prepare(self, ctx: PrepareContext) -> None:
        from fusion_oci.errors import RuntimeUnavailableError

        raise RuntimeUnavailableError(self.id, self._availability.reason, self._availability.hint)

    async def run(self, command: str | Sequence[str], opts: RunOptions) -> RunResult:
        await self.prepare(PrepareContext(task_id="x", run_id="x", worktree_path="/"))
        raise AssertionError("unreachable")

    async def dispose(self) -> None:
        return None
