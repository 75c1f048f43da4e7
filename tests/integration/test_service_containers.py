"""Per-task service containers (issue #35, ``policy.services``) for real: a PostgreSQL container
of ``images/postgres`` started at prepare, reached by the task's commands at 127.0.0.1:5432 on
every runtime (a PostgreSQL wire-protocol client in plain Node.js, tests/services_world.py,
and ``psql`` where the sandbox has the host's /usr), and gone after dispose, a timeout, an
abort, a failed prepare and, after a crash, ``gc``.

Every backend of tests/security through its ``prober``. native cannot give a task a loopback
of its own: it lists the services as unenforced. The rootless backends are driven as an
unprivileged user: their services run on that user's rootless engine, whose containers'
namespaces the relay reaches through a helper that joins the engine's user namespace first
(fusion_oci/services/netns.py). kubernetes runs them as containers beside the task's in its
pod (the test cluster's nodes have the image imported: no registry), where the commands reach
them on the pod's own loopback (tests/cluster/test_kube_services.py tests them further).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.engines import connect
from fusion_oci.engines.labels import LABEL_TASK
from fusion_oci.errors import SandboxSetupError
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox
from fusion_oci.sidecars.run import _endpoints
from tests.backends import backend_settings, require_runtime
from tests.integration.service_images import ensure_service_image
from tests.security.conftest import (  # noqa: F401 - the fixtures, shared with the probes
    REMOTE,
    ROOTLESS_BACKENDS,
    Prober,
    backend,
    dockerless_user,
    prober,
    rootless_user,
)
from tests.services_world import PG_CLIENT_JS

SERVICES_PART = "services (per-task service containers)"

DB: dict[str, Any] = {
    "name": "db",
    "image": "postgres",
    "env": {"POSTGRES_DB": "app"},
    "port": 5432,
    "ready": "pg_isready -q",
}


def services_env(backend_id: str) -> dict[str, str]:
    """Where the service containers' engine is: the CI's sockets (scripts/services.sh env)."""
    env: dict[str, str] = {}
    if os.environ.get("FUSION_OCI_PODMAN_URL"):
        env["CONTAINER_HOST"] = os.environ["FUSION_OCI_PODMAN_URL"]
    if backend_id == "docker" and os.environ.get("DOCKER_HOST"):
        env["DOCKER_HOST"] = os.environ["DOCKER_HOST"]
    return env


def service_engine(backend_id: str) -> str:
    return "docker" if backend_id == "docker" else "podman"


def with_images(prober: Prober) -> dict[str, Any]:  # noqa: F811 - the fixture's value
    """The service images where ``prober``'s backend runs them; the ``db`` service as that
    backend names its image (kubernetes: the reference the nodes have, imported)."""
    if prober.backend in REMOTE:
        from tests.cluster.kube import load_image

        ref = ensure_service_image("podman", "postgres").ref
        load_image(ref)
        return {**DB, "image": ref}
    if prober.backend in ("podman", "docker"):
        from tests.integration.images_fixture import ensure_node_image

        ensure_node_image(prober.backend)  # the task's own image
    if prober.backend in ROOTLESS_BACKENDS:
        # the user's own engine runs them (the one its task runs on), from its own store
        ensure_service_image(prober.backend, "postgres")
    elif prober.backend != "native":
        ensure_service_image(service_engine(prober.backend), "postgres")
        prober.env.update(services_env(prober.backend))
    return DB


def service_adapter(backend_id: str) -> Any:
    """The engine that runs ``backend_id``'s service containers, as the tests (root) reach
    it: a rootless backend's user's own engine, else the CI's rootful one."""
    if backend_id in ROOTLESS_BACKENDS:
        from tests.integration.images_fixture import open_target, target_of

        return open_target(target_of(backend_id))
    engine = service_engine(backend_id)
    return connect(engine, _endpoints(engine, SandboxSettings(), services_env(backend_id)))  # type: ignore[arg-type]


