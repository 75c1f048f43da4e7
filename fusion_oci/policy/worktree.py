"""Which folder is the task's worktree, which is its project, and which folders are refused.

The worktree is what the sandboxed command may write, so a wrong default is a hole: started
from ``/`` the old default (the current directory) made the whole host the worktree, Docker's
socket and ``/etc/shadow`` included. The rules:

- Without an explicit worktree, it is the top of the git work tree holding the current
  directory (a sub-folder would leave ``.git`` outside the sandbox and break git).
- ``/``, ``$HOME`` and its ancestors, a folder outside any git work tree and a sub-folder of
  one are refused unless the caller says so explicitly (``--unsafe-worktree``,
  ``PrepareContext.unsafe_worktree``).

The project (settings, audit log, caches) never comes from anything the command can write: an
explicit project root wins; else a linked worktree's project is its main repository; else the
worktree itself, whose ``.fusion/`` the runtimes then bind read-only. A ``.fusion`` folder
inside a linked worktree is never read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fusion_oci.errors import FlagError, SettingsError
from fusion_oci.models import PrepareContext
from fusion_oci.policy.layout import project_root

__all__ = [
    "check_inputs",
    "check_worktree",
    "default_worktree",
    "git_top",
    "project_root",
    "worktree_problem",
]


def git_top(start: Path) -> Path | None:
    """The nearest folder at or above ``start`` holding ``.git`` (a directory or a file)."""
    for folder in (start, *start.parents):
        if (folder / ".git").exists():
            return folder
    return None


def default_worktree(cwd: Path) -> Path:
    """The top of the git work tree that holds ``cwd``; ``cwd`` itself outside one (refused
    later by :func:`check_worktree` unless the caller allows it)."""
    return git_top(cwd) or cwd


def worktree_problem(path: Path, env: Mapping[str, str]) -> tuple[str, str] | None:
    """Why ``path`` is not a safe worktree, with the fix; None when it is. Reads the disk."""
    resolved = path.resolve()
    if resolved == Path("/"):
        return (
            "it is the root of the host: the command could write everywhere",
            "pass the task's git worktree (--worktree DIR), or cd into it",
        )
    home = env.get("HOME")
    if home:
        home_path = Path(home).resolve()
        if resolved == home_path or resolved in home_path.parents:
            return (
                f"it is your home folder ({home_path}) or holds it: the command could "
                "read and change your keys, shell start-up files and other projects",
                "pass the task's git worktree (--worktree DIR), or cd into it",
            )
    top = git_top(resolved)
    if top is None:
        return (
            "it is not inside a git work tree",
            "pass the task's git worktree (git worktree add), or run `git init` there",
        )
    if top != resolved:
        return (
            f"it is a sub-folder of the git work tree {top}: git would not work inside",
            f"use the top of the work tree (--worktree {top})",
        )
    return None


def check_worktree(
    path: Path, env: Mapping[str, str], *, unsafe_ok: bool, name: str = "--worktree"
) -> None:
    """Refuse a worktree that is missing or unsafe (:func:`worktree_problem`); exit 2."""
    if not path.is_dir():
        raise FlagError(
            f"{name} {path}",
            "it does not exist or is not a directory",
            "pass the task's worktree directory",
        )
    if unsafe_ok:
        return
    problem = worktree_problem(path, env)
    if problem is not None:
        why, hint = problem
        raise FlagError(
            f"{name} {path} is refused as a worktree",
            why,
            hint + "; --unsafe-worktree (PrepareContext.unsafe_worktree) accepts it "
            "if you really mean this folder",
        )


def check_inputs(ctx: PrepareContext, host_ca: str, env: Mapping[str, str]) -> None:
    """Everything about a task that is the caller's mistake, checked before any runtime is
    chosen: a bad value is exit 2 in every failure mode and never a reason to fall back."""
    if not ctx.worktree_checked:  # else the front door checked it, in its caller's words
        check_worktree(
            Path(ctx.worktree_path), env, unsafe_ok=ctx.unsafe_worktree, name="worktreePath"
        )
    if ctx.project_dir is not None and not Path(ctx.project_dir).is_dir():
        raise FlagError(
            f"projectDir {ctx.project_dir}",
            "it does not exist or is not a folder",
            "pass the project's root folder (the main repository)",
        )
    policy = ctx.policy
    for key, paths in (
        ("allowedPaths", policy.allowed_paths),
        ("writablePaths", policy.writable_paths),
    ):
        for i, path in enumerate(paths):
            if not Path(path).exists():
                raise SettingsError(
                    f"settings error at sandbox.policy.{key}[{i}]",
                    f"{path} does not exist (paths are bound at their host location)",
                    "create it first, or remove it from the policy",
                )
    if host_ca not in ("auto", "off") and not Path(host_ca).is_file():
        raise SettingsError(
            "settings error at sandbox.hostCa",
            f"{host_ca} is not a file",
            "point hostCa at a PEM bundle, or set it to auto or off",
        )
