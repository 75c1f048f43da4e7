"""The runtime protocol, and the skeleton the built-in runtimes share.

A runtime reads only the spec. The lifecycle (:class:`fusion_oci.sandbox.Sandbox`) resolves the
task once (:func:`fusion_oci.resolve.resolve`), hands it to :meth:`Runtime.prepare`, and for each
command compiles the spec (:func:`fusion_oci.resolve.compile_spec`), asks :meth:`Runtime.check`
for the parts the runtime cannot enforce, takes :meth:`Runtime.plan` (a pure function from the
spec to the launch: argv, env, SDK arguments) and hands that very plan to
:meth:`Runtime.execute`. What a plan shows is what runs.
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

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
    NETWORK_FILTERED = "network filtered (egress only through the task's proxy)"
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
    elif mode is NetworkMode.FILTERED:
        need.add(Requirement.NETWORK_FILTERED)
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
    elif mode is NetworkMode.FILTERED:
        need.add(Requirement.NETWORK_FILTERED)
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


def unenforced_in(spec: Spec, enforced: frozenset[Requirement]) -> list[str]:
    """The parts of ``spec`` outside ``enforced``, sorted: the usual :meth:`Runtime.check`."""
    return sorted(r.value for r in spec_requirements(spec) - enforced)


def unenforced_parts(runtime: Runtime, policy: SandboxPolicy) -> list[str]:
    """The requirements of ``policy`` that ``runtime`` does not enforce here, sorted.

    A runtime whose enforcement depends on the policy (native honours envAllowlist only when
    one is set) overrides :meth:`Runtime.enforces_for`; by default it answers ``enforces()``.
    """
    return sorted(r.value for r in requirements(policy) - runtime.enforces_for(policy))


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
    """How a runtime starts a spec: an argv, or SDK call arguments. Printable, golden, and
    what :meth:`Runtime.execute` runs (a runtime fills its own placeholders, such as the fd
    numbers of pipes made at launch, and nothing else)."""

    backend: str
    argv: list[str] | None = None
    sdk_call: str | None = None
    sdk_kwargs: dict[str, Any] | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    notes: list[str] = field(default_factory=list)
    spec: Spec = field(kw_only=True, repr=False, compare=False)
    """The spec this plan launches (not part of :meth:`to_json`: ``fusion-oci plan`` prints
    it beside the plan as ``config.json``)."""

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


P = TypeVar("P", bound=LaunchPlan)


def own_plan(runtime: Runtime, plan: LaunchPlan, kind: type[P]) -> P:
    """``plan`` as one of ``runtime``'s own plans (made by its :meth:`Runtime.plan`, so of
    its plan type ``kind``): another runtime's plan is refused, never reinterpreted."""
    if not isinstance(plan, kind) or plan.backend != runtime.id:
        from fusion_oci.errors import SandboxSetupError

        raise SandboxSetupError(f"runtime '{runtime.id}' was handed a plan it did not make",
                                f"a {type(plan).__name__} of backend '{plan.backend}'",
                                f"execute the plan that runtime '{runtime.id}'.plan(spec) "
                                "returns")
    return plan


@runtime_checkable
class Runtime(Protocol):
    """The brief's SandboxBackend, in Python: what a built-in runtime and a plugin implement.

    The lifecycle drives every runtime the same way: ``availability``, ``enforces`` (against
    the policy), ``check`` (against the task spec), ``prepare`` once, then per command
    ``check``, ``plan`` and ``execute`` of that plan, and ``dispose``.
    """

    id: str
    default_image: str | None
    """The image a task runs on when neither it nor the settings name one (None: the host's
    system directories); the resolve step reads it."""
    isolates: bool
    """False: the status quo (native), which isolates nothing: the lifecycle lists what it
    leaves unenforced instead of refusing it, and the CLI says so."""
    streams_stdin: bool
    """True: :meth:`execute` writes a StdinStream's chunks as they come; False: the lifecycle
    reads it to its end first and hands over bytes."""
    egress_via_tcp: bool
    """True: the filtering proxy is reached over host TCP (no network namespace to bind its
    socket into, as with landlock)."""
    audit: AuditLog | None
    """Service the lifecycle hands over before ``prepare``: where provisioning and other
    runtime-side events are audited."""
    ask: AskCallback | None
    """Service the lifecycle hands over before ``prepare``: who answers an ``ask`` gate
    (None: ``ask`` gates deny)."""

    def capabilities(self) -> SandboxCapabilities: ...

    def availability(self) -> Availability: ...

    def enforces(self) -> frozenset[Requirement]:
        """The requirements this runtime enforces on this host."""
        ...

    def enforces_for(self, policy: SandboxPolicy) -> frozenset[Requirement]:
        """The requirements enforced for ``policy`` (default: :meth:`enforces`)."""
        ...

    def check(self, spec: Spec) -> list[str]:
        """The parts of ``spec`` this runtime does not enforce here, sorted (the lifecycle
        refuses a spec with any, or lists them when the runtime does not isolate)."""
        ...

    def plan(self, spec: Spec) -> LaunchPlan:
        """The launch of ``spec``, exactly as :meth:`execute` will run it. Pure given what
        :meth:`prepare` set up; before prepare, host paths not made yet are placeholders."""
        ...

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        """Set up what every command of ``task`` shares; returns the task as its commands will
        run (e.g. on the local reference of an image it provisioned)."""
        ...

    async def execute(self, plan: LaunchPlan, opts: RunOptions) -> RunResult:
        """Run ``plan`` (one of this runtime's own plans, for ``plan.spec``) with the
        command's I/O: stdin, output callbacks, timeout, maxBuffer."""
        ...

    async def dispose(self) -> None: ...

    async def image_digest(self) -> str | None:
        """The digest of the image the prepared task runs on (None: no image, or unknown)."""
        ...

    def close(self) -> None:
        """Drop what a runtime built only to be probed (an engine client); idempotent."""
        ...


