"""The one front door: a task as a caller asks for it → the settings layers → the worktree
check → the :class:`PrepareContext`.

The CLI (its flags, :func:`fusion_oci.caller.flags.resolve_task`) and the server (``prepare``'s
params, :mod:`fusion_oci.server.methods`) both come in here, so a task is the same task
whoever asks for it. Each settings file is read once, and the worktree is checked once: the
context leaves marked (``PrepareContext.worktree_checked``), and ``Sandbox.prepare`` does not
check that worktree again. What differs between callers is only how they name things in an
error (``--worktree`` or ``worktreePath``) and the layers they put on top of the files.

The layers, bottom to top (a later one wins, key by key): the global file, the project file,
the caller's own (the server's client settings), the task prompt's ``**Sandbox:** X`` line, the
caller's top layer (the CLI's flags, the server's prepare context policy).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from fusion_oci.errors import FlagError, FusionOCIError
from fusion_oci.models import PrepareContext
from fusion_oci.policy.settings import (
    EffectiveSettings,
    Layer,
    SandboxSettings,
    file_layers,
    merge_layers,
)
from fusion_oci.policy.worktree import check_worktree, project_root

TopLayer = Layer | Callable[[SandboxSettings], Layer | None] | None
"""The caller's top layer: a layer, or one made from the settings below it (the CLI's list
flags add to what the files allow); None: none."""


def _no_prompt() -> str | None:
    return None


@dataclass(frozen=True)
class TaskRequest:
    """A task as a caller asks for it, before anything is read or checked."""

    worktree: Path
    """Absolute: the folder the caller named (or the CLI's default, the work tree it is in)."""
    task_id: str
    run_id: str
    env: Mapping[str, str]
    """The caller's environment: where the global settings file is, whose HOME is refused."""
    context_error: Callable[[ValidationError], FusionOCIError]
    """A context the model refuses (a bad task id), as the caller reports it."""
    unsafe_worktree: bool = False
    project_dir: Path | None = None
    """The explicit project root. None: found from the worktree (:func:`find_project_dir`)."""
    prompt: Callable[[], str | None] = _no_prompt
    """The task prompt, read once the worktree and the project are checked (the CLI's may
    come from stdin). None: no prompt."""
    layers: Sequence[Layer] = ()
    """The caller's settings above the files and below the task prompt."""
    top: TopLayer = None
    worktree_name: str = "worktreePath"
    """How the caller's errors name the worktree."""
    project_name: str | None = None
    """How the caller's errors name the project root, checked here. None: it is checked by
    ``Sandbox.prepare`` (as ``projectDir``)."""


@dataclass(frozen=True)
class Entry:
    """What the front door lets in: the settings, the context to prepare, the project."""

    effective: EffectiveSettings
    ctx: PrepareContext
    project_dir: Path


def find_project_dir(worktree: Path, explicit: Path | None = None) -> Path:
    """The explicit project root, else the project of ``worktree`` (its main repository when
    linked); never a ``.fusion`` folder the sandboxed command could have planted."""
    if explicit is not None:
        return explicit.expanduser().absolute()
    return project_root(worktree)


def front_door(request: TaskRequest) -> Entry:
    """The settings, the checked worktree and the context of ``request``; raises the caller's
    mistakes (exit 2) before anything is made."""
    # First the worktree: it is what the command may write, and it finds the project.
    check_worktree(
        request.worktree,
        request.env,
        unsafe_ok=request.unsafe_worktree,
        name=request.worktree_name,
    )
    project = find_project_dir(request.worktree, request.project_dir)
    if request.project_name is not None and not project.is_dir():
        raise FlagError(
            f"{request.project_name} {project}",
            "it does not exist or is not a directory",
            "pass the project's root folder (the main repository)",
        )
    effective = _settings(request, project)
    settings = effective.settings
    try:
        ctx = PrepareContext(
            task_id=request.task_id,
            run_id=request.run_id,
            worktree_path=str(request.worktree),
            policy=settings.policy,
            image=settings.image,
            cache_mode=settings.cache_mode,
            project_dir=str(project),
            unsafe_worktree=request.unsafe_worktree,
        )
    except ValidationError as exc:
        raise request.context_error(exc) from exc
    return Entry(effective, ctx.mark_worktree_checked(), project)


def _settings(request: TaskRequest, project: Path) -> EffectiveSettings:
    from fusion_oci.policy.prompt import parse_prompt_override

    prompt = request.prompt()  # before the files: a bad prompt file is the first error
    layers, ignored = file_layers(project, request.env)
    layers += request.layers
    if prompt and (backend := parse_prompt_override(prompt)):
        layers.append(Layer("task prompt", {"backend": backend}))
    top = request.top
    if callable(top):
        below = merge_layers(layers)  # merged again with the top: no file is read again
        top = top(below.settings)
        if top is None:
            return EffectiveSettings(below.settings, below.provenance, below.warnings + ignored)
    if top is not None:
        layers.append(top)
    merged = merge_layers(layers)
    return EffectiveSettings(merged.settings, merged.provenance, merged.warnings + ignored)
