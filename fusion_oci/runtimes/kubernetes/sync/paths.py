"""What a path, a mode and a ref name from the remote may be. Pure: nothing here reads the disk.

A path the remote sends ends up as a name the host writes, so every spelling that could land
somewhere else on some host is refused: absolute, ``.``/``..``/empty components, NUL, a
backslash (a separator on Windows hosts), and ``.git`` in any of the spellings that git itself
treats as ``.git`` on a case-insensitive, NTFS or HFS+ file system (``.GIT``, ``.git ``,
``.git.``, ``git~1``, ``.git::$INDEX_ALLOCATION``, ``.g\\u200cit``). Two paths that fold to the
same name are refused too: on a case-insensitive host one would be written over the other.
"""

from __future__ import annotations

import fnmatch
import unicodedata
from collections.abc import Iterable, Sequence

MAX_PATH_BYTES = 4096
MAX_COMPONENT_BYTES = 255
MAX_LINK_BYTES = 4096
FILE_MODES = frozenset({"100644", "100755", "120000"})
"""Modes a path may have on the host: a file, an executable, a symlink (kept as a symlink)."""
GITLINK = "160000"
"""A submodule's commit: quarantined, never written (see ``gitlinks`` in the plan)."""

# The code points HFS+ ignores when it compares names (git's is_hfs_dotgit list): ".g\u200cit"
# is ".git" there.
_HFS_IGNORED = frozenset(
    [0x200C, 0x200D, 0x200E, 0x200F, 0xFEFF, *range(0x202A, 0x202F), *range(0x206A, 0x2070)]
)


def fold(name: str) -> str:
    """The name a case-insensitive, normalising, HFS+-ignoring file system would compare."""
    kept = "".join(ch for ch in name if ord(ch) not in _HFS_IGNORED)
    return unicodedata.normalize("NFC", kept).casefold()


def is_dotgit(component: str) -> bool:
    """Whether some host file system would take ``component`` for ``.git``."""
    name = fold(component)
    name = name.split(":", 1)[0]  # NTFS alternate data streams: ".git::$INDEX_ALLOCATION"
    name = name.rstrip(" .")  # NTFS drops trailing spaces and dots
    return name in (".git", "git~1")


def check_path(path: str) -> str | None:
    """Why ``path`` (as git prints it, relative, ``/``-separated) may not be written; None
    when it may."""
    raw = path.encode("utf-8", "surrogateescape")
    if not raw:
        return "an empty path"
    if b"\0" in raw:
        return "a NUL byte in the path"
    if len(raw) > MAX_PATH_BYTES:
        return f"a path longer than {MAX_PATH_BYTES} bytes"
    if path.startswith("/"):
        return "an absolute path"
    if "\\" in path:
        return "a backslash in the path (a separator on Windows hosts)"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return f"a {part or 'empty'!r} component"
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT_BYTES:
            return f"a component longer than {MAX_COMPONENT_BYTES} bytes"
        if is_dotgit(part):
            return f"a component git reads as .git ({part!r})"
    return None


def check_link_target(target: bytes) -> str | None:
    """Why a symlink's target may not be written; None when it may. The target itself may
    point anywhere: the host never follows a link it writes (nor any other)."""
    if not target:
        return "an empty symlink target"
    if b"\0" in target:
        return "a NUL byte in a symlink target"
    if len(target) > MAX_LINK_BYTES:
        return f"a symlink target longer than {MAX_LINK_BYTES} bytes"
    return None


def protected_by(path: str, patterns: Sequence[str]) -> str | None:
    """The protectedPaths pattern (relative to the worktree) that covers ``path`` or one of
    its parents, compared folded (a case-insensitive host reads ``.VSCODE`` as ``.vscode``);
    None when none does."""
    parts = path.split("/")
    prefixes = [fold("/".join(parts[: i + 1])) for i in range(len(parts))]
    for pattern in patterns:
        text = fold(pattern.strip("/"))
        if text and any(fnmatch.fnmatchcase(prefix, text) for prefix in prefixes):
            return pattern
    return None


def relative_patterns(worktree: str, patterns: Iterable[str]) -> tuple[str, ...]:
    """protectedPaths entries as patterns relative to the worktree: relative ones as they
    are, absolute ones inside the worktree made relative, the others dropped (nothing from
    the remote lands outside the worktree anyway)."""
    root = worktree.rstrip("/") + "/"
    out = []
    for pattern in patterns:
        if pattern.startswith("/"):
            if pattern.startswith(root):
                out.append(pattern[len(root) :])
        else:
            out.append(pattern)
    return tuple(p for p in out if p.strip("/"))


def collisions(paths: Iterable[str]) -> dict[str, str]:
    """Each path whose folded spelling another, different path also has -> that other one."""
    seen: dict[str, str] = {}
    clash: dict[str, str] = {}
    for path in paths:
        key = fold(path)
        other = seen.setdefault(key, path)
        if other != path:
            clash[path] = other
            clash.setdefault(other, path)
    return clash


_REF_FORBIDDEN = frozenset(" ~^:?*[\\\x7f")


def check_branch(name: str) -> str | None:
    """Why ``name`` may not be the task branch (git's check-ref-format rules, and never
    something a git command line could read as an option); None when it may."""
    if not name or name.startswith("-"):
        return "an empty name or one that starts with '-'"
    if name == "HEAD" or name.startswith("refs/"):
        return "a name that is not a branch name"
    if any(ord(ch) < 0x20 or ch in _REF_FORBIDDEN for ch in name):
        return "a control character, a space or one of ~^:?*[\\"
    if ".." in name or "@{" in name or "//" in name or name.endswith((".", "/", ".lock")):
        return "'..', '@{', '//', or a trailing '.', '/' or '.lock'"
    if any(part.startswith(".") or part.endswith(".lock") for part in name.split("/")):
        return "a component that starts with '.' or ends with '.lock'"
    return None


def is_oid(value: object, hex_len: int) -> bool:
    """Whether ``value`` is an object id of this repository's hash (lower-case hex)."""
    return (
        isinstance(value, str)
        and len(value) == hex_len
        and all(ch in "0123456789abcdef" for ch in value)
    )


__all__ = [
    "FILE_MODES",
    "GITLINK",
    "check_branch",
    "check_link_target",
    "check_path",
    "collisions",
    "fold",
    "is_dotgit",
    "is_oid",
    "protected_by",
    "relative_patterns",
]
