"""Per-task service containers on the cluster (issue #35, ``policy.services``): containers
beside the task's in its pod, beyond what the prober-driven suites check on every backend
(tests/integration/test_service_containers.py reaches the pod's Postgres with real clients,
tests/security/test_service_containers.py probes other tasks and the host):

- a pod of a namespace enforcing Pod Security's ``restricted`` level runs a Postgres and a
  Redis beside the task, reached at 127.0.0.1 and by name; the prepare event records each
  service (env by name only) and when it was ready;
- sandbox mode: the shape's template carries the services, a claimed warm pod has them ready;
- a service that never gets ready fails prepare, naming the container and its readiness, and
  leaves no pod; an image that would run as root is refused by the kubelet, and the error says
  what to use instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.errors import SandboxSetupError
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.sandbox import Sandbox
from tests.cluster.kube import Kube, load_image, wait_for
from tests.cluster.test_kube_runtime import _ours, _settings
from tests.conftest import git_init
from tests.integration.service_images import ensure_service_image
from tests.integration.test_service_containers import DB, REDIS_JS
from tests.services_world import PG_CLIENT_JS

PAUSE = "localhost/fusion-oci/pause:3.10"
"""An image every node has (scripts/cluster.sh imports it) that runs as root."""


def _images() -> tuple[str, str]:
    refs = []
    for name in ("postgres", "redis"):
        ref = ensure_service_image("podman", name).ref
        load_image(ref)
        refs.append(ref)
    return refs[0], refs[1]


def _restricted(kube: Kube, ns: str) -> None:
    kube.run("label", "--overwrite", "namespace", ns,
             "pod-security.kubernetes.io/enforce=restricted")  # fmt: skip


def _ctx(wt: Path, task: str, policy: SandboxPolicy) -> PrepareContext:
    return PrepareContext(
        task_id=task,
        run_id="r1",
        worktree_path=str(wt),
        policy=policy,
        project_dir=str(wt.parent / "project"),
    )


def _policy(services: list[dict[str, Any]], network: str = "none") -> SandboxPolicy:
    return SandboxPolicy.model_validate({"network": network, "services": services})


@pytest.mark.parametrize("mode", ["pods", "sandbox"])
async def test_a_postgres_and_a_redis_beside_the_task_by_address_and_name(
    kube: Kube, ns: str, tmp_path: Path, mode: str
) -> None:
    _restricted(kube, ns)
    pg, redis = _images()
    (tmp_path / "project").mkdir()
    wt = git_init(tmp_path / "wt")
    (wt / "pg.js").write_text(PG_CLIENT_JS)
    (wt / "redis.js").write_text(REDIS_JS)
    cache = {"name": "cache", "image": redis, "env": {"REDIS_PASSWORD": "pw"}, "port": 6379,
             "ready": "redis-cli -a pw ping | grep -q PONG"}  # fmt: skip
    policy = _policy([{**DB, "image": pg}, cache])
    settings = _settings(kube, ns, mode=mode, warm_pool=1)
    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    async with Sandbox(settings, cache_root=tmp_path / "cache", audit=audit) as sb:
        await sb.prepare(_ctx(wt, f"svc-{mode}", policy))
        r = await sb.run(
            "node pg.js 127.0.0.1:5432 'select 40+2'; node pg.js db:5432 'select 7'; "
            "node redis.js 127.0.0.1 pw; node redis.js cache pw",
            RunOptions(timeout_ms=60_000),
        )
    assert r.exit_code == 0, (r.stdout, r.stderr[-2000:])
    assert r.stdout.splitlines() == ["42", "7", *["+OK +PONG +OK $6 fusion"] * 2], r
    prepared = next(e for e in events if e.type == "sandbox:prepare")
    services = (prepared.details or {})["services"]
    assert [(s["name"], s["port"], s["env_names"]) for s in services] == [
        ("db", 5432, ["POSTGRES_DB"]),
        ("cache", 6379, ["REDIS_PASSWORD"]),
    ]
    assert "pw" not in str(prepared.model_dump())  # env by name only
    print(f"\n{mode}: services ready {services[0]['ready_ms']} ms after the pod's create")
    kinds = ("pods",) if mode == "pods" else ("pods", "sandboxclaims")
    for kind in kinds:
        left = [n for n in _ours(kube, ns, kind) if f"svc-{mode}" in n]
        if kind == "pods":
            # a warm pool's own pods stay (the shape's); the task's pod is gone
            left = [n for n in left if n.startswith(f"fusion-oci-svc-{mode}-")]
        assert left == [], (kind, left)


async def test_a_service_never_ready_fails_prepare_naming_it_and_leaves_no_pod(
    kube: Kube, ns: str, tmp_path: Path
) -> None:
    pg, _ = _images()
    (tmp_path / "project").mkdir()
    wt = git_init(tmp_path / "wt")
    policy = _policy([{**DB, "image": pg, "ready": "exit 3", "readyTimeoutS": 4}])
    with pytest.raises(SandboxSetupError) as failed:
        async with Sandbox(_settings(kube, ns, mode="pods"), cache_root=tmp_path / "c") as sb:
            await sb.prepare(_ctx(wt, "svc-never", policy))
    text = failed.value.render()
    assert "svc-db" in text and "within 4 s" in text and "not ready" in text, text
    wait_for("no pod left", lambda: not _ours(kube, ns, "pods") or None, 60)


async def test_an_image_that_runs_as_root_is_refused_with_what_to_use(
    kube: Kube, ns: str, tmp_path: Path
) -> None:
    (tmp_path / "project").mkdir()
    wt = git_init(tmp_path / "wt")
    policy = _policy([{"name": "db", "image": PAUSE, "port": 5432}])
    with pytest.raises(SandboxSetupError) as failed:
        async with Sandbox(_settings(kube, ns, mode="pods"), cache_root=tmp_path / "c") as sb:
            await sb.prepare(_ctx(wt, "svc-root", policy))
    text = failed.value.render()
    assert "svc-db" in text and "CreateContainerConfigError" in text, text
    assert "numeric non-root user" in text, text
    wait_for("no pod left", lambda: not _ours(kube, ns, "pods") or None, 60)
