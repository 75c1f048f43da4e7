"""The native runtime: the command runs on the host as the caller, in the worktree.

It isolates nothing (filesystem, network and cgroup limits are not enforced, and it says so);
what it does honour from the bundle: the reduced environment, the working directory, a private
HOME and TMPDIR, rlimits, and ending the whole process tree on timeout.
"""

from __future__ import annotations

import sys

from fusion_oci.models import RunOptions, RunResult, SandboxCapabilities
from fusion_oci.oci.spec import Spec
from fusion_oci.runtimes.base import Availability, LaunchPlan, Requirement
from fusion_oci.runtimes.hostproc import HostProcessRuntime, native_env, native_rlimits

__all__ = ["NativeRuntime", "native_env", "native_rlimits"]


class NativeRuntime(HostProcessRuntime):
    id = "native"

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
        return frozenset({Requirement.ENV, Requirement.CPU_TIME, Requirement.FILE_SIZE})

    def plan(self, spec: Spec) -> LaunchPlan:
        home, tmp = self._dirs()
        return LaunchPlan(
            backend=self.id,
            argv=["<reaper>", *spec["process"]["args"]],
            env=native_env(spec, home, tmp),
            cwd=spec["process"]["cwd"],
            notes=[
                "runs on the host as the caller: no filesystem, network or cgroup isolation",
                "rlimits: " + ", ".join(f"{n}={s}/{h}" for n, s, h in native_rlimits(spec)),
            ],
        )

    async def execute(self, spec: Spec, opts: RunOptions) -> RunResult:
        home, tmp = self._dirs()
        return await self.run_reaped(spec["process"]["args"], native_env(spec, home, tmp),
                                     spec, opts)
