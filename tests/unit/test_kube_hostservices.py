"""Host services on the kubernetes runtime (issue #35 on #34): the pod relay's listeners and
the table that maps each listener back to its grant's relay on the executor. Pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusion_oci.errors import SandboxSetupError
from fusion_oci.models import NetworkMode, RunOptions, SandboxPolicy
from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.kubernetes.hostservices import (
    listened,
    listener_table,
    pod_mux_argv,
    published_ports,
    unix_refusals,
)
from fusion_oci.runtimes.kubernetes.pod import PodOptions, pod_grants, pod_manifest, unix_folders
from fusion_oci.runtimes.kubernetes.runtime import MUX_ARGV, KubernetesRuntime
from fusion_oci.runtimes.requirements import Requirement
from tests.unit.test_containers_translate import SERVICES, task_for

TCP = SandboxPolicy(allow_network=False, host_services=["127.0.0.1:5432", "[::1]:6379"])
MUX, AGENT = MUX_ARGV[4], MUX_ARGV[6]


def test_each_grant_is_a_listener_of_the_pods_relay_in_order() -> None:
    spec = task_for(SERVICES).spec
    sock = "unix:/var/run/postgresql/.s.PGSQL.5432"
    assert listened(spec.host_services) == ["127.0.0.1:5432", "[::1]:6379", sock]
    assert pod_mux_argv(spec) == [
        "python3", "-S", "-E", "-s", MUX,
        "--service-listen", "127.0.0.1:5432", "--service-listen", "[::1]:6379",
        "--service-listen", sock, "--agent", AGENT,
    ]  # fmt: skip
    filtered = SandboxPolicy(
        network=NetworkMode.FILTERED, allowed_domains=["a.example"], host_services=["127.0.0.2:80"]
    )
    assert pod_mux_argv(task_for(filtered).spec)[5:11] == [
        "--egress-listen", "3128", "--service-listen", "127.0.0.2:80", "--agent", AGENT,
    ]  # fmt: skip
    # without a grant nor filtered: the plain relay, as before
    assert pod_mux_argv(task_for(SandboxPolicy(allow_network=False)).spec) == MUX_ARGV


def test_the_listener_table_is_the_hosts_relays_in_the_pods_order() -> None:
    relays = {"[::1]:6379": "/s/1.sock", "127.0.0.1:5432": "/s/0.sock", "unix:/x": "/s/2.sock"}
    assert listener_table(["127.0.0.1:5432", "[::1]:6379"], relays) == ("/s/0.sock", "/s/1.sock")
    assert listener_table([], None) == ()
    with pytest.raises(SandboxSetupError) as missing:
        listener_table(["127.0.0.1:5432", "127.0.0.1:9"], {"127.0.0.1:5432": "/s/0.sock"})
    assert "127.0.0.1:9" in missing.value.why
    with pytest.raises(SandboxSetupError):
        listener_table(["127.0.0.1:5432"], None)  # no relays started (not through Sandbox)


def runtime(tmp_path: Path) -> KubernetesRuntime:
    settings = SandboxSettings(
        backend="kubernetes",
        kubernetes=KubernetesSettings(seccomp_profile="fusion-oci/task.json"),
    )
    return KubernetesRuntime(settings, {"HOME": str(tmp_path)}, cache_root=tmp_path)


def test_grants_are_enforced_and_a_socket_in_a_system_folder_refused(tmp_path: Path) -> None:
    rt = runtime(tmp_path)
    assert Requirement.HOST_SERVICES in rt.enforces()
    assert rt.check(task_for(TCP)) == []
    with_unix = SandboxPolicy(allow_network=False, host_services=SERVICES.host_services)
    assert rt.check(task_for(with_unix)) == []  # /var/run/postgresql: a folder of its own
    in_run = SandboxPolicy(allow_network=False, host_services=["unix:/run/s.sock"])
    refused = rt.check(task_for(in_run))
    assert len(refused) == 1 and refused[0].startswith("hostServices unix:/run/s.sock:"), refused
    assert "/run" in refused[0] and "TCP address" in refused[0]
    # the plan names the listeners (adopted, not prepared)
    rt.adopt(task_for(TCP))
    plan = rt.plan(rt.adopted().process(["true"], RunOptions()))
    assert "--service-listen" in plan.sandbox.sdk_kwargs["command"]
    assert any(n.startswith("host services:") for n in plan.notes)


def test_a_unix_grants_folder_is_a_volume_of_its_own_unless_the_pod_writes_there() -> None:
    grants = task_for(SERVICES).spec.host_services
    assert unix_folders(grants, ["/tmp", "/wt"]) == ["/var/run/postgresql"]
    assert unix_folders(grants, ["/var/run"]) == []  # already writable: nothing more
    tmp = [
        g for g in task_for(SandboxPolicy(host_services=["unix:/tmp/a/s.sock"])).spec.host_services
    ]
    assert unix_folders(tmp, ["/tmp"]) == [] and unix_refusals(tmp, ["/tmp"]) == []
    top = task_for(SandboxPolicy(host_services=["unix:/tmp/s.sock"])).spec.host_services
    assert unix_refusals(top, []) != []  # no writable /tmp: it would hide the image's
    assert unix_refusals(top, ["/tmp"]) == []


def test_the_pod_gets_the_sockets_folder_as_a_small_writable_volume() -> None:
    task = task_for(SERVICES)
    process = task.process(["true"], RunOptions())
    pod = pod_manifest(task.spec, process, PodOptions(name="p", image="i")).pod
    container = pod["spec"]["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/var/run/postgresql")
    assert mount["readOnly"] is False
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume == {"name": mount["name"], "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
    plain = task_for(TCP)
    no_unix = pod_manifest(
        plain.spec, plain.process(["true"], RunOptions()), PodOptions(name="p", image="i")
    ).pod
    assert "/var/run/postgresql" not in str(no_unix)


def test_a_socket_in_a_system_folder_is_a_gap_of_the_pod_never_a_volume_over_it() -> None:
    """The pod follows check's rule (export makes pods without check): no empty volume over
    /run, the grant listed unenforced instead."""
    task = task_for(SandboxPolicy(allow_network=False, host_services=["unix:/run/s.sock"]))
    mapping = pod_manifest(
        task.spec, task.process(["true"], RunOptions()), PodOptions(name="p", image="i")
    )
    mounts = mapping.pod["spec"]["containers"][0]["volumeMounts"]
    assert all(m["mountPath"] != "/run" for m in mounts), mounts
    assert [u for u in mapping.unenforced if u.startswith("hostServices unix:/run/s.sock")]


def test_a_service_containers_endpoint_is_the_pods_own_not_a_listener() -> None:
    """policy.services: the service listens on the pod's loopback itself, so the pod's relay
    listens only for the grants (the spec lists the services' endpoints among them)."""
    db = {"name": "db", "image": "postgres", "port": 5432}
    policy = SandboxPolicy.model_validate(
        {"network": "none", "hostServices": ["127.0.0.1:6379"], "services": [db]}
    )
    spec = task_for(policy).spec
    assert [str(g) for g in spec.host_services] == ["127.0.0.1:6379", "127.0.0.1:5432"]
    assert [str(g) for g in pod_grants(spec)] == ["127.0.0.1:6379"]
    argv = pod_mux_argv(spec)
    assert "127.0.0.1:6379" in argv and "127.0.0.1:5432" not in argv
    (defined,) = spec.service_definitions
    assert (defined.name, defined.image, defined.port) == ("db", "postgres", 5432)


def test_published_ports_are_the_ports_the_pods_relay_may_connect_to(tmp_path: Path) -> None:
    """publishPorts: the pod's relay connects only to the sandbox ports the spec publishes,
    each once, whatever host ports they are published on."""
    policy = SandboxPolicy.model_validate(
        {"network": "none", "publishPorts": ["3000", "8080:3000", "9000:80"]}
    )
    spec = task_for(policy).spec
    assert published_ports(spec) == [3000, 80]
    argv = pod_mux_argv(spec)
    assert argv[argv.index("--publish-port") :][:4] == [
        "--publish-port", "3000", "--publish-port", "80",
    ]  # fmt: skip
    rt = runtime(tmp_path)
    assert Requirement.PUBLISHED_PORTS in rt.enforces()
    assert rt.check(task_for(policy)) == []


def test_the_plan_names_the_pods_service_containers_and_published_ports(tmp_path: Path) -> None:
    policy = SandboxPolicy.model_validate(
        {
            "network": "none",
            "publishPorts": ["3000"],
            "services": [{"name": "db", "image": "registry.example/pg:15", "port": 5432}],
        }
    )
    rt = runtime(tmp_path)
    rt.adopt(task_for(policy))
    plan = rt.plan(rt.adopted().process(["true"], RunOptions()))
    notes = "\n".join(plan.notes)
    assert "svc-db registry.example/pg:15" in notes and "published ports:" in notes, notes
    assert "--publish-port" in plan.sandbox.sdk_kwargs["command"]
    assert "127.0.0.1:5432" not in plan.sandbox.sdk_kwargs["command"]  # served in the pod
