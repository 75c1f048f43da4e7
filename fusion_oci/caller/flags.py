"""The CLI's task flags → the front door (:mod:`fusion_oci.caller.frontdoor`) → the task:
shared by the CLI's run, plan, bundle and settings commands and by the resident server (which
resolves a client's flags from its cwd and environment)."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fusion_oci.caller import frontdoor
from fusion_oci.errors import FlagError
from fusion_oci.models import PrepareContext, RunOptions
from fusion_oci.policy.settings import EffectiveSettings, Layer, SandboxSettings
from fusion_oci.policy.worktree import default_worktree


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


def _flag_layer(
    flags: TaskFlags, below: SandboxSettings, cwd: Path, env: Mapping[str, str]
) -> Layer | None:
    """The flags as the top settings layer ("command line"); None: no flag sets a setting."""

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
    current = below.policy
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
    return Layer("command line", out) if out else None


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
    entry = frontdoor.front_door(
        frontdoor.TaskRequest(
            worktree=(
                host_path(flags.worktree, where, env)
                if flags.worktree is not None
                else default_worktree(where)
            ),
            task_id=values["task_id"],
            run_id=values["run_id"],
            env=env,
            context_error=lambda exc: flag_error(exc, values),
            unsafe_worktree=flags.unsafe_worktree,
            project_dir=(
                None if flags.project_dir is None else host_path(flags.project_dir, where, env)
            ),
            prompt=lambda: _prompt(flags, where, env),
            top=lambda below: _flag_layer(flags, below, where, env),
            worktree_name="--worktree"
            if flags.worktree is not None
            else "worktree (current directory; pass --worktree DIR)",
            project_name="--project-dir",
        )
    )
    try:
        opts = RunOptions(
            env=dict(env),
            **{k: v for k, v in values.items() if k in ("timeout_ms", "max_buffer", "cwd")},
        )
    except ValidationError as exc:
        raise flag_error(exc, values) from exc
    return Task(entry.effective, entry.ctx, opts, entry.project_dir)


def _prompt(flags: TaskFlags, cwd: Path, env: Mapping[str, str]) -> str | None:
    """The text of --task-prompt (``-``: stdin); None: not given."""
    if flags.task_prompt is None:
        return None
    if str(flags.task_prompt) == "-":
        import sys

        return sys.stdin.read()
    try:
        return host_path(flags.task_prompt, cwd, env).read_text(encoding="utf-8")
    except OSError as exc:
        raise FlagError(
            f"--task-prompt {flags.task_prompt}",
            str(exc),
            "pass a readable file with the task's prompt",
        ) from exc


def caller_env() -> dict[str, str]:
    return dict(os.environ)
