"""The Pod mapping and the executor's Role against the real cluster.

- A ServiceAccount bound to exactly the Role of docs/kubernetes.md (``rbac.role``) may create
  and delete everything the mapping makes, in both modes (server-side dry run: admission and
  the CRDs' schemas check each object, nothing is stored), and doctor finds nothing missing.
- Without the binding, doctor names every missing permission, and a create fails with a
  named, typed error.
- The mapping's Pod passes Pod Security Admission's ``restricted`` level in a namespace that
  enforces it, and the warm pool's pods the agent-sandbox controller makes from the template
  do too (they become Ready); a root pod is refused there (the level is really enforced).
- doctor's NetworkPolicy probe says the cluster enforces NetworkPolicy (kube-router).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from fusion_oci.errors import SandboxSetupError
from fusion_oci.models import RunOptions, SandboxPolicy
from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.runtimes.kubernetes.client import ApiError, KubeClient, path_of
from fusion_oci.runtimes.kubernetes.facts import cluster_facts
from fusion_oci.runtimes.kubernetes.kubeconfig import find_access
from fusion_oci.runtimes.kubernetes.netprobe import probe_network_policy
from fusion_oci.runtimes.kubernetes.objects import TaskObjects, task_objects
from fusion_oci.runtimes.kubernetes.rbac import role, role_binding
from tests.cluster.kube import Kube, wait_for
from tests.unit.test_containers_translate import POLICY, task_for

ROOT = Path(__file__).resolve().parents[2]
OWNER = {"io.fusion-oci.kind": "task", "io.fusion-oci.owner-pid": "4242"}


def _objects(
    kube: Kube, mode: str, policy: SandboxPolicy = POLICY, name: str = "t1", warm_pool: int = 1
) -> TaskObjects:
    task = task_for(policy, image=kube.node_image)
    agent = task.process(["sleep", "infinity"], RunOptions())
    return task_objects(
        task.spec, agent, KubernetesSettings(warm_pool=warm_pool), mode=mode,  # type: ignore[arg-type]
        name=f"fusion-oci-{name}", image=kube.node_image, owner_labels=OWNER,
        transferred=("/srv/wt", "/srv/repo/.git"), shutdown_time="2030-01-01T00:00:00Z",
    )  # fmt: skip


def _service_account(kube: Kube, ns: str, name: str, tmp: Path, *, bound: bool) -> Path:
    """A kubeconfig for ServiceAccount ``name`` of ``ns`` (a 10-minute token), bound to the
    executor's Role when ``bound``."""
    kube.run("-n", ns, "create", "serviceaccount", name)
    if bound:
        kube.apply(role(ns), role_binding(ns, name), namespace=ns)
    token = kube.run("-n", ns, "create", "token", name, "--duration=10m").stdout.strip()
    admin = yaml.safe_load(kube.kubeconfig.read_text())
    cluster = admin["clusters"][0]["cluster"]
    path = tmp / f"{name}.kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": name, "user": {"token": token}}],
                "contexts": [{"name": name, "context": {"cluster": "c", "user": name,
                                                        "namespace": ns}}],
                "current-context": name,
            }
        )
    )  # fmt: skip
    return path


def _client(kubeconfig: Path) -> KubeClient:
    access = find_access(KubernetesSettings(kubeconfig=str(kubeconfig)), {})
    assert access is not None
    return KubeClient(access, timeout_s=20)


def test_exactly_the_role_creates_and_deletes_what_the_mapping_makes(
    kube: Kube, ns: str, tmp_path: Path
) -> None:
    kubeconfig = _service_account(kube, ns, "executor", tmp_path, bound=True)
    client = _client(kubeconfig)
    facts = cluster_facts(KubernetesSettings(kubeconfig=str(kubeconfig)), {})
    assert facts["reachable"] and facts["mode"] == "sandbox", facts
    assert facts["rbac"] == {"missing": [], "ok": True}
    # both modes; sandbox with a warm pool (the claim names the pool) and without (the template)
    for mode, pool in (("pods", 1), ("sandbox", 1), ("sandbox", 0)):
        for obj in _objects(kube, mode, warm_pool=pool).manifests():
            made = client.create(path_of(obj, ns), obj, dry_run=True)
            assert (
                made["kind"] == obj["kind"] and made["metadata"]["name"] == obj["metadata"]["name"]
            )
    # delete: really, for the kinds it may make (a dry-run delete needs the object to exist)
    for obj in _objects(kube, "pods", name="del").manifests():
        client.create(path_of(obj, ns), obj)
        client.delete(f"{path_of(obj, ns)}/{obj['metadata']['name']}")
    gone = client.get(path_of(_objects(kube, "pods").mapping.pod, ns))["items"]
    assert [p for p in gone if p["metadata"].get("deletionTimestamp") is None] == []


