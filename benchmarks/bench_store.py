"""Warm-store ``pnpm install`` and disk per extra task with the host-side store links
(fusion_oci/store.py), against the host's own pnpm on its own warm store, interleaved.

    .venv/bin/python -m benchmarks.bench_store [--rounds 3] [--backends bubblewrap,oci,...]

Per round and backend a new task (worktree) of one project installs
tests/data/workload-project offline from the project's warm store; the time is the whole
``Sandbox.run`` (the install and the host's link pass after it). Disk: ``du`` of the task's
``node_modules`` counted after the blob store and the earlier tasks (what this task adds),
over its full size.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, write_markdown
from fusion_oci.models import NetworkMode, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.sandbox import Sandbox
from tests.backends import backend_settings
from tests.conftest import git_init

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "tests" / "data" / "workload-project"
INSTALL = "pnpm install --frozen-lockfile --offline"
LONG = RunOptions(timeout_ms=600_000)
INTRO = """`benchmarks/bench_store.py --rounds {rounds}`: tests/data/workload-project installed
offline
from a warm store, each round a new task (worktree) of one project per backend and a new
directory for the host's own pnpm on its own warm store, interleaved; a sandbox's time is
its whole `run` (pnpm, which copies inside the sandbox, then the host's pass that links
`node_modules/.pnpm` to the project's blob store, fusion_oci/store.py). Disk: what the last
task's `node_modules` adds to `du` after the blob store and the earlier tasks, against its
full size."""
READING = """
- Targets: warm install within 1.3x of the host's; one more task on the same lockfile adds
  under 10% of its `node_modules` (what it adds is directories, symlinks and pnpm's own
  metadata; every package file is a link to a blob).
- Inside bubblewrap, oci and the containers pnpm cannot link (the store is another mount, and a
  task may link only files it could rewrite): it copies, and the host links after. Landlock
  sees the host's filesystem, so pnpm links its store itself and the pass re-links to blobs.
- Where fusion-oci runs unprivileged (rootless engines) there are no shared links (each task
  keeps its copies): docs/security.md, "the poisoning model".
"""


def du_kib(*paths: Path) -> list[int]:
    """KiB each path adds, in order (du counts an inode once, at its first path)."""
    out = subprocess.run(
        ["du", "-sk", *map(str, paths)], capture_output=True, text=True, check=True
    ).stdout
    return [int(line.split()[0]) for line in out.splitlines()]


def settings(backend: str, network: NetworkMode) -> object:
    policy = SandboxPolicy(network=network)
    if backend in ("podman", "docker"):
        from tests.integration.container_cases import engine_settings

        return engine_settings(backend, policy=policy)
    return backend_settings(backend, policy=policy)


async def task_install(
    backend: str, base: Path, name: str, command: str, network: NetworkMode
) -> tuple[Path, float]:
    wt = base / f"wt-{backend}-{name}"
    shutil.copytree(PROJECT, wt)
    git_init(wt)
    chosen = settings(backend, network)
    image = None
    if backend in ("podman", "docker"):
        from tests.integration.container_cases import image as node_image

        image = node_image(backend)
    env = {
        "HOME": str(base / "home"),
        "PATH": os.environ["PATH"],
        "LANG": "C.UTF-8",
        **{k: v for k, v in os.environ.items() if k in ("DOCKER_HOST", "FUSION_OCI_PODMAN_URL")},
    }
    async with Sandbox(chosen, env=env, cache_root=base / "cache") as sb:  # type: ignore[arg-type]
        await sb.prepare(
            PrepareContext(
                task_id=name,
                run_id="r",
                worktree_path=str(wt),
                policy=chosen.policy,  # type: ignore[attr-defined]
                project_dir=str(base / "project"),
                image=image,
            )
        )
        start = time.perf_counter()
        done = await sb.run(command, LONG)
        took = time.perf_counter() - start
        assert done.exit_code == 0, done.stderr[-2000:] + done.stdout[-2000:]
    return wt, took


def host_install(base: Path, name: str) -> float:
    wt = base / f"wt-host-{name}"
    shutil.copytree(PROJECT, wt)
    env = {**os.environ, "npm_config_store_dir": str(base / "host-store")}
    start = time.perf_counter()
    subprocess.run(INSTALL.split(), cwd=wt, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="bubblewrap,landlock,oci,podman,docker")
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    args, _ = parser.parse_known_args()  # scripts/bench.sh passes --runs to every benchmark
    backends = args.backends.split(",")
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-bench-store-"))
    (base / "home").mkdir()
    (base / "project").mkdir()
    try:
        # Warm both stores once, with the network (the project's store through the sandbox).
        env = {**os.environ, "npm_config_store_dir": str(base / "host-store")}
        warm = base / "wt-host-warm"
        shutil.copytree(PROJECT, warm)
        await asyncio.to_thread(
            subprocess.run,
            ["pnpm", "install", "--frozen-lockfile"],
            cwd=warm,
            env=env,
            check=True,
            capture_output=True,
        )
        for backend in backends:
            # Landlock cannot confine egress: it warms its store with the host's network.
            net = NetworkMode.HOST if backend == "landlock" else NetworkMode.EGRESS
            await task_install(backend, base, "warm", "pnpm install --frozen-lockfile", net)
        times: dict[str, list[float]] = {"host": [], **{b: [] for b in backends}}
        worktrees: dict[str, list[Path]] = {b: [] for b in backends}
        for i in range(args.rounds):
            times["host"].append(host_install(base, f"r{i}"))
            for backend in backends:
                wt, took = await task_install(backend, base, f"r{i}", INSTALL, NetworkMode.NONE)
                times[backend].append(took)
                worktrees[backend].append(wt)
        host = statistics.median(times["host"])
        rows: list[list[object]] = [
            ["host (its own pnpm, hard links)", f"{host:.2f} s", "1.00x", "-"]
        ]
        blobs = next((base / "cache" / "projects").glob("*/store-blobs"))
        for backend in backends:
            med = statistics.median(times[backend])
            full = du_kib(worktrees[backend][-1] / "node_modules")[0]
            adds = du_kib(blobs, *[w / "node_modules" for w in worktrees[backend]])[-1]
            rows.append(
                [
                    backend,
                    f"{med:.2f} s",
                    f"{med / host:.2f}x",
                    f"{adds} / {full} KiB ({100 * adds / full:.1f}%)",
                ]
            )
        body = markdown_table(
            [
                "case",
                "warm install (median)",
                "vs host",
                "extra disk of one more task / its node_modules",
            ],
            rows,
        )
        print(body)
        write_markdown(
            args.markdown,
            "Package store links: warm install and disk per task",
            INTRO.format(rounds=args.rounds),
            body,
            READING,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
