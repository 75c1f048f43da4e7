"""The TaskSpec → Pod / agent-sandbox translation, the kubeconfig discovery and the Role, against
golden files (tests/data/kubernetes/; FUSION_OCI_UPDATE_GOLDEN=1 rewrites them: review the
diff)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from fusion_oci.errors import SettingsError
from fusion_oci.models import NetworkMode, RunOptions, SandboxPolicy
from fusion_oci.oci.model import ProcessSpec, TaskSpec
from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.kubernetes.agentsandbox import shape_of
from fusion_oci.runtimes.kubernetes.kubeconfig import find_access, kubeconfig_paths
from fusion_oci.runtimes.kubernetes.objects import TaskObjects, task_objects
from fusion_oci.runtimes.kubernetes.pod import PodService, label_value
from fusion_oci.runtimes.kubernetes.rbac import RULES, access_reviews, role
from tests.golden import assert_golden
from tests.unit.test_containers_translate import FILTERED, POLICY, task_for

AGENT = ["/opt/fusion-oci/agent", "--stdio"]
"""Stands in for the exec agent's argv (the command path is the next slice)."""
OWNER = {
    "io.fusion-oci.kind": "task",
    "io.fusion-oci.task-id": "t1",
    "io.fusion-oci.owner-host": "build-host",
    "io.fusion-oci.owner-pid": "4242",
}
TRANSFERRED = ("/srv/wt", "/srv/repo/.git")
"""The worktree and the common git folder of tests.unit.test_containers_translate's layout."""

SERVICES = SandboxPolicy.model_validate(
    {
        "network": "none",
        "services": [
            {"name": "db", "image": "postgres", "env": {"POSTGRES_DB": "app"}, "port": 5432,
             "ready": "pg_isready -q"},
            {"name": "cache", "image": "registry.example/redis:7", "port": 6379,
             "command": ["redis-server", "--bind", "127.0.0.1"]},
        ],
    }
)  # fmt: skip
"""Two service containers: a recipe's (the nodes have its local name) with a ready command,
a full reference with its own command and the port as its readiness."""


def pod_services(policy: SandboxPolicy) -> list[PodService]:
    return [
        PodService(s, "localhost/fusion-oci/postgres:feedc0ffee12", "Never")
        if s.image == "postgres"
        else PodService(s, s.image)
        for s in policy.services
    ]


CASES: dict[str, tuple[SandboxPolicy, KubernetesSettings]] = {
    "pods-egress": (POLICY, KubernetesSettings(mode="pods")),
    "pods-none": (SandboxPolicy(allow_network=False), KubernetesSettings(mode="pods")),
    "pods-filtered": (FILTERED, KubernetesSettings(mode="pods")),
    "pods-host": (SandboxPolicy(network=NetworkMode.HOST), KubernetesSettings(mode="pods")),
    "pods-localhost-seccomp": (
        POLICY,
        KubernetesSettings(
            mode="pods", seccomp_profile="fusion-oci/task.json", runtime_class="gvisor"
        ),
    ),
    "pods-services": (SERVICES, KubernetesSettings(mode="pods")),
    "sandbox-egress": (POLICY, KubernetesSettings(mode="sandbox", warm_pool=3)),
    "sandbox-cold": (SandboxPolicy(allow_network=False), KubernetesSettings(warm_pool=0)),
}


def specs(policy: SandboxPolicy, task_id: str = "t1") -> tuple[TaskSpec, ProcessSpec]:
    task = task_for(policy)
    if task_id != "t1":
        task = task_for(policy)  # the same shape: the id is only in annotations and labels
    return task.spec, task.process(AGENT, RunOptions())


def objects(case: str, owner: dict[str, str] | None = None) -> TaskObjects:
    policy, settings = CASES[case]
    task, agent = specs(policy)
    return task_objects(
        task,
        agent,
        settings,
        mode="sandbox" if case.startswith("sandbox") else "pods",
        name="fusion-oci-t1-abcd",
        image="localhost/fusion-oci/node:0123456789ab",
        owner_labels=owner or OWNER,
        transferred=TRANSFERRED,
        shutdown_time="2026-12-05T23:00:00Z" if case.startswith("sandbox") else None,
        services=pod_services(policy),
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_task_objects_golden(case: str) -> None:
    objs = objects(case)
    assert_golden(
        f"kubernetes/{case}.json",
        {
            "manifests": objs.manifests(),
            "gaps": [
                {"item": g.item, "handling": g.handling, "detail": g.detail}
                for g in objs.mapping.gaps
            ],
            "transferred": list(objs.mapping.transferred),
            "unenforced": objs.unenforced,
            "notCarried": objs.not_carried,
        },
    )


def test_the_pod_is_locked_down() -> None:
    pod = objects("pods-egress").mapping.pod
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "runAsUser": 1000,
        "runAsGroup": 1000,
    }
    assert (
        c["resources"]["limits"]
        == c["resources"]["requests"]
        == {
            "memory": "512Mi",
            "cpu": "1500m",
        }
    )
    assert "hostPath" not in str(spec["volumes"])  # a node has none of the executor's paths
    assert pod["metadata"]["labels"]["io.fusion-oci/owner-pid"] == "4242"  # a prefixed key


