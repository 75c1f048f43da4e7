"""Where a container's extra time goes: one suspect changed at a time, interleaved with the host.

    .venv/bin/python -m benchmarks.bench_container_overhead [--rounds 5] [--engines docker,podman]

The workload (benchmarks/data/overhead.mjs) times its own phases inside the container, so the
engine's container start never counts: ``cpu`` (a loop, no system calls), ``hash`` (OpenSSL),
``spawn`` (fork/exec of /bin/true), ``fs`` (small files in the bind-mounted worktree). Each
variant is ``ENGINE run`` with the flags fusion-oci's container gets (``ours``: no
capabilities, no new privileges, our seccomp profile, read-only root, the spec's ulimits, the
caller's uid) and one thing changed; ``agent`` is the same container as fusion-oci runs it
(warm, the command spawned by the exec agent, its output through the agent's pipes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.common import markdown_table, write_markdown
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.seccomp import default_profile
from fusion_oci.runtimes.engine.containers import seccomp_json
from fusion_oci.sandbox import Sandbox
from tests.conftest import git_init

SCRIPT = Path(__file__).resolve().parent / "data" / "overhead.mjs"
PHASES = ("cpu", "hash", "spawn", "spawn_static", "fs")
STATIC = "/usr/bin/tini-static"
"""A static binary (installed for the oci runtime) copied into the worktree: ``spawn_static``
execs it from the bind mount, no loader and no image layer involved."""


def engine_cli(engine: str) -> list[str]:
    if engine == "podman":
        return ["podman", "--remote", "--url", os.environ["FUSION_OCI_PODMAN_URL"]]
    return ["docker"]


def variants(engine: str, profile: Path) -> dict[str, list[str]]:
    ours = [
        "--network",
        "none",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--read-only",
        "--tmpfs",
        "/tmp:nosuid,nodev,mode=1777",
        "--ulimit",
        "nofile=20000:20000",
        "--ulimit",
        "nproc=32768:32768",
        "--user",
        f"{os.getuid()}:{os.getgid()}",
    ]
    seccomp = ["--security-opt", f"seccomp={profile}"]
    return {
        "ours": ours + seccomp,
        "seccomp unconfined": [*ours, "--security-opt", "seccomp=unconfined"],
        "engine's default seccomp": ours,
        "cpu quota 2 cores": ours + seccomp + ["--cpus", "2"],
        "nofile 1024": [*ours, *seccomp, "--ulimit", "nofile=1024:1024"],
        "shm 1g": ours + seccomp + ["--shm-size", "1g"],
    }


def parse(out: str) -> dict[str, float]:
    line = out.strip().splitlines()[-1]
    return {k: float(v) for k, v in json.loads(line).items()}


def run_host(work: Path) -> dict[str, float]:
    env = {**os.environ, "OVERHEAD_STATIC": str(work / "static")}
    out = subprocess.run(
        ["node", str(work / "overhead.mjs"), str(work)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    return parse(out)


def run_engine(engine: str, flags: list[str], image: str, work: Path) -> dict[str, float]:
    argv = [
        *engine_cli(engine),
        "run",
        "--rm",
        *flags,
        "-v",
        f"{work}:{work}",
        "-w",
        str(work),
        "-e",
        f"OVERHEAD_STATIC={work}/static",
        image,
        "node",
        str(work / "overhead.mjs"),
        str(work),
    ]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return parse(done.stdout)


async def run_agent(sb: Sandbox, work: Path) -> dict[str, float]:
    done = await sb.run(
        f"OVERHEAD_STATIC={work}/static node {work}/overhead.mjs {work}",
        RunOptions(timeout_ms=300_000),
    )
    assert done.exit_code == 0, done.stderr[-2000:]
    return parse(done.stdout)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engines", default="docker,podman")
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    args, _ = parser.parse_known_args()  # scripts/bench.sh passes --runs to every benchmark
    from tests.integration.container_cases import engine_settings, image

    base = Path(tempfile.mkdtemp(prefix="fusion-oci-overhead-"))
    base.chmod(0o755)  # noqa: ASYNC240 (set-up, before anything is timed)
    work = git_init(base / "wt")
    shutil.copy(SCRIPT, work / "overhead.mjs")
    shutil.copy(STATIC, work / "static")
    profile = base / "seccomp.json"
    profile.write_text(seccomp_json(default_profile()))
    samples: dict[str, list[dict[str, float]]] = {"host": []}
    engines = args.engines.split(",")
    sandboxes: dict[str, Sandbox] = {}
    try:
        for engine in engines:
            settings = engine_settings(engine, policy=SandboxPolicy(allow_network=False))
            sb = Sandbox(settings, env=dict(os.environ), cache_root=base / "cache")
            await sb.prepare(
                PrepareContext(
                    task_id=f"ovh-{engine}",
                    run_id="r",
                    worktree_path=str(work),
                    policy=settings.policy,
                    image=image(engine),
                )
            )
            sandboxes[engine] = sb
        for _ in range(args.rounds):
            samples["host"].append(await asyncio.to_thread(run_host, work))
            for engine in engines:
                ref = image(engine)
                for name, flags in variants(engine, profile).items():
                    got = await asyncio.to_thread(run_engine, engine, flags, ref, work)
                    samples.setdefault(f"{engine}: {name}", []).append(got)
                got = await run_agent(sandboxes[engine], work)
                samples.setdefault(f"{engine}: agent (fusion-oci)", []).append(got)
    finally:
        for sb in sandboxes.values():
            await sb.dispose()
        shutil.rmtree(base, ignore_errors=True)
    keys = [*PHASES, *(f"{p}_cpu" for p in PHASES)]
    med = {
        case: {k: statistics.median(s[k] for s in runs) for k in keys}
        for case, runs in samples.items()
    }
    host = med["host"]
    rows = [
        [case, *(f"{phases[k] / max(host[k], 1):.2f}x" for k in keys)]
        for case, phases in med.items()
    ]
    body = markdown_table(
        ["case", *(f"{p} wall" for p in PHASES), *(f"{p} CPU" for p in PHASES)], rows
    )
    print(body)
    write_markdown(args.markdown, "Container overhead", (__doc__ or "").split("\n\n", 1)[-1], body)


if __name__ == "__main__":
    asyncio.run(main())
