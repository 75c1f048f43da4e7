"""Warm-store ``pnpm install`` and disk per extra task with the host-side store links
(fusion_oci/store/linking.py) and placed trees (fusion_oci/store/tree.py), against the host's
own pnpm on its own warm store, interleaved.

    .venv/bin/python -m benchmarks.bench_store [--rounds 3] [--backends bubblewrap,oci,...]

Per round and backend two new tasks (worktrees) of one project install
tests/data/workload-project offline from the project's warm store: one whose packages the host
placed at prepare from the tree the earlier installs left, and one with the project's trees
removed first (pnpm copies every file, as before trees), in alternating order. The time is the
placement (at prepare) plus the whole ``Sandbox.run`` (the install and the host's link pass
after it). Disk: ``du`` of the placed tasks' ``node_modules`` counted after the blob store and
the earlier tasks (what the last one adds), over its full size.
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
from benchmarks.disk_usage import extent_kib
from fusion_oci.models import NetworkMode, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.sandbox import Sandbox
from tests.backends import backend_settings
from tests.conftest import git_init

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "tests" / "data" / "workload-project"
INSTALL = "pnpm install --frozen-lockfile --offline"
LONG = RunOptions(timeout_ms=600_000)
INTRO = """`benchmarks/bench_store.py --rounds {rounds}`: tests/data/workload-project installed
offline from a warm store, each round two new tasks (worktrees) of one project per backend and
a new directory for the host's own pnpm on its own warm store, interleaved. One task's
packages are placed by the host at prepare from the tree earlier installs of the lockfile
left (fusion_oci/store/tree.py: links to the blobs, bin targets its own copies or clones), so pnpm
imports none; the other's project trees are removed first, so pnpm copies every file inside
the sandbox (its store is another mount) and the host's pass links them after
(fusion_oci/store/linking.py), as before trees. A sandbox's time is the placement plus its whole
`run` (pnpm, then the pass). Disk: what the last placed task's `node_modules` adds to `du`
after the blob store and the earlier tasks (each physical extent counted once:
benchmarks/disk_usage.py, so a clone of a blob adds nothing), against its full size.
Filesystem: {fs}."""
READING = """
- Targets: warm install within 1.3x of the host's; one more task on the same lockfile adds
  under 10% of its `node_modules` (what it adds is directories, symlinks, bin targets and
  pnpm's own metadata; every other package file is a link to a blob).
- Inside bubblewrap, oci and the containers pnpm cannot link (the store is another mount, and a
  task may link only files it could rewrite): without a tree it copies, and the host links
  after. Landlock sees the host's filesystem, so pnpm links its store itself and the pass
  re-links to blobs.
- A bin target is the task's own file (pnpm `chmod`-s it): on ext4 a copy (esbuild's is its
  9.5 MB native binary), on XFS with reflink or btrfs a clone of its blob (no data blocks).
- Where fusion-oci runs unprivileged (rootless engines) the pass and the placement run in a
  user namespace of their own (fusion_oci/store/namespace.py); this benchmark drives the runtimes in
  its own process, as root: bench_workload has the rootless rows.
"""


def filesystem(path: Path) -> str:
    return subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()


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
) -> tuple[Path, float, int]:
    """A new task's install: (its worktree, placement + run seconds, packages placed)."""
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
        placed = sb.linker.placed if sb.linker is not None else None
        start = time.perf_counter()
        done = await sb.run(command, LONG)
        took = time.perf_counter() - start
        assert done.exit_code == 0, done.stderr[-2000:] + done.stdout[-2000:]
    if placed is None:
        return wt, took, 0
    return wt, took + placed.seconds, placed.packages


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
    parser.add_argument(
        "--scratch",
        help="make the project, its cache and the worktrees here (a folder on the filesystem "
        "to measure, e.g. an XFS with reflink: bin targets are clones there)",
    )
    args, _ = parser.parse_known_args()  # scripts/bench.sh passes --runs to every benchmark
    backends = args.backends.split(",")
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-bench-store-", dir=args.scratch))
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
            await task_install(
                backend, base, f"warm-{backend}", "pnpm install --frozen-lockfile", net
            )
        times: dict[str, list[float]] = {"host": []}
        placed: dict[str, list[int]] = {}
        worktrees: dict[str, list[Path]] = {b: [] for b in backends}
        trees = base / "cache" / "projects"
        for i in range(args.rounds):
            times["host"].append(host_install(base, f"r{i}"))
            for backend in backends:
                for case in ("placed", "copying") if i % 2 == 0 else ("copying", "placed"):
                    kept = next(trees.glob("*/store-blobs/trees"))
                    if case == "copying":  # no tree for this task; the others' stay kept
                        kept.rename(kept.with_name("trees-kept"))
                    wt, took, packages = await task_install(
                        backend, base, f"r{i}-{case}", INSTALL, NetworkMode.NONE
                    )
                    if case == "copying":
                        shutil.rmtree(kept, ignore_errors=True)  # what its own pass kept
                        kept.with_name("trees-kept").rename(kept)
                    times.setdefault(f"{backend} {case}", []).append(took)
                    placed.setdefault(f"{backend} {case}", []).append(packages)
                    if case == "placed":
                        worktrees[backend].append(wt)
        host = statistics.median(times["host"])
        rows: list[list[object]] = [
            ["host (its own pnpm, hard links)", "-", f"{host:.2f} s", "1.00x", "-"]
        ]
        blobs = next(trees.glob("*/store-blobs"))
        for backend in backends:
            full = du_kib(worktrees[backend][-1] / "node_modules")[0]
            adds = extent_kib(blobs, *[w / "node_modules" for w in worktrees[backend]])[-1]
            for case in ("placed", "copying"):
                med = statistics.median(times[f"{backend} {case}"])
                rows.append(
                    [
                        f"{backend}, {case}",
                        min(placed[f"{backend} {case}"]),
                        f"{med:.2f} s",
                        f"{med / host:.2f}x",
                        f"{adds} / {full} KiB ({100 * adds / full:.1f}%)"
                        if case == "placed"
                        else "-",
                    ]
                )
        body = markdown_table(
            [
                "case",
                "packages placed",
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
            INTRO.format(rounds=args.rounds, fs=filesystem(base)),
            body,
            READING,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
