"""Per-task service containers (issue #35, ``policy.services``): what must not reach them, on
every backend.

- ``service-container-other-task``: two tasks run side by side, each with its own ``db``
  (images/postgres). Task A writes a row into its database; task B, with the same settings,
  looks for that row and tries every address it could reach A's container by. B must see
  only its own (empty) database: the row, or any answer from A's container, is a leak.
- ``service-container-host-network``: from the host, while the task lives, nothing answers
  for its service: not the service's port on the host's loopback, not any address of the
  container (it has no interface but ``lo``: read from its own ``/proc/PID/net/dev``).

native cannot run service containers and lists them as unenforced. The rootless backends run
them on their user's rootless engine. kubernetes runs them in the task's pod, on its own
loopback; there the probes are sharper, because a pod has an address other pods route to: A's
service listens on every address of A's pod (``listen_addresses=*``), and B, and the host, try
A's pod address itself (the pod's NetworkPolicy admits no ingress). A command's files come back
from a pod only when it ends, so there the two tasks take turns instead of waiting on files.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.sandbox import SyncSandbox
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
    """native: the services are listed as unenforced, and the probe is recorded so. True
    when that was the case."""
    if prober.backend != "native":
        return False
    result = prober.run("true", SandboxPolicy.model_validate(POLICY))
    assert any(SERVICES_PART in u for u in result.unenforced), result
    record(probe, prober.backend, "unenforced")
    return True


TCP_JS = r"""
// node tcp.js HOST:PORT...: "open" or "closed CODE" for each, in order.
const net = require('net');
async function one(target) {
  const i = target.lastIndexOf(':');
  return new Promise((done) => {
    const c = net.connect(Number(target.slice(i + 1)), target.slice(0, i));
    c.setTimeout(3000, () => { c.destroy(); done('closed TIMEOUT'); });
    c.on('connect', () => { c.destroy(); done('open'); });
    c.on('error', (e) => done('closed ' + e.code));
  });
}
(async () => { for (const t of process.argv.slice(2)) console.log(await one(t)); })();
"""


def _kube_sandbox(prober: Prober, policy: SandboxPolicy, task_id: str) -> SyncSandbox:
    from tests.backends import backend_settings

    sb = SyncSandbox(
        backend_settings(prober.backend, policy=policy),
        env=prober.env,
        cache_root=prober.tmp / "cache",
    )
    sb.prepare(
        PrepareContext(
            task_id=task_id, run_id="run", policy=policy, worktree_path=str(prober.worktree)
        )
    )
    return sb


def _pod_address(task_id: str) -> str:
    from tests.cluster.kube import Kube, cluster_env
    from tests.contract.harness import CONTRACT_NAMESPACE

    pods = Kube.from_env(cluster_env()).get("pods", namespace=CONTRACT_NAMESPACE)["items"]
    (pod,) = [
        p
        for p in pods
        if p["metadata"]["name"].startswith(f"fusion-oci-{task_id}-")
        and not p["metadata"].get("deletionTimestamp")
    ]
    return str(pod["status"]["podIP"])


def _kube_policy(prober: Prober, *, everywhere: bool, network: str = "none") -> SandboxPolicy:
    db = with_images(prober)
    if everywhere:
        # the entrypoint's own `listen_addresses=127.0.0.1` comes first; the last -c wins
        db = {**db, "command": ["/usr/local/bin/fusion-postgres", "-c", "listen_addresses=*"]}
    return SandboxPolicy.model_validate({"network": network, "services": [db]})


def _kube_other_task(prober: Prober) -> None:
    (prober.worktree / "pg.js").write_text(PG_CLIENT_JS)
    (prober.worktree / "tcp.js").write_text(TCP_JS)
    exposed = _kube_policy(prober, everywhere=True)
    timeout = RunOptions(timeout_ms=60_000, env=prober.env)
    a = _kube_sandbox(prober, exposed, "svc-task-a")
    try:
        address = _pod_address("svc-task-a")
        wrote = a.run(
            "node pg.js 127.0.0.1:5432 'create table a_only(x int)' >/dev/null; "
            "node pg.js 127.0.0.1:5432 \"select 'a-was-here'\"; "
            f"node tcp.js {address}:5432",
            timeout,
        )
        # B may reach other pods (`egress`): only A's policy (no ingress) keeps it out
        b_policy = _kube_policy(prober, everywhere=False, network="egress")
        with _kube_sandbox(prober, b_policy, "svc-task-b") as b:
            seen = b.run(
                "node pg.js 127.0.0.1:5432 "
                "\"select count(*) from pg_tables where tablename = 'a_only'\"; "
                f"node tcp.js {address}:5432",
                timeout,
            )
    finally:
        a.dispose()
    assert "a-was-here" in wrote.stdout, wrote  # A's own service answered A ...
    assert wrote.stdout.split()[-1:] == ["open"], wrote  # ... on A's pod address too
    lines = seen.stdout.split("\n")
    assert lines[:1] == ["0"], seen  # B's own database answered B, without A's table
    leaked = lines[:1] != ["0"] or "a-was-here" in seen.stdout or "open" in seen.stdout
    check("service-container-other-task", prober.backend, leaked, f"B saw {seen.stdout!r}")


def _kube_host_network(prober: Prober) -> None:
    policy = _kube_policy(prober, everywhere=True)
    with _kube_sandbox(prober, policy, "svc-host-net"):
        address = _pod_address("svc-host-net")
        seen: dict[str, int] = {}
        for name, host in (("pod-address", address), ("host-loopback", "127.0.0.1")):
            with socket.socket() as s:
                s.settimeout(3)
                seen[name] = s.connect_ex((host, 5432))
    leaked = 0 in seen.values()
    check("service-container-host-network", prober.backend, leaked, f"{seen}")


def test_another_task_cannot_reach_this_tasks_service(prober: Prober) -> None:
    if _cannot(prober, "service-container-other-task"):
        return
    if prober.backend in REMOTE:
        _kube_other_task(prober)
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
    if prober.backend in REMOTE:
        _kube_host_network(prober)
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
