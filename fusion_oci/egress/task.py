"""A task's proxy from start to gone: the scratch folder its socket lives in, the profile and
rules it enforces, and its removal.

The socket's folder is a scratch folder (:func:`fusion_oci.host.scratch.make_scratch`, kind
``egress``): only the host writes there, and when the owner is killed (``kill -9``) the proxy
thread dies with it and the next prepare's :func:`~fusion_oci.host.scratch.gc_scratch` removes the
folder and the socket file in it.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_oci.egress.pin import PinnedProfile, pin_profile
from fusion_oci.egress.profile import resolve_profile
from fusion_oci.egress.proxy import SOCKET_NAME, EgressProxy, start_proxy
from fusion_oci.egress.rules import EgressRules
from fusion_oci.errors import SandboxSetupError
from fusion_oci.host.scratch import make_scratch

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog
    from fusion_oci.egress.credentials import Broker
    from fusion_oci.models import PrepareContext

# A unix socket path has at most 107 bytes: the scratch folder's name keeps a short task id.
_TASK_ID_IN_PATH = 24


async def task_profile(
    ctx: PrepareContext, env: Mapping[str, str], *, create: bool
) -> PinnedProfile:
    """The built-in profile's hosts the task may use: what the worktree's files name only as
    pinned (:mod:`fusion_oci.egress.pin`). ``create=False`` makes no pin (dry runs)."""
    from fusion_oci.policy.layout import task_project

    worktree = Path(ctx.worktree_path)
    hosts = await resolve_profile(worktree, env)
    return await asyncio.to_thread(
        pin_profile,
        hosts,
        project=task_project(ctx),
        worktree=worktree,
        task_id=ctx.task_id,
        create=create,
    )


async def start_task_proxy(
    ctx: PrepareContext,
    env: Mapping[str, str],
    *,
    audit: AuditLog | None,
    tcp: bool,
    backend: str,
    broker: Broker | None = None,
) -> tuple[EgressProxy, PinnedProfile]:
    """Make the socket's folder, resolve the rules, start the proxy; the proxy and the
    profile it allows (for the prepare's audit event)."""
    profile = await task_profile(ctx, env, create=True)
    rules = EgressRules.from_policy(ctx.policy, [h.pattern for h in profile.hosts])
    state_dir = make_scratch("egress", ctx.task_id[:_TASK_ID_IN_PATH])
    try:
        proxy = await start_proxy(
            task_id=ctx.task_id,
            rules=rules,
            state_dir=state_dir,
            audit=audit,
            tcp=tcp,
            backend=backend,
            policy_hash=ctx.policy.digest(),
            broker=broker,
        )
    except OSError as exc:
        shutil.rmtree(state_dir, ignore_errors=True)
        raise SandboxSetupError(
            "the task's egress proxy could not start",
            f"{state_dir / SOCKET_NAME}: {exc}",
            "a unix socket path has at most 107 bytes: set TMPDIR to a short folder (e.g. /tmp)",
        ) from exc
    except BaseException:
        shutil.rmtree(state_dir, ignore_errors=True)
        raise
    proxy.set_run(ctx.run_id)
    return proxy, profile


async def stop_task_proxy(proxy: EgressProxy) -> None:
    """Stop the proxy (every tunnel closed) and remove its folder."""
    try:
        await proxy.stop()
    finally:
        shutil.rmtree(proxy.unix_socket.parent, ignore_errors=True)
