"""The native runtime: the command runs on the host as the caller, in the worktree.

It is the status quo (the brief's Phase A: "no behaviour change"): the caller's environment,
HOME, PATH and working directory, unchanged. It isolates nothing and says so: filesystem,
network, cgroup limits, protected paths and /proc protections are listed as unenforced. What it
does honour: timeouts and aborts that end the whole process tree, maxBuffer, the spec's rlimits
(cpuLimit.maxMs, fileSizeLimitMb), and ``envAllowlist`` when the policy sets one.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from fusion_oci.models import RunOptions, RunResult, SandboxCapabilities, SandboxPolicy
from fusion_oci.oci.spec import Spec, allowed_env
from fusion_oci.runtimes.base import Availability, LaunchPlan, Requirement
from fusion_oci.runtimes.hostproc import HostProcessRuntime, native_rlimits

__all__ = ["NativeRuntime", "native_rlimits", "status_quo_env"]

# What a login shell needs even when an allowlist narrows the rest of the environment.
BASIC_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "TERM", "TMPDIR")


def status_quo_env(policy: SandboxPolicy, source: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment as it is; narrowed to the allowlist (plus the basics a shell
    needs) only when the policy sets one. Pure."""
    if not policy.env_allowlist:
        return dict(source)
    env = {k: source[k] for k in BASIC_ENV if k in source}
    env.update(allowed_env(policy.env_allowlist, source))
    return env


class NativeRuntime(HostProcessRuntime):
    id = "native"
    private_dirs = False

    def capabilities(self) -> SandboxCapabilities:
        return SandboxCapabilities(
            filesystem_isolation="none", network_policy="none", resource_limits="basic",
            requires_install=False, supports_mac=True, supports_linux=True,
            supports_windows=False,
        )

    def availability(self) -> Availability:
        return Availability(True, version=f"python {sys.version.split()[0]}",
                            rootless=None, details={"isolation": "none"})

    def enforces(self) -> frozenset[Requirement]:
        return frozenset({Requirement.CPU_TIME, Requirement.FILE_SIZE})

    def enforces_for(self, policy: SandboxPolicy) -> frozenset[Requirement]:
        """The env allowlist is enforced only when the policy sets one (else: status quo)."""
        extra = {Requirement.ENV} if policy.env_allowlist else set()
        return self.enforces() | extra

    def _env(self, opts: RunOptions | None) -> dict[str, str]:
        source = opts.env if opts is not None and opts.env is not None else self.env
        policy = self.ctx.policy if self.ctx is not None else SandboxPolicy()
        return status_quo_env(policy, source)

    def plan(self, spec: Spec) -> LaunchPlan:
        return LaunchPlan(
            backend=self.id,
            argv=self.launch_argv(spec["process"]["args"], spec),
            env=self._env(None),
            cwd=spec["process"]["cwd"],
            notes=[
                "runs on the host as the caller (the status quo): no filesystem, network or "
                "cgroup isolation; the caller's environment unless envAllowlist is set",
                "rlimits: " + ", ".join(f"{n}={s}/{h}" for n, s, h in native_rlimits(spec)),
            ],
            spec=spec,
        )

    async def execute(self, plan: LaunchPlan, opts: RunOptions) -> RunResult:
        spec = plan.spec
        return await self.run_reaped(spec["process"]["args"], self._env(opts), spec, opts)
