"""The ``sandbox-exec`` runtime: macOS Seatbelt around the command, on the host.

``sandbox-exec -p PROFILE -D NAME=PATH ... /bin/sh -c COMMAND``, with the profile generated
from the compiled spec by :mod:`.seatbelt`, run inside the same subreaper
shim as native (timeout, process-group kill, rlimits). Opt-in: Apple marks ``sandbox-exec``
deprecated, though it ships with current macOS.

What it cannot enforce, it does not claim: memory, pids and CPU quota have no Seatbelt
counterpart, so ``enforces()`` leaves them out and the lifecycle refuses such policies. On
Linux and Windows it is unavailable with the reason; :meth:`plan` still works there (it is pure)
so ``fusion-oci plan --backend sandbox-exec`` can show the profile anywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_oci.errors import BundleError, RuntimeUnavailableError
from fusion_oci.host.process import run_process
from fusion_oci.models import RunOptions, RunResult
from fusion_oci.oci.model import ProcessSpec, TaskSpec
from fusion_oci.runtimes.hostproc import HostProcessRuntime, native_env
from fusion_oci.runtimes.plans import ArgvPlan, Plan, own_plan
from fusion_oci.runtimes.protocol import Availability
from fusion_oci.runtimes.requirements import Requirement
from fusion_oci.runtimes.sandbox_exec.seatbelt import (
    SANDBOX_EXEC,
    SeatbeltProfile,
    seatbelt_profile,
)

if TYPE_CHECKING:
    from fusion_oci.resolve import ResolvedTask

MAC_EXTRA_PATH = ("/opt/homebrew/bin", "/opt/homebrew/sbin")
"""Where Homebrew puts node, pnpm and git on Apple silicon (Intel's /usr/local is already on
the sandbox PATH)."""


def mac_env(spec: TaskSpec, process: ProcessSpec, home: str, tmp: str) -> dict[str, str]:
    """The command's environment: native's mapping of sandbox paths to host paths, with
    Homebrew's bin directories appended to PATH. Pure."""
    env = native_env(spec, process, home, tmp)
    parts = env.get("PATH", "").split(":")
    env["PATH"] = ":".join([*parts, *(p for p in MAC_EXTRA_PATH if p not in parts)])
    return env


def with_params(
    argv: Sequence[str], planned: SeatbeltProfile, launched: SeatbeltProfile
) -> list[str]:
    """The planned argv with ``launched``'s ``-D`` parameters in place of ``planned``'s (the
    same names; values with their symlinks resolved). Pure; by position, right after
    ``sandbox-exec -p PROFILE``, so the command's own words are never touched."""
    out = list(argv)
    at = out.index(SANDBOX_EXEC) + 3
    old, new = planned.parameter_args(), launched.parameter_args()
    if (
        out[at - 2 : at] != ["-p", planned.text]
        or out[at : at + len(old)] != old
        or len(new) != len(old)
    ):
        raise ValueError("the sandbox-exec command line does not match its profile")
    out[at : at + len(old)] = new
    return out


@dataclass(frozen=True)
class SeatbeltPlan(ArgvPlan):
    """A sandbox-exec launch plan, with the profile whose parameters execute resolves."""

    profile: SeatbeltProfile = field(kw_only=True, repr=False, compare=False)


