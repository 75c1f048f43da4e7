"""The environment as a ``devcontainer.json``."""

from __future__ import annotations

import json
from typing import Any

from fusion_oci.export.common import (
    common_unexpressed,
    header,
    limit_flags,
    loopback_note,
    seccomp_note,
    tmpfs_opt,
)
from fusion_oci.export.source import ExportSource


def to_devcontainer(src: ExportSource) -> tuple[str, list[str]]:
    missing = [
        *common_unexpressed(src),
        *seccomp_note(src),
        *loopback_note(src, "devcontainer"),
        "the command is not run on start (a dev container starts a shell): run it "
        "inside, as written above",
    ]
    run_args = [f"--user={src.uid}:{src.gid}", "--cap-drop=ALL"]
    run_args += [f"--cap-add={c.removeprefix('CAP_')}" for c in src.capabilities]
    if src.no_new_privileges:
        run_args.append("--security-opt=no-new-privileges")
    if src.read_only_root:
        run_args.append("--read-only")
    if src.network in ("none", "host"):
        run_args.append(f"--network={src.network}")
    run_args += limit_flags(src)
    if src.hostname:
        run_args.append(f"--hostname={src.hostname}")
    binds = [m for m in src.mounts if m.kind == "bind"]
    work = next((m for m in binds if m.target == src.cwd), None) or next(
        (m for m in binds if src.cwd.startswith(m.target + "/")), None
    )
    mounts = [
        f"type=bind,source={m.source},target={m.target}" + (",readonly" if m.read_only else "")
        for m in binds
        if m is not work
    ]
    run_args += [f"--tmpfs={m.target}:{tmpfs_opt(m)}" for m in src.mounts if m.kind == "tmpfs"]
    doc: dict[str, Any] = {
        "name": src.name,
        "image": src.image,
        "containerEnv": {k: v for k, v in src.env.items() if v is not None},
        "remoteEnv": {k: f"${{localEnv:{k}}}" for k, v in src.env.items() if v is None},
        "runArgs": run_args,
        "mounts": mounts,
        "overrideCommand": True,
        "updateRemoteUserUID": False,
    }
    if work is not None:
        doc["workspaceMount"] = f"type=bind,source={work.source},target={work.target}"
        doc["workspaceFolder"] = src.cwd
    if not doc["remoteEnv"]:
        del doc["remoteEnv"]
    body = json.dumps(doc, indent=2) + "\n"
    return header(missing, "devcontainer", src, "//") + body, missing
