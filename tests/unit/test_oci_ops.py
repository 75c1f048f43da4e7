"""The spec operations of fusion_oci.oci.ops: each a pure typed spec -> spec function. The golden of
each op is what it changed (every top-level section that differs, before and after)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from fusion_oci.oci import ops
from fusion_oci.oci.model import ConfigSpec
from tests.golden import assert_golden
from tests.unit.test_oci_plan import POLICIES, spec_for

HOOK = ops.EgressHook("/s/1.egress-request", "/s/1.egress-reply", "/s/resolv.conf")

OPS: dict[str, tuple[str, Callable[[ConfigSpec], ConfigSpec]]] = {
    "init": ("egress", lambda s: ops.with_init(s, "/usr/bin/tini-static")),
    "rootfs": ("egress", lambda s: ops.with_rootfs(s, "/cache/oci-rootfs/abc/rootfs")),
    "egress-hook": ("egress", lambda s: ops.with_egress_hook(s, HOOK)),
    "resolv-conf": ("egress", lambda s: ops.with_resolv_conf(s, "/s/resolv.conf")),
    "without-netns": ("egress", ops.without_network_namespace),
    "cgroups-path": ("none-limits", lambda s: ops.with_cgroups_path(s, "fusion-oci.1.ab")),
    "rootless": ("none-limits", lambda s: ops.with_rootless(s, 1000, 1000)),
    "rootless-host-network": ("host", lambda s: ops.with_rootless(s, 1000, 1000)),
}


def changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The sections (``linux`` and ``process`` one level down, mounts by value) that the op
    changed."""
    out: dict[str, Any] = {}
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if key == "mounts" and old != new:
            # Mounts by value: which were added and which went (a changed one is both).
            out[key] = {
                "added": [m for m in new if m not in old],
                "removed": [m for m in old if m not in new],
            }
        elif key in ("linux", "process") and isinstance(old, dict) and isinstance(new, dict):
            for sub in sorted(set(old) | set(new)):
                if old.get(sub) != new.get(sub):
                    out[f"{key}.{sub}"] = {"before": old.get(sub), "after": new.get(sub)}
        elif old != new:
            out[key] = {"before": old, "after": new}
    return out


@pytest.mark.parametrize("name", sorted(OPS))
def test_golden_op(name: str, oci_validator: Any) -> None:
    policy, op = OPS[name]
    spec = spec_for(POLICIES[policy])
    pristine = copy.deepcopy(spec.to_oci())
    out = op(spec).to_oci()
    assert spec.to_oci() == pristine, "an op must not change its input"
    oci_validator.validate(out)
    assert_golden(f"oci/ops/{name}.json", changed(pristine, out))


def test_rootless_maps_tmpfs_owners_to_root_inside() -> None:
    out = ops.with_rootless(spec_for(POLICIES["egress"]), 1000, 1000)
    home = next(m for m in out.task.mounts if m.destination == "/home/sandbox")
    assert "uid=0" in (home.options or []) and "uid=1000" not in (home.options or [])
