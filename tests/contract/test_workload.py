"""A real workload on every runtime: the contract suite's other cases run ``sh``; this one runs
what a coding agent runs, so a runtime that cannot start a thread, resolve a name or hard-link a
store file fails here, not in a user's task.

The project (tests/data/workload-project) is a small TypeScript package with real dependencies
from the npm registry at pinned versions (its pnpm-lock.yaml): vitest on its ``threads`` pool,
a test that spawns ``worker_threads`` Workers, tsc, and esbuild (Go threads) as the bundler.
Each runtime takes it through ``pnpm install``, ``pnpm test``, the type check, the build and a
``git commit`` in a linked worktree made on the host, the executor's layout; then a second task
on the same lockfile installs (over the packages the host placed, where it links), tests,
``pnpm add``-s a dependency and type-checks.

The runtimes that run as this process's user share one warm pnpm store (``cacheMode:
shared``, one cache root and project for the module), so only the first install downloads; the
rootless ones run with caches off (pnpm's own store inside the sandbox: a cold install). A
runtime that cannot run the project fails; landlock runs it under ``network: filtered`` (it
has no egress without the host's loopback; ``host`` on a kernel without Landlock's TCP rules),
as its doctor details and docs/security.md say.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.models import CacheMode, NetworkMode, RunOptions
from fusion_oci.runtimes.landlock import host_abi, workload_network
from fusion_oci.runtimes.registry import create_runtime
from tests.conftest import git
from tests.contract.harness import Runtime, sandbox

# Engine volumes bound under this session's temporary directory go at the module's end.
from tests.integration.container_cases import drop_test_cache_volumes  # noqa: F401

PROJECT = Path(__file__).resolve().parents[1] / "data" / "workload-project"
LOCAL = shutil.ignore_patterns("node_modules", "dist", ".pnpm-store")
"""What a local install in tests/data would leave there: never part of the project."""
INSTALL = RunOptions(timeout_ms=300_000)
"""A cold install downloads the project's dependencies from the registry."""
STEP = RunOptions(timeout_ms=120_000)
"""Every other step takes seconds; one that hangs (a worker that cannot start) fails soon."""
COMMIT = (
    "printf 'export const task = \"done\";\\n' > src/task.ts && git add -A && "
    "git -c user.name=t -c user.email=t@example.invalid commit -qm 'workload from the "
    "sandbox'"
)
STEPS = (
    ("install", "pnpm install --frozen-lockfile"),
    ("test", "pnpm test"),
    ("typecheck", "pnpm typecheck"),
    ("build", "pnpm build"),
    ("commit", COMMIT),
)
"""The steps in order, as an agent runs them (a step runs only when the one before passed)."""

NETWORK = {
    "landlock": workload_network(host_abi()),
    "kubernetes": NetworkMode.FILTERED,
    "plugin": NetworkMode.HOST,
}
"""Where a runtime reaches the registry other than by ``egress``: landlock (no network
namespace) through the task's proxy (``filtered``; ``host`` on a kernel without Landlock's TCP
rules), as its doctor details say; kubernetes through the task's proxy on the executor, back
through the agent's stream (its pod's NetworkPolicy denies all egress); the test plugin runs
commands natively and isolates no network."""


def linked_project(site: Path) -> tuple[Path, Path]:
    """A repository holding the project, and a linked worktree of it (``git worktree add``)."""
    repo = site / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    shutil.copytree(PROJECT, repo, dirs_exist_ok=True, ignore=LOCAL)
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "init")
    wt = site / "wt-task"
    git(repo, "worktree", "add", "-q", "-b", "task", str(wt))
    return repo, wt


@pytest.fixture(scope="module")
def warm_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache root, project dir) that the module's in-process runtimes share: one pnpm store."""
    base = tmp_path_factory.mktemp("workload-cache")
    return base / "cache", base / "project"


