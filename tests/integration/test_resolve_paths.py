"""run, `fusion-oci plan` and `fusion-oci bundle create` go through one resolve step and one
compiler (fusion_oci.resolve): for the same inputs, the same config.json, host CA included."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.caller import TaskFlags, resolve_task
from fusion_oci.models import RunOptions
from fusion_oci.sandbox import Sandbox

pytestmark = pytest.mark.bubblewrap

COMMAND = "echo hi"
IDS = ("--task-id", "t1", "--run-id", "r1")


def environ(worktree: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HOME": str(worktree.parent / "home"),
        "XDG_CONFIG_HOME": str(worktree.parent / "home/.config"),
    }


def cli(worktree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fusion_oci.cli.main", *args],
        cwd=worktree,
        env=environ(worktree),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def run_path_spec(worktree: Path, *, host_ca: str, ctx_ca: str | None = None) -> Any:
    """The spec `run` executes: the lifecycle's prepare (the resolve step) and compile."""
    env = environ(worktree)
    task = resolve_task(
        TaskFlags(worktree=worktree, host_ca=host_ca, task_id="t1", run_id="r1"), env
    )
    ctx = task.ctx if ctx_ca is None else task.ctx.model_copy(update={"host_ca_bundle": ctx_ca})
    settings = task.effective.settings

    async def go() -> Any:
        async with Sandbox(settings, env=env) as sb:
            await sb.prepare(ctx)
            return sb.spec_for(COMMAND, task.opts)

    return asyncio.run(go())


@pytest.fixture
def project(worktree: Path) -> tuple[Path, str]:
    (worktree / ".fusion").mkdir()
    (worktree / ".fusion/settings.yaml").write_text("sandbox:\n  backend: bubblewrap\n")
    ca = worktree.parent / "extra-ca.pem"
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", ca)
    return worktree, str(ca)


def test_run_plan_and_bundle_create_give_the_same_spec(
    project: tuple[Path, str], tmp_path: Path
) -> None:
    worktree, ca = project
    out = tmp_path / "bundle"
    made = cli(worktree, "bundle", "create", "-o", str(out), "--host-ca", ca, *IDS, "--", COMMAND)
    assert made.returncode == 0, made.stderr
    bundle = json.loads((out / "config.json").read_text())
    planned = cli(worktree, "plan", "--json", "--host-ca", ca, *IDS, "--", COMMAND)
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)["config"]
    run = run_path_spec(worktree, host_ca=ca)
    assert any(m["source"] == ca for m in run["mounts"]), "the host CA is shared"
    assert plan == run
    assert bundle == run


def test_plan_honours_the_contexts_host_ca_bundle(project: tuple[Path, str]) -> None:
    """A library or server context may name its own CA bundle: plan shows what run mounts."""
    from fusion_oci.cli.dryrun import dry_run

    worktree, ca = project
    env = environ(worktree)
    task = resolve_task(TaskFlags(worktree=worktree, task_id="t1", run_id="r1"), env)
    task = type(task)(
        task.effective,
        task.ctx.model_copy(update={"host_ca_bundle": ca}),
        task.opts,
        task.project_dir,
    )
    planned = dry_run(task, COMMAND, env)["config"]
    assert any(m["source"] == ca for m in planned["mounts"])
    assert planned == run_path_spec(worktree, host_ca="auto", ctx_ca=ca)


def test_the_resolve_step_gives_runtimes_and_compile_the_same_inputs(
    project: tuple[Path, str],
) -> None:
    from fusion_oci.host.cachedir import default_cache_root
    from fusion_oci.oci.host import probe_host
    from fusion_oci.resolve import compile_spec, resolve

    worktree, ca = project
    env = environ(worktree)
    task = resolve_task(TaskFlags(worktree=worktree, host_ca=ca, task_id="t1", run_id="r1"), env)
    settings = task.effective.settings
    resolved = resolve(
        settings, task.ctx, probe_host(), env=env, cache_root=default_cache_root(env)
    )
    assert resolved.ca_bundle == ca and resolved.image is None
    spec = compile_spec(resolved, COMMAND, RunOptions(env=env)).to_oci()
    assert spec == run_path_spec(worktree, host_ca=ca)
