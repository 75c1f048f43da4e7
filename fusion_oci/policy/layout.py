"""Where a task's files are on the host: worktree, git directories, caches, CA bundle.

:func:`resolve_layout` is the one step that reads (and, for cache directories, creates) host
paths before compiling; everything after it is pure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fusion_oci.errors import BundleError
from fusion_oci.models import CacheMode, PrepareContext

CACHE_ROOT_IN_SANDBOX = "/var/cache/fusion-oci"
CA_IN_SANDBOX = "/etc/fusion-oci/host-ca.pem"


@dataclass(frozen=True)
class GitLayout:
    """The git directories a worktree needs.

    ``linked``: ``.git`` is a file pointing into the main repository's ``.git/worktrees/NAME``
    (``git worktree add``). ``main``: ``.git`` is a directory inside the worktree.
    """

    kind: str
    git_dir: str
    common_dir: str
    worktree_config: str | None = None
    """``config.worktree`` of this worktree when ``extensions.worktreeConfig`` is on: git reads
    it like ``config``, so it is mounted read-only too (else it could set core.hooksPath)."""


@dataclass(frozen=True)
class CacheMount:
    """A package cache shared into the sandbox, and the env var that points tools at it."""

    name: str
    host_path: str
    sandbox_path: str
    env: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class TaskLayout:
    worktree: str
    git: GitLayout | None
    caches: tuple[CacheMount, ...]
    ca_bundle: str | None
    """Host CA bundle to share read-only, or None."""
    ca_complete: bool = False
    """Whether ``ca_bundle`` is a whole trust store (the host's own system bundle, maybe with
    the credential broker's CA added), so that Node.js may trust it in place of its own roots
    (fusion_oci/oci/environment.py: ``NODE_OPENSSL_CA``); False for a bundle the settings
    name, which may hold a company's CA only and so is added to Node.js's roots."""
    protected: tuple[str, ...] = ()
    """Existing host paths inside what the sandbox may write that stay read-only there."""
    unprotected: tuple[str, ...] = field(default=())
    """protectedPaths entries that could not be protected, each with the reason (they are
    listed as unenforced in the result and the audit)."""
    blobs: str | None = None
    """The project's blob store (fusion_oci.store: what node_modules files are hard-linked
    to, on the host side, never mounted), or None with ``cacheMode: off``."""
    sentinels: tuple[tuple[str, str], ...] = ()
    """Brokered credentials (``sandbox.credentials``): variable -> the task's sentinel, set
    in every command's environment (the value stays on the host, in the proxy)."""
    git_credentials: tuple[tuple[str, str, str], ...] = ()
    """(host, user name, variable): git's credential helper answers the sentinel for https
    remotes of that host."""
    hosts_file: str | None = None
    """A host file bound read-only at ``/etc/hosts``: the task's service containers' names
    on its own 127.0.0.1 (``policy.services``; written at prepare). None: the host's or the
    image's ``/etc/hosts``."""
    project: str | None = None
    """The task's project folder, resolved (:func:`task_project`: ``--project-dir``, else the
    worktree's main repository): its ``.fusion/`` holds the settings and the audit log. None
    (a layout made by hand): the worktree's own project, see :meth:`fusion_dir`."""

    def fusion_dir(self) -> str:
        """The project's ``.fusion/`` folder, resolved. A layout without :attr:`project` reads
        the worktree's git files for it (:func:`project_root`), as :func:`task_project` does
        when no project folder is named."""
        project = Path(self.project) if self.project else project_root(Path(self.worktree))
        return str(project.resolve() / ".fusion")


GLOB_CHARS = frozenset("*?[")