def test_what_a_pod_cannot_say_is_listed_never_dropped() -> None:
    objs = objects("pods-egress")
    by_item = {g.item.split(" (")[0]: g.handling for g in objs.mapping.gaps}
    # rlimits: the agent sets them per command; pids and the seccomp profile: nobody here
    assert by_item["rlimits"] == "in-pod"
    assert by_item["pidsLimit 256"] == "unenforced"
    assert by_item["seccomp"] == "unenforced"
    assert by_item["host path /opt/ref"] == "not-carried"
    assert not any(u.startswith("rlimits") for u in objs.unenforced)
    assert any(u.startswith("host path /opt/ref") for u in objs.not_carried)
    assert any(u.startswith("pidsLimit") for u in objs.unenforced)
    # the worktree and git folders are the transfer's, not lost
    assert "/srv/repo/.git/hooks" in objs.mapping.transferred
    # with a Localhost profile on the nodes the bundle's seccomp is no longer a gap
    assert not any(u.startswith("seccomp") for u in objects("pods-localhost-seccomp").unenforced)


def test_the_template_is_keyed_by_shape_not_by_task() -> None:
    a = objects("sandbox-egress")
    b = objects("sandbox-egress", {**OWNER, "io.fusion-oci.task-id": "t2"})
    assert a.sandbox is not None and b.sandbox is not None
    assert a.sandbox.template == b.sandbox.template and a.sandbox.pool == b.sandbox.pool
    assert a.sandbox.claim != b.sandbox.claim
    other = task_objects(
        *specs(SandboxPolicy(memory_limit_mb=1024)),
        KubernetesSettings(),
        mode="sandbox",
        name="x",
        image="localhost/fusion-oci/node:0123456789ab",
        owner_labels=OWNER,
        transferred=TRANSFERRED,
    )
    assert other.sandbox is not None and other.sandbox.shape != a.sandbox.shape
    template = a.sandbox.template
    assert template["metadata"]["name"] == f"fusion-oci-{a.sandbox.shape}"
    assert a.sandbox.shape == shape_of(
        {
            "metadata": {
                "labels": {
                    k: v
                    for k, v in template["spec"]["podTemplate"]["metadata"]["labels"].items()
                    if k != "io.fusion-oci/shape"
                }
            },
            "spec": template["spec"]["podTemplate"]["spec"],
        }
    )


def test_label_values_are_valid_and_distinct() -> None:
    assert label_value("t1") == "t1"
    odd = label_value("Task #7 / fix: the 'login' page")
    assert len(odd) <= 63 and odd[0].isalnum() and odd[-1].isalnum()
    assert label_value("a b") != label_value("a-b")
    assert len(label_value("x" * 100)) <= 63


def test_the_role_golden() -> None:
    assert_golden("kubernetes/role.yaml", yaml.safe_dump(role("fusion-oci"), sort_keys=False))
    reviews = access_reviews("ns")
    assert len(reviews) == sum(len(r.verbs) for r in RULES)
    exec_review = dict(reviews)["create pods/exec"]["spec"]["resourceAttributes"]
    assert exec_review == {
        "namespace": "ns",
        "verb": "create",
        "group": "",
        "resource": "pods",
        "subresource": "exec",
    }


# ------------------------------------------------------------------ settings and kubeconfig


def _kubeconfig(
    path: Path, context: str, server: str = "https://10.0.0.1:6443", **user: Any
) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": context,
                "clusters": [
                    {"name": context,
                     "cluster": {"server": server, "certificate-authority": "ca.crt"}}
                ],
                "users": [{"name": context, "user": user or {"token": "secret-token"}}],
                "contexts": [
                    {"name": context, "context": {"cluster": context, "user": context,
                                                  "namespace": f"ns-{context}"}}
                ],
            }
        )
    )  # fmt: skip
    return path


def test_kubeconfig_is_found_as_kubectl_finds_it(tmp_path: Path) -> None:
    a = _kubeconfig(tmp_path / "a", "alpha")
    b = _kubeconfig(tmp_path / "b", "beta")
    env = {"KUBECONFIG": f"{tmp_path / 'missing'}:{a}:{b}", "HOME": str(tmp_path)}
    found = find_access(KubernetesSettings(), env)
    assert found is not None
    # the first file naming a current-context wins; relative paths are the file's
    assert (found.context, found.namespace, found.ca_file) == (
        "alpha",
        "ns-alpha",
        str(tmp_path / "ca.crt"),
    )
    assert "secret-token" not in repr(found)
    beta = find_access(KubernetesSettings(context="beta", namespace="mine"), env)
    assert beta is not None and (beta.context, beta.namespace) == ("beta", "mine")
    # no KUBECONFIG: ~/.kube/config; none of them: nothing configured (not an error)
    assert kubeconfig_paths(KubernetesSettings(), {"HOME": "/h"}) == [Path("/h/.kube/config")]
    assert find_access(KubernetesSettings(), {"HOME": str(tmp_path)}) is None


