"""Which of the host repository's remotes a remote sandbox's repository gets. Pure.

On a local runtime the command sees the host's ``.git/config``, so ``git push origin`` works.
A pod's repository is the transfer's own, made by the first push: without this it has no
remote at all. What crosses is only what a push or fetch needs, only host → pod (the pull
never reads the pod's config back), and nothing that is a secret or means nothing there:

- ``remote.NAME.url``, ``.pushurl`` and ``.fetch``, for remotes reached over the network
  (``https://``, ``http://``, ``ssh://``, ``git://``, or ssh's ``user@host:path``);
- a URL's password (``https://user:TOKEN@host``) is never carried: the whole userinfo of an
  http(s) URL is dropped (the credentials tier gives the pod a sentinel, not the token);
- a remote that is a path or a ``file://`` URL is left out: the host's folders are not there;
- ``branch.TASK.remote`` and ``.merge`` of the task branch, so ``git push`` and ``git pull``
  with no arguments mean there what they mean on the host.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
_REMOTE_KEY = re.compile(rf"remote\.({_NAME})\.(url|pushurl|fetch)")
_NETWORK_SCHEMES = frozenset({"https", "http", "ssh", "git", "git+ssh", "ssh+git"})
_SCP_LIKE = re.compile(r"[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[^/].*|[A-Za-z0-9.-]+\.[A-Za-z]+:[^/].*")
MAX_VALUE = 2048
_MERGE = re.compile(r"refs/heads/[^\x00-\x20\x7f~^:?*\[\\]{1,250}")


def network_url(url: str) -> str | None:
    """``url`` as the pod may have it, or None when it is not a network remote."""
    if not url or len(url) > MAX_VALUE or any(ord(c) < 0x20 or c == "\x7f" for c in url):
        return None
    if "://" not in url:
        # scp-like ssh: `git@github.com:acme/widget.git` (git's rule: a colon before any slash)
        return url if _SCP_LIKE.fullmatch(url) else None
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _NETWORK_SCHEMES or not parts.hostname:
        return None
    if scheme in ("http", "https") and (parts.username or parts.password):
        host = parts.netloc.rsplit("@", 1)[1]
        return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    if parts.password:
        return None  # ssh://user:pass@ — not a form anyone should carry
    return url


def carried_config(pairs: Iterable[tuple[str, str]], branch: str) -> list[tuple[str, str]]:
    """The ``(key, value)`` entries of ``git config --list`` the pod's repository gets, in
    their order (``fetch`` may repeat)."""
    entries = list(pairs)
    urls: dict[str, str | None] = {}
    for key, value in entries:
        m = _REMOTE_KEY.fullmatch(key)
        if m and m.group(2) == "url":
            urls[m.group(1)] = network_url(value)
    out: list[tuple[str, str]] = []
    for key, value in entries:
        m = _REMOTE_KEY.fullmatch(key)
        if m:
            name, field = m.groups()
            if urls.get(name) is None:
                continue
            if field == "url":
                out.append((key, str(urls[name])))
            elif field == "pushurl":
                push = network_url(value)
                if push is not None:
                    out.append((key, push))
            elif len(value) <= MAX_VALUE and value.isprintable():
                out.append((key, value))
        elif _tracking(key, value, branch, urls):
            out.append((key, value))
    return out


def _tracking(key: str, value: str, branch: str, urls: dict[str, str | None]) -> bool:
    """``branch.TASK.remote`` naming a carried remote, or ``branch.TASK.merge`` a branch."""
    if key == f"branch.{branch}.remote":
        return urls.get(value) is not None
    return key == f"branch.{branch}.merge" and _MERGE.fullmatch(value) is not None
