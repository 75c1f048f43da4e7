"""The built-in git/npm profile: parsers (pure) and the resolved hosts with their sources."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from fusion_oci.egress.profile import (
    ProfileHost,
    file_hosts,
    merge,
    parse_npmrc,
    parse_remotes,
    parse_yarnrc,
    resolve_profile,
    url_host,
)


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("https://registry.npmjs.org/", "registry.npmjs.org:443"),
        ("https://npm.pkg.github.com", "npm.pkg.github.com:443"),
        ("http://verdaccio.internal:4873/", "verdaccio.internal:4873"),
        ("https://user:tok@GitLab.example.com/group/repo.git", "gitlab.example.com:443"),
        ("git@github.com:org/repo.git", "github.com:22"),
        ("github.com:org/repo.git", "github.com:22"),
        ("ssh://git@git.example.com:2222/org/repo.git", "git.example.com:2222"),
        ("ssh://git.example.com/org/repo.git", "git.example.com:22"),
        ("git+ssh://git@github.com/org/repo.git", "github.com:22"),
        ("git://git.kernel.org/pub/scm/git/git.git", "git.kernel.org:9418"),
        ("https://[2001:db8::1]:8443/r.git", "[2001:db8::1]:8443"),
        ("'https://quoted.example.com/'", "quoted.example.com:443"),
    ],
)
def test_url_host(url: str, host: str) -> None:
    assert url_host(url) == host


@pytest.mark.parametrize(
    "url",
    [
        "/srv/git/repo.git",
        "./repo",
        "../repo.git",
        "~/repo",
        "file:///srv/repo.git",
        "C:\\repo",
        "",
        "not a url",
    ],
)
def test_url_host_ignores_local_paths(url: str) -> None:
    assert url_host(url) is None


def test_parse_npmrc() -> None:
    text = """
; comment
# comment
registry=https://registry.example.com/
@acme:registry = https://npm.acme.test/
//npm.acme.test/:_authToken=${TOKEN}
strict-ssl=true
"""
    assert parse_npmrc(text) == [
        ("registry", "https://registry.example.com/"),
        ("@acme:registry", "https://npm.acme.test/"),
    ]


def test_parse_yarnrc() -> None:
    text = """
npmRegistryServer: "https://yarn.example.com"
npmScopes:
  acme:
    npmRegistryServer: https://npm.acme.test
  other:
    npmAlwaysAuth: true
"""
    assert parse_yarnrc(text) == [
        ("npmRegistryServer", "https://yarn.example.com"),
        ("npmScopes.acme.npmRegistryServer", "https://npm.acme.test"),
    ]
    assert parse_yarnrc(": : not yaml [") == []
    assert parse_yarnrc("- a list") == []


def test_parse_remotes() -> None:
    text = (
        "origin\tgit@github.com:org/repo.git (fetch)\n"
        "origin\thttps://github.com/org/repo.git (push)\n"
    )
    assert parse_remotes(text) == [
        ("origin (fetch)", "git@github.com:org/repo.git"),
        ("origin (push)", "https://github.com/org/repo.git"),
    ]


def test_merge_keeps_every_source() -> None:
    merged = merge(
        [
            ProfileHost("a:443", "one"),
            ProfileHost("b:443", "two"),
            ProfileHost("a:443", "three"),
            ProfileHost("a:443", "one"),
        ]
    )
    assert merged == [ProfileHost("a:443", "one; three"), ProfileHost("b:443", "two")]


def test_file_hosts_reads_worktree_user_pnpm_and_yarn_settings(tmp_path: Path) -> None:
    wt, home = tmp_path / "wt", tmp_path / "home"
    (home / ".config" / "pnpm").mkdir(parents=True)
    wt.mkdir()
    (wt / ".npmrc").write_text("@acme:registry=https://npm.acme.test/\n")
    (home / ".npmrc").write_text("registry=https://mirror.example.com/npm/\n")
    (home / ".config" / "pnpm" / "rc").write_text("@pn:registry=https://pnpm.example.com\n")
    (wt / ".yarnrc.yml").write_text("npmScopes:\n  y:\n    npmRegistryServer: https://y.test\n")
    (wt / "yarn.lock").write_text("")
    hosts = file_hosts(wt, {"HOME": str(home)})
    assert [(h.pattern, h.source) for h in hosts] == [
        ("npm.acme.test:443", f"{wt / '.npmrc'} (@acme:registry)"),
        ("mirror.example.com:443", f"{home / '.npmrc'} (registry)"),
        ("pnpm.example.com:443", f"{home / '.config' / 'pnpm' / 'rc'} (@pn:registry)"),
        ("y.test:443", f"{wt / '.yarnrc.yml'} (npmScopes.y.npmRegistryServer)"),
        ("registry.yarnpkg.com:443", f"yarn's default registry ({wt / 'yarn.lock'})"),
    ]


def test_file_hosts_userconfig_env_and_nothing_without_files(tmp_path: Path) -> None:
    rc = tmp_path / "custom-npmrc"
    rc.write_text("registry=https://custom.example.com\n")
    hosts = file_hosts(tmp_path, {"HOME": str(tmp_path / "none"), "NPM_CONFIG_USERCONFIG": str(rc)})
    assert [h.pattern for h in hosts] == ["custom.example.com:443"]
    assert file_hosts(tmp_path, {"HOME": str(tmp_path / "none")}) == []


def test_resolve_profile_runs_npm_and_git(tmp_path: Path) -> None:
    """Real npm and git: the registry npm is configured with for the user (run outside the
    worktree: its .npmrc is read as a file, for the pin), the worktree's, and both remotes."""
    wt, home = tmp_path / "wt", tmp_path / "home"
    home.mkdir()
    subprocess.run(["git", "init", "-q", str(wt)], check=True)
    subprocess.run(
        ["git", "-C", str(wt), "remote", "add", "origin", "git@github.com:org/repo.git"], check=True
    )
    subprocess.run(
        ["git", "-C", str(wt), "remote", "add", "mirror", "https://git.example.com/org/repo.git"],
        check=True,
    )
    (wt / ".npmrc").write_text("registry=https://registry.example.test/\n")
    import os

    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    found = asyncio.run(resolve_profile(wt, env))
    hosts = {h.pattern: h.source for h in found}
    assert hosts == {
        "registry.npmjs.org:443": "npm config get registry",
        "registry.example.test:443": f"{wt / '.npmrc'} (registry)",
        "github.com:22": "git remote origin (fetch); git remote origin (push)",
        "git.example.com:443": "git remote mirror (fetch); git remote mirror (push)",
    }
    assert [h.pattern for h in found if h.worktree] == ["registry.example.test:443"]


async def test_resolve_profile_defaults_to_npmjs(tmp_path: Path) -> None:
    import os

    (tmp_path / "home").mkdir()
    env = {"HOME": str(tmp_path / "home"), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    hosts = await resolve_profile(tmp_path, env)
    assert [h.pattern for h in hosts] == ["registry.npmjs.org:443"]