class SandboxExecRuntime(HostProcessRuntime):
    id = "sandbox-exec"

    platform: str = sys.platform
    """The host's platform (a test sets another to see the runtime away from a Mac)."""

    def availability(self) -> Availability:
        if self.platform != "darwin":
            where = "Windows" if self.platform.startswith("win") else self.platform
            return Availability(
                False,
                f"sandbox-exec (macOS Seatbelt) exists only on macOS; this host is {where}",
                "on Linux choose bubblewrap, oci, podman or docker; on Windows see "
                "docs/windows.md; `fusion-oci plan --backend sandbox-exec` still shows the "
                "profile it would use",
            )
        if not Path(SANDBOX_EXEC).is_file():
            return Availability(
                False,
                f"{SANDBOX_EXEC} is missing (Apple deprecated it; this macOS removed it)",
                "choose docker or podman (through their VM), or native",
            )
        return Availability(
            True,
            version=None,
            rootless=True,
            details={
                "binary": SANDBOX_EXEC,
                "deprecated": "Apple marks sandbox-exec deprecated; it is opt-in here",
                "not enforced": "memoryLimitMb, pidsLimit, cpuLimit.maxCores (refused)",
            },
        )

    def enforces(self) -> frozenset[Requirement]:
        return frozenset(
            {
                Requirement.FILESYSTEM,
                Requirement.PROC_PATHS,
                Requirement.ENV,
                # (allow signal/process-info* (target same-sandbox)) and nothing wider;
                # macOS has no call that changes another process's rlimits.
                Requirement.HOST_PROCESSES,
                Requirement.NETWORK_NONE,
                Requirement.NETWORK_EGRESS,
                Requirement.CPU_TIME,
                Requirement.FILE_SIZE,
            }
        )

    # -- the pure translation

    def profile(self, spec: TaskSpec) -> SeatbeltProfile:
        """The Seatbelt profile and its ``-D`` parameters for ``spec``. Pure."""
        home, tmp = self._dirs()
        return seatbelt_profile(
            spec, caller_home=self.env.get("HOME"), scratch_home=home, scratch_tmp=tmp
        )

    def plan(self, process: ProcessSpec) -> SeatbeltPlan:
        """argv is what :meth:`execute` runs (the subreaper shim with the process's rlimits, then
        sandbox-exec with the profile text as its ``-p`` word), but for one step: execute
        resolves the parameters' symlinks on the Mac, as Seatbelt matches resolved paths
        (:func:`with_params`). Notes hold the profile again, line by line. Pure: works on
        any platform."""
        home, tmp = self._dirs()
        spec = self.task_spec
        profile = self.profile(spec)
        notes = [
            "runs on the host under a Seatbelt profile (sandbox-exec, deprecated by Apple, "
            "opt-in); paths reach the profile only as -D parameters",
            "not enforced here (the lifecycle refuses them): memoryLimitMb, pidsLimit, "
            "cpuLimit.maxCores",
            process.shown_limits(),
        ]
        if spec.image:
            notes.append(
                f"REFUSED: image {spec.image} needs a container "
                "runtime; sandbox-exec runs the host's tools"
            )
        notes += [
            "parameters (symlinks resolved at launch):",
            *(f"  {k}={v}" for k, v in profile.params),
            "profile:",
            *("  " + line for line in profile.text.splitlines()),
        ]
        return SeatbeltPlan(
            backend=self.id,
            argv=self.launch_argv(profile.argv(list(process.args)), process),
            env=mac_env(spec, process, home, tmp),
            cwd=process.cwd,
            notes=notes,
            process=process,
            profile=profile,
        )

    # -- lifecycle

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        avail = self.availability()
        if not avail.available:
            raise RuntimeUnavailableError(self.id, avail.reason, avail.hint)
        task = await super().prepare(task)
        if image := task.spec.image:
            await self.dispose()
            raise BundleError(
                f"sandbox-exec cannot run image {image}",
                "it sandboxes the host's own tools; images need a container",
                "drop sandbox.image, or choose docker or podman",
            )
        return task

    async def execute(self, plan: Plan, opts: RunOptions) -> RunResult:
        launch = own_plan(self, plan, SeatbeltPlan)
        # Seatbelt matches resolved paths: resolve any other symlinks now (plan() stays pure;
        # canonical_path already took /var, /tmp and /etc to /private).
        argv = with_params(launch.argv, launch.profile, launch.profile.resolved())
        outcome = await run_process(
            argv,
            env=launch.env,
            cwd=launch.cwd,
            stdin=opts.stdin,
            timeout_s=opts.timeout_ms / 1000,
            max_buffer=opts.max_buffer,
            on_output=opts.on_output,
            keep_output=opts.keep_output,
            term_group=False,  # the shim ends the tree itself, then dies by the same signal
        )
        return self.result(outcome, launch.process)
