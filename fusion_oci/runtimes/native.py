"""The native runtime: the command runs on the host as the caller, in the worktree.

It isolates nothing (filesystem, network and cgroup limits are not enforced, and it says so);
what it does honour from the bundle: the reduced environment, the working directory, a private
HOME and TMPDIR, rlimits, and ending the whole process tree on timeout.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from fusion_oci.models import PrepareContext, RunOptions, RunResult, SandboxCapabilities
from fusion_oci.oci.spec import SANDBOX_HOME, Spec, spec_env
from fusion_oci.process import reaper_argv, run_process
from fusion_oci.runtimes.base import Availability, LaunchPlan, Requirement, SpecRuntime


def native_env(spec: Spec, home: str, tmp: str) -> dict[str, str]:
    """The spec's env with sandbox-only paths mapped back to their host sources. Pure."""
    env = spec_env(spec)
    binds = {
        m["destination"]: m["source"]
        for m in spec["mounts"]
        if m.get("type") == "bind" and m["destination"] != m["source"]
    }
    binds[SANDBOX_HOME] = home
    binds["/tmp"] = tmp
    for key, value in env.items():
        for dest, src in binds.items():
            if value == dest or value.startswith(dest + "/"):
                env[key] = src + value[len(dest):]
                break
    return env


def native_rlimits(spec: Spec) -> list[tuple[str, int, int]]:
    return [(r["type"], r["soft"], r["hard"]) for r in spec["process"].get("rlimits", [])]


class NativeRuntime(SpecRuntime):
    id = "native"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._scratch: Path | None = None

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

    def _dirs(self) -> tuple[str, str]:
        if self._scratch is None:
            return "<private-home>", "<private-tmp>"
        return str(self._scratch / "home"), str(self._scratch / "tmp")

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

    async def prepare(self, ctx: PrepareContext) -> None:
        await super().prepare(ctx)
        self._scratch = Path(tempfile.mkdtemp(prefix=f"fusion-oci-{ctx.task_id}-"))
        for sub in ("home", "tmp"):
            (self._scratch / sub).mkdir(mode=0o700)

    async def execute(self, spec: Spec, opts: RunOptions) -> RunResult:
        home, tmp = self._dirs()
        outcome = await run_process(
            reaper_argv(spec["process"]["args"], native_rlimits(spec)),
            env=native_env(spec, home, tmp),
            cwd=spec["process"]["cwd"],
            stdin=opts.stdin,
            timeout_s=opts.timeout_ms / 1000,
            max_buffer=opts.max_buffer,
            term_group=False,
        )
        return self.result(outcome, spec)

    async def dispose(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        await super().dispose()
