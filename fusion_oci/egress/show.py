"""What ``fusion-oci settings show`` adds for a ``filtered`` network: every host the task's
proxy would allow or deny, and where each came from (the built-in profile's sources, or the
policy key)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from fusion_oci.egress.rules import ALLOW_KEY, DENY_KEY
from fusion_oci.egress.task import task_profile
from fusion_oci.models import NetworkMode, PrepareContext


def egress_rows(ctx: PrepareContext, env: Mapping[str, str]) -> list[dict[str, object]]:
    """Rows ``{"key", "value", "source"}`` (the settings table's shape): ``egress.allowed[i]``
    for the profile's hosts and allowedDomains, ``egress.denied[i]`` for deniedDomains.
    Nothing when the network is not filtered (npm and git are not even run then)."""
    if ctx.policy.network_mode is not NetworkMode.FILTERED:
        return []
    profile = asyncio.run(task_profile(ctx, env, create=False))
    allowed: list[tuple[str, str]] = [
        (h.pattern, f"built-in git/npm profile: {h.source}") for h in profile.hosts
    ]
    allowed += [(p, ALLOW_KEY) for p in ctx.policy.allowed_domains]
    rows: list[dict[str, object]] = [
        {"key": f"egress.allowed[{i}]", "value": value, "source": source}
        for i, (value, source) in enumerate(allowed)
    ]
    rows += [
        {"key": f"egress.denied[{i}]", "value": value, "source": DENY_KEY}
        for i, value in enumerate(ctx.policy.denied_domains)
    ]
    rows += [
        {
            "key": f"egress.leftOut[{i}]",
            "value": h.pattern,
            "source": f"{h.source}: not in the pin {profile.pin} (a command may have written "
            f"it); allow it in {ALLOW_KEY}, or remove the pin to pin the worktree anew",
        }
        for i, h in enumerate(profile.left_out)
    ]
    return rows
