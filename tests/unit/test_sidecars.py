"""Per-task service containers (issue #35, ``policy.services``): the settings, the spec's
annotations, the create arguments (golden) and what ``settings show``/``plan``/``doctor`` say.
Pure; the containers themselves run in tests/integration/test_service_containers.py."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest
from pydantic import ValidationError

from fusion_oci.engines.labels import Owner
from fusion_oci.models import PrepareContext, SandboxPolicy, ServiceContainer
from fusion_oci.models.hostservice import HostService
from fusion_oci.oci.spec import compile_task
from fusion_oci.policy.layout import resolve_layout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sidecars.plan import plan_service, ready_argv
from fusion_oci.sidecars.show import service_lines, service_rows, service_summary
from tests.golden import GOLDEN_HOST, assert_golden

DB = {
    "name": "db",
    "image": "postgres",
    "env": {"POSTGRES_PASSWORD": "secret", "POSTGRES_DB": "app"},
    "port": 5432,
    "ready": "pg_isready",
}
CACHE = {"name": "cache", "image": "redis", "port": 6379, "ready": "redis-cli ping"}


def test_the_issue_spelling_is_read_at_sandbox_services_and_at_policy_services() -> None:
    top = SandboxSettings.model_validate({"services": [DB, CACHE]})
    inner = SandboxSettings.model_validate({"policy": {"services": [DB, CACHE]}})
    assert top == inner
    assert [s.name for s in top.policy.services] == ["db", "cache"]
    assert top.policy.services[0] == ServiceContainer(**DB)  # type: ignore[arg-type]
    assert top.policy.service_endpoints() == [
        HostService("tcp", address="127.0.0.1", port=5432),
        HostService("tcp", address="127.0.0.1", port=6379),
    ]
    with pytest.raises(ValidationError, match=r"both sandbox\.services and sandbox\.policy"):
        SandboxSettings.model_validate({"services": [DB], "policy": {"services": [CACHE]}})


@pytest.mark.parametrize(
    ("services", "extra", "says"),
    [
        ([{**DB, "name": "Db"}], {}, "not a host name"),
        ([{**DB, "name": "db_1"}], {}, "not a host name"),
        ([{**DB, "name": "localhost"}], {}, "sandbox's own name"),
        ([DB, {**CACHE, "name": "db"}], {}, r"name is taken by services\[0\]"),
        ([DB, {**CACHE, "port": 5432}], {}, r"port 5432 is taken by services\[0\]"),
        ([{**DB, "port": 4040}], {}, "dashboard"),
        ([{**DB, "port": 70000}], {}, "less than 65536"),
        ([{**DB, "port": 3128}], {"network": "filtered"}, "proxy's forwarder"),
        ([DB], {"network": "host"}, "services with network host"),
        ([DB], {"hostServices": ["127.0.0.1:5432"]}, r"granted already as a host service"),
        ([{**DB, "env": {"A=B": "x"}}], {}, "not an environment variable name"),
        ([{**DB, "flavour": "x"}], {}, "Extra inputs are not permitted"),
    ],
)
def test_a_bad_service_is_a_settings_error_naming_it_and_the_fix(
    services: list[dict[str, object]], extra: dict[str, object], says: str
) -> None:
    with pytest.raises(ValidationError, match=says) as err:
        SandboxPolicy.model_validate({"services": services, **extra})
    assert "services" in str(err.value)


def test_no_service_keeps_every_policy_hash_and_services_show_in_the_summary() -> None:
    assert SandboxPolicy().digest() == SandboxPolicy(services=[]).digest()
    policy = SandboxPolicy.model_validate({"services": [DB, CACHE]})
    assert policy.digest() != SandboxPolicy().digest()
    assert policy.summary().endswith("containers=db,cache")


def _task(policy: SandboxPolicy, tmp_path: Path) -> object:
    ctx = PrepareContext(task_id="t1", run_id="r1", worktree_path=str(tmp_path), policy=policy)
    layout = resolve_layout(ctx, cache_root=tmp_path / "c", ca_bundle=None, create=False)
    return compile_task(ctx, layout, GOLDEN_HOST)


def test_the_spec_relays_the_services_after_the_grants_and_names_them(tmp_path: Path) -> None:
    policy = SandboxPolicy.model_validate(
        {"network": "none", "hostServices": ["[::1]:6380"], "services": [DB, CACHE]}
    )
    spec = _task(policy, tmp_path)
    assert [str(g) for g in spec.host_services] == [  # type: ignore[attr-defined]
        "[::1]:6380",
        "127.0.0.1:5432",
        "127.0.0.1:6379",
    ]
    assert spec.service_containers == (("db", 5432), ("cache", 6379))  # type: ignore[attr-defined]
    plain = _task(SandboxPolicy(network="none"), tmp_path)
    assert plain.host_services == () and plain.service_containers == ()  # type: ignore[attr-defined]


OWNER = Owner(pid=4242, start="777", boot="boot-id", host="machine")


@pytest.mark.parametrize("engine", ["podman", "docker"])
def test_a_service_container_has_no_network_and_carries_its_owner(engine: str) -> None:
    plan = plan_service(
        ServiceContainer.model_validate(DB),
        "localhost/fusion-oci/postgres:abc",
        engine=engine,  # type: ignore[arg-type]
        task_id="t1",
        owner=OWNER,
        nonce="n0",
        rlimits={"nofile": (1024, 4096), "nproc": (512, 512)},
    )
    assert plan.create["network_mode"] == "none"
    assert plan.create["labels"]["io.fusion-oci.kind"] == "service"
    assert_golden(f"sidecars/{engine}-create.json", {"create": plan.create, "notes": plan.notes})
    # The env's values go to the engine, never into the notes (plan, audit).
    assert "secret" not in " ".join(plan.notes)


def test_the_task_resolves_each_service_name_to_its_own_loopback(tmp_path: Path) -> None:
    from dataclasses import replace

    from fusion_oci.sidecars.run import hosts_text

    assert hosts_text(["db", "cache"], "fusion-sandbox") == (
        "127.0.0.1\tlocalhost fusion-sandbox\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
        "127.0.0.1\tdb cache\n"
    )
    policy = SandboxPolicy.model_validate({"network": "none", "services": [DB]})
    ctx = PrepareContext(task_id="t1", run_id="r1", worktree_path=str(tmp_path), policy=policy)
    layout = resolve_layout(ctx, cache_root=tmp_path / "c", ca_bundle=None, create=False)
    spec = compile_task(ctx, replace(layout, hosts_file="/h/hosts"), GOLDEN_HOST)
    (hosts,) = [m for m in spec.mounts if m.destination == "/etc/hosts"]
    assert hosts.source == "/h/hosts" and "ro" in (hosts.options or [])
    plain = compile_task(ctx, layout, GOLDEN_HOST)
    assert not [m for m in plain.mounts if m.destination == "/etc/hosts"]


def test_ready_is_a_shell_command_line_or_the_port_alone() -> None:
    assert ready_argv(ServiceContainer.model_validate(DB)) == ["/bin/sh", "-c", "pg_isready"]
    assert ready_argv(ServiceContainer(name="x", image="i", port=1)) is None


def test_settings_show_plan_and_doctor_name_each_service_without_env_values() -> None:
    policy = SandboxPolicy.model_validate({"services": [DB, CACHE]})
    summary = service_summary(policy)
    assert summary[0]["reachedAt"] == ["127.0.0.1:5432", "db:5432"]
    assert summary[0]["envNames"] == ["POSTGRES_DB", "POSTGRES_PASSWORD"]
    rows = service_rows(policy)
    assert [r["key"] for r in rows] == ["services.container[0]", "services.container[1]"]
    assert rows[0]["value"] == "db=postgres"
    text = repr(summary) + repr(rows) + "".join(service_lines(summary))
    assert "secret" not in text and "POSTGRES_PASSWORD" in text


def test_netns_sockets_connect_inside_the_namespace_they_were_given(tmp_path: Path) -> None:
    """The current namespace stands in for a container's: a socket made on the helper thread
    connects to a listener of this namespace (the integration tests use real containers)."""
    if os.geteuid() != 0:
        pytest.fail("setns needs CAP_SYS_ADMIN: the suite runs as root (scripts/test.sh)")
    from fusion_oci.services.netns import NetnsSockets

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    sockets = NetnsSockets.of_pid(os.getpid(), "self")
    try:
        sock = asyncio.run(sockets.connect(port, 5.0))
        conn, _ = server.accept()
        sock.close()
        conn.close()
    finally:
        sockets.close()
        server.close()


def test_a_namespace_that_cannot_be_entered_is_an_error_at_once(tmp_path: Path) -> None:
    """setns of something that is no network namespace fails in the helper thread's start:
    an OSError from the constructor, not a broken pool at the first connection."""
    from fusion_oci.services.netns import NetnsSockets

    plain = tmp_path / "not-a-namespace"
    plain.write_text("")
    with pytest.raises(OSError, match="cannot enter the network namespace"):
        NetnsSockets(os.open(plain, os.O_RDONLY))


def test_filtered_lets_http_clients_reach_the_services_directly(tmp_path: Path) -> None:
    from fusion_oci.models import RunOptions
    from fusion_oci.oci.spec import compile_process

    policy = SandboxPolicy.model_validate(
        {"network": "filtered", "hostServices": ["[::1]:6380"], "services": [DB, CACHE]}
    )
    ctx = PrepareContext(task_id="t1", run_id="r1", worktree_path=str(tmp_path), policy=policy)
    layout = resolve_layout(ctx, cache_root=tmp_path / "c", ca_bundle=None, create=False)
    process = compile_process(ctx, layout, GOLDEN_HOST, "true", RunOptions(), {})
    env = dict(e.split("=", 1) for e in process.env)
    assert env["NO_PROXY"] == "::1,127.0.0.1,localhost,db,cache"


def test_what_keeps_a_runtime_from_running_services_is_said_at_check() -> None:
    from fusion_oci.sidecars import SERVICES_PART, services_missing

    assert services_missing(False, True, SandboxSettings(), {}) == []
    (native,) = services_missing(True, False, SandboxSettings(), {})
    assert native.startswith(SERVICES_PART) and "host's network" in native


def test_prebuild_provisions_the_services_images_too() -> None:
    from fusion_oci.images.ops import referenced_images

    settings = SandboxSettings.model_validate(
        {"image": "node", "services": [DB, CACHE, {**DB, "name": "db2", "port": 5433}]}
    )
    assert referenced_images(settings) == ["node", "postgres", "redis"]