def client_script() -> str:
    node = "node pg.js"
    return "; ".join(
        [
            f"{node} 127.0.0.1:5432 'select 40+2'",
            f"{node} 127.0.0.1:5432 'select count(*) from generate_series(1,5000)'",
            "if command -v psql >/dev/null; then "
            "psql -h 127.0.0.1 -p 5432 -U postgres -d app -Atc 'select current_database()'; "
            "pg_isready -h 127.0.0.1 -p 5432 -q && echo ready; "
            "else echo app; echo ready; fi",
        ]
    )


@pytest.mark.parametrize("network", ["none", "filtered"])
def test_a_task_reaches_its_own_postgres_with_real_clients(
    prober: Prober,  # noqa: F811 - the fixture imported above
    network: str,
) -> None:
    db = with_images(prober)
    (prober.worktree / "pg.js").write_text(PG_CLIENT_JS)
    policy = SandboxPolicy.model_validate({"network": network, "services": [db]})
    if prober.backend == "native":
        result = prober.run("true", policy)
        assert any(SERVICES_PART in u for u in result.unenforced), result
        return
    task = f"pg-{network}"
    result = prober.run(client_script(), policy, timeout_ms=120_000, task_id=task)
    assert result.exit_code == 0, (result.stdout, result.stderr[-2000:])
    assert result.stdout.split() == ["42", "5000", "app", "ready"], result
    if prober.backend in REMOTE:
        from tests.cluster.kube import Kube, cluster_env
        from tests.contract.harness import CONTRACT_NAMESPACE

        # disposed: the pod (and with it the service container) is gone or going
        pods = Kube.from_env(cluster_env()).get("pods", namespace=CONTRACT_NAMESPACE)["items"]
        left = [
            p["metadata"]["name"]
            for p in pods
            if p["metadata"]["name"].startswith(f"fusion-oci-{task}-")
            and not p["metadata"].get("deletionTimestamp")
        ]
        assert left == [], left
        return
    # disposed: no container of the task's in its engine, no namespace helper of ours
    adapter = service_adapter(prober.backend)
    try:
        left = [f.name for f in adapter.list_labelled(LABEL_TASK, task) if f.kind == "container"]
    finally:
        adapter.close()
    assert left == [], left
    helpers = subprocess.run(["pgrep", "-f", "shims/nssockets.py"], capture_output=True, text=True)
    assert helpers.stdout == "", helpers.stdout


def _settings(backend_id: str, policy: SandboxPolicy) -> SandboxSettings:
    return backend_settings(backend_id, policy=policy)


def _ours(task_id: str) -> list[str]:
    """The names of the containers labelled with ``task_id`` in rootful podman."""
    env = services_env("bubblewrap")
    adapter = connect("podman", _endpoints("podman", SandboxSettings(), env))
    try:
        return [
            f.name
            for f in adapter.list_labelled(LABEL_TASK, task_id)
            if f.kind == "container" and f.labels.get("io.fusion-oci.kind") == "service"
        ]
    finally:
        adapter.close()


@pytest.fixture
def bwrap_task(tmp_path: Path) -> dict[str, Any]:
    require_runtime("bubblewrap")
    ensure_service_image("podman", "postgres")
    from tests.conftest import git_init

    wt = git_init(tmp_path / "wt")
    (wt / "pg.js").write_text(PG_CLIENT_JS)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        **services_env("bubblewrap"),
    }
    return {"wt": wt, "env": env, "cache": tmp_path / "cache"}


def _sandbox(
    t: dict[str, Any], policy: SandboxPolicy, audit: AuditLog | None = None
) -> SyncSandbox:
    return SyncSandbox(
        _settings("bubblewrap", policy), env=t["env"], cache_root=t["cache"], audit=audit
    )


def _ctx(t: dict[str, Any], task_id: str, policy: SandboxPolicy) -> PrepareContext:
    return PrepareContext(task_id=task_id, run_id="r1", policy=policy, worktree_path=str(t["wt"]))


