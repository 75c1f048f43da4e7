"""Flags → effective settings → task context: the part of the CLI shared by run, plan, bundle."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusion_oci.errors import SettingsError
from fusion_oci.models import PrepareContext, RunOptions
from fusion_oci.policy.layout import inspect_git
from fusion_oci.policy.settings import EffectiveSettings, load_settings


@dataclass
class TaskFlags:
    """The policy and run flags of `run`, `plan` and `bundle create` (None: not given)."""

    backend: str | None = None
    worktree: Path | None = None
    image: str | None = None
    network: str | None = None
    allow_path: list[str] | None = None
    writable_path: list[str] | None = None
    env: list[str] | None = None
    memory_mb: int | None = None
    cpus: float | None = None
    cpu_time_ms: int | None = None
    pids: int | None = None
    timeout_ms: int | None = None
    max_buffer: int | None = None
    failure_mode: str | None = None
    task_id: str | None = None
    run_id: str | None = None
    task_prompt: Path | None = None
    cache_mode: str | None = None
    host_ca: str | None = None


def find_project_dir(worktree: Path) -> Path:
    """The nearest ancestor with a ``.fusion`` folder; else the main repository of a linked
    worktree; else the worktree itself."""
    for folder in (worktree, *worktree.parents):
        if (folder / ".fusion").is_dir():
            return folder
    git = inspect_git(worktree)
    if git is not None and git.kind == "linked":
        return Path(git.common_dir).parent
    return worktree


def _abs(paths: list[str]) -> list[str]:
    # On the command line a relative path means relative to where the user stands.
    return [str(Path(p).expanduser().absolute()) for p in paths]


def _overrides(flags: TaskFlags, base: EffectiveSettings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    policy: dict[str, Any] = {}
    for key, value in (("backend", flags.backend), ("image", flags.image),
                       ("failureMode", flags.failure_mode), ("cacheMode", flags.cache_mode),
                       ("hostCa", flags.host_ca)):
        if value is not None:
            out[key] = value
    if flags.network is not None:
        policy["network"] = flags.network
        policy["allowNetwork"] = flags.network != "none"
    current = base.settings.policy
    # List flags add to what the settings files already allow.
    if flags.allow_path:
        policy["allowedPaths"] = [*current.allowed_paths, *_abs(flags.allow_path)]
    if flags.writable_path:
        policy["writablePaths"] = [*current.writable_paths, *_abs(flags.writable_path)]
    if flags.env:
        policy["envAllowlist"] = [*current.env_allowlist, *flags.env]
    if flags.memory_mb is not None:
        policy["memoryLimitMb"] = flags.memory_mb
    if flags.pids is not None:
        policy["pidsLimit"] = flags.pids
    cpu: dict[str, Any] = {}
    if flags.cpus is not None:
        cpu["maxCores"] = flags.cpus
    if flags.cpu_time_ms is not None:
        cpu["maxMs"] = flags.cpu_time_ms
    if cpu:
        policy["cpuLimit"] = cpu
    if policy:
        out["policy"] = policy
    return out


def new_run_id() -> str:
    return f"r{int(time.time())}-{secrets.token_hex(3)}"


@dataclass
class Task:
    effective: EffectiveSettings
    ctx: PrepareContext
    opts: RunOptions
    project_dir: Path


def resolve_task(flags: TaskFlags, env: Mapping[str, str]) -> Task:
    worktree = (flags.worktree or Path.cwd()).expanduser().absolute()
    if not worktree.is_dir():
        raise SettingsError(
            f"--worktree {worktree}", "it does not exist or is not a directory",
            "pass the task's worktree directory (default: the current directory)",
        )
    project = find_project_dir(worktree)
    prompt = None
    if flags.task_prompt is not None:
        try:
            prompt = flags.task_prompt.read_text(encoding="utf-8")
        except OSError as exc:
            raise SettingsError(f"--task-prompt {flags.task_prompt}", str(exc),
                                "pass a readable file with the task's prompt") from exc
    base = load_settings(project_dir=project, env=env, task_prompt=prompt)
    overrides = _overrides(flags, base)
    effective = load_settings(project_dir=project, env=env, task_prompt=prompt,
                              overrides=overrides) if overrides else base
    settings = effective.settings
    try:
        ctx = PrepareContext(
            task_id=flags.task_id or "adhoc",
            run_id=flags.run_id or new_run_id(),
            worktree_path=str(worktree),
            policy=settings.policy,
            image=settings.image,
            cache_mode=settings.cache_mode,
            project_dir=str(project),
        )
        run_opts: dict[str, Any] = {}
        if flags.timeout_ms is not None:
            run_opts["timeout_ms"] = flags.timeout_ms
        if flags.max_buffer is not None:
            run_opts["max_buffer"] = flags.max_buffer
        opts = RunOptions(env=dict(env), **run_opts)
    except ValueError as exc:
        raise SettingsError("command-line flags", str(exc).splitlines()[-1].strip(),
                            "see `fusion-oci run --help`") from exc
    return Task(effective, ctx, opts, project)


def caller_env() -> dict[str, str]:
    return dict(os.environ)
