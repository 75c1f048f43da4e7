"""The environment as a shell script around ``podman run``."""

from __future__ import annotations

import json
import shlex

from fusion_oci.export.common import common_unexpressed, header, limit_flags, tmpfs_opt
from fusion_oci.export.source import ExportSource


def podman_argv(src: ExportSource, seccomp_file: str | None) -> list[str]:
    """``podman run`` for the environment. Pure."""
    argv = [
        "podman",
        "run",
        "--rm",
        "-i",
        "--user",
        f"{src.uid}:{src.gid}",
        "--workdir",
        src.cwd,
        "--cap-drop=ALL",
    ]
    argv += [f"--cap-add={c.removeprefix('CAP_')}" for c in src.capabilities]
    if src.no_new_privileges:
        argv.append("--security-opt=no-new-privileges")
    if seccomp_file:
        argv.append(f"--security-opt=seccomp={seccomp_file}")
    if src.read_only_root:
        argv += ["--read-only", "--read-only-tmpfs=false"]
    if src.hostname:
        argv += ["--hostname", src.hostname]
    argv.append(
        "--network=none"
        if src.network == "none"
        else "--network=host"
        if src.network == "host"
        else "--network=slirp4netns:allow_host_loopback=false"
    )
    argv += limit_flags(src)
    for m in src.mounts:
        if m.kind == "tmpfs":
            argv.append(f"--tmpfs={m.target}:{tmpfs_opt(m)}")
        else:
            argv.append(
                f"--mount=type=bind,source={m.source},destination={m.target}"
                + (",ro=true" if m.read_only else "")
            )
    for key, value in src.env.items():
        argv += ["--env", key if value is None else f"{key}={value}"]
    for key, value in src.labels.items():
        argv += ["--label", f"{key}={value}"]
    return [*argv, src.image, *src.argv]


def to_script(src: ExportSource) -> tuple[str, list[str]]:
    missing = [*common_unexpressed(src)]
    lines = [
        "#!/bin/sh",
        header(missing, "script", src, "#").rstrip("\n"),
        "# Env passed by name (their values come from the environment this runs in):",
        "#   " + (", ".join(k for k, v in src.env.items() if v is None) or "none"),
        "set -eu",
    ]
    seccomp_var = None
    if src.seccomp:
        seccomp_var = "$seccomp"
        lines += [
            'seccomp="$(mktemp)"',
            "trap 'rm -f \"$seccomp\"' EXIT",
            "cat >\"$seccomp\" <<'FUSION_OCI_SECCOMP'",
            json.dumps(src.seccomp, separators=(",", ":")),
            "FUSION_OCI_SECCOMP",
        ]
    argv = podman_argv(src, "@SECCOMP@" if seccomp_var else None)
    quoted = [
        shlex.quote(a).replace("@SECCOMP@", '"$seccomp"') if "@SECCOMP@" in a else shlex.quote(a)
        for a in argv
    ]
    # not `exec`: the trap removes the profile file after podman ends; status is podman's.
    lines.append(" \\\n    ".join(quoted))
    return "\n".join(lines) + "\n", missing
