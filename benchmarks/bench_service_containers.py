"""Per-task service containers (``policy.services``): how soon a task's Postgres is ready.

    eval "$(bash scripts/services.sh env)"
    .venv/bin/python benchmarks/bench_service_containers.py [--runs N]
        [--cases bubblewrap,bubblewrap+env,podman+env,docker+env]

Each case prepares N tasks one after the other (``network: none``, one
``{name: db, image: postgres, port: 5432, ready: "pg_isready -q"}``; ``+env`` adds
``POSTGRES_DB`` and ``POSTGRES_PASSWORD``, which the image makes at start), runs one command
that connects to 127.0.0.1:5432, and disposes. ``ready`` is the prepare event's
``details.services[0].ready_ms`` (the container's create to the first ``ready`` that exits 0).
The images must be warm: the service containers tests build them (tests/integration/
service_images.py), or ``fusion-oci images build postgres --base offline``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.sandbox import SyncSandbox
from tests.backends import backend_settings
from tests.conftest import git_init

CONNECT = "node -e \"require('net').connect(5432,'127.0.0.1').on('connect',()=>process.exit(0))\""


def engine_env(backend: str) -> dict[str, str]:
    if backend == "docker":
        return {"DOCKER_HOST": os.environ["DOCKER_HOST"]}
    return {"CONTAINER_HOST": os.environ["FUSION_OCI_PODMAN_URL"]}


def run_case(case: str, runs: int, work: Path) -> dict[str, list[float]]:
    backend, _, with_env = case.partition("+")
    svc: dict[str, object] = {"name": "db", "image": "postgres", "port": 5432}
    svc["ready"] = "pg_isready -q"
    if with_env:
        svc["env"] = {"POSTGRES_DB": "app", "POSTGRES_PASSWORD": "pw"}
    policy = SandboxPolicy.model_validate({"network": "none", "services": [svc]})
    env = {"PATH": os.environ["PATH"], "HOME": str(work), **engine_env(backend)}
    worktree = work / f"wt-{backend}{with_env}"
    if not worktree.exists():
        git_init(worktree)
    out: dict[str, list[float]] = {"ready": [], "prepare": [], "command": [], "dispose": []}
    for i in range(runs):
        events: list[AuditEvent] = []
        audit = AuditLog()
        audit.subscribe(events.append)
        sb = SyncSandbox(
            backend_settings(backend, policy=policy), env=env, audit=audit, cache_root=work / "c"
        )
        ctx = PrepareContext(
            task_id=f"bench-svc-{i}",
            run_id="r",
            policy=policy,
            worktree_path=str(worktree),
        )
        t = time.monotonic()
        sb.prepare(ctx)
        out["prepare"].append(time.monotonic() - t)
        t = time.monotonic()
        result = sb.run(CONNECT, RunOptions(timeout_ms=20_000))
        out["command"].append(time.monotonic() - t)
        assert result.exit_code == 0, result
        t = time.monotonic()
        sb.dispose()
        out["dispose"].append(time.monotonic() - t)
        prepared = next(e for e in events if e.type == "sandbox:prepare")
        out["ready"].append(float((prepared.details or {})["services"][0]["ready_ms"]) / 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cases", default="bubblewrap,bubblewrap+env,podman+env,docker+env")
    args = parser.parse_args()
    print("| case | ready (median, min-max) | whole prepare | first connect command | dispose |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="bench-svc-") as tmp:
        for case in args.cases.split(","):
            numbers = run_case(case, args.runs, Path(tmp))

            def ms(xs: list[float]) -> str:
                return f"{statistics.median(xs) * 1000:.0f} ms"

            ready = numbers["ready"]
            print(
                f"| {case} | {ms(ready)} ({min(ready) * 1000:.0f}-{max(ready) * 1000:.0f}) "
                f"| {ms(numbers['prepare'])} | {ms(numbers['command'])} "
                f"| {ms(numbers['dispose'])} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
