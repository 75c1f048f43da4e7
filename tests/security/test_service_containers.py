"""Per-task service containers (issue #35, ``policy.services``): what must not reach them, on
every backend.

- ``service-container-other-task``: two tasks run side by side, each with its own ``db``
  (images/postgres). Task A writes a row into its database; task B, with the same settings,
  looks for that row and tries every address it could reach A's container by. B must see
  only its own (empty) database: the row, or any answer from A's container, is a leak.
- ``service-container-host-network``: from the host, while the task lives, nothing answers
  for its service: not the service's port on the host's loopback, not any address of the
  container (it has no interface but ``lo``: read from its own ``/proc/PID/net/dev``).

The backends that cannot run service containers say so before anything starts: native lists
them as unenforced, kubernetes refuses the policy (a pod's network is on a cluster node). The
rootless backends run them on their user's rootless engine.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import SandboxPolicy
from tests.integration.test_service_containers import (
    DB,
    SERVICES_PART,
    service_adapter,
    with_images,
)
from tests.security.conftest import REMOTE, Prober, record
from tests.security.test_probes import check
from tests.services_world import PG_CLIENT_JS

POLICY: dict[str, Any] = {"network": "none", "services": [DB]}


def _cannot(prober: Prober, probe: str) -> bool:
    """native and kubernetes: the services are listed or refused, and the probe is recorded
    as unenforced there. True when that was the case."""
    policy = SandboxPolicy.model_validate(POLICY)
    if prober.backend == "native":
        result = prober.run("true", policy)
        assert any(SERVICES_PART in u for u in result.unenforced), result
    elif prober.backend in REMOTE:
        with pytest.raises(PolicyNotEnforceableError) as refused:
            prober.run("true", policy)
        assert any(SERVICES_PART in u for u in refused.value.unenforced), refused.value
    else:
        return False
    record(probe, prober.backend, "unenforced")
    return True


def test_another_task_cannot_reach_this_tasks_service(prober: Prober) -> None:
    if _cannot(prober, "service-container-other-task"):
        return
    with_images(prober)
    (prober.worktree / "pg.js").write_text(PG_CLIENT_JS)
    policy = SandboxPolicy.model_validate(POLICY)
    a_ready = threading.Event()
    b_done = threading.Event()
    out: dict[str, Any] = {}

    def task_a() -> None:
        # A keeps its task (and its container) alive until B has looked.
        out["a"] = prober.run(
            "node pg.js 127.0.0.1:5432 'create table a_only(x int)' >/dev/null; "
            "node pg.js 127.0.0.1:5432 \"select 'a-was-here'\"; "
            "touch a.ready; i=0; while [ ! -e b.done ] && [ $i -lt 600 ]; do "
            "sleep 0.1; i=$((i+1)); done",
            policy,
            timeout_ms=120_000,
            task_id="svc-task-a",
        )

    thread = threading.Thread(target=task_a)
    thread.start()
    try:
        ready = prober.worktree / "a.ready"
        for _ in range(1200):
            if ready.exists():
                break
            thread.join(0.1)
        a_ready.set()
        assert ready.exists(), out
        b = prober.run(
            "node pg.js 127.0.0.1:5432 "
            "\"select count(*) from pg_tables where tablename = 'a_only'\"; "
            "for h in db 10.88.0.1 172.17.0.1; do node pg.js $h:5432 'select 1' | head -1; done",
            policy,
            timeout_ms=120_000,
            task_id="svc-task-b",
        )
    finally:
        (prober.worktree / "b.done").touch()
        b_done.set()
        thread.join(180)
    a = out["a"]
    assert "a-was-here" in a.stdout, a  # A's own service answered A
    lines = b.stdout.split()
    assert lines[:1] == ["0"], b  # B's own database answered B, without A's table
    leaked = lines[:1] != ["0"] or "a-was-here" in b.stdout
    check("service-container-other-task", prober.backend, leaked, f"B saw {b.stdout!r}")


def test_the_hosts_network_cannot_reach_the_tasks_service(prober: Prober) -> None:
    if _cannot(prober, "service-container-host-network"):
        return
    with_images(prober)

    policy = SandboxPolicy.model_validate(POLICY)
    seen: dict[str, Any] = {}

    def look() -> None:
        # While the task runs: the host's view of its service container.
        adapter = service_adapter(prober.backend)
        try:
            found = [
                f
                for f in adapter.list_labelled("io.fusion-oci.task-id", "svc-host-net")
                if f.kind == "container" and f.labels.get("io.fusion-oci.kind") == "service"
            ]
            seen["containers"] = len(found)
            _, pid, _ = adapter.container_state(found[0].id)
        finally:
            adapter.close()
        with open(f"/proc/{pid}/net/dev") as dev:
            seen["interfaces"] = sorted(line.split(":")[0].strip() for line in dev.readlines()[2:])
        with socket.socket() as s:
            s.settimeout(2)
            seen["host-loopback"] = s.connect_ex(("127.0.0.1", 5432))

    def task() -> None:
        seen["result"] = prober.run(
            "touch look.now; i=0; while [ ! -e look.done ] && [ $i -lt 300 ]; do sleep 0.1; "
            "i=$((i+1)); done",
            policy,
            timeout_ms=60_000,
            task_id="svc-host-net",
        )

    thread = threading.Thread(target=task)
    thread.start()
    try:
        marker = prober.worktree / "look.now"
        for _ in range(1200):
            if marker.exists():
                break
            thread.join(0.1)
        assert marker.exists(), seen
        look()
    finally:
        (prober.worktree / "look.done").touch()
        thread.join(120)
    assert seen["containers"] == 1, seen
    leaked = seen["interfaces"] != ["lo"] or seen["host-loopback"] == 0
    check("service-container-host-network", prober.backend, leaked, f"{seen}")