def test_without_the_role_doctor_names_what_is_missing(kube: Kube, ns: str, tmp_path: Path) -> None:
    kubeconfig = _service_account(kube, ns, "nobody", tmp_path, bound=False)
    facts = cluster_facts(KubernetesSettings(kubeconfig=str(kubeconfig)), {})
    assert facts["reachable"] is True
    missing = facts["rbac"]["missing"]
    assert "create pods" in missing and "create pods/exec" in missing
    assert "create extensions.agents.x-k8s.io/sandboxclaims" in missing
    assert "docs/kubernetes.md" in facts["rbac"]["hint"]
    obj = _objects(kube, "pods").mapping.pod
    with pytest.raises(ApiError) as info:
        _client(kubeconfig).create(path_of(obj, ns), obj, dry_run=True)
    err = info.value
    assert (err.status, err.reason, err.kind) == (403, "Forbidden", "engine-error")
    assert "docs/kubernetes.md" in err.hint

    # the CLI: `fusion-oci doctor --json` in a project whose settings name the cluster
    project = tmp_path / "project"
    (project / ".fusion").mkdir(parents=True)
    (project / ".fusion" / "settings.yaml").write_text(
        yaml.safe_dump({"sandbox": {"kubernetes": {"kubeconfig": str(kubeconfig)}}})
    )
    env = {**os.environ, "FUSION_OCI_NO_SERVER": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "fusion_oci.cli.main", "doctor", "--json",
         "--project-dir", str(project), "--worktree", str(project)],
        capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    out = json.loads(proc.stdout)["kubernetes"]
    assert out["rbac"]["ok"] is False and "create pods" in out["rbac"]["missing"], out
    text = subprocess.run(
        [sys.executable, "-m", "fusion_oci.cli.main", "doctor",
         "--project-dir", str(project), "--worktree", str(project)],
        capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL,
    ).stdout  # fmt: skip
    assert "x RBAC: missing create pods," in text, text


def test_the_pod_passes_restricted_pod_security(kube: Kube, ns: str) -> None:
    kube.run(
        "label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    )  # fmt: skip
    client = KubeClient(find_access(KubernetesSettings(), _admin_env(kube)) or _never())
    pod = _objects(kube, "pods").mapping.pod
    client.create(path_of(pod, ns), pod, dry_run=True)
    # the level is enforced: the same pod as root is refused, naming why
    root = json.loads(json.dumps(pod))
    root["spec"]["securityContext"].update(runAsUser=0, runAsNonRoot=False)
    with pytest.raises(ApiError) as info:
        client.create(path_of(root, ns), root, dry_run=True)
    assert info.value.status == 403 and "restricted" in info.value.why
    # sandbox mode: the pods the controller makes from the template pass it too (and run)
    objs = _objects(kube, "sandbox")
    assert objs.sandbox is not None and objs.sandbox.pool is not None
    for obj in (objs.sandbox.template, objs.sandbox.pool):
        client.create(path_of(obj, ns), obj)
    shape = objs.sandbox.shape

    def ready() -> bool:
        pods = kube.get("pods", namespace=ns)["items"]
        return any(
            p["metadata"].get("labels", {}).get("io.fusion-oci/shape") == shape
            and any(c["type"] == "Ready" and c["status"] == "True"
                    for c in p.get("status", {}).get("conditions", []))
            for p in pods
        )  # fmt: skip

    wait_for("a warm pod of the template Ready under `restricted`", ready, 180)


def test_doctor_probes_networkpolicy_enforcement(kube: Kube, ns: str) -> None:
    client = KubeClient(find_access(KubernetesSettings(), _admin_env(kube)) or _never())
    result = probe_network_policy(client, ns, kube.node_image, timeout_s=120)
    assert result["enforced"] is True, result
    # the probe leaves nothing behind
    left = [p["metadata"]["name"] for p in kube.get("pods", namespace=ns)["items"]]
    assert not [n for n in left if n.startswith("fusion-oci-netprobe-")]
    assert kube.get("networkpolicies", namespace=ns)["items"] == []


def _admin_env(kube: Kube) -> dict[str, Any]:
    return {"KUBECONFIG": str(kube.kubeconfig)}


def _never() -> Any:
    raise AssertionError("the admin kubeconfig names no cluster")


async def test_a_shape_is_provisioned_once_behind_the_gate(kube: Kube, ns: str) -> None:
    from fusion_oci.audit import AuditEvent, AuditLog
    from fusion_oci.errors import GateDeniedError
    from fusion_oci.images.gates import AuditContext, ProvisionGate
    from fusion_oci.policy.settings import GateSettings
    from fusion_oci.runtimes.kubernetes.provision import ensure_shape

    client = KubeClient(find_access(KubernetesSettings(), _admin_env(kube)) or _never())
    objs = _objects(kube, "sandbox", warm_pool=0).sandbox
    assert objs is not None
    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)

    def gate(setting: str) -> ProvisionGate:
        return ProvisionGate(
            GateSettings(sandbox_provision=setting),  # type: ignore[arg-type]
            AuditContext(audit, "t1", "r1", "kubernetes"),
        )

    with pytest.raises(GateDeniedError):
        await ensure_shape(client, objs, ns, gate("deny"))
    assert kube.get("sandboxtemplates", namespace=ns)["items"] == []
    assert await ensure_shape(client, objs, ns, gate("allow")) is True
    made = [e.details["ref"] for e in events if e.type == "sandbox:provision" and e.details]
    assert made == [f"SandboxTemplate/{objs.template['metadata']['name']}",
                    f"SandboxWarmPool/{objs.pool['metadata']['name']}"]  # fmt: skip
    # the second task of the shape finds it: no gate asked, nothing made
    before = len(events)
    assert await ensure_shape(client, objs, ns, gate("deny")) is False
    assert len(events) == before
    assert kube.get("sandboxwarmpools", objs.pool["metadata"]["name"], ns)["spec"]["replicas"] == 0
    # a template edited under the shape's name (another image here) is refused: every claim
    # of ours would run it
    name = objs.template["metadata"]["name"]
    kube.run("-n", ns, "patch", "sandboxtemplate", name, "--type=json", "-p",
             '[{"op": "replace", "path": "/spec/podTemplate/spec/containers/0/image",'
             ' "value": "localhost/someone-else:1"}]')  # fmt: skip
    with pytest.raises(SandboxSetupError, match="is not fusion-oci's"):
        await ensure_shape(client, objs, ns, gate("allow"))


