"""The environment as a compose service."""

from __future__ import annotations

from typing import Any

import yaml

from fusion_oci.export.common import (
    common_unexpressed,
    header,
    loopback_note,
    seccomp_note,
    tmpfs_opt,
)
from fusion_oci.export.source import ExportSource


def to_compose(src: ExportSource) -> tuple[str, list[str]]:
    missing = [*common_unexpressed(src), *seccomp_note(src), *loopback_note(src, "compose")]
    service: dict[str, Any] = {
        "image": src.image,
        "command": src.argv,
        "working_dir": src.cwd,
        "user": f"{src.uid}:{src.gid}",
        "environment": [k if v is None else f"{k}={v}" for k, v in src.env.items()],
        "read_only": src.read_only_root,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"] if src.no_new_privileges else [],
        "tmpfs": [f"{m.target}:{tmpfs_opt(m)}" for m in src.mounts if m.kind == "tmpfs"],
        "volumes": [
            {"type": "bind", "source": m.source, "target": m.target, "read_only": m.read_only}
            for m in src.mounts
            if m.kind == "bind"
        ],
        "labels": src.labels
        | ({"io.fusion-oci.image-digest": src.image_digest} if src.image_digest else {}),
    }
    if src.capabilities:
        service["cap_add"] = [c.removeprefix("CAP_") for c in src.capabilities]
    if src.hostname:
        service["hostname"] = src.hostname
    if src.network == "none":
        service["network_mode"] = "none"
    elif src.network == "host":
        service["network_mode"] = "host"
    if src.memory_bytes:
        service["mem_limit"] = src.memory_bytes
        service["memswap_limit"] = src.memory_bytes
    if src.cpus:
        service["cpus"] = src.cpus
    if src.pids:
        service["pids_limit"] = src.pids
    if src.rlimits:
        service["ulimits"] = {
            k: {"soft": s, "hard": h} for k, (s, h) in src.rlimits.items() if s >= 0 and h >= 0
        }
        unlimited = [k for k, (s, h) in src.rlimits.items() if s < 0 or h < 0]
        if unlimited:
            service["ulimits"].update({k: -1 for k in unlimited})
    body = yaml.safe_dump({"services": {"task": _no_interpolation(service)}}, sort_keys=False)
    return header(missing, "compose", src, "#") + body, missing


def _no_interpolation(value: Any) -> Any:
    """Compose substitutes ``$NAME`` in the file itself: ``$$`` keeps a ``$`` for the command."""
    if isinstance(value, str):
        return value.replace("$", "$$")
    if isinstance(value, list):
        return [_no_interpolation(v) for v in value]
    if isinstance(value, dict):
        return {k: _no_interpolation(v) for k, v in value.items()}
    return value
