"""Per-command overhead of the podman and docker runtimes beside the engines' own CLIs.

    .venv/bin/python benchmarks/bench_containers.py [--runs N] [--engines docker,podman]

Engines are reached as the tests do (DOCKER_HOST, FUSION_OCI_PODMAN_URL). Per engine:
warm: ``Sandbox.run("true")`` in a prepared task container vs ``docker|podman exec C true`` on
a container started from the same image; one-shot: the runtime's oneshot mode vs
``docker|podman run --rm IMAGE true``. Prints medians and ratios; quote the ratios.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_ms, report, run_argv
from fusion_oci.models import CacheMode, PrepareContext, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox
from tests.integration.images_fixture import ensure_node_image


def cli(engine: str) -> list[str]:
    if engine == "docker":
        return ["docker", "-H", os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")]
    return ["podman", "--url", os.environ.get("FUSION_OCI_PODMAN_URL",
                                              "unix:///run/podman/podman.sock")]


# Podman's default rlimits exceed this kind of host's hard limits (see machine notes).
LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]


def settings(engine: str, mode: str) -> SandboxSettings:
    url: dict[str, Any] = {"docker_url": os.environ.get("DOCKER_HOST")} if engine == "docker" else {
        "podman_url": os.environ.get("FUSION_OCI_PODMAN_URL")}
    return SandboxSettings(backend=engine, container_mode=mode, **url)


def bench(engine: str, runs: int) -> None:
    image = ensure_node_image(engine).ref
    base = cli(engine)
    with tempfile.TemporaryDirectory() as wt:
        ctx = PrepareContext(task_id=f"bench-{engine}", run_id="r", worktree_path=wt,
                             image=image, cache_mode=CacheMode.OFF,
                             policy=SandboxPolicy(allow_network=False))
        name = f"fusion-oci-bench-{os.getpid()}"
        subprocess.run([*base, "run", "-d", "--rm", "--name", name, "--network", "none",
                        *LIMITS, image, "sleep", "infinity"], check=True,
                       stdout=subprocess.DEVNULL)
        try:
            raw_exec = median_ms(run_argv([*base, "exec", name, "true"]), runs)
        finally:
            subprocess.run([*base, "rm", "-f", name], stdout=subprocess.DEVNULL, check=False)
        raw_run = median_ms(run_argv([*base, "run", "--rm", "--network", "none", *LIMITS,
                                      image, "true"]), max(5, runs // 2))
        with SyncSandbox(settings(engine, "warm"), env=dict(os.environ)) as sb:
            sb.prepare(ctx)
            warm = median_ms(lambda: sb.run("true"), runs)
        with SyncSandbox(settings(engine, "oneshot"), env=dict(os.environ)) as sb:
            sb.prepare(ctx)
            oneshot = median_ms(lambda: sb.run("true"), max(5, runs // 2))
    report(f"{engine}: warm per-command overhead", (f"{engine} exec C true", raw_exec),
           [("fusion-oci warm run('true')", warm)])
    report(f"{engine}: one-shot per-command overhead", (f"{engine} run --rm IMAGE true", raw_run),
           [("fusion-oci oneshot run('true')", oneshot)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--engines", default="docker,podman")
    args = parser.parse_args()
    for engine in args.engines.split(","):
        bench(engine.strip(), args.runs)


if __name__ == "__main__":
    main()