async def test_a_real_typescript_project_installs_tests_checks_builds_and_commits(
    runtime: Runtime, site: Path, warm_store: tuple[Path, Path]
) -> None:
    repo, wt = linked_project(site)
    cache: dict[str, Any] = {}
    if runtime.user is None:
        cache = {
            "cache_mode": CacheMode.SHARED,
            "cache_root": warm_store[0],
            "project_dir": warm_store[1],
        }
    network = NETWORK.get(runtime.name, NetworkMode.EGRESS)
    if runtime.name == "landlock":
        # The weaker policy is said where a user looks before choosing (fusion-oci doctor).
        details = create_runtime("landlock", runtime.settings, os.environ).availability().details
        assert f"network: {network}" in details["workloads"], details
    took: dict[str, float] = {}
    async with sandbox(runtime, wt, network=network, **cache) as sb:
        for name, command in STEPS:
            start = time.monotonic()
            result = await sb.run(command, INSTALL if name == "install" else STEP)
            took[name] = round(time.monotonic() - start, 1)
            assert result.exit_code == 0, (
                f"{runtime.name}: {name} ({command}) failed with {result.exit_code} "
                f"{result.signal or ''} after {took[name]} s\n"
                f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            )
            if name == "test":
                # native and the plugin keep the caller's env: under CI=true vitest colours its
                # summary, so the words are read without the escapes
                plain = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)
                assert re.search(r"Tests\s+4 passed", plain), plain[-2000:]
            if name == "build":
                assert 'bundle ok: "bundle" x2' in result.stdout, result.stdout[-2000:]
        if runtime.name not in ("native", "plugin"):  # they keep the caller's HOME and env
            # Four pnpm commands, and none asked the registry for a newer pnpm: a sandbox's
            # home is new with each task, so its once-a-day state would never hold.
            state = await sb.run("ls $HOME/.local/state/pnpm/pnpm-state.json", STEP)
            assert state.exit_code != 0, (runtime.name, state.stdout)
    print(
        f"\nworkload {runtime.name}: "
        + " ".join(f"{k} {v}s" for k, v in took.items())
        + f" (total {sum(took.values()):.1f}s)"
    )
    # A rootless runtime's repository is its user's: git refuses it to root unless told.
    mine = ("-c", f"safe.directory={repo}")
    assert "workload from the sandbox" in git(repo, *mine, "log", "--oneline", "-1", "task")
    committed = git(repo, *mine, "ls-tree", "-r", "--name-only", "task").split()
    assert {"src/digest.ts", "src/task.ts", "pnpm-lock.yaml"} <= set(committed)
    assert not [p for p in committed if p.startswith(("node_modules/", "dist/", ".pnpm"))]
    if runtime.user is None:
        await second_task(runtime, repo, site, network, cache)


SECOND = (
    ("install", "pnpm install --frozen-lockfile"),
    ("test", "pnpm test"),
    # Every install that links bins chmods each bin target (typescript's tsc, vitest's
    # vitest.mjs): one the host had linked to a blob (nobody's) failed it with EPERM.
    ("add", "pnpm add is-number@7.0.0"),
    ("typecheck", "pnpm typecheck"),
)


async def second_task(
    runtime: Runtime, repo: Path, site: Path, network: NetworkMode, cache: dict[str, Any]
) -> None:
    """A second task on the same lockfile and warm store: where the host links (the isolating
    runtimes), its packages are placed before its first command (fusion_oci/store/tree.py),
    and pnpm still installs, tests, adds a dependency and type-checks over them."""
    from fusion_oci.store.blobs import STORE_UID

    wt = site / "wt-task2"
    git(repo, "worktree", "add", "-q", "-b", "task2", str(wt))
    async with sandbox(runtime, wt, network=network, **cache) as sb:
        linking = getattr(sb, "linker", None) is not None
        typescript = next((wt / "node_modules" / ".pnpm").glob("typescript@*"), None)
        assert (typescript is not None) == linking, (runtime.name, linking)
        if typescript is not None:
            package = typescript / "node_modules" / "typescript"
            assert (package / "lib" / "typescript.js").stat().st_uid == STORE_UID
            assert (package / "bin" / "tsc").stat().st_uid == wt.stat().st_uid  # its own
        for name, command in SECOND:
            result = await sb.run(command, INSTALL)
            assert result.exit_code == 0, (
                f"{runtime.name}: second task's {name} ({command}) failed with "
                f"{result.exit_code}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            )
