"""The runtime protocol as the lifecycle drives it: one resolve and one check of the task spec
at prepare, then per command compile -> plan -> execute of that very plan, for a runtime that
implements only the protocol (it records the calls; nothing runs)."""

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
from fusion_oci.oci.model import ANN_IMAGE, ProcessSpec, User
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.resolve import ResolvedTask
from fusion_oci.runtimes.plans import ArgvPlan, Plan, own_plan
from fusion_oci.runtimes.protocol import Availability, Runtime
from fusion_oci.runtimes.registry import with_defaults
from fusion_oci.runtimes.requirements import Requirement, task_requirements, unenforced
from fusion_oci.runtimes.skeleton import UnavailableRuntime
from fusion_oci.sandbox import Sandbox
from tests.golden import GOLDEN_HOST

CLAIMED = frozenset(
    {
        Requirement.FILESYSTEM,
        Requirement.PROC_PATHS,
        Requirement.ENV,
        Requirement.NETWORK_NONE,
        Requirement.HOST_PROCESSES,
    }
)


class Recording:
    """Protocol only; ``calls`` says what the lifecycle asked, in order."""

    id = "custom"
    default_image: str | None = "example/default:1"
    refuse: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.calls: list[tuple[str, Any]] = []

    def capabilities(self) -> SandboxCapabilities:
        return SandboxCapabilities(
            filesystem_isolation="strong",
            network_policy="coarse",
            resource_limits="none",
            requires_install=False,
            supports_mac=False,
            supports_linux=True,
            supports_windows=False,
        )

    def availability(self) -> Availability:
        return Availability(True)

    def enforces(self) -> frozenset[Requirement]:
        return CLAIMED

    def check(self, task: ResolvedTask) -> list[str]:
        self.calls.append(("check", task))
        return [*self.refuse, *unenforced(task_requirements(task), CLAIMED)]

    def plan(self, process: ProcessSpec) -> Plan:
        self.calls.append(("plan", process))
        return ArgvPlan(self.id, argv=list(process.args), env={}, cwd=process.cwd, process=process)

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        self.calls.append(("prepare", task))
        return task.with_image("localhost/provisioned:1")  # as after a provision

    async def execute(self, plan: Plan, opts: RunOptions) -> RunResult:
        self.calls.append(("execute", plan))
        argv = own_plan(self, plan, ArgvPlan).argv
        return RunResult(
            stdout=" ".join(argv), stderr="", exit_code=0, duration_ms=0, backend=self.id
        )

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
    recording: list[Recording], worktree: Path, tmp_path: Path
) -> None:
    settings = SandboxSettings(backend="custom", custom_runtime="recording")
    ctx = PrepareContext(
        task_id="t",
        run_id="r",
        worktree_path=str(worktree),
        policy=SandboxPolicy(allow_network=False),
    )
    async with Sandbox(
        settings, env={"PATH": "/usr/bin"}, cache_root=tmp_path / "cache", host=GOLDEN_HOST
    ) as sb:
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
        assert [name for name, _ in rt.calls] == ["plan", "execute"]  # checked once, at prepare
        process, plan = (value for _, value in rt.calls)
        assert plan.process is process and process.args == ["echo", "hi"]
        # Compiled from the task prepare returned (the provisioned image), not the resolved one.
        assert (
            sb.task is not None and sb.task.spec.annotations[ANN_IMAGE] == "localhost/provisioned:1"
        )
        assert sb.spec_for(["echo", "hi"])["process"] == process.to_oci()
    assert rt.calls[-1] == ("dispose", None) and sb.task is None


async def test_a_task_the_runtime_cannot_enforce_is_refused_before_it_is_prepared(
    recording: list[Recording], worktree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Recording, "refuse", ("memoryLimitMb",))
    settings = SandboxSettings(backend="custom", custom_runtime="recording")
    ctx = PrepareContext(
        task_id="t",
        run_id="r",
        worktree_path=str(worktree),
        policy=SandboxPolicy(allow_network=False),
    )
    sb = Sandbox(
        settings, env={"PATH": "/usr/bin"}, cache_root=tmp_path / "cache", host=GOLDEN_HOST
    )
    with pytest.raises(PolicyNotEnforceableError) as refused:
        await sb.prepare(ctx)
    assert refused.value.unenforced == ["memoryLimitMb"]
    rt = recording[0]
    assert [name for name, _ in rt.calls][:1] == ["check"]
    assert "prepare" not in [name for name, _ in rt.calls]  # nothing set up, nothing ran
    assert not (tmp_path / "cache").exists()  # resolved without creating the cache folders


def test_a_runtime_refuses_a_plan_it_did_not_make() -> None:
    process = ProcessSpec(user=User(uid=0, gid=0), args=["true"], cwd="/")
    theirs = ArgvPlan("bubblewrap", argv=["true"], env={}, cwd="/", process=process)
    with pytest.raises(SandboxSetupError, match="did not make"):
        own_plan(Recording(), theirs, ArgvPlan)


def test_an_unavailable_runtime_implements_the_protocol() -> None:
    stand_in = UnavailableRuntime("podman", "no engine", "start it")
    assert isinstance(stand_in, Runtime) and stand_in.default_image is None
