"""The runtime protocol: what a built-in runtime and a plugin implement, and the defaults of
its optional members.

The lifecycle (:class:`fusion_oci.sandbox.Sandbox`) resolves the task once
(:func:`fusion_oci.resolve.resolve`: its typed :class:`~fusion_oci.oci.model.TaskSpec` and the
rlimits of its commands), asks :meth:`Runtime.check` for the parts of it the runtime cannot
enforce, hands it to :meth:`Runtime.prepare` once; then per command compiles its
:class:`~fusion_oci.oci.model.ProcessSpec`, takes :meth:`Runtime.plan` (a pure function of the
process and what prepare set up: :mod:`fusion_oci.runtimes.plans`) and hands that very plan to
:meth:`Runtime.execute`. What a plan shows is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fusion_oci.models import RunOptions, RunResult, SandboxCapabilities
from fusion_oci.runtimes.requirements import Requirement, task_requirements, unenforced

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog
    from fusion_oci.images.gates import AskCallback
    from fusion_oci.oci.model import ProcessSpec
    from fusion_oci.resolve import ResolvedTask
    from fusion_oci.runtimes.plans import Plan


@dataclass(frozen=True)
class Availability:
    """Whether a runtime can work on this host, and what to do when it cannot."""

    available: bool
    reason: str = ""
    hint: str = ""
    version: str | None = None
    rootless: bool | None = None
    details: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Runtime(Protocol):
    """The brief's SandboxBackend, in Python.

    The lifecycle drives every runtime the same way: ``availability``, ``check(task)`` and
    ``prepare(task)`` once, then per command ``plan(process)`` and ``execute(plan)``, and
    ``dispose``.
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
    shares_host_files: bool
    """False: the sandbox runs on another machine (kubernetes): it sees none of the host's
    files but what the runtime carries (the worktree's transfer), so the host-side package
    store linking (fusion_oci/store) does not apply."""
    egress_via_tcp: bool
    """True: the filtering proxy is reached over host TCP (no network namespace to bind its
    socket into, as with landlock)."""
    runs_services: bool
    """True: the runtime starts the task's service containers itself, beside the task
    (kubernetes: containers in the task's pod), and reports them in :attr:`services_started`;
    False: the lifecycle starts them on this host's engine (fusion_oci.sidecars) and relays
    them in."""
    services_started: tuple[dict[str, object], ...]
    """What a runtime that ``runs_services`` started at prepare, one record each."""
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

    def enforces_for(self, task: ResolvedTask) -> frozenset[Requirement]:
        """The requirements enforced for ``task`` (default: :meth:`enforces`)."""
        ...

    def check(self, task: ResolvedTask) -> list[str]:
        """The parts of ``task`` (its spec and its commands' rlimits) this runtime does not
        enforce here, sorted: the lifecycle refuses a task with any, or lists them when the
        runtime does not isolate. Default: the task's requirements outside
        :meth:`enforces_for`."""
        ...

    def adopt(self, task: ResolvedTask) -> None:
        """Take ``task`` as the one :meth:`plan` plans for, creating nothing (``fusion-oci
        plan``; :meth:`prepare` adopts its task first)."""
        ...

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        """Set up what every command of ``task`` shares; returns the task as its commands will
        run (e.g. on the local reference of an image it provisioned)."""
        ...

    def plan(self, process: ProcessSpec) -> Plan:
        """The launch of one command of the adopted task, exactly as :meth:`execute` will run
        it. Pure given what :meth:`prepare` set up; before prepare, host paths not made yet
        are placeholders."""
        ...

    async def execute(self, plan: Plan, opts: RunOptions) -> RunResult:
        """Run ``plan`` (one of this runtime's own plans) with the command's I/O: stdin,
        output callbacks, timeout, maxBuffer."""
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
    derives from this (built-ins through :class:`~fusion_oci.runtimes.skeleton.SpecRuntime`;
    a plugin that derives from nothing gets it from the registry), so callers use the members
    directly."""

    isolates: bool = True
    streams_stdin: bool = False
    shares_host_files: bool = True
    egress_via_tcp: bool = False
    runs_services: bool = False
    services_started: tuple[dict[str, object], ...] = ()
    """What a runtime that ``runs_services`` started at prepare, as the prepare event records
    a service (name, image, port, env names, ready_ms)."""
    audit: AuditLog | None = None
    ask: AskCallback | None = None
    task: ResolvedTask | None = None
    """The adopted task (:meth:`adopt`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Fail closed: "isolates nothing" (unenforced parts listed, not refused) is declared
        # by a class itself, never inherited; a runtime built on native's code isolates.
        if "isolates" not in vars(cls):
            cls.isolates = True

    def enforces(self) -> frozenset[Requirement]:
        raise NotImplementedError

    def enforces_for(self, task: ResolvedTask) -> frozenset[Requirement]:
        """The requirements enforced for ``task``: those of :meth:`enforces`."""
        return self.enforces()

    def check(self, task: ResolvedTask) -> list[str]:
        """The task's requirements outside :meth:`enforces_for`, sorted."""
        return unenforced(task_requirements(task), self.enforces_for(task))

    def adopt(self, task: ResolvedTask) -> None:
        """Keep the task (nothing is created)."""
        self.task = task

    async def image_digest(self) -> str | None:
        """No image of its own: None."""
        return None

    def close(self) -> None:
        """Nothing held between calls."""
        return None
