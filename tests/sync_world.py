"""Two real repositories joined by the worktree transfer over a subprocess's pipes.

``host`` is the executor's worktree (a repository on the task branch ``task``), ``remote``
the sandbox's copy, served by the real remote script (``fusion_oci/runtimes/kubernetes/sync/
remote.py``) under Debian's python3, as in the task image. With ``hostile=True`` the remote
is ``tests/security/sync_hostile_remote.py``: the real script, except that a pull answers
whatever the test put in ``ctl/`` (a crafted reply and pack, or raw bytes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest_asyncio

from fusion_oci.runtimes.kubernetes.sync import (
    ProcessStream,
    SyncSettings,
    WorktreeSync,
    remote_argv,
)
from fusion_oci.runtimes.kubernetes.sync.stream import local_python

HOSTILE = Path(__file__).parent / "security" / "sync_hostile_remote.py"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def git(cwd: Path, *args: str, stdin: bytes | None = None) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, env=GIT_ENV, input=stdin, capture_output=True, check=False
    )
    assert done.returncode == 0, (args, done.stderr.decode(errors="replace"))
    return done.stdout.decode(errors="surrogateescape")


def sh(cwd: Path, script: str) -> None:
    """A command "run in the sandbox": a shell script in the remote worktree."""
    subprocess.run(["/bin/sh", "-ec", script], cwd=cwd, env=GIT_ENV, check=True)


@dataclass
class World:
    tmp: Path
    host: Path
    remote: Path
    ctl: Path
    sync: WorktreeSync

    def git_host(self, *args: str) -> str:
        return git(self.host, *args)

    def git_remote(self, *args: str, stdin: bytes | None = None) -> str:
        return git(self.remote, *args, stdin=stdin)

    def reply(self, meta: dict[str, Any], pack: bytes = b"") -> None:
        """The hostile remote's answer to the next pull."""
        (self.ctl / "reply.pack").write_bytes(pack)
        (self.ctl / "reply.json").write_text(json.dumps(meta))

    def raw_reply(self, data: bytes) -> None:
        """Bytes the hostile remote writes instead of a frame at the next pull."""
        (self.ctl / "raw").write_bytes(data)

    def pack(self, *revs: str) -> bytes:
        """A pack of the remote's objects named by ``revs`` (rev-list syntax, ``^`` too)."""
        return subprocess.run(
            ["git", "pack-objects", "--revs", "--thin", "--stdout", "-q"],
            cwd=self.remote,
            input="".join(f"{r}\n" for r in revs).encode(),
            capture_output=True,
            check=True,
        ).stdout

    def mktree(self, entries: list[tuple[str, str, str, bytes]]) -> str:
        """A tree object written as is (no check of names or modes, as a hostile git would):
        (mode, type, oid, name) entries, in the order given."""
        body = b"".join(
            mode.encode() + b" " + name + b"\0" + bytes.fromhex(oid)
            for mode, _kind, oid, name in entries
        )
        return self.git_remote(
            "hash-object", "-t", "tree", "-w", "--literally", "--stdin", stdin=body
        ).strip()

    def blob(self, data: bytes) -> str:
        return self.git_remote("hash-object", "-w", "--stdin", stdin=data).strip()


def make_host(host: Path) -> None:
    host.mkdir(parents=True)
    git(host, "init", "-q", "-b", "task")
    (host / "README.md").write_text("hello\n")
    (host / ".gitignore").write_text("node_modules/\ndist/\n")
    (host / "src").mkdir()
    (host / "src" / "a.ts").write_text("export const a = 1;\n")
    (host / "run.sh").write_text("#!/bin/sh\necho run\n")
    (host / "run.sh").chmod(0o755)
    git(host, "add", "-A")
    git(host, "commit", "-qm", "init")


async def open_world(
    tmp: Path, settings: SyncSettings | None = None, hostile: bool = False
) -> World:
    host, remote, ctl = tmp / "host", tmp / "remote", tmp / "ctl"
    make_host(host)
    ctl.mkdir()
    if hostile:
        argv = [local_python(), "-S", "-E", str(HOSTILE), str(remote), str(ctl)]
    else:
        argv = remote_argv(str(remote), python=local_python())
    env = {"PATH": GIT_ENV["PATH"], "HOME": "/nonexistent", "PYTHONPATH": str(Path.cwd())}
    stream = await ProcessStream.start(argv, env={**env, **GIT_ENV})
    sync = WorktreeSync(host, stream, tmp / "state", settings, env=GIT_ENV)
    await sync.open()
    return World(tmp, host, remote, ctl, sync)


@pytest_asyncio.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = await open_world(tmp_path)
    try:
        yield w
    finally:
        await w.sync.close()


@pytest_asyncio.fixture
async def hostile(tmp_path: Path) -> AsyncIterator[World]:
    w = await open_world(tmp_path, hostile=True)
    try:
        yield w
    finally:
        await w.sync.close()


__all__ = ["World", "git", "hostile", "make_host", "open_world", "sh", "sys", "world"]
