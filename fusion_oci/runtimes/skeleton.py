"""The skeleton the built-in runtimes share (a plugin may derive from it, or from nothing),
and the stand-in for a runtime that cannot be used here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_oci.models import EndReason, RunOptions, RunResult, SandboxCapabilities
from fusion_oci.models.backends import CAPABILITIES, NOTHING
from fusion_oci.runtimes.outcome import classify, run_result
from fusion_oci.runtimes.plans import AgentPlan, Plan, own_plan
from fusion_oci.runtimes.protocol import Availability, RuntimeDefaults
from fusion_oci.runtimes.requirements import Requirement

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog
    from fusion_oci.host.process import ProcessOutcome
    from fusion_oci.images.gates import AskCallback
    from fusion_oci.oci.host import HostInfo
    from fusion_oci.oci.model import ProcessSpec, TaskSpec
    from fusion_oci.policy.layout import TaskLayout
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.resolve import ResolvedTask
    from fusion_oci.runtimes.box import Box


class SpecRuntime(RuntimeDefaults):
    """Skeleton of the built-in runtimes.

    Subclasses provide ``id`` (with its row of :data:`fusion_oci.models.backends.CAPABILITIES`),
    :meth:`availability`, :meth:`enforces` and :meth:`plan`; they may extend :meth:`check`,
    :meth:`prepare` and :meth:`dispose`, say what their host changes of their capabilities
    (:meth:`host_capabilities`), and make their own state in :meth:`setup` (the constructor is
    this one). A runtime whose
    commands go through the task's exec agent keeps its running sandbox in :attr:`box` and
    uses :meth:`execute` as it is, with its hooks (:meth:`check_plan`, :meth:`run_spawn`); the
    others override :meth:`execute`.
    """

    id: str = "abstract"
    default_image: str | None = None
    """Image used when neither the task nor the settings name one (None: the host's system
    directories)."""
    plan_type: type[AgentPlan] = AgentPlan
    """The type of this runtime's own plans (:meth:`execute` refuses any other)."""
    runs_in: str = "its exec agent"
    """What prepare starts, as the error for a command run before it names it."""

    def __init__(
        self,
        settings: SandboxSettings,
        env: Mapping[str, str],
        cache_root: Path | None = None,
        host: HostInfo | None = None,
    ) -> None:
        self.settings = settings
        self.env = dict(env)
        self.cache_root = cache_root or default_cache_root(self.env)
        self._host = host
        self.layout: TaskLayout | None = None
        # Services the lifecycle hands over (Sandbox sets them): where provisioning and other
        # runtime-side events are audited, and who answers an `ask` gate.
        self.audit: AuditLog | None = None
        self.ask: AskCallback | None = None
        self.task: ResolvedTask | None = None
        """The task as adopted or prepared (changed by :meth:`set_image`)."""
        self.box: Box[Any, Any] | None = None
        """The task's running sandbox, for a runtime whose commands go through its exec agent
        (prepare starts it, dispose ends it); None: not prepared, or no agent of its own."""
        self.setup()

    def setup(self) -> None:
        """A runtime's own state, made from :attr:`settings` and :attr:`env` at construction
        (default: none)."""

    @property
    def host(self) -> HostInfo:
        if self._host is None:
            from fusion_oci.oci.host import probe_host

            self._host = probe_host()
        return self._host

    @property
    def task_spec(self) -> TaskSpec:
        """The adopted task's sandbox spec (what a runtime prepares from)."""
        return self.adopted().spec

    def adopted(self) -> ResolvedTask:
        """The adopted task, or a setup error saying prepare comes first."""
        if self.task is None:
            from fusion_oci.errors import SandboxSetupError

            raise SandboxSetupError(
                f"runtime '{self.id}' was not prepared",
                "run() came before prepare()",
                "call prepare(ctx) first",
            )
        return self.task

    def enforces(self) -> frozenset[Requirement]:
        raise NotImplementedError

    def capabilities(self) -> SandboxCapabilities:
        """The backend's row of :data:`fusion_oci.models.backends.CAPABILITIES` as this host has it:
        ``fine`` network policy where ``network: filtered`` is enforced here, and what
        :meth:`host_capabilities` says (a plugin of another id: :data:`NOTHING`)."""
        offers = CAPABILITIES.get(self.id, NOTHING)._asdict()
        if Requirement.NETWORK_FILTERED in self.enforces():
            offers["network_policy"] = "fine"
        return SandboxCapabilities(**(offers | self.host_capabilities()))

    def host_capabilities(self) -> dict[str, str]:
        """The fields of :meth:`capabilities` this host decides beyond the network policy
        (default: none)."""
        return {}

    def adopt(self, task: ResolvedTask) -> None:
        self.task = task
        self.layout = task.layout

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        """Adopt the resolved task (the lifecycle resolved it once); subclasses set up from
        :attr:`task_spec` and return :attr:`task` (changed by :meth:`set_image`)."""
        self.adopt(task)
        return task

    def set_image(self, image: str) -> None:
        """After provisioning: the task runs on ``image`` (a local reference)."""
        self.adopt(self.adopted().with_image(image))

    def process(self, command: str | Sequence[str], opts: RunOptions) -> ProcessSpec:
        """A process of the prepared task for a command of the runtime's own (a probe, a
        keeper process): the one compile step, as the lifecycle uses it for the caller's."""
        return self.adopted().process(command, opts)

    async def execute(self, plan: Plan, opts: RunOptions) -> RunResult:
        """The one agent-backed execute: one of this runtime's own plans, its spawn frame to
        the box's agent; a command that failed is classified with the counters of the box's
        cgroup."""
        own = own_plan(self, plan, self.plan_type)
        box = self.box
        if box is None:
            from fusion_oci.errors import SandboxSetupError

            raise SandboxSetupError(
                f"runtime '{self.id}' was not prepared",
                f"{self.runs_in} is not running",
                "call prepare(ctx) first",
            )
        self.check_plan(own, box)
        outcome = await self.run_spawn(box, own, opts)
        return self.result(
            outcome, own.process, classify(outcome, own.process, box.counters(outcome))
        )

    def check_plan(self, plan: AgentPlan, box: Box[Any, Any]) -> None:
        """Refuse a plan the running box cannot run (default: any of its own plans runs)."""

    async def run_spawn(
        self, box: Box[Any, Any], plan: AgentPlan, opts: RunOptions
    ) -> ProcessOutcome:
        """Run the plan's spawn frame on the box's agent with the command's I/O."""
        return await box.agent.run_command(plan.spawn, opts)

    async def dispose(self) -> None:
        self.layout = None
        self.task = None

    def result(
        self, outcome: ProcessOutcome, process: ProcessSpec, reason: EndReason | None = None
    ) -> RunResult:
        return run_result(self.id, outcome, reason or classify(outcome, process))


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
        return SandboxCapabilities(**NOTHING._asdict())

    def availability(self) -> Availability:
        return self._availability

    def enforces(self) -> frozenset[Requirement]:
        return frozenset()

    def plan(self, process: ProcessSpec) -> Plan:
        return Plan(self.id, notes=[f"unavailable: {self._availability.reason}"], process=process)

    def _unavailable(self) -> Exception:
        from fusion_oci.errors import RuntimeUnavailableError

        return RuntimeUnavailableError(self.id, self._availability.reason, self._availability.hint)

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        raise self._unavailable()

    async def execute(self, plan: Plan, opts: RunOptions) -> RunResult:
        raise self._unavailable()

    async def dispose(self) -> None:
        return None
