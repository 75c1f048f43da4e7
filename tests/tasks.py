"""Resolved tasks for pure tests: a task spec compiled from fixed host facts and a layout,
with nothing read from or made on the host, and a runtime's plan of one command of it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fusion_oci.models import PrepareContext, RunOptions
from fusion_oci.oci.host import HostInfo
from fusion_oci.oci.model import ProcessSpec, TaskSpec, config_json
from fusion_oci.policy.layout import TaskLayout
from fusion_oci.resolve import ResolvedTask, compile_spec
from tests.golden import GOLDEN_HOST


def resolved(
    ctx: PrepareContext,
    layout: TaskLayout,
    host: HostInfo = GOLDEN_HOST,
    env: Mapping[str, str] | None = None,
) -> ResolvedTask:
    """The task as the resolve step would give it for this layout (no host reads)."""
    return ResolvedTask(ctx=ctx, layout=layout, host=host, env=dict(env or {}))


def config_for(
    ctx: PrepareContext,
    layout: TaskLayout,
    host: HostInfo,
    command: str | Sequence[str],
    opts: RunOptions,
    env: Mapping[str, str],
) -> dict[str, Any]:
    """The ``config.json`` of one command (:func:`fusion_oci.resolve.compile_spec`, the one
    compile step) of the task this layout resolves to, drawing on ``env`` (no host reads)."""
    return compile_spec(resolved(ctx, layout, host, env), command, opts).to_oci()


def plan_for(
    runtime: Any,
    task: ResolvedTask,
    command: str | Sequence[str] = "pnpm test",
    opts: RunOptions | None = None,
) -> Any:
    """``runtime``'s plan of ``command`` in ``task`` (adopted, not prepared)."""
    runtime.adopt(task)
    return runtime.plan(task.process(command, opts or RunOptions()))


@dataclass(frozen=True)
class Case:
    """One command of a resolved task, as the pure translations take it."""

    task: ResolvedTask
    command: str | Sequence[str] = "pnpm test"
    opts: RunOptions = field(default_factory=RunOptions)

    @property
    def spec(self) -> TaskSpec:
        return self.task.spec

    @property
    def process(self) -> ProcessSpec:
        return self.task.process(self.command, self.opts)

    def config(self) -> dict[str, Any]:
        """The whole config.json of the command."""
        return config_json(self.spec, self.process)
