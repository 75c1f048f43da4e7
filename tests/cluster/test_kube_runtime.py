"""The ``kubernetes`` runtime on the real cluster, beyond the contract suite (which runs it in
pods mode, tests/contract/harness.py):

- sandbox mode: the shape's SandboxTemplate and SandboxWarmPool made behind the provision
  gate, each task a SandboxClaim on the pool, a warm pod handed over; tasks whose worktrees
  share a folder share the shape; nothing of a task is left after dispose (the shape stays);
- the executor's least Role (docs/kubernetes.md) is enough to run a task, and without it the
  task fails with a typed error naming the Role;
- ``fusion-oci gc`` removes what an executor killed with ``kill -9`` left (its pod and policy);
- an API server that does not answer at prepare is retried, then a clear ``engine-error``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.errors import FusionOCIError
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.policy.settings import GateSettings, SandboxSettings
from fusion_oci.runtimes.kubernetes.client import KubeClient
from fusion_oci.runtimes.kubernetes.gc import collect_cluster
from fusion_oci.runtimes.kubernetes.kubeconfig import find_access
from fusion_oci.sandbox import Sandbox
from tests.cluster.kube import Kube, wait_for
from tests.cluster.test_kube_mapping_cluster import _service_account
from tests.conftest import git_init

ROOT = Path(__file__).resolve().parents[2]


def _settings(kube: Kube, ns: str, kubeconfig: Path | None = None, **kw: Any) -> SandboxSettings:
    return SandboxSettings(
        backend="kubernetes",
        image=kube.node_image,
        gates=GateSettings(sandbox_provision="allow"),
        kubernetes=KubernetesSettings(
            kubeconfig=str(kubeconfig or kube.kubeconfig),
            namespace=ns,
            seccomp_profile="fusion-oci/task.json",
            node_networks=["10.231.0.0/16"],
            **kw,
        ),
    )


def _ctx(worktree: Path, task: str) -> PrepareContext:
    return PrepareContext(
        task_id=task,
        run_id="r1",
        worktree_path=str(worktree),
        policy=SandboxPolicy(allow_network=False),
        project_dir=str(worktree.parent / "project"),
    )


def _ours(kube: Kube, ns: str, kind: str) -> list[str]:
    items = kube.get(kind, namespace=ns)["items"]
    return sorted(
        i["metadata"]["name"]
        for i in items
        if i["metadata"].get("labels", {}).get("app.kubernetes.io/managed-by") == "fusion-oci"
        and not i["metadata"].get("deletionTimestamp")
    )


def _running(kube: Kube, ns: str) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in kube.get("pods", namespace=ns)["items"]
        if p.get("status", {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    ]


async def test_sandbox_mode_claims_a_warm_pod_and_shares_the_shape(
    kube: Kube, ns: str, tmp_path: Path
) -> None:
    (tmp_path / "project").mkdir()
    settings = _settings(kube, ns, mode="sandbox", warm_pool=2)
    prepared: list[float] = []
    for i in range(3):
        wt = git_init(tmp_path / f"wt{i}")
        (wt / "hello.txt").write_text(f"task {i}\n")
        if i == 1:
            # the pool has made its pods by now: the next claims are handed warm ones
            wait_for("two warm pods", lambda: len(_running(kube, ns)) >= 2 or None, 180)
        async with Sandbox(settings, cache_root=tmp_path / "cache") as sb:
            t0 = time.monotonic()
            await sb.prepare(_ctx(wt, f"claim-{i}"))
            prepared.append(time.monotonic() - t0)
            r = await sb.run("cat hello.txt; echo made > out.txt", RunOptions(timeout_ms=30_000))
            assert (r.exit_code, r.stdout) == (0, f"task {i}\n"), r
        assert (wt / "out.txt").read_text() == "made\n", "the command's file came back"
    templates = _ours(kube, ns, "sandboxtemplates")
    assert len(templates) == 1, f"one shape for worktrees in one folder: {templates}"
    assert _ours(kube, ns, "sandboxwarmpools") == templates
    wait_for("no claim left", lambda: not _ours(kube, ns, "sandboxclaims") or None, 60)
    print("\nsandbox mode prepare (claim, pod running, streams):", [round(p, 2) for p in prepared])


async def test_the_least_role_runs_a_task_and_without_it_the_error_names_it(
    kube: Kube, ns: str, tmp_path: Path
) -> None:
    (tmp_path / "project").mkdir()
    kubeconfig = _service_account(kube, ns, "executor", tmp_path, bound=True)
    wt = git_init(tmp_path / "wt")
    async with Sandbox(
        _settings(kube, ns, kubeconfig, mode="pods"), cache_root=tmp_path / "c"
    ) as sb:
        await sb.prepare(_ctx(wt, "role-ok"))
        r = await sb.run("echo ok", RunOptions(timeout_ms=30_000))
        assert (r.exit_code, r.stdout) == (0, "ok\n"), r
    unbound = _service_account(kube, ns, "nobody", tmp_path, bound=False)
    with pytest.raises(FusionOCIError) as refused:
        async with Sandbox(
            _settings(kube, ns, unbound, mode="pods"), cache_root=tmp_path / "c2"
        ) as sb:
            await sb.prepare(_ctx(wt, "role-missing"))
    assert refused.value.kind == "engine-error", refused.value.render()
    assert "403" in refused.value.render() and "docs/kubernetes.md" in refused.value.render()


DRIVER = """
import asyncio, json, sys
from pathlib import Path
from fusion_oci.models import PrepareContext, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import Sandbox

