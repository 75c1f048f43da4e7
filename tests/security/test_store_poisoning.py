"""Poisoning through shared store links (fusion_oci/store.py, docs/security.md "the poisoning
model"): task a tries every way to change the bytes of an installed file it shares with task b,
then task b checks its own copy.

The install is made by shell (what pnpm leaves: files under ``node_modules/.pnpm`` and a
``.modules.yaml``), so the probe needs no network and runs on every backend, gVisor too. A
control case shows the attack is real: the same commands against a link to an inode the task
owns (what pnpm's own links would be, were they possible) do change task b's file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from fusion_oci.models import CacheMode
from fusion_oci.store import STORE_UID
from tests.security.conftest import Prober, record

INSTALLED = "node_modules/.pnpm/victim@1.0.0/node_modules/victim/index.js"
ATTACK = " ; ".join(
    [
        "f=" + INSTALLED,
        "chmod u+w $f",
        "echo EVIL >> $f",
        "printf EVIL > $f",
        "truncate -s 0 $f",
        "ln $f again && echo EVIL >> again",
        "python3 -c \"open('$f', 'r+b').write(b'EVIL')\" 2>/dev/null",
        "find $f -printf 'links=%n uid=%U mode=%m'",
    ]
)


def _install(prober: Prober, task: str, project: Path, good: str) -> tuple[Path, str]:
    from tests.conftest import git_init

    wt = git_init(prober.tmp / f"wt-{task}")
    folder = INSTALLED.rsplit("/", 1)[0]
    made = prober.run(
        f"mkdir -p {folder} && printf '%s' '{good}' > {INSTALLED} && "
        "echo 'layoutVersion: 5' > node_modules/.modules.yaml",
        worktree=wt,
        cache_mode=CacheMode.SHARED,
        project_dir=project,
        task_id=task,
    )
    assert made.exit_code == 0, made.stderr
    # find, not stat: coreutils stat calls statx, which this gVisor release refuses.
    seen = prober.run(
        f"find {INSTALLED} -printf %n",
        worktree=wt,
        cache_mode=CacheMode.SHARED,
        project_dir=project,
        task_id=task,
    )
    assert seen.exit_code == 0, seen.stderr
    return wt, seen.stdout.strip()


def test_a_task_cannot_change_a_file_another_task_got_from_the_store(prober: Prober) -> None:
    good = "GOOD-" + secrets.token_hex(8)
    project = prober.tmp / "project"
    project.mkdir()
    wt_a, links_a = _install(prober, "store-a", project, good)
    wt_b, _ = _install(prober, "store-b", project, good)
    a, b = wt_a / INSTALLED, wt_b / INSTALLED
    shared = a.stat().st_ino == b.stat().st_ino
    attack = prober.run(
        ATTACK, worktree=wt_a, cache_mode=CacheMode.SHARED, project_dir=project, task_id="store-a"
    )
    seen = prober.run(
        f"cat {INSTALLED}",
        worktree=wt_b,
        cache_mode=CacheMode.SHARED,
        project_dir=project,
        task_id="store-b",
    ).stdout
    leaked = seen != good or b.read_text() != good
    if shared:
        # The links are the store's: the count inside the sandbox says so, the blob is
        # nobody's and read-only, and nothing task a did reached task b's bytes.
        assert int(links_a) > 1, f"link count inside {prober.backend}: {links_a}"
        assert b.stat().st_uid == STORE_UID and b.stat().st_mode & 0o222 == 0
        record("store-link-poisoning", prober.backend, "leaks" if leaked else "blocked")
        assert not leaked, f"task a changed task b's file on {prober.backend}: {attack.stdout}"
    else:
        # No shared links here (native, or fusion-oci unprivileged: rootless engines): each
        # task keeps its own copies, so there is nothing to poison through them.
        record("store-link-poisoning", prober.backend, "copies")
        assert not leaked


def test_control_the_same_attack_on_a_task_owned_shared_inode_leaks(prober: Prober) -> None:
    """The naive design (a shared inode the task owns) is poisoned by the very same commands:
    the probe above can see a leak."""
    from tests.conftest import git_init

    good = "GOOD\n"
    wt_a, wt_b = git_init(prober.tmp / "wt-ctl-a"), git_init(prober.tmp / "wt-ctl-b")
    for wt in (wt_a, wt_b):
        (wt / INSTALLED).parent.mkdir(parents=True)
    (wt_a / INSTALLED).write_text(good)
    os.link(wt_a / INSTALLED, wt_b / INSTALLED)
    project = prober.tmp / "project-ctl"
    project.mkdir()
    prober.run(ATTACK, worktree=wt_a, task_id="ctl-a", project_dir=project)
    assert (wt_b / INSTALLED).read_text() != good, "the attack must change a writable inode"
