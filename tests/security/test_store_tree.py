"""Poisoning through placed trees (fusion_oci/store/tree.py, docs/security.md "the poisoning
model"): a task's packages placed at prepare from what an earlier task installed.

- ``store-tree-placement``: task b gets task a's package placed before its first command, and
  tries every way to change its bytes (the attack of test_store_poisoning); task a's file and
  a third task's placed copy must be untouched.
- ``tree-poisoning-isolated``: with ``cacheMode: isolated`` nothing another task installed is
  placed, whatever it installed (closed).
- ``tree-poisoning-shared``: with ``cacheMode: shared`` the first task's bytes are what the
  next task of the lockfile gets, as the shared pnpm store's are (leaks by design, like
  ``cache-poisoning-shared``: the mode trades isolation for speed).

The install is shell-made (what pnpm leaves: a package folder with its manifest, a
``.modules.yaml``), so the probe needs no network and runs on every backend.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from fusion_oci.models import CacheMode
from tests.security.conftest import REMOTE, Prober, record
from tests.security.test_store_poisoning import ATTACK, INSTALLED

LOCKFILE = "lockfileVersion: '9.0'\n# store-tree probe\n"


def _worktree(prober: Prober, task: str) -> Path:
    from tests.conftest import git_init

    wt = git_init(prober.tmp / f"wt-{task}")
    (wt / "pnpm-lock.yaml").write_text(LOCKFILE)
    return wt


def _install(prober: Prober, project: Path, task: str, data: str, mode: CacheMode) -> Path:
    wt = _worktree(prober, task)
    folder = INSTALLED.rsplit("/", 1)[0]
    made = prober.run(
        f"mkdir -p {folder} && printf '%s' '{{\"name\":\"victim\"}}' > {folder}/package.json && "
        f"printf '%s' '{data}' > {INSTALLED} && "
        "echo 'layoutVersion: 5' > node_modules/.modules.yaml",
        worktree=wt,
        cache_mode=mode,
        project_dir=project,
        task_id=task,
    )
    assert made.exit_code == 0, made.stderr
    return wt


def _first_look(prober: Prober, project: Path, task: str, mode: CacheMode) -> tuple[Path, str]:
    """A new task on the same lockfile: what its first command finds at the installed path."""
    wt = _worktree(prober, task)
    seen = prober.run(
        f"cat {INSTALLED} 2>/dev/null || echo ABSENT",
        worktree=wt,
        cache_mode=mode,
        project_dir=project,
        task_id=task,
    )
    assert seen.exit_code == 0, seen.stderr
    return wt, seen.stdout.strip()


def test_a_placed_file_cannot_be_changed_for_the_next_task(prober: Prober) -> None:
    good = "GOOD-" + secrets.token_hex(8)
    project = prober.tmp / "project-tree"
    project.mkdir()
    wt_a = _install(prober, project, "tree-a", good, CacheMode.SHARED)
    wt_b, seen_b = _first_look(prober, project, "tree-b", CacheMode.SHARED)
    if seen_b == "ABSENT":
        # No trees where no links are made (native): each task installs its own copies.
        assert prober.backend == "native" or prober.backend in REMOTE, (
            f"nothing placed on {prober.backend}"
        )
        assert not (wt_b / "node_modules").exists()
        record("store-tree-placement", prober.backend, "copies")
        return
    assert seen_b == good
    placed = wt_b / INSTALLED
    assert placed.stat().st_uid == prober.store_owner and placed.samefile(wt_a / INSTALLED)
    attack = prober.run(
        ATTACK,
        worktree=wt_b,
        cache_mode=CacheMode.SHARED,
        project_dir=project,
        task_id="tree-b",
    )
    _, seen_c = _first_look(prober, project, "tree-c", CacheMode.SHARED)
    leaked = seen_c != good or (wt_a / INSTALLED).read_text() != good
    record("store-tree-placement", prober.backend, "leaks" if leaked else "blocked")
    assert not leaked, f"task b changed what task c was placed on {prober.backend}: {attack}"


def test_with_isolated_caches_nothing_another_task_installed_is_placed(prober: Prober) -> None:
    project = prober.tmp / "project-isolated"
    project.mkdir()
    _install(prober, project, "iso-a", "EVIL-" + secrets.token_hex(4), CacheMode.ISOLATED)
    wt_b, seen_b = _first_look(prober, project, "iso-b", CacheMode.ISOLATED)
    leaked = seen_b != "ABSENT" or (wt_b / "node_modules").exists()
    record("tree-poisoning-isolated", prober.backend, "leaks" if leaked else "blocked")
    assert not leaked, f"task b was placed task a's install on {prober.backend}: {seen_b}"


def test_with_shared_caches_the_first_install_is_what_the_next_task_gets(
    prober: Prober,
) -> None:
    """Leaks by design (docs/security.md): the tree is as trusted as the shared pnpm store
    it stands for, which any task of the project can already write."""
    planted = "PLANTED-" + secrets.token_hex(4)
    project = prober.tmp / "project-shared"
    project.mkdir()
    _install(prober, project, "shared-a", planted, CacheMode.SHARED)
    _, seen_b = _first_look(prober, project, "shared-b", CacheMode.SHARED)
    assert seen_b in (planted, "ABSENT"), seen_b
    record("tree-poisoning-shared", prober.backend, "leaks" if seen_b == planted else "copies")
