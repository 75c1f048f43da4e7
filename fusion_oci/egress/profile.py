"""The built-in git/npm egress profile: exactly the hosts a task's package manager and git
need, each with where it came from.

- npm's registry as ``npm config get registry`` answers it (run on the host outside the
  worktree, with the caller's environment: the user's and global ``.npmrc``, ``npm_config_*``);
- every ``registry=`` and ``@scope:registry=`` of the worktree's ``.npmrc``, the user's
  (``$NPM_CONFIG_USERCONFIG`` or ``~/.npmrc``) and pnpm's own rc
  (``$XDG_CONFIG_HOME/pnpm/rc``);
- yarn's ``npmRegistryServer`` and ``npmScopes.*.npmRegistryServer`` of the worktree's and
  the user's ``.yarnrc.yml`` (and yarn's default registry when the worktree has a
  ``yarn.lock`` and names none);
- the worktree's git remotes (``git remote -v``): https / http, ``ssh://`` and scp-like
  ``git@host:path``, ``git://``.

Nothing else. Each host is pinned to the port its URL uses (443 for https, 22 for ssh). What
the worktree's own files name is allowed only as :mod:`fusion_oci.egress.pin` pinned it: a
command writes those files.
The parsers are pure; :func:`resolve_profile` is the one step that reads files and runs
``npm`` and ``git`` (each with a short timeout).
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from fusion_oci.host.process import run_process

PROBE_TIMEOUT_S = 5.0
DEFAULT_PORTS = {"https": 443, "http": 80, "ssh": 22, "git": 9418, "git+ssh": 22, "ssh+git": 22}
NPM_DEFAULT = "https://registry.npmjs.org/"
YARN_DEFAULT = "https://registry.yarnpkg.com/"

_SCP_LIKE = re.compile(r"^(?:[^@/\s]+@)?(\[[^\]]+\]|[^:/\s]+):(?!//)")


@dataclass(frozen=True)
class ProfileHost:
    """One host the profile allows: the pattern (``host:port``) and where it came from."""

    pattern: str
    source: str
    worktree: bool = False
    """Named by a file of the worktree, which commands write: allowed only as pinned
    (:mod:`fusion_oci.egress.pin`)."""


def url_host(url: str) -> str | None:
    """``host:port`` of a registry or remote URL (https, http, ssh://, git://, scp-like
    ``user@host:path``); None for a local path or something that is not a URL."""
    url = url.strip().strip("'\"")
    if not url:
        return None
    if "://" in url:
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in DEFAULT_PORTS or not parts.hostname:
            return None
        try:
            port = parts.port or DEFAULT_PORTS[scheme]
        except ValueError:
            return None
        host = parts.hostname.lower()
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    match = _SCP_LIKE.match(url)
    if match is None or url.startswith(("/", ".", "~")):
        return None
    host = match.group(1).strip("[]").lower()
    if len(host) == 1:  # C:\path on a Windows checkout
        return None
    return f"[{host}]:22" if ":" in host else f"{host}:22"


def parse_npmrc(text: str) -> list[tuple[str, str]]:
    """``(key, url)`` for each ``registry=`` / ``@scope:registry=`` line of an npmrc (ini)."""
    found: list[tuple[str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith((";", "#")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        key = key.strip()
        if key == "registry" or re.fullmatch(r"@[^:\s]+:registry", key):
            found.append((key, value.strip()))
    return found


def parse_yarnrc(text: str) -> list[tuple[str, str]]:
    """``(key, url)`` for ``npmRegistryServer`` and each ``npmScopes.S.npmRegistryServer``."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return []
    if not isinstance(data, dict):
        return []
    found: list[tuple[str, str]] = []
    if isinstance(data.get("npmRegistryServer"), str):
        found.append(("npmRegistryServer", data["npmRegistryServer"]))
    scopes = data.get("npmScopes")
    if isinstance(scopes, dict):
        for scope, conf in scopes.items():
            if isinstance(conf, dict) and isinstance(conf.get("npmRegistryServer"), str):
                found.append((f"npmScopes.{scope}.npmRegistryServer", conf["npmRegistryServer"]))
    return found


def parse_remotes(text: str) -> list[tuple[str, str]]:
    """``(remote (fetch|push), url)`` for each line of ``git remote -v``."""
    found: list[tuple[str, str]] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2:
            kind = fields[2].strip("()") if len(fields) > 2 else "fetch"
            found.append((f"{fields[0]} ({kind})", fields[1]))
    return found


RC_MAX_BYTES = 1 << 20
"""More than this of an rc file is not read: a worktree file is the command's to make."""


