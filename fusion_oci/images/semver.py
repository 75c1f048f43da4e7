"""The part of npm's semver that project files use to name a Node.js version. Pure.

Covers what ``.nvmrc``, ``.node-version`` and ``engines.node`` hold in practice: exact versions
(``22.11.0``, ``v22``), partial and x-ranges (``22``, ``22.x``, ``*``), comparators (``>=20``,
``<23``), caret and tilde (``^22.1``, ``~20.9``), hyphen ranges (``18 - 20``) and ``||``.
Pre-release tags are not selected (registry builds of Node.js are releases). Anything else is a
:class:`SemverError` rather than a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Version = tuple[int, int, int]
_INF = 10**9
_TOP: Version = (_INF, 0, 0)
_PART = r"(?:0|[1-9]\d*|[xX*])"
_PARTIAL = re.compile(rf"v?({_PART})(?:\.({_PART})(?:\.({_PART})(?:[-+][0-9A-Za-z.+-]*)?)?)?")
_COMPARATOR = re.compile(r"(<=|>=|<|>|=|\^|~>|~)?(\S+)")


class SemverError(ValueError):
    """A version or range that this subset of semver cannot read."""


@dataclass(frozen=True)
class Interval:
    """Versions ``lo`` (inclusive) to ``hi`` (exclusive)."""

    lo: Version
    hi: Version

    def __contains__(self, v: object) -> bool:
        return isinstance(v, tuple) and self.lo <= v < self.hi

    def overlaps(self, lo: Version, hi: Version) -> bool:
        return self.lo < hi and lo < self.hi


def parse_version(text: str) -> Version:
    """``22.11.0`` or ``v22.11.0`` → (22, 11, 0); a pre-release or partial one is an error."""
    m = re.fullmatch(r"v?(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)", text.strip())
    if not m:
        raise SemverError(f"'{text}' is not an exact version (MAJOR.MINOR.PATCH)")
    return int(m[1]), int(m[2]), int(m[3])


def is_release(text: str) -> bool:
    try:
        parse_version(text)
    except SemverError:
        return False
    return True


def _partial(text: str) -> tuple[int | None, int | None, int | None]:
    m = _PARTIAL.fullmatch(text)
    if not m:
        raise SemverError(f"'{text}' is not a version")
    parts: list[int | None] = []
    for g in m.groups():
        parts.append(None if g is None or g in "xX*" else int(g))
    # "1.x.3" means "1.x": nothing after a wildcard counts
    for i, p in enumerate(parts):
        if p is None:
            parts[i + 1 :] = [None] * (2 - i)
            break
    return parts[0], parts[1], parts[2]


def _bump(parts: tuple[int | None, int | None, int | None]) -> Version:
    """The first version after every version the partial names (``1.2`` → 1.3.0)."""
    major, minor, patch = parts
    if major is None:
        return _TOP
    if minor is None:
        return major + 1, 0, 0
    if patch is None:
        return major, minor + 1, 0
    return major, minor, patch + 1


def _floor(parts: tuple[int | None, int | None, int | None]) -> Version:
    return parts[0] or 0, parts[1] or 0, parts[2] or 0


def _comparator(op: str, text: str) -> Interval:
    parts = _partial(text)
    lo, after = _floor(parts), _bump(parts)
    major, minor, patch = parts
    if op in ("", "="):
        return Interval(lo, after)
    if op == ">=":
        return Interval(lo, _TOP)
    if op == ">":
        return Interval(after, _TOP)
    if op == "<":
        return Interval((0, 0, 0), lo if major is not None else (0, 0, 0))
    if op == "<=":
        return Interval((0, 0, 0), after)
    if op in ("~", "~>"):
        hi = (lo[0] + 1, 0, 0) if minor is None else (lo[0], lo[1] + 1, 0)
        return Interval(lo, hi if major is not None else _TOP)
    # caret: the leftmost non-zero part may not change
    if major is None:
        return Interval(lo, _TOP)
    if major > 0 or minor is None:
        return Interval(lo, (major + 1, 0, 0))
    if minor > 0 or patch is None:
        return Interval(lo, (0, minor + 1, 0))
    return Interval(lo, (0, 0, patch + 1))


def _set(text: str) -> Interval:
    """One comparator set (space-separated, all must hold) → its interval."""
    text = text.strip()
    hyphen = re.fullmatch(r"(\S+)\s+-\s+(\S+)", text)
    if hyphen:
        return Interval(_floor(_partial(hyphen[1])), _bump(_partial(hyphen[2])))
    text = re.sub(r"(<=|>=|<|>|=|\^|~>|~)\s+", r"\1", text)
    lo, hi = (0, 0, 0), _TOP
    for token in (text or "*").split():
        m = _COMPARATOR.fullmatch(token)
        if m is None:
            raise SemverError(f"'{token}' is not a comparator")
        piece = _comparator(m[1] or "", m[2])
        lo, hi = max(lo, piece.lo), min(hi, piece.hi)
    return Interval(lo, hi)


def parse_range(text: str) -> tuple[Interval, ...]:
    """A range (``>=20 <23 || ^24``) → the intervals it allows (empty ones dropped)."""
    if not text.strip():
        raise SemverError("the range is empty")
    out = tuple(i for i in (_set(part) for part in text.split("||")) if i.lo < i.hi)
    if not out:
        raise SemverError(f"'{text}' allows no version")
    return out


def satisfies(version: Version, intervals: tuple[Interval, ...]) -> bool:
    return any(version in i for i in intervals)


def majors(intervals: tuple[Interval, ...], up_to: int) -> list[int]:
    """The majors (0..``up_to``) that hold at least one version of the range, ascending."""
    return [
        m for m in range(up_to + 1) if any(i.overlaps((m, 0, 0), (m + 1, 0, 0)) for i in intervals)
    ]


def newest(candidates: list[str], intervals: tuple[Interval, ...]) -> str | None:
    """The highest release in ``candidates`` that the range allows."""
    best: tuple[Version, str] | None = None
    for text in candidates:
        if not is_release(text):
            continue
        v = parse_version(text)
        if satisfies(v, intervals) and (best is None or v > best[0]):
            best = (v, text)
    return best[1] if best else None
