"""Flags → effective settings → task context: shared by the CLI's run, plan and bundle and by
the resident server (which resolves a client's flags from its cwd and environment)."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fusion_oci.errors import FlagError
from fusion_oci.models import PrepareContext, RunOptions
from fusion_oci.policy.settings import EffectiveSettings, load_settings
from fusion_oci.policy.worktree import check_worktree, default_worktree, project_root


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
    """A file with the task prompt; ``-``: read it from stdin."""
    cwd: str | None = None
    cache_mode: str | None = None
    host_ca: str | None = None
    project_dir: Path | None = None
    unsafe_worktree: bool = False


def find_project_dir(worktree: Path, explicit: Path | None = None) -> Path:
    """The explicit project root, else the project of ``worktree`` (its main repository when
    linked); never a ``.fusion`` folder the sandboxed command could have planted."""
    if explicit is not None:
        return explicit.expanduser().absolute()
    return project_root(worktree)


def host_path(path: Path | str, cwd: Path, env: Mapping[str, str]) -> Path:
    """A path given on the command line, as the caller meant it: ``~`` is the caller's HOME,
    a relative path is relative to the caller's cwd (the resident server resolves flags for a
    client that stands elsewhere; in this process it is ``Path.expanduser().absolute()``)."""
    text = str(path)
    if (text == "~" or text.startswith("~/")) and env.get("HOME"):
        text = env["HOME"] + text[1:]
    elif text.startswith("~"):
        text = str(Path(text).expanduser())
    out = Path(text)
    return out if out.is_absolute() else cwd / out


def resolve_worktree(flags: TaskFlags, env: Mapping[str, str], cwd: Path | None = None) -> Path:
    """The flag's folder, else the top of the git work tree holding the current directory;
    refused (exit 2) when unsafe unless --unsafe-worktree says so."""
    where = cwd if cwd is not None else Path.cwd().absolute()
    worktree = (
        host_path(flags.worktree, where, env)
        if flags.worktree is not None
        else default_worktree(where)
    )
    check_worktree(
        worktree,
        env,
        unsafe_ok=flags.unsafe_worktree,
        name="--worktree"
        if flags.worktree is not None
        else "worktree (current directory; pass --worktree DIR)",
    )
    return worktree


# Model fields whose values come from a flag: a validation error names the flag.
_FLAG_OF = {
    "timeout_ms": "--timeout-ms",
    "max_buffer": "--max-buffer",
    "task_id": "--task-id",
    "run_id": "--run-id",
    "cwd": "--cwd",
}


def flag_error(exc: ValidationError, values: Mapping[str, object]) -> FlagError:
    """A pydantic error about flag-made values as: the flag, the value, what is accepted."""
    first = exc.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else ""
    flag = _FLAG_OF.get(field, field)
    msg = str(first["msg"]).removeprefix("Value error, ")
    return FlagError(
        f"{flag} {values.get(field, first.get('input'))!r}",
        msg,
        f"see `fusion-oci run --help` for {flag}",
    )


def _overrides(
    flags: TaskFlags, base: EffectiveSettings, cwd: Path, env: Mapping[str, str]
) -> dict[str, Any]:
    def _abs(paths: list[str]) -> list[str]:
        # On the command line a relative path means relative to where the user stands.
        return [str(host_path(p, cwd, env)) for p in paths]

    out: dict[str, Any] = {}
    policy: dict[str, Any] = {}
    for key, value in (
        ("backend", flags.backend),
        ("image", flags.image),
        ("failureMode", flags.failure_mode),
        ("cacheMode", flags.cache_mode),
        ("hostCa", flags.host_ca),
    ):
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


def resolve_task(flags: TaskFlags, env: Mapping[str, str], cwd: Path | None = None) -> Task:
    """The task of these flags, for a caller standing in ``cwd`` (default: ours) with ``env``."""
    where = cwd if cwd is not None else Path.cwd().absolute()
    worktree = resolve_worktree(flags, env, where)
    project = find_project_dir(
        worktree, None if flags.project_dir is None else host_path(flags.project_dir, where, env)
    )
    if not project.is_dir():
        raise FlagError(
            f"--project-dir {project}",
            "it does not exist or is not a directory",
            "pass the project's root folder (the main repository)",
        )
    prompt = None
    if flags.task_prompt is not None and str(flags.task_prompt) == "-":
        import sys

        prompt = sys.stdin.read()
    elif flags.task_prompt is not None:
        try:
            prompt = host_path(flags.task_prompt, where, env).read_text(encoding="utf-8")
        except OSError as exc:
            raise FlagError(
                f"--task-prompt {flags.task_prompt}",
                str(exc),
                "pass a readable file with the task's prompt",
            ) from exc
    base = load_settings(project_dir=project, env=env, task_prompt=prompt)
    overrides = _overrides(flags, base, where, env)
    effective = (
        load_settings(project_dir=project, env=env, task_prompt=prompt, overrides=overrides)
        if overrides
        else base
    )
    settings = effective.settings
    values: dict[str, Any] = {
        "task_id": flags.task_id or "adhoc",
        "run_id": flags.run_id or new_run_id(),
    }
    if flags.timeout_ms is not None:
        values["timeout_ms"] = flags.timeout_ms
    if flags.max_buffer is not None:
        values["max_buffer"] = flags.max_buffer
    if flags.cwd is not None:
        values["cwd"] = flags.cwd
    try:
        ctx = PrepareContext(
            task_id=values["task_id"],
            run_id=values["run_id"],
            worktree_path=str(worktree),
            policy=settings.policy,
            image=settings.image,
            cache_mode=settings.cache_mode,
            project_dir=str(project),
            unsafe_worktree=flags.unsafe_worktree,
        )
        opts = RunOptions(
            env=dict(env),
            **{k: v for k, v in values.items() if k in ("timeout_ms", "max_buffer", "cwd")},
        )
    except ValidationError as exc:
        raise flag_error(exc, values) from exc
    return Task(effective, ctx, opts, project)


def caller_env() -> dict[str, str]:
    return dict(os.environ)