def test_kubeconfig_errors_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"kubernetes\.kubeconfig"):
        find_access(KubernetesSettings(kubeconfig=str(tmp_path / "nope")), {})
    plugin = _kubeconfig(tmp_path / "p", "cloud", exec={"command": "gke-gcloud-auth-plugin"})
    with pytest.raises(SettingsError, match="exec plugin") as info:
        find_access(KubernetesSettings(kubeconfig=str(plugin)), {})
    assert "docs/kubernetes.md" in info.value.hint
    plain = _kubeconfig(tmp_path / "h", "plain", server="http://10.0.0.1:8080")
    with pytest.raises(SettingsError, match="https"):
        find_access(KubernetesSettings(kubeconfig=str(plain)), {})
    with pytest.raises(SettingsError, match="no context named 'nope'"):
        find_access(KubernetesSettings(kubeconfig=str(plain), context="nope"), {})


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("namespace", "Not_A_Namespace", "kubernetes.namespace"),
        ("runtimeClass", "gVisor!", "kubernetes.runtimeClass"),
        ("seccompProfile", "/var/lib/kubelet/seccomp/x.json", "kubernetes.seccompProfile"),
        ("mode", "fast", "auto"),
        ("warmPool", -1, "greater than or equal to 0"),
    ],
)
def test_bad_kubernetes_settings_name_the_field_and_the_fix(
    field: str, value: Any, says: str
) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SandboxSettings.model_validate({"kubernetes": {field: value}})
    assert says in str(info.value)


def test_an_unreachable_api_server_is_retried_then_a_typed_error(tmp_path: Path) -> None:
    import socket

    from fusion_oci.runtimes.kubernetes.client import ApiError, KubeClient, retrying
    from fusion_oci.runtimes.kubernetes.kubeconfig import ClusterAccess

    # a port nobody listens on: a real refused connection, no mock
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = KubeClient(
        ClusterAccess(server=f"https://127.0.0.1:{port}", namespace="default", source="test"),
        timeout_s=2,
    )
    calls: list[int] = []
    waits: list[float] = []

    def call() -> dict[str, Any]:
        calls.append(1)
        return client.get("/version")

    with pytest.raises(ApiError) as info:
        retrying(call, attempts=3, wait_s=0.5, sleep=waits.append)
    assert len(calls) == 3 and len(waits) == 2  # tenacity's waits, not slept here
    err = info.value
    assert (err.status, err.transient, err.kind) == (0, True, "engine-error")
    assert "kubectl cluster-info" in err.hint


def test_the_docs_print_the_role_the_code_checks() -> None:
    import re

    text = (Path(__file__).parents[2] / "docs" / "kubernetes.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "kind: Role" in b)
    assert yaml.safe_load(block) == role("agents")


def test_doctor_lines_mark_each_cluster_fact() -> None:
    from fusion_oci.cli.doctor import kubernetes_lines

    assert kubernetes_lines({"configured": False, "why": "no kubeconfig"}) == [
        "[bold]kubernetes[/]: - not configured (no kubeconfig)"
    ]
    down = kubernetes_lines(
        {"configured": True, "reachable": False, "source": "k (context c)", "why": "a\nhint: b"}
    )
    assert down == [
        "[bold]kubernetes[/]: [red]x[/] k (context c) unreachable",
        "    a\n    hint: b",
    ]
    up = kubernetes_lines(
        {
            "configured": True,
            "reachable": True,
            "server": "https://s:6443",
            "version": "v1.34.4",
            "namespace": "agents",
            "source": "k (context c)",
            "mode": "pods",
            "agentSandbox": {"extensions.agents.x-k8s.io/sandboxclaims": False},
            "rbac": {"ok": False, "missing": ["create pods"], "hint": "bind the Role"},
            "networkPolicy": {"enforced": None, "how": "not probed"},
            "runtimeClass": {"name": "gvisor", "exists": False, "why": "HTTP 404"},
        }
    )
    assert up[1] == "  [green]ok[/] mode: pods (agent-sandbox APIs: sandboxclaims no)"
    assert up[2] == "  [red]x[/] RBAC: missing create pods\n    hint: bind the Role"
    assert up[3] == "  [yellow]?[/] NetworkPolicy enforced: not probed"
    assert up[4] == "  [red]x[/] RuntimeClass gvisor: HTTP 404"