@pytest.mark.parametrize("warm_pool", [1, 0])
def test_a_claim_binds_a_pod_of_the_shape(kube: Kube, ns: str, warm_pool: int) -> None:
    """The objects do what they say, not only pass the schemas: the claim binds a warm pod of
    the pool (or, with none kept, a new one), which runs as the mapping says; the template's
    managed NetworkPolicy exists; deleting the claim deletes the pod."""
    client = KubeClient(find_access(KubernetesSettings(), _admin_env(kube)) or _never())
    # no CPU quota: two nodes of this 2-core machine hold a warm pod and a claimed one
    objs = _objects(kube, "sandbox", SandboxPolicy(memory_limit_mb=256), warm_pool=warm_pool)
    assert objs.sandbox is not None
    s = objs.sandbox
    for obj in (s.template, s.pool):
        client.create(path_of(obj, ns), obj)

    def ready_pods() -> list[str]:
        return sorted(
            p["metadata"]["name"]
            for p in kube.get("pods", namespace=ns)["items"]
            if p["metadata"].get("labels", {}).get("io.fusion-oci/shape") == s.shape
            and not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True"
                    for c in p.get("status", {}).get("conditions", []))
        )  # fmt: skip

    warm = wait_for("a warm pod", lambda: ready_pods() or None, 180) if warm_pool else []
    client.create(path_of(s.claim, ns), s.claim)
    claim = s.claim["metadata"]["name"]

    def bound() -> str | None:
        st = kube.get("sandboxclaim", claim, namespace=ns).get("status", {})
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", [])
        )
        name = st.get("sandbox", {}).get("name")
        return str(name) if ready and name else None

    sandbox = wait_for("the claim bound", bound, 180)
    if warm_pool:
        assert sandbox in warm, (sandbox, warm)  # adopted from the pool, not made anew
    claimed = kube.get("sandboxclaim", claim, ns)["metadata"]["labels"]
    assert claimed["io.fusion-oci/owner-pid"] == "4242"  # gc finds the claim; it owns the rest
    assert kube.get("pod", sandbox, ns)["metadata"]["labels"]["io.fusion-oci/shape"] == s.shape
    assert kube.exec(ns, sandbox, "id", "-u").stdout.strip() == "1000"
    assert kube.exec(ns, sandbox, "sh", "-c", "touch /x").returncode != 0  # read-only root
    assert kube.get("networkpolicies", namespace=ns)["items"], "no managed NetworkPolicy"
    kube.run("-n", ns, "delete", "sandboxclaim", claim, "--wait=true", timeout=120)
    wait_for("the claimed pod deleted", lambda: not kube.exists("pod", sandbox, ns), 120)
