"""A task's objects on the cluster: made, watched until the pod runs, and removed.

Every call is one bounded request of :class:`~.client.KubeClient` run off the event loop;
creates are retried on transient answers (no answer, 429, 5xx) with tenacity, as
provisioning is, then fail with the API server's words. Waiting for the pod reads its status
until the container runs, and stops at once, with the kubelet's reason, on a state that will
not get better by waiting (an image the node does not have, a config the runtime refuses).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fusion_oci.errors import SandboxSetupError
from fusion_oci.runtimes.kubernetes.client import ApiError, KubeClient, path_of, retrying
from fusion_oci.runtimes.kubernetes.pod import SERVICE_PREFIX

HOPELESS = frozenset(
    {
        "ErrImageNeverPull",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)
"""Container waiting reasons that do not resolve by waiting (for a task's pod)."""


async def ensure(client: KubeClient, obj: Mapping[str, Any], namespace: str) -> bool:
    """``obj`` exists afterwards (a shared object: made by whoever came first). True when
    this call made it."""
    path = path_of(obj, namespace)
    name = obj["metadata"]["name"]

    def make() -> bool:
        try:
            found = client.get(f"{path}/{name}")
        except ApiError as exc:
            if exc.status != 404:
                raise
        else:
            _check_same(found, obj, namespace)
            return False
        try:
            client.create(path, obj)
        except ApiError as exc:
            if exc.status == 409:  # made meanwhile by another task
                _check_same(client.get(f"{path}/{name}"), obj, namespace)
                return False
            raise
        return True

    return await asyncio.to_thread(retrying, make)


SHARED_CONTENT = ("binaryData", "data", "immutable")
"""What a shared object's content is (a ConfigMap of programs or certificates): the name is
its hash, but anyone who may create ConfigMaps in the namespace could take the name first."""


def _check_same(found: Mapping[str, Any], obj: Mapping[str, Any], namespace: str) -> None:
    """A shared object found under our content-hash name must hold our content: a co-tenant of
    the namespace could have planted another agent binary under it, and every pod of ours
    would run it."""
    for key in SHARED_CONTENT:
        if key in obj and found.get(key) != obj[key]:
            name = obj["metadata"]["name"]
            raise SandboxSetupError(
                f"the {obj['kind']} {name} in namespace {namespace} is not fusion-oci's",
                f"its {key} differs from what its name (a hash of the content) stands for: "
                "someone else made it",
                f"delete it (`kubectl -n {namespace} delete {obj['kind'].lower()} {name}`) and "
                "find out who could, or give fusion-oci a namespace of its own",
            )


async def create(
    client: KubeClient, objs: Sequence[Mapping[str, Any]], namespace: str
) -> list[dict[str, Any]]:
    """Create ``objs`` in order (a pod's NetworkPolicy before the pod); the objects as the
    API server stored them."""
    made: list[dict[str, Any]] = []
    for obj in objs:
        path = path_of(obj, namespace)

        def make(obj: Mapping[str, Any] = obj, path: str = path) -> dict[str, Any]:
            return client.create(path, obj)

        made.append(await asyncio.to_thread(retrying, make))
    return made


async def remove(
    client: KubeClient, objs: Sequence[Mapping[str, Any]], namespace: str
) -> list[str]:
    """Delete ``objs`` (last made, first gone); an object already gone is fine. The errors,
    as text (the caller reports them; gc finds what is left by its labels)."""
    errors: list[str] = []
    for obj in reversed(objs):
        name = obj["metadata"]["name"]
        path = f"{path_of(obj, namespace)}/{name}"
        try:
            await asyncio.to_thread(retrying, lambda path=path: client.delete(path))
        except ApiError as exc:
            if exc.status != 404:
                errors.append(f"{obj['kind']} {name}: {exc.why}")
    return errors


async def wait_running(
    client: KubeClient, namespace: str, name: str, timeout_s: float, what: str
) -> dict[str, Any]:
    """The pod once its container runs; a setup error naming the kubelet's reason when it
    cannot, or after ``timeout_s``."""
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    last = "not scheduled yet"
    while True:
        pod = await asyncio.to_thread(client.get, path)
        state, detail = pod_state(pod)
        if state == "running":
            return pod
        last = detail
        if state == "failed":
            if detail.startswith(SERVICE_PREFIX):
                # a service container beside the task's: its own words, not the task image's
                raise _service_failed(namespace, name, detail, None)
            raise SandboxSetupError(
                f"the task's pod {name} could not start",
                detail,
                f"check {what}; `kubectl -n {namespace} describe pod {name}` says more",
            )
        if time.monotonic() >= deadline:
            raise SandboxSetupError(
                f"the task's pod {name} did not start within {timeout_s:.0f} s",
                last,
                "check that the cluster has room for it (`kubectl describe pod`), or raise "
                "kubernetes.startTimeoutS",
            )
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def pod_state(pod: Mapping[str, Any]) -> tuple[str, str]:
    """``running``, ``failed`` or ``waiting``, with the kubelet's words. Running: the task's
    container (``task``; a pod of one container: that one) runs; failed: any container ended
    or cannot start (a service container beside the task's too). Pure."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    if phase in ("Failed", "Succeeded"):
        return "failed", f"phase {phase}: {status.get('reason', '')} {status.get('message', '')}"
    statuses = status.get("containerStatuses") or []
    several = len(statuses) > 1

    def who(c: Mapping[str, Any]) -> str:
        return f"{c.get('name')}: " if several else ""

    waiting_for = ""
    for c in statuses:
        st = c.get("state") or {}
        if "terminated" in st:
            t = st["terminated"]
            return "failed", (
                f"{who(c)}container ended: {t.get('reason', '')} (exit {t.get('exitCode')})"
            )
        waiting = st.get("waiting") or {}
        reason = waiting.get("reason", "")
        said = f"{who(c)}{reason}" + (f": {waiting['message']}" if waiting.get("message") else "")
        if reason in HOPELESS:
            return "failed", said
        if reason and not waiting_for:
            waiting_for = said
    main = [c for c in statuses if c.get("name") == "task"] or statuses[:1]
    if any("running" in (c.get("state") or {}) for c in main):
        return "running", "running"
    if waiting_for:
        return "waiting", waiting_for
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return "waiting", f"not scheduled: {cond.get('message', '')}"
    return "waiting", f"phase {phase}"


def services_state(pod: Mapping[str, Any], containers: Sequence[str]) -> tuple[str, str]:
    """``ready`` once every one of ``containers`` (the service containers) passed its
    readiness probe, ``failed`` when one ended or cannot start, else ``waiting`` with the
    first not ready. Pure."""
    state, detail = pod_state(pod)
    if state == "failed":
        return state, detail
    by_name = {c.get("name"): c for c in (pod.get("status") or {}).get("containerStatuses") or []}
    for name in containers:
        c = by_name.get(name)
        if c is None or not c.get("ready"):
            st = (c or {}).get("state") or {}
            said = (st.get("waiting") or {}).get("reason") or ("running" if "running" in st else "")
            return "waiting", f"{name}: not ready" + (f" ({said})" if said else "")
    return "ready", "ready"


async def wait_services_ready(
    client: KubeClient,
    namespace: str,
    name: str,
    containers: Sequence[str],
    timeout_s: float,
) -> float:
    """Once every service container of the pod is ready: the seconds it took. A setup error
    naming the container and the kubelet's words (and its last log lines) when one ends or
    cannot start, or after ``timeout_s``."""
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"
    start = time.monotonic()
    delay = 0.05
    while True:
        pod = await asyncio.to_thread(client.get, path)
        state, detail = services_state(pod, containers)
        if state == "ready":
            return time.monotonic() - start
        late = time.monotonic() - start >= timeout_s
        if state == "failed" or late:
            failing = next((c for c in containers if detail.startswith(c + ":")), containers[0])
            logs = await _last_logs(client, path, failing)
            within = timeout_s if late and state != "failed" else None
            raise _service_failed(namespace, name, detail, within, logs, failing)
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.25)


def _service_failed(
    namespace: str,
    pod: str,
    detail: str,
    within: float | None,
    logs: str = "",
    container: str = "",
) -> SandboxSetupError:
    container = container or detail.partition(":")[0]
    return SandboxSetupError(
        f"the task's service container {container} did not start"
        + (f" within {within:.0f} s" if within is not None else ""),
        detail + (f"; its last lines: {logs}" if logs else ""),
        "its image must run as a numeric non-root user (images/postgres and images/redis do: "
        "uid 999) and be on the nodes or pullable by them, and its ready command must exit 0 "
        f"once it serves (`kubectl -n {namespace} describe pod {pod}` says more); or raise "
        "the service's readyTimeoutS",
    )


async def _last_logs(client: KubeClient, pod_path: str, container: str) -> str:
    """A container's last lines, for an error (empty: none, or the API did not give them)."""
    query = {"container": container, "tailLines": "8", "limitBytes": "2048"}
    try:
        # not JSON: the client hands back its first 500 characters as the "message"
        doc = await asyncio.to_thread(client.get, f"{pod_path}/log", query=query)
    except Exception:  # an error message's extra, never a second failure
        return ""
    text = str(doc.get("message") or "")
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())[-1000:]