class RuntimeDefaults:
    """The optional members of :class:`Runtime`, with their defaults: every runtime class
    derives from this (built-ins through :class:`SpecRuntime`; a plugin that derives from
    nothing gets it from the registry), so callers use the members directly."""

    isolates: bool = True
    streams_stdin: bool = False
    egress_via_tcp: bool = False
    audit: AuditLog | None = None
    ask: AskCallback | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Fail closed: "isolates nothing" (unenforced parts listed, not refused) is declared
        # by a class itself, never inherited; a runtime built on native's code isolates.
        if "isolates" not in vars(cls):
            cls.isolates = True

    def enforces(self) -> frozenset[Requirement]:
        raise NotImplementedError

    def enforces_for(self, policy: SandboxPolicy) -> frozenset[Requirement]:
        """The requirements enforced for ``policy``: those of :meth:`enforces`."""
        return self.enforces()

    async def image_digest(self) -> str | None:
        """No image of its own: None."""
        return None

    def close(self) -> None:
        """Nothing held between calls."""
        return None


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


class SpecRuntime(RuntimeDefaults):
    """Skeleton of the built-in runtimes (a plugin may derive from it, or from nothing).

    Subclasses provide ``id``, :meth:`capabilities`, :meth:`availability`, :meth:`enforces`,
    :meth:`plan` and :meth:`execute`; they may extend :meth:`check`, :meth:`prepare` and
    :meth:`dispose`.
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
        self.resolved: ResolvedTask | None = None
        """The task as prepared (set by :meth:`prepare`, and by :meth:`set_image`)."""
        self.task_spec: Spec | None = None
        """The spec all of the task's commands share but for the process (set by
        :meth:`prepare`): what a runtime prepares from."""

    @property
    def host(self) -> HostInfo:
        if self._host is None:
            from fusion_oci.oci.host import probe_host

            self._host = probe_host()
        return self._host

    def enforces(self) -> frozenset[Requirement]:
        raise NotImplementedError

    def check(self, spec: Spec) -> list[str]:
        """What :meth:`enforces` leaves out of ``spec``'s requirements."""
        return unenforced_in(spec, self.enforces())

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        """Keep the resolved task (the lifecycle resolved it once) and compile its task spec;
        subclasses take what they set up from :attr:`task_spec`, and return
        :attr:`resolved` (changed by :meth:`set_image`)."""
        from fusion_oci.resolve import task_spec

        self.resolved = task
        self.ctx = task.ctx
        self.layout = task.layout
        self.task_spec = task_spec(task)
        return task

    def set_image(self, image: str) -> None:
        """After provisioning: the task runs on ``image`` (a local reference)."""
        from fusion_oci.resolve import task_spec

        assert self.resolved is not None
        self.resolved = self.resolved.with_image(image)
        self.ctx = self.resolved.ctx
        self.task_spec = task_spec(self.resolved)

    def compile(self, command: str | Sequence[str], opts: RunOptions) -> Spec:
        """A spec of the prepared task for a command of the runtime's own (a probe, a keeper
        process): the one compile step, as the lifecycle uses it for the caller's commands."""
        from fusion_oci.errors import SandboxSetupError
        from fusion_oci.resolve import compile_spec

        if self.resolved is None:
            raise SandboxSetupError(f"runtime '{self.id}' was not prepared",
                                    "run() came before prepare()", "call prepare(ctx) first")
        return compile_spec(self.resolved, command, opts)

    async def execute(self, plan: LaunchPlan, opts: RunOptions) -> RunResult:
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


class UnavailableRuntime(RuntimeDefaults):
    """Stands in for a backend that is known but cannot be used here (never "unknown")."""

    default_image: str | None = None

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

    def check(self, spec: Spec) -> list[str]:
        return unenforced_in(spec, self.enforces())

    def plan(self, spec: Spec) -> LaunchPlan:
        return LaunchPlan(self.id, notes=[f"unavailable: {self._availability.reason}"],
                          spec=spec)

    def _unavailable(self) -> Exception:
        from fusion_oci.errors import RuntimeUnavailableError

        return RuntimeUnavailableError(self.id, self._availability.reason,
                                       self._availability.hint)

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        raise self._unavailable()

    async def execute(self, plan: LaunchPlan, opts: RunOptions) -> RunResult:
        raise self._unavailable()

    async def dispose(self) -> None:
        return None