def test_dispose_a_timeout_and_an_abort_leave_no_container(bwrap_task: dict[str, Any]) -> None:
    policy = SandboxPolicy.model_validate({"network": "none", "services": [DB]})
    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    sb = _sandbox(bwrap_task, policy, audit)
    sb.prepare(_ctx(bwrap_task, "svc-life", policy))
    try:
        assert len(_ours("svc-life")) == 1
        timed = sb.run("sleep 30", RunOptions(timeout_ms=500))
        assert timed.timed_out
        threading.Timer(0.5, sb.abort).start()
        aborted = sb.run("sleep 30", RunOptions(timeout_ms=30_000))
        assert aborted.reason == "aborted"
        # The service outlives a command's timeout or abort (the task goes on) ...
        after = sb.run("node pg.js 127.0.0.1:5432 'select 7'", RunOptions(timeout_ms=30_000))
        assert after.stdout.split() == ["7"], after
    finally:
        sb.dispose()
    # ... and not the task.
    assert _ours("svc-life") == []
    prepared = next(e for e in events if e.type == "sandbox:prepare")
    (svc,) = (prepared.details or {})["services"]
    assert svc["name"] == "db" and svc["env_names"] == ["POSTGRES_DB"]
    assert isinstance(svc["ready_ms"], int)
    relayed = [
        e for e in events if e.type == "sandbox:egress" and (e.details or {}).get("container")
    ]
    assert relayed and all((e.rule or "").startswith("policy.services[0] 'db'") for e in relayed)


def test_a_service_that_never_gets_ready_fails_prepare_and_is_removed(
    bwrap_task: dict[str, Any],
) -> None:
    policy = SandboxPolicy.model_validate(
        {"network": "none", "services": [{**DB, "ready": "exit 3", "readyTimeoutS": 3}]}
    )
    sb = _sandbox(bwrap_task, policy)
    try:
        with pytest.raises(SandboxSetupError, match="did not start") as err:
            sb.prepare(_ctx(bwrap_task, "svc-never", policy))
        assert "exited 3" in err.value.render() and "services[0]" in err.value.render()
    finally:
        sb.dispose()
    assert _ours("svc-never") == []


