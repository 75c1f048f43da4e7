"""The runtime protocol as the lifecycle drives it: one resolve at prepare, then per command
compile -> check -> plan -> execute of that very plan, for a runtime that implements only the
protocol (it records the calls; nothing runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fusion_oci.errors import PolicyNotEnforceableError, SandboxSetupError
from fusion_oci.models import (
    PrepareContext,
    RunOptions,
    RunResult,
    SandboxCapabilities,
    SandboxPolicy,
)
from fusion_oci.oci.spec import ANN_IMAGE, Spec
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.resolve import ResolvedTask
from fusion_oci.runtimes.base import (
    Availability,
    LaunchPlan,
    Requirement,
    Runtime,
    UnavailableRuntime,
    own_plan,
    unenforced_in,
)
from fusion_oci.runtimes.registry import with_defaults
from fusion_oci.sandbox import Sandbox
from tests.golden import GOLDEN_HOST

CLAIMED = frozenset({Requirement.FILESYSTEM, Requirement.PROC_PATHS, Requirement.ENV,
                     Requirement.NETWORK_NONE})


class Recording:
    """Protocol only; ``calls`` says what the lifecycle asked, in order."""

    id = "custom"
    default_image: str | None = "example/default:1"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.refuse: list[str] = []

    def capabilities(self) -> SandboxCapabilities:
        return SandboxCapabilities(
            filesystem_isolation="strong", network_policy="coarse", resource_limits="none",
            requires_install=False, supports_mac=False, supports_linux=True,
            supports_windows=False)

    def availability(self) -> Availability:
        return Availability(True)

    def enforces(self) -> frozenset[Requirement]:
        return CLAIMED

    def check(self, spec: Spec) -> list[str]:
        self.calls.append(("check", spec))
        return [*self.refuse, *unenforced_in(spec, CLAIMED)]

    def plan(self, spec: Spec) -> LaunchPlan:
        self.calls.append(("plan", spec))
        return LaunchPlan(self.id, argv=list(spec["process"]["args"]), spec=spec)

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        self.calls.append(("prepare", task))
        return task.with_image("localhost/provisioned:1")  # as after a provision

    async def execute(self, plan: LaunchPlan, opts: RunOptions) -> RunResult:
        self.calls.append(("execute", plan))
        own_plan(self, plan, LaunchPlan)
        return RunResult(stdout=" ".join(plan.argv or []), stderr="", exit_code=0,
                         duration_ms=0, backend=self.id)

    async def dispose(self) -> None:
        self.calls.append(("dispose", None))


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> list[Recording]:
    made: list[Recording] = []

    def create(*args: Any, **kwargs: Any) -> Runtime:
        # As the registry builds a plugin class: its optional members from RuntimeDefaults.
        made.append(with_defaults(Recording)())
        return made[-1]

    monkeypatch.setattr("fusion_oci.sandbox.create_runtime", create)
    return made


async def test_the_lifecycle_drives_a_protocol_only_runtime(
        recording: list[Recording], worktree: Path, tmp_path: Path) -> None:
    settings = SandboxSettings(backend="custom", custom_runtime="recording")
    ctx = PrepareContext(task_id="t", run_id="r", worktree_path=str(worktree),
                         policy=SandboxPolicy(allow_network=False))
    async with Sandbox(settings, env={"PATH": "/usr/bin"}, cache_root=tmp_path / "cache",
                       host=GOLDEN_HOST) as sb:
        await sb.prepare(ctx)
        rt = recording[0]
        assert isinstance(rt, Runtime)
        # Checked against the task spec before anything is set up; resolved once, with the
        # runtime's default image.
        assert [name for name, _ in rt.calls] == ["check", "prepare"]
        task = rt.calls[1][1]
        assert task.image == "example/default:1" and task.host is GOLDEN_HOST
        rt.calls.clear()

        result = await sb.run(["echo", "hi"])
        assert result.stdout == "echo hi" and result.backend == "custom"
        assert [name for name, _ in rt.calls] == ["check", "plan", "execute"]
        checked, planned, plan = (value for _, value in rt.calls)
        spec = sb.last_spec
        assert spec is not None
        assert checked is planned is plan.spec is spec  # one compile, recorded for replay
        # Compiled from the task prepare returned (the provisioned image), not the resolved one.
        assert spec["annotations"][ANN_IMAGE] == "localhost/provisioned:1"
        assert sb.spec_for(["echo", "hi"]) == spec

        rt.calls.clear()
        rt.refuse = ["memoryLimitMb"]
        with pytest.raises(PolicyNotEnforceableError) as refused:
            await sb.run("true")
        assert refused.value.unenforced == ["memoryLimitMb"]
        assert [name for name, _ in rt.calls] == ["check"]  # nothing planned, nothing ran
    assert rt.calls[-1] == ("dispose", None) and sb.task is None


def test_a_runtime_refuses_a_plan_it_did_not_make() -> None:
    spec: Spec = {"process": {"args": ["true"]}}
    theirs = LaunchPlan("bubblewrap", argv=["true"], spec=spec)
    with pytest.raises(SandboxSetupError, match="did not make"):
        own_plan(Recording(), theirs, LaunchPlan)


def test_an_unavailable_runtime_implements_the_protocol() -> None:
    stand_in = UnavailableRuntime("podman", "no engine", "start it")
    assert isinstance(stand_in, Runtime) and stand_in.default_image is None