def claim_ready(claim: Mapping[str, Any]) -> tuple[str | None, str]:
    """The bound sandbox's name once the claim is Ready (else None), and the claim's last
    words. Pure."""
    status = claim.get("status") or {}
    name = (status.get("sandbox") or {}).get("name")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            if cond.get("status") == "True" and name:
                return str(name), "ready"
            return None, f"{cond.get('reason', '')}: {cond.get('message', '')}"
    return None, "no status yet"


async def wait_claimed(
    client: KubeClient,
    namespace: str,
    claim: str,
    api: str,
    timeout_s: float,
    resource_version: str = "",
) -> str:
    """The name of the sandbox (and its pod) agent-sandbox bound to ``claim``, once Ready.

    Watched, not polled: the controller binds a warm pod in tens of milliseconds, and a poll
    either hammers the API server or sees the binding late. ``resource_version``: the
    claim's as created, so no change between the create and the watch is missed."""
    plural = f"/apis/{api}/namespaces/{namespace}/sandboxclaims"
    deadline = time.monotonic() + timeout_s
    last = "no status yet"
    version = resource_version
    while True:
        if not version:
            obj = await asyncio.to_thread(client.get, f"{plural}/{claim}")
            name, last = claim_ready(obj)
            if name is not None:
                return name
            version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        left = deadline - time.monotonic()
        if left <= 0:
            raise SandboxSetupError(
                f"the task's SandboxClaim {claim} was not bound within {timeout_s:.0f} s",
                last,
                "check the agent-sandbox controller and the warm pool "
                f"(`kubectl -n {namespace} describe sandboxclaim {claim}`), or raise "
                "kubernetes.startTimeoutS",
            )

        def ready(obj: dict[str, Any]) -> str | None:
            nonlocal last
            name, last = claim_ready(obj)
            return name

        try:
            got = await asyncio.to_thread(
                client.watch, plural, claim, version, ready, min(left, 10.0)
            )
        except ApiError as exc:
            if exc.status not in (0, 410):
                raise
            got = None
            await asyncio.sleep(0.05)  # the watch broke or its version is gone: read again
        if got is not None:
            return got
        version = ""
