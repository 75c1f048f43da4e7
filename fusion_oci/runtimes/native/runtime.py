"""The native runtime: the command runs on the host as the caller, in the worktree.

It is the status quo (the brief's Phase A: "no behaviour change"): the caller's environment,
HOME, PATH and working directory, unchanged. It isolates nothing and says so: filesystem,
network, cgroup limits, protected paths and /proc protections are listed as unenforced. What it
does honour: timeouts and aborts that end the whole process tree, maxBuffer, the spec's rlimits
(cpuLimit.maxMs, fileSizeLimitMb), and ``envAllowlist`` when the policy sets one.

On Linux every command goes through the sandbox's exec agent (fusion_oci/agent), started at
prepare and stopped at dispose: no interpreter starts per command. The agent's keeper per run
is the subreaper that ends the whole tree; :meth:`NativeRuntime.plan` shows the exact spawn
frame. The agent is Linux C (subreapers, signalfd, close_range); on macOS native keeps the
per-command reaper shim, which sandbox-exec uses there too.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fusion_oci.agent.client import BINARY_NAME, BUILD_HINT, Agent, agent_binary
from fusion_oci.errors import SandboxSetupError
from fusion_oci.models import RunOptions, RunResult
from fusion_oci.oci.environment import allowed_env
from fusion_oci.oci.model import ProcessSpec
from fusion_oci.runtimes.box import Box
from fusion_oci.runtimes.hostproc import HostProcessRuntime
from fusion_oci.runtimes.plans import AgentPlan, ArgvPlan, Plan, own_plan, spawn_of
from fusion_oci.runtimes.protocol import Availability
from fusion_oci.runtimes.requirements import Requirement

if TYPE_CHECKING:
    from fusion_oci.host.process import ProcessOutcome
    from fusion_oci.resolve import ResolvedTask

__all__ = ["NativeRuntime", "status_quo_env"]

# What a login shell needs even when an allowlist narrows the rest of the environment.
BASIC_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "TERM", "TMPDIR")


def status_quo_env(allowlist: Sequence[str], source: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment as it is; narrowed to the allowlist (plus the basics a shell
    needs) only when the policy sets one (``envAllowlist``, as the task spec carries it). Pure."""
    if not allowlist:
        return dict(source)
    env = {k: source[k] for k in BASIC_ENV if k in source}
    env.update(allowed_env(allowlist, source))
    return env


AGENT_PLATFORM = sys.platform.startswith("linux")
"""Where the exec agent exists (the build hook compiles it only there)."""


class NativeRuntime(HostProcessRuntime):
    id = "native"
    isolates = False  # the status quo: what it leaves unenforced is listed, not refused
    private_dirs = False
    uses_agent = AGENT_PLATFORM

    box: Box[None, None] | None
    """The task's exec agent on the host (Linux), started at prepare."""

    def availability(self) -> Availability:
        if not self.uses_agent:
            return Availability(
                True,
                version=f"python {sys.version.split()[0]}",
                rootless=None,
                details={"isolation": "none"},
            )
        try:
            binary = agent_binary()
        except SandboxSetupError as exc:
            return Availability(False, f"the exec agent is missing: {exc.why}", BUILD_HINT)
        return Availability(
            True,
            version=f"python {sys.version.split()[0]}",
            rootless=None,
            details={"isolation": "none", "agent": str(binary)},
        )

    def enforces(self) -> frozenset[Requirement]:
        return frozenset({Requirement.CPU_TIME, Requirement.FILE_SIZE})

    def enforces_for(self, task: ResolvedTask) -> frozenset[Requirement]:
        """The env allowlist is enforced only when the policy sets one (else: status quo)."""
        extra = {Requirement.ENV} if task.spec.env_allowlist else set()
        return self.enforces() | extra

    def _env(self, opts: RunOptions | None) -> dict[str, str]:
        source = opts.env if opts is not None and opts.env is not None else self.env
        # The status quo is the caller's environment, narrowed by the policy's allowlist (the
        # task spec carries it), not the process's sandbox env (HOME, caches, proxies).
        allowlist = self.task.spec.env_allowlist if self.task is not None else ()
        return status_quo_env(allowlist, source)

    def plan(self, process: ProcessSpec) -> Plan:
        rlimits = process.shown_limits()
        if not self.uses_agent:
            return ArgvPlan(
                backend=self.id,
                argv=self.launch_argv(process.args, process),
                env=self._env(None),
                cwd=process.cwd,
                notes=[
                    "runs on the host as the caller (the status quo), under the reaper shim",
                    rlimits,
                ],
                process=process,
            )
        return AgentPlan(
            backend=self.id,
            spawn=spawn_of(process, env=self._env(None)),
            notes=[
                "runs on the host as the caller (the status quo): no filesystem, network or "
                "cgroup isolation; the caller's environment unless envAllowlist is set",
                f"through the sandbox's exec agent ({BINARY_NAME} --fd N, started at prepare): "
                "the spawn frame's fields above; a keeper per run ends the whole tree",
                rlimits,
            ],
            process=process,
        )

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        task = await super().prepare(task)
        if self.uses_agent and self.box is None:
            self.box = Box(agent=await Agent.start_local(), launch=None)
        return task

    async def execute(self, plan: Plan, opts: RunOptions) -> RunResult:
        if not self.uses_agent:
            process = own_plan(self, plan, ArgvPlan).process
            return await self.run_reaped(process.args, self._env(opts), process, opts)
        return await super().execute(plan, opts)

    async def run_spawn(
        self, box: Box[Any, Any], plan: AgentPlan, opts: RunOptions
    ) -> ProcessOutcome:
        # The environment is the caller's at run time (opts.env), as the status quo has it.
        return await box.agent.run_command(spawn_of(plan.process, env=self._env(opts)), opts)

    async def dispose(self) -> None:
        box, self.box = self.box, None
        try:
            if box is not None:
                await box.agent.close()
        finally:
            await super().dispose()