CRASHING = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    from fusion_oci.models import PrepareContext, SandboxPolicy
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.sandbox import SyncSandbox
    cfg = json.loads(sys.argv[1])
    policy = SandboxPolicy.model_validate(cfg["policy"])
    sb = SyncSandbox(SandboxSettings(backend="bubblewrap", policy=policy), env=cfg["env"],
                     cache_root=Path(cfg["cache"]))
    sb.prepare(PrepareContext(task_id="svc-crash", run_id="r1", policy=policy,
                              worktree_path=cfg["wt"]))
    print("prepared", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_gc_removes_the_services_of_a_crashed_owner(bwrap_task: dict[str, Any]) -> None:
    import json

    from fusion_oci.gc import gc

    policy = SandboxPolicy.model_validate({"network": "none", "services": [DB]})
    cfg = {
        "policy": policy.model_dump(mode="json", by_alias=True),
        "env": bwrap_task["env"],
        "cache": str(bwrap_task["cache"]),
        "wt": str(bwrap_task["wt"]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING, json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "prepared" in proc.stdout
    assert len(_ours("svc-crash")) == 1  # what the crash left
    report = gc(env=bwrap_task["env"], engines=("podman",))
    assert any("svc-crash" in r for r in report.removed), report
    assert _ours("svc-crash") == []


def test_a_warm_postgres_is_ready_within_two_seconds_of_prepare(
    bwrap_task: dict[str, Any],
) -> None:
    """issue #35's bound, on a warm image: from the container's create to ``pg_isready``
    (what the prepare event records as ``ready_ms``). Measured 3 times; the median counts."""
    policy = SandboxPolicy.model_validate({"network": "none", "services": [DB]})
    ready: list[int] = []
    for i in range(3):
        events: list[AuditEvent] = []
        audit = AuditLog()
        audit.subscribe(events.append)
        with _sandbox(bwrap_task, policy, audit) as sb:
            started = time.monotonic()
            sb.prepare(_ctx(bwrap_task, f"svc-warm-{i}", policy))
            whole = time.monotonic() - started
        prepared = next(e for e in events if e.type == "sandbox:prepare")
        ready.append(int((prepared.details or {})["services"][0]["ready_ms"]))
        print(f"postgres ready {ready[-1]} ms; prepare {whole * 1000:.0f} ms")
    assert sorted(ready)[1] < 2000, ready


def test_a_prepare_cancelled_while_services_start_leaves_no_container(
    bwrap_task: dict[str, Any],
) -> None:
    """An abort of the task while its services are still starting (the caller cancels
    prepare): what was created is removed before the cancellation ends."""
    import asyncio

    from fusion_oci.sandbox import Sandbox

    # A ready command that never succeeds keeps prepare waiting for the services.
    policy = SandboxPolicy.model_validate(
        {"network": "none", "services": [{**DB, "ready": "exit 1"}]}
    )

    async def main() -> None:
        sb = Sandbox(
            _settings("bubblewrap", policy), env=bwrap_task["env"], cache_root=bwrap_task["cache"]
        )
        task = asyncio.ensure_future(sb.prepare(_ctx(bwrap_task, "svc-cancel", policy)))
        # Until its container exists (read in-process: podman's list waits for the locks of
        # a container that is being exec'd into, as its ready command is here).
        for _ in range(600):
            await asyncio.sleep(0.05)
            if sb.sidecars is not None and any(s.container for s in sb.sidecars.started):
                break
        assert sb.sidecars is not None and sb.sidecars.started[0].container, "never started"
        await asyncio.sleep(0.5)  # in the ready loop
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sb.dispose()

    asyncio.run(main())
    assert _ours("svc-cancel") == []


REDIS_JS = r"""
// node redis.js HOST: AUTH with $1's password, PING, SET/GET; prints the replies' first lines.
const c = require('net').connect(6379, process.argv[2]);
c.setTimeout(8000, () => { console.log('timeout'); process.exit(2); });
c.on('error', (e) => { console.log('error ' + e.code); process.exit(2); });
c.write('AUTH ' + process.argv[3] + '\r\nPING\r\nSET k fusion\r\nGET k\r\n');
let out = '';
c.on('data', (d) => {
  out += d;
  if (out.split('\r\n').length > 5) {
    console.log(out.split('\r\n').filter(Boolean).join(' '));
    process.exit(0);
  }
});
"""


def test_a_task_reaches_its_own_redis_by_address_and_by_name(bwrap_task: dict[str, Any]) -> None:
    ensure_service_image("podman", "redis")
    (bwrap_task["wt"] / "redis.js").write_text(REDIS_JS)
    cache = {
        "name": "cache",
        "image": "redis",
        "env": {"REDIS_PASSWORD": "pw"},
        "port": 6379,
        "ready": "redis-cli -a pw ping | grep -q PONG",
    }
    policy = SandboxPolicy.model_validate({"network": "none", "services": [cache]})
    with _sandbox(bwrap_task, policy) as sb:
        sb.prepare(_ctx(bwrap_task, "svc-redis", policy))
        result = sb.run(
            "node redis.js 127.0.0.1 pw; node redis.js cache pw", RunOptions(timeout_ms=30_000)
        )
    assert result.stdout.splitlines() == ["+OK +PONG +OK $6 fusion"] * 2, result
    assert _ours("svc-redis") == []


def test_settings_show_plan_and_doctor_list_the_services(worktree: Path) -> None:
    """The CLI as a user runs it, with the issue's spelling (``sandbox.services``): each
    service, where the task reaches it, and its env by name only."""
    import json

    from tests.integration.test_cli import cli

    (worktree / ".fusion").mkdir(exist_ok=True)
    (worktree / ".fusion/settings.yaml").write_text(
        "sandbox:\n  backend: bubblewrap\n  policy: {network: none}\n  services:\n"
        "    - {name: db, image: postgres, env: {POSTGRES_PASSWORD: hunter2}, port: 5432,"
        " ready: pg_isready}\n"
    )
    env = {"FUSION_OCI_NO_SERVER": "1"}
    shown = cli("settings", "show", "--json", cwd=worktree, env=env)
    assert shown.returncode == 0, shown.stderr
    rows = {r["key"]: r for r in json.loads(shown.stdout)}
    assert rows["services.container[0]"]["value"] == "db=postgres"
    assert "POSTGRES_PASSWORD" in rows["services.container[0]"]["source"]
    plan = cli("plan", "--", "psql", cwd=worktree, env=env)
    assert plan.returncode == 0, plan.stderr
    assert "services db: image postgres, reached by the task only at 127.0.0.1:5432" in plan.stdout
    data = json.loads(cli("plan", "--json", "--", "psql", cwd=worktree, env=env).stdout)
    assert data["services"][0]["reachedAt"] == ["127.0.0.1:5432", "db:5432"]
    doctor = cli("doctor", "--json", cwd=worktree, env=env)
    assert json.loads(doctor.stdout)["configured"]["services"][0]["name"] == "db"
    # The values are the settings' own (settings show and the plan's policy print the
    # settings, as for every key); the lines about the services and doctor name them only.
    lines = [line for line in plan.stdout.splitlines() if line.startswith("services ")]
    assert lines and "hunter2" not in " ".join(lines) and "hunter2" not in doctor.stdout


def test_a_full_image_reference_and_a_port_only_readiness(bwrap_task: dict[str, Any]) -> None:
    """A user's own reference (here the built image by its full name: no registry is
    reachable on these machines, so nothing else can be pulled) is used as the engine has
    it; without ``ready``, the port accepting a connection is ready."""
    ref = ensure_service_image("podman", "postgres").ref
    svc = {
        "name": "pg",
        "image": ref,
        "port": 5433,
        "command": ["/usr/local/bin/fusion-postgres", "-p", "5433"],
    }
    policy = SandboxPolicy.model_validate({"network": "none", "services": [svc]})
    with _sandbox(bwrap_task, policy) as sb:
        sb.prepare(_ctx(bwrap_task, "svc-ref", policy))
        result = sb.run("node pg.js pg:5433 'select 9'", RunOptions(timeout_ms=30_000))
    assert result.stdout.split() == ["9"], result


@pytest.mark.parametrize("runtime", ["bubblewrap", "landlock", "podman"])
def test_a_host_grant_and_a_service_side_by_side(
    bwrap_task: dict[str, Any], tmp_path: Path, runtime: str
) -> None:
    """The relays serve the grants first, then the services: each endpoint reaches its own
    upstream (the host's server for the grant, the container for the service)."""
    from tests.services_world import listening

    require_runtime(runtime)
    if runtime == "podman":
        from tests.integration.images_fixture import ensure_node_image

        ensure_node_image("podman")
    sock = tmp_path / "svc"
    sock.mkdir()
    sock.chmod(0o755)
    with listening([sock / "host.sock"]) as host:
        policy = SandboxPolicy.model_validate(
            {
                "network": "none",
                "hostServices": [f"127.0.0.1:{host.port}", f"unix:{sock / 'host.sock'}"],
                "services": [DB],
            }
        )
        project = tmp_path / "project"  # landlock: the project's .fusion/ outside the worktree
        project.mkdir()
        ctx = PrepareContext(
            task_id=f"svc-mixed-{runtime}",
            run_id="r1",
            policy=policy,
            worktree_path=str(bwrap_task["wt"]),
            project_dir=str(project),
        )
        settings = _settings(runtime, policy)
        with SyncSandbox(settings, env=bwrap_task["env"], cache_root=bwrap_task["cache"]) as sb:
            sb.prepare(ctx)
            # landlock keeps the host's /etc/hosts: the service by its address only there.
            by_name = "127.0.0.1" if runtime == "landlock" else "db"
            result = sb.run(
                f"node pg.js 127.0.0.1:5432 'select 5'; node pg.js {by_name}:5432 'select 6'; "
                f"node -e \"require('net').connect({host.port}, '127.0.0.1')"
                ".on('connect', () => process.exit(0))\" && echo host",
                RunOptions(timeout_ms=60_000),
            )
        time.sleep(0.3)
    assert result.stdout.split() == ["5", "6", "host"], result
    assert "tcp4" in host.seen, host.seen
