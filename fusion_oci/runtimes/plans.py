"""What a runtime's :meth:`~fusion_oci.runtimes.protocol.Runtime.plan` returns: exactly what
runs for one command, printable and golden.

Two kinds, as there are two ways a command runs:

* :class:`ArgvPlan` — the command is a host process of its own (native without its agent,
  sandbox-exec): this argv, in this environment and folder.
* :class:`AgentPlan` — the command is a *spawn frame* sent to the exec agent inside the
  sandbox that prepare started once for the task (bubblewrap, oci, landlock, podman, docker,
  native with its agent): the frame's fields, and beside it the task's sandbox launch
  (:class:`SandboxLaunch`: a bwrap or runc argv, landlock's reaper shim, or an engine SDK
  call).

Each carries the :class:`~fusion_oci.oci.model.ProcessSpec` it runs (not part of
:meth:`Plan.to_json`: ``fusion-oci plan`` prints the spec beside it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fusion_oci.agent.protocol import Spawn
from fusion_oci.oci.model import ProcessSpec

PLAN_RUN_ID = "<run>"
"""A spawn frame's id in a plan (a counter per agent when it runs)."""
STD_FDS = ("stdin", "stdout", "stderr")


@dataclass(frozen=True)
class Plan:
    """What runs for one command; see the module docstring for the kinds."""

    backend: str
    notes: list[str] = field(default_factory=list, kw_only=True)
    process: ProcessSpec = field(kw_only=True, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"backend": self.backend, "kind": self.kind}
        data.update(self._body())
        notes = self.shown_notes()
        if notes:
            data["notes"] = notes
        return data

    @property
    def kind(self) -> str:
        return "none"

    def _body(self) -> dict[str, Any]:
        return {}

    def shown_notes(self) -> list[str]:
        """The words beside what runs (a runtime may add notes that cost more to write than
        the plan itself: they are written only when shown)."""
        return list(self.notes)


@dataclass(frozen=True)
class ArgvPlan(Plan):
    """The command is a host process: ``argv`` in ``env`` and ``cwd``."""

    argv: list[str] = field(kw_only=True)
    env: dict[str, str] = field(kw_only=True)
    cwd: str = field(kw_only=True)

    @property
    def kind(self) -> str:
        return "argv"

    def _body(self) -> dict[str, Any]:
        return {"argv": self.argv, "env": self.env, "cwd": self.cwd}


@dataclass(frozen=True)
class SandboxLaunch:
    """How prepare started the task's sandbox, once: an argv (bwrap, runc) with its
    environment and folder, or an engine SDK call with its keyword arguments."""

    argv: list[str] | None = None
    env: dict[str, str] | None = None
    cwd: str | None = None
    sdk_call: str | None = None
    sdk_kwargs: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key, name in (
            ("argv", "argv"),
            ("env", "env"),
            ("cwd", "cwd"),
            ("sdk_call", "sdkCall"),
            ("sdk_kwargs", "sdkKwargs"),
        ):
            value = getattr(self, key)
            if value is not None:
                data[name] = value
        return data


@dataclass(frozen=True)
class AgentPlan(Plan):
    """The command is ``spawn``, a frame to the task's exec agent, in ``sandbox``."""

    spawn: Spawn = field(kw_only=True)
    sandbox: SandboxLaunch | None = field(default=None, kw_only=True)
    """The task's sandbox (None: the agent runs on the host, as native's does)."""

    @property
    def kind(self) -> str:
        return "agent"

    def _body(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.sandbox is not None:
            data["sandbox"] = self.sandbox.to_json()
        data["spawn"] = {
            "fields": [f"{k}={v}" for k, v in self.spawn.fields()],
            "fds": list(STD_FDS),
        }
        return data


def spawn_of(
    process: ProcessSpec,
    *,
    env: Mapping[str, str] | None = None,
    run_id: str = PLAN_RUN_ID,
) -> Spawn:
    """The agent's spawn frame for ``process``: argv, env (``env`` overrides the process's,
    as native's status-quo environment does), cwd, rlimits. The user is the sandbox's: every
    runtime starts its agent as the task's user. Pure."""
    return Spawn(
        id=run_id,
        argv=list(process.args),
        env=dict(env) if env is not None else process.env_map(),
        cwd=process.cwd,
        rlimits=process.limits(),
    )


P = TypeVar("P", bound=Plan)


class _Named(Protocol):
    @property
    def id(self) -> str: ...


def own_plan(runtime: _Named, plan: Plan, kind: type[P]) -> P:
    """``plan`` as one of ``runtime``'s own plans (made by its :meth:`Runtime.plan`, so of
    its plan type ``kind``): another runtime's plan is refused, never reinterpreted."""
    if not isinstance(plan, kind) or plan.backend != runtime.id:
        from fusion_oci.errors import SandboxSetupError

        raise SandboxSetupError(
            f"runtime '{runtime.id}' was handed a plan it did not make",
            f"a {type(plan).__name__} of backend '{plan.backend}'",
            f"execute the plan that runtime '{runtime.id}'.plan(process) returns",
        )
    return plan
