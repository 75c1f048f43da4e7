"""The host's git after a command: no config or hook a command wrote runs on the host.

After each command an executor runs git in the worktree on the host (``git status``,
``git submodule update``). Git enters every populated submodule there and runs its config
(``core.fsmonitor`` is a program) and hooks. The top repository's ``.git/config`` and hooks are
protected paths (test_probes.py, git-hooks-write); these probes go one level down, on every
backend: a repository the command makes and stages (``git init x && git add x``), and an
existing submodule whose git dir the command rewrites. The host's git runs as the worktree's
owner; a marker file outside the worktree says whether a command's program ran.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import git
from tests.security.conftest import Prober
from tests.security.test_probes import check


def _host_git(prober: Prober, *args: str) -> None:
    """git in the worktree on the host, as its owner would run it."""
    uid = prober.rootless.uid if prober.rootless is not None else None
    gid = prober.rootless.gid if prober.rootless is not None else None
    subprocess.run(
        ["git", "-C", str(prober.worktree), *args],
        env={"PATH": "/usr/bin:/bin", "HOME": str(prober.home), "LANG": "C.UTF-8"},
        user=uid,
        group=gid,
        capture_output=True,
        timeout=60,
        check=False,
    )


def _marker_dir(prober: Prober) -> Path:
    folder = prober.tmp / "markers"
    folder.mkdir(exist_ok=True)
    folder.chmod(0o777)  # the program runs as the worktree's owner (a rootless user too)
    return folder


def test_a_repository_made_inside_runs_nothing_on_the_host(prober: Prober) -> None:
    marker = _marker_dir(prober) / "nested"
    command = (
        "git init -q nested && "
        "git -C nested -c user.email=a@b.c -c user.name=a commit -q --allow-empty -m n; "
        f"git -C nested config core.fsmonitor 'touch {marker}; false' && "
        f"mkdir -p nested/.git/hooks && printf '#!/bin/sh\\ntouch {marker}\\n' > "
        "nested/.git/hooks/post-checkout && chmod +x nested/.git/hooks/post-checkout && "
        "git add nested 2>/dev/null; git ls-files -s nested"
    )
    result = prober.run(command)
    assert "160000" in result.stdout, result.stderr[-500:]
    _host_git(prober, "status")
    _host_git(prober, "diff", "HEAD")
    check("git-nested-repo", prober.backend, marker.exists(), result.stderr[-400:])


def test_a_submodules_git_dir_rewritten_inside_runs_nothing_on_the_host(prober: Prober) -> None:
    marker = _marker_dir(prober) / "submodule"
    lib = prober.tmp / "lib"
    git(prober.tmp, "init", "-q", str(lib))
    git(lib, "commit", "-q", "--allow-empty", "-m", "l")
    git(prober.worktree, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib))
    git(prober.worktree, "commit", "-qm", "sub")
    # (the rootless prober hands the tree to its user before the run)
    command = (
        f"git config -f .git/modules/lib/config core.fsmonitor 'touch {marker}; false'; "
        f"printf '#!/bin/sh\\ntouch {marker}\\n' > .git/modules/lib/hooks/post-checkout; "
        "chmod +x .git/modules/lib/hooks/post-checkout; echo rewrote"
    )
    result = prober.run(command)
    _host_git(prober, "status")
    _host_git(prober, "-c", "protocol.file.allow=always", "submodule", "update", "--checkout")
    check("git-submodule-rewrite", prober.backend, marker.exists(), result.stderr[-400:])
