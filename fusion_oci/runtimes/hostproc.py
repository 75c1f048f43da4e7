"""What the runtimes that run the command as a host process share (native, sandbox-exec,
landlock).

A private scratch HOME and TMPDIR per task, the spec's sandbox paths mapped back to host
paths, and the run itself inside the subreaper shim (timeout, whole-tree kill, rlimits) for the
runtime that still needs a per-command wrapper (sandbox-exec's profile); native and landlock run
every command through the task's exec agent instead (fusion_oci/agent; landlock's is the
confined child of one shim per task).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_oci.host.process import reaper_argv, run_process
from fusion_oci.host.scratch import make_scratch
from fusion_oci.models import RunOptions, RunResult
from fusion_oci.oci.environment import SANDBOX_HOME
from fusion_oci.oci.model import ProcessSpec, TaskSpec
from fusion_oci.runtimes.skeleton import SpecRuntime

if TYPE_CHECKING:
    from fusion_oci.resolve import ResolvedTask

PLACEHOLDER_HOME = "<private-home>"
PLACEHOLDER_TMP = "<private-tmp>"


def native_env(task: TaskSpec, process: ProcessSpec, home: str, tmp: str) -> dict[str, str]:
    """The process's env with sandbox-only paths mapped back to their host sources. Pure."""
    env = process.env_map()
    binds = {
        m.destination: m.source
        for m in task.mounts
        if m.type == "bind" and m.source is not None and m.destination != m.source
    }
    binds[SANDBOX_HOME] = home
    binds["/tmp"] = tmp
    for key, value in env.items():
        for dest, src in binds.items():
            if value == dest or value.startswith(dest + "/"):
                env[key] = src + value[len(dest) :]
                break
    return env


class HostProcessRuntime(SpecRuntime):
    """Base of runtimes whose command is a host process (under the reaper shim unless the
    runtime overrides :meth:`execute`, as native does with its exec agent)."""

    private_dirs = True
    streams_stdin = True  # run_process writes a StdinStream's chunks as they come
    """Whether each task gets a scratch HOME and TMPDIR (native: no, the caller's own)."""

    _scratch: Path | None = None
    """The task's private HOME and TMPDIR (from prepare)."""

    def _dirs(self) -> tuple[str, str]:
        """(HOME, TMPDIR) on the host; placeholders before prepare, so plans stay pure."""
        if self._scratch is None:
            return PLACEHOLDER_HOME, PLACEHOLDER_TMP
        return str(self._scratch / "home"), str(self._scratch / "tmp")

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        task = await super().prepare(task)
        if not self.private_dirs:
            return task
        self._scratch = make_scratch(self.id, task.spec.task_id)
        for sub in ("home", "tmp"):
            (self._scratch / sub).mkdir(mode=0o700)
        return task

    def launch_argv(self, argv: Sequence[str], process: ProcessSpec) -> list[str]:
        """What really runs: argv under the subreaper shim, with the process's rlimits."""
        return reaper_argv(argv, process.limits())

    async def run_reaped(
        self, argv: Sequence[str], env: dict[str, str], process: ProcessSpec, opts: RunOptions
    ) -> RunResult:
        outcome = await run_process(
            self.launch_argv(argv, process),
            env=env,
            cwd=process.cwd,
            stdin=opts.stdin,
            timeout_s=opts.timeout_ms / 1000,
            max_buffer=opts.max_buffer,
            on_output=opts.on_output,
            keep_output=opts.keep_output,
            term_group=False,  # the shim ends the tree itself, then dies by the same signal
        )
        return self.result(outcome, process)

    async def dispose(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        await super().dispose()
