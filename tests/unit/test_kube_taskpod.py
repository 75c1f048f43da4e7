"""What the kubernetes runtime reads from the objects it watches (taskpod.py). Pure."""

from __future__ import annotations

from typing import Any

from fusion_oci.runtimes.kubernetes.taskpod import claim_ready, pod_state, services_state


def test_a_claim_is_ready_only_with_its_sandbox_named() -> None:
    assert claim_ready({}) == (None, "no status yet")
    cond = {"type": "Ready", "status": "False", "reason": "Pending", "message": "no warm pod"}
    pending = {"status": {"conditions": [cond]}}
    assert claim_ready(pending) == (None, "Pending: no warm pod")
    unnamed = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert claim_ready(unnamed)[0] is None
    ready = {"status": {"sandbox": {"name": "sb-1"},
                        "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip
    assert claim_ready(ready) == ("sb-1", "ready")


def test_pod_states() -> None:
    assert pod_state({}) == ("waiting", "phase Pending")
    running = {"status": {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]}}
    assert pod_state(running) == ("running", "running")
    never = {"status": {"containerStatuses": [{"state": {"waiting": {
        "reason": "ErrImageNeverPull", "message": "not present"}}}]}}  # fmt: skip
    assert pod_state(never) == ("failed", "ErrImageNeverPull: not present")
    ended = {"status": {"containerStatuses": [{"state": {"terminated": {
        "reason": "Error", "exitCode": 1}}}]}}  # fmt: skip
    assert pod_state(ended) == ("failed", "container ended: Error (exit 1)")


def test_a_pod_with_service_containers_runs_with_its_task_and_fails_with_any() -> None:
    def pod(task: dict[str, Any], db: dict[str, Any], ready: bool = False) -> dict[str, Any]:
        return {"status": {"phase": "Running", "containerStatuses": [
            {"name": "task", "state": task, "ready": True},
            {"name": "svc-db", "state": db, "ready": ready},
        ]}}  # fmt: skip

    starting = pod({"running": {}}, {"waiting": {"reason": "ContainerCreating"}})
    assert pod_state(starting) == ("running", "running")
    assert services_state(starting, ["svc-db"]) == (
        "waiting",
        "svc-db: not ready (ContainerCreating)",
    )
    assert services_state(pod({"running": {}}, {"running": {}}, True), ["svc-db"]) == (
        "ready",
        "ready",
    )
    root = pod({"running": {}}, {"waiting": {"reason": "CreateContainerConfigError",
                                             "message": "image has non-numeric user"}})  # fmt: skip
    assert pod_state(root) == (
        "failed",
        "svc-db: CreateContainerConfigError: image has non-numeric user",
    )
    ended = pod({"running": {}}, {"terminated": {"reason": "Error", "exitCode": 2}})
    assert services_state(ended, ["svc-db"]) == (
        "failed",
        "svc-db: container ended: Error (exit 2)",
    )
    waiting_task = pod({"waiting": {"reason": "ContainerCreating"}}, {"running": {}})
    assert pod_state(waiting_task) == ("waiting", "task: ContainerCreating")


def test_a_found_object_contains_what_we_set_plus_the_servers_defaults() -> None:
    from fusion_oci.runtimes.kubernetes.provision import contains

    want = {"podTemplate": {"spec": {"containers": [{"name": "task", "image": "a:1"}]}}}
    defaulted = {
        "podTemplate": {
            "spec": {
                "containers": [{"name": "task", "image": "a:1", "imagePullPolicy": "Never"}],
                "dnsPolicy": "ClusterFirst",
            }
        }
    }
    assert contains(defaulted, want)
    other_image = {"podTemplate": {"spec": {"containers": [{"name": "task", "image": "b:1"}]}}}
    assert not contains(other_image, want)
    extra = {"podTemplate": {"spec": {"containers": [{"name": "task", "image": "a:1"}, {}]}}}
    assert not contains(extra, want), "a container added beside ours"
    assert not contains({}, want) and not contains(None, want)
