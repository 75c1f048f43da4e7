"""A third party's runtime plugin as small as the protocol allows, for the registry test and
the contract suite (``custom`` backend, entry point ``contract-host``).

It derives from nothing in fusion-oci (no SpecRuntime): it implements the
:class:`~fusion_oci.runtimes.protocol.Runtime` protocol and nothing more (``check``, ``plan``,
``prepare``, ``execute`` of its own plan, ...), and runs commands on the host (through a
private native runtime, as a plugin would through its own launcher). It is a test double: it
*claims* the filesystem, /proc and network isolation a policy asks for, so the lifecycle
admits it; what the contract holds it to is the behaviour a command observes.

Like a plugin that provisions an image, ``prepare`` asks the ``sandbox_provision`` gate when
the task names an image, through the ``audit`` log and ``ask`` callback the lifecycle hands
every runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_oci.audit import AuditLog
from fusion_oci.images.gates import AuditContext, GateRequest, ProvisionGate
from fusion_oci.models import RunOptions, RunResult, SandboxCapabilities
from fusion_oci.runtimes.native import NativeRuntime
from fusion_oci.runtimes.plans import Plan
from fusion_oci.runtimes.protocol import Availability
from fusion_oci.runtimes.requirements import Requirement, task_requirements, unenforced

if TYPE_CHECKING:
    import pytest

    from fusion_oci.images.gates import AskCallback
    from fusion_oci.oci.host import HostInfo
    from fusion_oci.oci.model import ProcessSpec
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.resolve import ResolvedTask

NAME = "contract-host"
ENTRY_POINT = EntryPoint(
    name=NAME, value=f"{__name__}:HostPluginRuntime", group="fusion_oci.runtimes"
)
CLAIMED = frozenset(
    {
        Requirement.FILESYSTEM,
        Requirement.PROC_PATHS,
        Requirement.ENV,
        Requirement.NETWORK_NONE,
        Requirement.HOST_PROCESSES,
    }
)


@dataclass(frozen=True)
class HostPlan(Plan):
    """The plugin's plan: its launcher's (the private native runtime's), which it runs."""

    inner: Plan = field(kw_only=True, repr=False, compare=False)

    def _body(self) -> dict[str, Any]:
        return {"inner": self.inner.to_json()}


class HostPluginRuntime:
    """Protocol only: ``id``, ``default_image``, capabilities, availability, enforces, check,
    plan, prepare, execute, dispose; ``audit`` and ``ask`` are whatever the lifecycle set."""

    id = "custom"
    default_image: str | None = None

    def __init__(
        self,
        settings: SandboxSettings,
        env: Mapping[str, str],
        *,
        cache_root: Path | None = None,
        host: HostInfo | None = None,
    ) -> None:
        self.settings = settings
        self.audit: AuditLog | None = None
        self.ask: AskCallback | None = None
        self._host = NativeRuntime(settings, env, cache_root=cache_root, host=host)

    def capabilities(self) -> SandboxCapabilities:
        return self._host.capabilities()

    def availability(self) -> Availability:
        return Availability(True, version="test plugin", details={"runs": "on the host"})

    def enforces(self) -> frozenset[Requirement]:
        return CLAIMED | self._host.enforces()

    def check(self, task: ResolvedTask) -> list[str]:
        return unenforced(task_requirements(task), self.enforces())

    def adopt(self, task: ResolvedTask) -> None:
        self._host.adopt(task)

    def plan(self, process: ProcessSpec) -> HostPlan:
        return HostPlan(self.id, process=process, inner=self._host.plan(process))

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        ctx = task.ctx
        if ctx.image:
            audit = AuditContext(self.audit or AuditLog(key=b""), ctx.task_id, ctx.run_id, self.id)
            gate = ProvisionGate(self.settings.gates, audit, ask=self.ask)
            await gate.check(
                GateRequest(
                    "sandbox_provision",
                    "pull",
                    ctx.image,
                    self.id,
                    reason="the plugin fetches its image",
                )
            )
        return await self._host.prepare(task)

    async def execute(self, plan: Plan, opts: RunOptions) -> RunResult:
        if not isinstance(plan, HostPlan):
            raise TypeError(f"not a plan of runtime '{self.id}': {plan.backend}")
        result = await self._host.execute(plan.inner, opts)
        return result.model_copy(update={"backend": self.id})

    async def dispose(self) -> None:
        await self._host.dispose()


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the plugin visible through the registry's entry points (as an installed
    distribution that declares it would be)."""
    from importlib.metadata import entry_points as real

    from fusion_oci.runtimes import registry

    def with_plugin(*, group: str) -> Any:
        found = list(real(group=group))
        return [*found, ENTRY_POINT] if group == registry.ENTRY_POINT_GROUP else found

    monkeypatch.setattr(registry, "entry_points", with_plugin)