def _inside(path: str, roots: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def resolve_protected(
    worktree: str,
    patterns: Sequence[str],
    writable_roots: Sequence[str],
    extra: Sequence[str] = (),
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The protectedPaths globs as existing host paths to bind read-only, and the entries that
    cannot be protected (with why). Reads the disk, creates nothing.

    Only paths inside something writable are bound: binding one from elsewhere would make a
    hidden path visible. A symlink is not followed (the command could replace the link).
    """
    protected: list[str] = []
    missing: list[str] = []
    for pattern in [*patterns, *extra]:
        text = pattern.rstrip("/") or pattern
        absolute = Path(text if text.startswith("/") else f"{worktree.rstrip('/')}/{text}")
        if GLOB_CHARS & set(text):
            anchor = Path(absolute.anchor)
            found = sorted(anchor.glob(str(absolute.relative_to(anchor))))
            if not found:
                missing.append(f"{pattern} (no match at prepare)")
        else:
            exists = absolute.is_symlink() or absolute.exists()
            parent = absolute.parent
            if not exists and parent.exists() and not parent.is_dir():
                continue  # e.g. .git/hooks where .git is a file: nothing can live there
            found = [absolute] if exists else []
            if not found and _inside(str(absolute), writable_roots):
                missing.append(f"{pattern} (absent at prepare)")
        for path in found:
            if not _inside(str(path), writable_roots):
                continue
            if path.is_symlink():
                missing.append(f"{pattern} ({path} is a symlink, which the command could replace)")
            elif str(path) not in protected:
                protected.append(str(path))
    return tuple(protected), tuple(missing)


def ensure_project_dir(project_dir: Path) -> None:
    """Create the project's ``.fusion/`` (the audit log lives there; it must exist to be bound
    read-only). One created inside a git work tree is listed in that repository's
    ``info/exclude`` (never in a tracked file), so ``git add -A`` does not commit it."""
    fusion = project_dir / ".fusion"
    if fusion.is_dir():
        return
    fusion.mkdir(parents=True, exist_ok=True)
    top = next((f for f in (project_dir, *project_dir.parents) if (f / ".git").exists()), None)
    if top is None:
        return
    git = inspect_git(top)
    if git is None:
        return
    entry = "/" + str(fusion.relative_to(top)) + "/"
    exclude = Path(git.common_dir) / "info" / "exclude"
    try:
        current = exclude.read_text(encoding="utf-8") if exclude.exists() else ""
        if entry not in current.splitlines():
            exclude.parent.mkdir(parents=True, exist_ok=True)
            sep = "" if not current or current.endswith("\n") else "\n"
            with exclude.open("a", encoding="utf-8") as fh:
                fh.write(f"{sep}# fusion-oci's settings and audit log\n{entry}\n")
    except OSError:
        pass  # an unwritable exclude file only means git status shows .fusion/


def _worktree_config(git_dir: Path, common: Path) -> str | None:
    try:
        config = (common / "config").read_text(encoding="utf-8", errors="replace").lower()
    except OSError:
        return None
    if "worktreeconfig" not in config.replace(" ", ""):
        return None
    return str(git_dir / "config.worktree")


def inspect_git(worktree: Path) -> GitLayout | None:
    dotgit = worktree / ".git"
    if dotgit.is_dir():
        return GitLayout("main", str(dotgit), str(dotgit), _worktree_config(dotgit, dotgit))
    if not dotgit.is_file():
        return None
    text = dotgit.read_text(encoding="utf-8", errors="replace").strip()
    if not text.startswith("gitdir:"):
        return None
    git_dir = Path(text.removeprefix("gitdir:").strip())
    if not git_dir.is_absolute():
        git_dir = (worktree / git_dir).resolve()
    commondir_file = git_dir / "commondir"
    if commondir_file.is_file():
        common = Path(commondir_file.read_text(encoding="utf-8").strip())
        common = common if common.is_absolute() else (git_dir / common).resolve()
    else:
        common = git_dir
    return GitLayout("linked", str(git_dir), str(common), _worktree_config(git_dir, common))


def project_root(worktree: Path) -> Path:
    """A linked worktree's main repository; else the worktree itself. Never a folder found by
    looking for ``.fusion`` (the command can create one anywhere it may write)."""
    git = inspect_git(worktree)
    if git is not None and git.kind == "linked":
        common = Path(git.common_dir)
        # A bare common dir (repo.git) has no work tree: its parent holds the project files.
        return common.parent if common.name == ".git" else common
    return worktree


def task_project(ctx: PrepareContext) -> Path:
    """The project of a task: ``ctx.project_dir``, else :func:`project_root` of the worktree."""
    return Path(ctx.project_dir) if ctx.project_dir else project_root(Path(ctx.worktree_path))


def project_cache(ctx: PrepareContext, cache_root: Path) -> Path:
    """The project's cache directory (its tasks' caches and blob store are under it)."""
    key = hashlib.sha256(str(task_project(ctx)).encode()).hexdigest()[:12]
    return cache_root / "projects" / key


def _cache_dirs(ctx: PrepareContext, cache_root: Path, create: bool) -> tuple[CacheMount, ...]:
    if ctx.cache_mode is CacheMode.OFF:
        return ()
    base = project_cache(ctx, cache_root)
    if ctx.cache_mode is CacheMode.ISOLATED:
        base = base / "tasks" / ctx.task_id
    specs = (
        # pnpm up to 10 reads npm_config_*, pnpm 11 and later only pnpm_config_*: both, or a
        # project on a newer pnpm would put its store inside the worktree (no cache, no links).
        (
            "pnpm-store",
            (("npm_config_store_dir", "pnpm-store"), ("pnpm_config_store_dir", "pnpm-store")),
        ),
        ("npm-cache", (("npm_config_cache", "npm-cache"),)),
    )
    mounts = []
    for name, envs in specs:
        host = base / name
        if create:
            host.mkdir(parents=True, exist_ok=True)
        inside = f"{CACHE_ROOT_IN_SANDBOX}/{name}"
        mounts.append(
            CacheMount(
                name, str(host), inside, tuple((k, f"{CACHE_ROOT_IN_SANDBOX}/{v}") for k, v in envs)
            )
        )
    return tuple(mounts)


def resolve_ca(setting: str, host_ca: str | None) -> str | None:
    if setting == "off":
        return None
    if setting == "auto":
        return host_ca
    if not Path(setting).is_file():
        raise BundleError(
            f"host CA bundle '{setting}' does not exist",
            "settings sandbox.hostCa names a missing file",
            "point hostCa at a PEM bundle, or set it to auto or off",
        )
    return setting


def resolve_layout(
    ctx: PrepareContext,
    *,
    cache_root: Path,
    ca_bundle: str | None,
    create: bool = True,
    ca_complete: bool = False,
) -> TaskLayout:
    """Read the task's host paths. ``create=False`` (dry runs) creates nothing on the host."""
    worktree = Path(ctx.worktree_path)
    if not worktree.is_dir():
        raise BundleError(
            f"worktree {worktree} is not a directory",
            "it does not exist or is not a directory",
            "create the worktree first (git worktree add) or pass --worktree DIR",
        )
    git = inspect_git(worktree)
    if git is not None and create:
        # hooks/ and config.worktree are mounted read-only; they must exist to be mount points.
        (Path(git.common_dir) / "hooks").mkdir(exist_ok=True)
        if git.worktree_config:
            Path(git.worktree_config).touch(exist_ok=True)
    project = task_project(ctx)
    if create:
        ensure_project_dir(project)
    resolved = str(worktree.resolve())
    writable = [resolved, *ctx.policy.writable_paths]
    # The project's own .fusion/ is protected wherever it lies inside something writable
    # (a main worktree, a project below the worktree), whatever protectedPaths says.
    project = project.resolve()
    extra = [str(project / ".fusion")]
    protected, unprotected = resolve_protected(
        resolved, ctx.policy.protected_paths, writable, extra
    )
    return TaskLayout(
        worktree=resolved,
        git=git,
        caches=_cache_dirs(ctx, cache_root, create),
        ca_bundle=ca_bundle,
        ca_complete=ca_bundle is not None and ca_complete,
        protected=protected,
        unprotected=unprotected,
        project=str(project),
        # Per project, in isolated mode too: a blob's bytes never change (so sharing one gives
        # no task a way into another), and tasks of other projects cannot even learn, by a
        # link count, that some worktree holds the same file.
        blobs=(
            None
            if ctx.cache_mode is CacheMode.OFF
            else str(project_cache(ctx, cache_root) / "store-blobs")
        ),
    )