def _read(path: Path, *, follow: bool = True) -> str | None:
    """A regular file's text (at most RC_MAX_BYTES), or None. Never blocks on a FIFO or reads
    a device; ``follow=False`` (a worktree's file, the command's to make) takes no symlink."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return fh.read(RC_MAX_BYTES).decode("utf-8", errors="replace")


def npmrc_paths(worktree: Path, env: Mapping[str, str]) -> list[Path]:
    home = Path(env.get("HOME", "/nonexistent"))
    user = env.get("NPM_CONFIG_USERCONFIG") or env.get("npm_config_userconfig")
    xdg = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
    return [worktree / ".npmrc", Path(user) if user else home / ".npmrc", xdg / "pnpm" / "rc"]


def yarnrc_paths(worktree: Path, env: Mapping[str, str]) -> list[Path]:
    home = Path(env.get("HOME", "/nonexistent"))
    return [worktree / ".yarnrc.yml", home / ".yarnrc.yml"]


def file_hosts(worktree: Path, env: Mapping[str, str]) -> list[ProfileHost]:
    """The registries the rc files name (no process runs)."""
    hosts: list[ProfileHost] = []
    for path in npmrc_paths(worktree, env):
        inside = _inside(path, worktree)
        for key, url in parse_npmrc(_read(path, follow=not inside) or ""):
            host = url_host(url)
            if host:
                hosts.append(ProfileHost(host, f"{path} ({key})", inside))
    named_yarn = False
    for path in yarnrc_paths(worktree, env):
        inside = _inside(path, worktree)
        for key, url in parse_yarnrc(_read(path, follow=not inside) or ""):
            host = url_host(url)
            if host:
                named_yarn = named_yarn or key == "npmRegistryServer"
                hosts.append(ProfileHost(host, f"{path} ({key})", inside))
    if (worktree / "yarn.lock").exists() and not named_yarn:
        host = url_host(YARN_DEFAULT)
        assert host is not None
        hosts.append(ProfileHost(host, f"yarn's default registry ({worktree / 'yarn.lock'})", True))
    return hosts


def _inside(path: Path, worktree: Path) -> bool:
    # The user's rc paths come from the caller's environment and could name a file in the
    # worktree: what a command can write is pinned, wherever the path came from.
    parent, top = path.parent.resolve(), worktree.resolve()
    return parent == top or top in parent.parents


async def _probe(argv: list[str], cwd: Path, env: Mapping[str, str]) -> str | None:
    try:
        outcome = await run_process(
            argv, cwd=str(cwd), env=env, timeout_s=PROBE_TIMEOUT_S, max_buffer=1 << 20, grace_s=0.5
        )
    except OSError:
        return None
    if outcome.returncode != 0 or outcome.timed_out:
        return None
    return outcome.stdout.decode("utf-8", errors="replace")


async def npm_registry_host(worktree: Path, env: Mapping[str, str]) -> ProfileHost:
    """npm's registry for this user; npm's default when npm cannot say. Run outside the
    worktree, so that npm reads the user's and the global config, not the worktree's
    ``.npmrc`` (which :func:`file_hosts` reads, for the pin)."""
    out = await _probe(["npm", "config", "get", "registry"], Path("/"), env)
    host = url_host(out.strip()) if out else None
    if host:
        return ProfileHost(host, "npm config get registry")
    default = url_host(NPM_DEFAULT)
    assert default is not None
    return ProfileHost(default, "npm's default registry (npm config get registry gave none)")


async def git_remote_hosts(worktree: Path, env: Mapping[str, str]) -> list[ProfileHost]:
    out = await _probe(["git", "-C", str(worktree), "remote", "-v"], worktree, env)
    hosts: list[ProfileHost] = []
    for name, url in parse_remotes(out or ""):
        host = url_host(url)
        if host:
            hosts.append(ProfileHost(host, f"git remote {name}"))
    return hosts


def merge(hosts: Iterable[ProfileHost]) -> list[ProfileHost]:
    """One entry per pattern, the first source kept (the others after it, '; ')."""
    by: dict[str, list[str]] = {}
    trusted: set[str] = set()
    for host in hosts:
        sources = by.setdefault(host.pattern, [])
        if host.source not in sources:
            sources.append(host.source)
        if not host.worktree:
            trusted.add(host.pattern)
    return [
        ProfileHost(pattern, "; ".join(sources), pattern not in trusted)
        for pattern, sources in by.items()
    ]


async def resolve_profile(worktree: Path, env: Mapping[str, str]) -> list[ProfileHost]:
    """The profile's hosts for a task (runs npm and git once each, short timeouts)."""
    # npm (a node start-up) and git run at once: this is on the prepare path.
    npm, remotes = await asyncio.gather(
        npm_registry_host(worktree, env), git_remote_hosts(worktree, env)
    )
    return merge([npm, *file_hosts(worktree, env), *remotes])
