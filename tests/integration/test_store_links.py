"""pnpm's files are hard links to the host's blob store inside every isolating runtime, and
a second task on the same lockfile shares them (fusion_oci/store/linking.py), placed before its
first command (fusion_oci/store/tree.py).

Each case: task a installs tests/data/pnpm-project (a real dependency from the npm registry),
the link count of an installed file is read *inside* the sandbox, then task b of the same
project installs the same lockfile and gets the very same inode, owned by the store's uid and
read-only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.audit import AuditLog, read_events
from fusion_oci.models import NetworkMode, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.policy.settings import GateSettings, SandboxSettings
from fusion_oci.sandbox import Sandbox
from fusion_oci.store.blobs import STORE_UID
from tests.backends import backend_settings, require_runtime
from tests.conftest import git_init

ROOT = Path(__file__).resolve().parents[2]
PNPM_PROJECT = ROOT / "tests" / "data" / "pnpm-project"
INSTALLED = "node_modules/.pnpm/is-number@7.0.0/node_modules/is-number/index.js"
LONG = RunOptions(timeout_ms=240_000)
BACKENDS = ["bubblewrap", "landlock", "oci", "podman", "docker"]
"""oci-runsc is not here: node aborts at start under this gVisor release (uv_thread_create
fails), so pnpm cannot run there; tests/security/test_store_poisoning.py checks its link count
with a shell-made install instead."""


def settings_for(backend: str) -> SandboxSettings:
    # Landlock cannot confine egress (it refuses it); it gets the host's network instead.
    network = NetworkMode.HOST if backend == "landlock" else NetworkMode.EGRESS
    extra: dict[str, Any] = {"policy": SandboxPolicy(network=network)}
    if backend in ("podman", "docker"):
        from tests.integration.container_cases import engine_settings

        return engine_settings(backend, **extra)
    return backend_settings(backend, gates=GateSettings(sandbox_provision="allow"), **extra)


async def install(
    backend: str, settings: SandboxSettings, tmp_path: Path, task: str, project: Path
) -> tuple[Path, str]:
    """Task ``task`` installs the project; returns its worktree and the in-sandbox ``stat``."""
    wt = tmp_path / f"wt-{task}"
    shutil.copytree(PNPM_PROJECT, wt)
    git_init(wt)
    image = None
    if backend in ("podman", "docker"):
        from tests.integration.container_cases import image as node_image

        image = node_image(backend)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {
        "HOME": str(home),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        **{k: v for k, v in os.environ.items() if k in ("DOCKER_HOST", "FUSION_OCI_PODMAN_URL")},
    }
    audit_path = tmp_path / f"audit-{task}.jsonl"
    async with Sandbox(
        settings, env=env, cache_root=tmp_path / "cache", audit=AuditLog(audit_path, key=b"")
    ) as sb:
        await sb.prepare(
            PrepareContext(
                task_id=task,
                run_id="r1",
                worktree_path=str(wt),
                policy=settings.policy,
                project_dir=str(project),
                image=image,
            )
        )
        done = await sb.run("pnpm install --frozen-lockfile", LONG)
        assert done.exit_code == 0, done.stderr + done.stdout
        seen = await sb.run(f"stat -c '%h %u' {INSTALLED} && head -c 40 {INSTALLED}", LONG)
        assert seen.exit_code == 0, seen.stderr
        # The links are read-only and not the task's: pnpm still re-installs over them, and
        # the task may throw node_modules away.
        again = await sb.run(
            "pnpm install --frozen-lockfile --offline && rm -rf node_modules "
            "&& pnpm install --frozen-lockfile --offline",
            LONG,
        )
        assert again.exit_code == 0, again.stderr + again.stdout
    # The host's pass is in the install's audit event: what it linked, in how long.
    runs = [
        e
        for e in read_events(audit_path)
        if e.type == "sandbox:run" and e.command == "pnpm install --frozen-lockfile"
    ]
    assert runs and runs[-1].details, runs
    links = runs[-1].details["store_links"]
    assert "stopped" not in links, links
    (prepared,) = [e for e in read_events(audit_path) if e.type == "sandbox:prepare"]
    assert prepared.details is not None
    placed = prepared.details["store_tree"]["placed"]
    if task == "store-a":
        # The first task: pnpm copies, the pass links and keeps the tree of what it linked.
        assert links["linked"] > 0 and links["recorded"] > 0 and not placed, (links, placed)
    else:
        # Same lockfile: its packages were placed as links at prepare (store_tree.py), so
        # pnpm imported none of them and its pass has nothing left to link.
        assert placed > 0 and links["linked"] == 0, (links, prepared.details)
    return wt, seen.stdout


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
async def test_installed_files_are_links_to_one_read_only_blob(
    backend: str, tmp_path: Path
) -> None:
    settings = settings_for(backend)
    require_runtime(backend, settings)
    project = tmp_path / "project"
    project.mkdir()
    wt_a, seen_a = await install(backend, settings, tmp_path, "store-a", project)
    links, _owner = seen_a.split()[:2]
    assert int(links) > 1, f"link count inside {backend}: {seen_a}"
    wt_b, seen_b = await install(backend, settings, tmp_path, "store-b", project)
    assert int(seen_b.split()[0]) > int(links), seen_b
    a, b = (wt / INSTALLED for wt in (wt_a, wt_b))
    assert a.stat().st_ino == b.stat().st_ino
    assert a.stat().st_uid == STORE_UID and a.stat().st_mode & 0o222 == 0