async def main() -> None:
    settings = SandboxSettings.model_validate(json.loads(sys.argv[1]))
    ctx = PrepareContext.model_validate(json.loads(sys.argv[2]))
    sb = Sandbox(settings, cache_root=Path(sys.argv[3]))
    await sb.prepare(ctx)
    print("prepared", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_gc_removes_what_a_killed_executor_left(kube: Kube, ns: str, tmp_path: Path) -> None:
    (tmp_path / "project").mkdir()
    wt = git_init(tmp_path / "wt")
    settings = _settings(kube, ns, mode="pods")
    proc = subprocess.Popen(
        [
            sys.executable, "-c", DRIVER,
            settings.model_dump_json(by_alias=True), _ctx(wt, "killed").model_dump_json(),
            str(tmp_path / "cache"),
        ],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"prepared"
        assert _ours(kube, ns, "pods") and _ours(kube, ns, "networkpolicies")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    access = find_access(settings.kubernetes, {})
    assert access is not None
    # by task: another task's gc keeps them; this task's takes them (the pod carries its id)
    other = collect_cluster(KubeClient(access, 20), ns, task_id="another")
    assert not other.removed and any("kubernetes pods " in k for k in other.kept), other
    report = collect_cluster(KubeClient(access, 20), ns, task_id="killed")
    assert not report.errors, report.errors
    assert any(r.startswith("kubernetes pods ") for r in report.removed), report
    assert any(r.startswith("kubernetes networkpolicies ") for r in report.removed), report
    wait_for("the pod gone", lambda: not _ours(kube, ns, "pods") or None, 60)
    assert not _ours(kube, ns, "networkpolicies")
    # the shared ConfigMaps are no task's: a gc of everything takes those no pod mounts
    everything = collect_cluster(KubeClient(access, 20), ns)
    assert not everything.errors, everything.errors
    assert not _ours(kube, ns, "configmaps"), "the tools no pod mounts go too"


async def test_an_api_server_that_does_not_answer_is_an_engine_error(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    wt = git_init(tmp_path / "wt")
    (tmp_path / "project").mkdir()
    settings = SandboxSettings(
        backend="kubernetes",
        image="localhost/fusion-oci/node:none",
        kubernetes=KubernetesSettings(
            kubeconfig=str(kubeconfig), request_timeout_s=2, seccomp_profile="fusion-oci/task.json"
        ),
    )
    t0 = time.monotonic()
    with pytest.raises(FusionOCIError) as failed:
        async with Sandbox(settings, cache_root=tmp_path / "c") as sb:
            await sb.prepare(_ctx(wt, "unreachable"))
    assert failed.value.kind == "engine-error", failed.value.render()
    assert "127.0.0.1:9" in failed.value.render(), failed.value.render()
    assert time.monotonic() - t0 < 60


async def test_twenty_concurrent_tasks_spread_over_both_nodes(
    kube: Kube, ns: str, tmp_path: Path
) -> None:
    (tmp_path / "project").mkdir()
    settings = _settings(kube, ns, mode="pods")

    async def task(i: int) -> tuple[str, str]:
        wt = git_init(tmp_path / f"wt{i}")
        (wt / "n.txt").write_text(f"{i}\n")
        async with Sandbox(settings, cache_root=tmp_path / "cache") as sb:
            await sb.prepare(_ctx(wt, f"many-{i}"))
            r = await sb.run("cat n.txt; echo done > out.txt", RunOptions(timeout_ms=120_000))
            assert (r.exit_code, r.stdout) == (0, f"{i}\n"), r
            pod = sb.runtime._pod  # type: ignore[union-attr]
            node = kube.get("pod", pod, namespace=ns)["spec"]["nodeName"]
        assert (wt / "out.txt").read_text() == "done\n"
        return pod, str(node)

    t0 = time.monotonic()
    placed = await asyncio.gather(*(task(i) for i in range(20)))
    took = time.monotonic() - t0
    nodes = {node for _, node in placed}
    assert nodes == {"fusion-oci-n1", "fusion-oci-n2"}, placed
    assert len({pod for pod, _ in placed}) == 20
    wait_for("every task pod gone", lambda: not _ours(kube, ns, "pods") or None, 120)
    print(f"\n20 concurrent tasks: {took:.1f} s; per node:",
          {n: sum(1 for _, m in placed if m == n) for n in sorted(nodes)})  # fmt: skip


async def test_a_planted_tools_configmap_is_refused(kube: Kube, ns: str, tmp_path: Path) -> None:
    """The tools ConfigMap is shared and named by its content's hash; a co-tenant of the
    namespace could take the name first with another agent binary, which every pod of ours
    would run. Found under our name with other content: refused, nothing started."""
    import base64

    from fusion_oci.runtimes.kubernetes.tools import load_tools

    name = load_tools().name
    planted = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name},
        "immutable": True,
        "binaryData": {"fusion-oci-agent": base64.b64encode(b"#!/bin/sh\necho owned\n").decode()},
    }
    kube.apply(planted, namespace=ns)
    (tmp_path / "project").mkdir()
    wt = git_init(tmp_path / "wt")
    with pytest.raises(FusionOCIError) as refused:
        async with Sandbox(_settings(kube, ns, mode="pods"), cache_root=tmp_path / "c") as sb:
            await sb.prepare(_ctx(wt, "planted"))
    assert "is not fusion-oci's" in refused.value.render(), refused.value.render()
    assert not _ours(kube, ns, "pods"), "nothing of the task was started"
