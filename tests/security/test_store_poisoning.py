"""Poisoning through shared store links (fusion_oci/store/linking.py, docs/security.md "the
poisoning model"): task a tries every way to change the bytes of an installed file it shares
with task b, then task b checks its own copy.

The install is made by shell (what pnpm leaves: files under ``node_modules/.pnpm`` and a
``.modules.yaml``), so the probe needs no network and runs on every backend, gVisor too. A
control case shows the attack is real: the same commands against a link to an inode the task
owns (what pnpm's own links would be, were they possible) do change task b's file.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from fusion_oci.models import CacheMode
from tests.conftest import git_init
from tests.security.conftest import REMOTE, Prober, RootlessUser, record

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


def _poisoning(prober: Prober, tag: str = "") -> tuple[Path, Path]:
    """Task a attacks a file it shares with task b (both installed the same bytes); returns
    both files (host paths) once task b looked at its own. ``tag``: after the probe's name
    in the matrix."""
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
        # the store owner's (nobody as root, a subordinate uid of the caller's rootless)
        # and read-only, and nothing task a did reached task b's bytes.
        assert int(links_a) > 1, f"link count inside {prober.backend}: {links_a}"
        assert b.stat().st_uid == prober.store_owner and b.stat().st_mode & 0o222 == 0
        record("store-link-poisoning" + tag, prober.backend, "leaks" if leaked else "blocked")
        assert not leaked, f"task a changed task b's file on {prober.backend}: {attack.stdout}"
    else:
        # No shared links here (native isolates nothing): each task keeps its own copies, so
        # there is nothing to poison through them.
        assert prober.backend == "native" or prober.backend in REMOTE, (
            f"no shared links on {prober.backend}"
        )
        record("store-link-poisoning" + tag, prober.backend, "copies")
        assert not leaked
    return a, b


def test_a_task_cannot_change_a_file_another_task_got_from_the_store(prober: Prober) -> None:
    _poisoning(prober)


ESCAPE = " ; ".join(
    [
        "f=" + INSTALLED,
        "me=$(id -u)",
        "grep -E '^(NoNewPrivs|CapEff)' /proc/self/status",
        # The setuid helper, on a namespace of the task's own that waits to be mapped: with
        # no_new_privs it runs as the task, which may map nothing but its own uid.
        "if command -v newuidmap >/dev/null; then "
        "(unshare -U sleep 5 & c=$!; sleep 0.5; "
        "newuidmap $c 0 $me 1 1 $SUB 1 && echo MAPPED-BY-HELPER; "
        "cat /proc/$c/uid_map; kill $c) ; else echo NO-NEWUIDMAP; fi",
        # By hand: a namespace of its own, the subordinate uid written into its map.
        "unshare -U sh -c \"echo '0 $SUB 1' > /proc/self/uid_map && echo MAPPED-BY-HAND; "
        'chmod u+w $f; echo EVIL >> $f"',
        # Root of a namespace that maps only its own uid: every attack from there.
        'unshare -U -r sh -c "id -u; chmod u+w $f; echo EVIL >> $f; truncate -s 0 $f; '
        'ln $f again2 && echo EVIL >> again2"',
        "find $f -printf 'links=%n uid=%U mode=%m'",
    ]
)
"""The task tries to become capable over the blobs' subordinate uid by itself."""


def test_a_task_cannot_become_capable_over_the_store_owner(prober: Prober, tag: str = "") -> None:
    """``subuid-escape``: the blobs' owner is a uid of the caller's own subordinate range
    where fusion-oci runs unprivileged (fusion_oci/store/namespace.py), which the setuid
    ``newuidmap`` maps for the caller. A task must not get that: it runs with no_new_privs and
    no capabilities, so the helper, or a user namespace of its own, maps it nothing but its
    own uid."""
    a, b = _poisoning(prober, tag)
    if prober.backend == "native" or prober.backend in REMOTE:
        record("subuid-escape" + tag, prober.backend, "copies")
        return
    good = b.read_text()
    project = prober.tmp / "project"
    wt_a = a.parents[len(INSTALLED.split("/")) - 1]
    prober.env["SUB"] = str(prober.store_owner)
    try:
        out = prober.run(
            ESCAPE,
            worktree=wt_a,
            cache_mode=CacheMode.SHARED,
            project_dir=project,
            task_id="store-a",
        )
    finally:
        del prober.env["SUB"]
    text = out.stdout + out.stderr
    status = dict(
        line.split(":\t", 1)
        for line in out.stdout.splitlines()
        if line.startswith(("NoNew", "CapEff"))
    )
    leaked = (
        "MAPPED-BY" in out.stdout
        or b.read_text() != good
        or b.stat().st_mode & 0o222 != 0
        or b.stat().st_uid != prober.store_owner
    )
    record("subuid-escape" + tag, prober.backend, "leaks" if leaked else "blocked")
    assert not leaked, f"the task mapped the store owner on {prober.backend}: {text}"
    # gVisor's /proc/self/status (this release) has no NoNewPrivs line: there the probe's
    # own refusals above are the proof.
    assert status.get("NoNewPrivs", "1" if prober.backend == "oci-runsc" else "") == "1", text
    assert int(status.get("CapEff", "1"), 16) == 0, text


@pytest.mark.parametrize("name", ["bubblewrap", "landlock"])
def test_an_unprivileged_caller_shares_blobs_no_task_can_change(
    name: str, rootless_user: RootlessUser
) -> None:
    """bubblewrap and landlock run by the unprivileged user (the rootless engines are
    backends of their own): the store namespace's blobs, and both probes above."""
    from tests.backends import require_runtime

    require_runtime(name)
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-probe-"))
    base.chmod(0o755)
    try:
        home, wt = base / "home", base / "wt"
        (home / ".ssh").mkdir(parents=True)
        git_init(wt)
        env = {
            "HOME": str(home),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
        }
        prober = Prober(name, base, wt, home, env, rootless_user)
        test_a_task_cannot_become_capable_over_the_store_owner(prober, "-unprivileged")
    finally:
        shutil.rmtree(base, ignore_errors=True)


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
    if prober.backend in REMOTE:
        # a pod gets the worktree's tracked and untracked files, not its ignored ones
        # (node_modules): the host's inode is not there to attack
        assert (wt_b / INSTALLED).read_text() == good
        return
    assert (wt_b / INSTALLED).read_text() != good, "the attack must change a writable inode"
