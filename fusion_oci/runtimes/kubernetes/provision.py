"""Making a task shape's SandboxTemplate and SandboxWarmPool: the cluster-side provisioning.

A shape's template and pool outlive the task that first needs them (tasks of the same shape
share them and their ready pods), and a pool keeps pods running: like the first build of an
image, that is what the ``sandbox_provision`` gate guards (an executor that may run tasks may
still be refused the right to leave pods running in the team's cluster). A shape that exists
already asks nothing. Each call is retried with tenacity when the API server did not answer or
was busy (429, 5xx), never on a refusal; every attempt's end is an audited
``sandbox:provision`` event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fusion_oci.errors import SandboxSetupError
from fusion_oci.images.gates import GateRequest, ProvisionGate
from fusion_oci.runtimes.kubernetes.agentsandbox import SandboxObjects
from fusion_oci.runtimes.kubernetes.client import ApiError, KubeClient, path_of, retrying


async def ensure_shape(
    client: KubeClient,
    objs: SandboxObjects,
    namespace: str,
    gate: ProvisionGate,
    *,
    attempts: int = 4,
    wait_s: float = 1.0,
    sleep: Callable[[float], None] | None = None,
) -> bool:
    """The shape's template and pool exist in ``namespace`` afterwards; True when this call
    made them. Raises :class:`~fusion_oci.errors.GateDeniedError` when the gate says no and
    :class:`~.client.ApiError` when the API server refuses or stays unreachable."""
    name = objs.template["metadata"]["name"]
    template_path = path_of(objs.template, namespace)
    found = await asyncio.to_thread(
        _found, client, f"{template_path}/{name}", attempts, wait_s, sleep
    )
    if found is not None:
        _check_template(found, objs.template, namespace)
        return False
    await gate.check(
        GateRequest(
            "sandbox_provision",
            "create",
            f"SandboxTemplate and SandboxWarmPool {name} (namespace {namespace}, "
            f"{objs.pool['spec']['replicas']} ready pods)",
            "kubernetes",
            reason="the first task of this shape on the cluster",
            alternative="set sandbox.gates.sandboxProvision: allow for this project",
        )
    )
    for obj in (objs.template, objs.pool):
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(_create, client, obj, namespace, attempts, wait_s, sleep)
        except ApiError as exc:
            _audit(gate, obj, "failed", t0, str(exc.why))
            raise
        _audit(gate, obj, "ok", t0, None)
    return True


def _found(
    client: KubeClient,
    path: str,
    attempts: int,
    wait_s: float,
    sleep: Callable[[float], None] | None,
) -> dict[str, Any] | None:
    def get() -> dict[str, Any] | None:
        try:
            return client.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    return retrying(get, attempts=attempts, wait_s=wait_s, sleep=sleep)


def contains(found: Any, want: Any) -> bool:
    """Whether ``found`` (an object as the API server returns it) holds everything of
    ``want``: the server adds defaults and status, never takes away what we set. Pure."""
    if isinstance(want, dict):
        return isinstance(found, dict) and all(
            k in found and contains(found[k], v) for k, v in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(found, list)
            and len(found) == len(want)
            and all(contains(f, w) for f, w in zip(found, want, strict=True))
        )
    return bool(found == want)


def _check_template(found: dict[str, Any], want: dict[str, Any], namespace: str) -> None:
    """The template found under the shape's content-hash name must be the shape: whoever may
    create SandboxTemplates in the namespace could take the name first (or edit it) with
    another image, command, mount or security context, and every claim of ours would run it."""
    if contains(found.get("spec"), want["spec"]):
        return
    name = want["metadata"]["name"]
    raise SandboxSetupError(
        f"the SandboxTemplate {name} in namespace {namespace} is not fusion-oci's",
        "its spec differs from the shape its name (a hash of the content) stands for: "
        "someone else made or changed it",
        f"delete it and its pool (`kubectl -n {namespace} delete sandboxtemplate,"
        f"sandboxwarmpool {name}`) and find out who could, or give fusion-oci a namespace of "
        "its own",
    )


def _create(
    client: KubeClient,
    obj: dict[str, Any],
    namespace: str,
    attempts: int,
    wait_s: float,
    sleep: Callable[[float], None] | None,
) -> None:
    def create() -> None:
        try:
            client.create(path_of(obj, namespace), obj)
        except ApiError as exc:
            # Another executor made the same shape first (or our retried create landed).
            if exc.status != 409:
                raise

    retrying(create, attempts=attempts, wait_s=wait_s, sleep=sleep)


def _audit(
    gate: ProvisionGate, obj: dict[str, Any], outcome: str, t0: float, error: str | None
) -> None:
    kind, name = obj["kind"], obj["metadata"]["name"]
    gate.ctx.emit(
        "sandbox:provision",
        f"create {kind} {name}: {outcome}" + (f" ({error})" if error else ""),
        duration_ms=int((time.monotonic() - t0) * 1000),
        action="create",
        ref=f"{kind}/{name}",
        engine="kubernetes",
        outcome=outcome,
        error=error,
    )
