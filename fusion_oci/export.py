"""``fusion-oci export``: the task environment of a run (or of the current settings) as a file
an engine's own tools reproduce it with: a compose service, a ``devcontainer.json``, a
Kubernetes Pod (+ NetworkPolicy), or a shell script around ``podman run``.

Each writer is a pure function of an :class:`ExportSource` (itself read from the resolved
spec) that returns the file's text and the parts of the spec the format cannot express. Those
are listed in a comment at the top of the file and, by the CLI, on stderr: never dropped.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from fusion_oci.audit import AuditEvent
    from fusion_oci.replay import ReplayRecord

EXPORT_FORMATS = ("compose", "devcontainer", "kube", "script")
ENGINE_MOUNTS = frozenset({"/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys"})
"""Mounts every engine makes itself (from its own defaults)."""
RLIMIT_KEYS = {"RLIMIT_NOFILE": "nofile", "RLIMIT_NPROC": "nproc", "RLIMIT_CPU": "cpu",
               "RLIMIT_FSIZE": "fsize", "RLIMIT_CORE": "core"}


@dataclass(frozen=True)
class Mount:
    target: str
    kind: str
    """``bind`` or ``tmpfs``."""
    source: str = ""
    read_only: bool = False
    size: str | None = None
    mode: str | None = None
    uid: str | None = None
    gid: str | None = None
    is_file: bool = False


@dataclass(frozen=True)
class ExportSource:
    """What every format needs, read from a resolved spec. ``env`` values None: the caller's
    variable of that name, passed through (its value is never recorded)."""

    name: str
    image: str
    image_digest: str | None
    argv: list[str]
    cwd: str
    env: dict[str, str | None]
    uid: int
    gid: int
    mounts: list[Mount]
    network: str
    memory_bytes: int | None = None
    cpus: float | None = None
    pids: int | None = None
    rlimits: dict[str, tuple[int, int]] = field(default_factory=dict)
    read_only_root: bool = True
    no_new_privileges: bool = True
    capabilities: list[str] = field(default_factory=list)
    seccomp: dict[str, Any] | None = None
    masked_paths: list[str] = field(default_factory=list)
    readonly_paths: list[str] = field(default_factory=list)
    hostname: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """Already known differences (e.g. a host-rootfs run exported onto an image)."""


def _bytes_size(options: Sequence[str]) -> str | None:
    for opt in options:
        if opt.startswith("size="):
            return opt[5:]
    return None


def _opt(options: Sequence[str], key: str) -> str | None:
    return next((o.split("=", 1)[1] for o in options if o.startswith(key + "=")), None)


def read_spec(spec: Mapping[str, Any], *, name: str, image: str, image_digest: str | None,
              system_dests: Sequence[str], env_names: Sequence[str],
              notes: Sequence[str] = (),
              host_rlimits: Mapping[str, Sequence[int]] | None = None) -> ExportSource:
    """The spec's parts that a foreign format can carry. Pure.

    ``system_dests``: destinations of the host's system directories (a host-rootfs spec);
    those are replaced by the image. ``env_names``: variables passed from the caller.
    """
    from fusion_oci.oci.spec import ANN, ANN_NETWORK

    proc = spec["process"]
    passed = set(env_names)
    env: dict[str, str | None] = {}
    for item in proc.get("env", []):
        key, eq, value = item.partition("=")
        env[key] = None if (key in passed or not eq) else value
    skip = set(system_dests) | ENGINE_MOUNTS
    mounts: list[Mount] = []
    for m in spec.get("mounts", []):
        if m["destination"] in skip:
            continue
        options = m.get("options", [])
        if m.get("type") == "tmpfs":
            mounts.append(Mount(m["destination"], "tmpfs", size=_bytes_size(options),
                                mode=_opt(options, "mode"), uid=_opt(options, "uid"),
                                gid=_opt(options, "gid")))
        elif m.get("type") == "bind" or "bind" in options or "rbind" in options:
            src = m.get("source", m["destination"])
            mounts.append(Mount(m["destination"], "bind", src, "ro" in options,
                                is_file=Path(src).is_file()))
    linux = spec.get("linux", {})
    res = linux.get("resources", {})
    cpu = res.get("cpu") or {}
    cpus = cpu["quota"] / cpu.get("period", 100_000) if cpu.get("quota") else None
    rlimits = {RLIMIT_KEYS[r["type"]]: (int(r["soft"]), int(r["hard"]))
               for r in proc.get("rlimits", []) if r["type"] in RLIMIT_KEYS}
    # A process the sandbox starts inherits the caller's RLIMIT_NPROC; an engine would apply
    # its own default instead (podman's for root exceeds some hosts' hard limit), so say it.
    if "nproc" not in rlimits and host_rlimits is not None:
        from fusion_oci.runtimes.engine import nproc_limit

        limits = {k: (int(v[0]), int(v[1])) for k, v in host_rlimits.items()}
        rlimits["nproc"] = nproc_limit(limits) or (-1, -1)
    ann = spec.get("annotations", {})
    return ExportSource(
        name=name, image=image, image_digest=image_digest, argv=list(proc["args"]),
        cwd=proc.get("cwd", "/"), env=env, uid=int(proc["user"]["uid"]),
        gid=int(proc["user"]["gid"]), mounts=mounts,
        network=ann.get(ANN_NETWORK, "none"),
        memory_bytes=(res.get("memory") or {}).get("limit"), cpus=cpus,
        pids=(res.get("pids") or {}).get("limit"), rlimits=rlimits,
        read_only_root=bool(spec.get("root", {}).get("readonly", False)),
        no_new_privileges=bool(proc.get("noNewPrivileges", False)),
        capabilities=sorted(proc.get("capabilities", {}).get("bounding", [])),
        seccomp=linux.get("seccomp"), masked_paths=list(linux.get("maskedPaths", [])),
        readonly_paths=list(linux.get("readonlyPaths", [])), hostname=spec.get("hostname"),
        labels={k: v for k, v in ann.items() if k.startswith(ANN) and isinstance(v, str)},
        notes=list(notes),
    )


def safe_name(text: str) -> str:
    import re

    out = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return (out or "task")[:50].rstrip("-")


def source_from_record(record: ReplayRecord, event: AuditEvent | None, *,
                       worktree: Path | None = None, image: str | None = None) -> ExportSource:
    """A recorded run's environment (its redacted spec; caller env by name)."""
    from fusion_oci.oci.spec import ANN_HOST_ROOTFS

    spec = json.loads(json.dumps(record.spec))
    notes: list[str] = []
    host_rootfs = spec.get("annotations", {}).get(ANN_HOST_ROOTFS) == "true"
    system = [m[0] for m in record.host.get("system_mounts", [])]
    system += [f"/etc/{n}" for n in record.host.get("etc_entries", [])]
    chosen = image or record.image_ref or record.image
    if chosen is None:
        chosen = default_image()
    if host_rootfs:
        notes.append(f"root filesystem: the run used the host's system directories "
                     f"(backend {record.backend}); the export runs image {chosen} instead")
    if worktree is not None and str(worktree) != record.worktree:
        spec = _move_worktree(spec, record.worktree, str(worktree.absolute()))
    digest = event.image_digest if event is not None else None
    return read_spec(spec, name=safe_name(f"fusion-oci-{record.task_id}"), image=chosen,
                     image_digest=None if image else digest,
                     system_dests=system if host_rootfs else [],
                     env_names=record.env_names, notes=notes,
                     host_rlimits=record.host.get("rlimits"))


def _move_worktree(spec: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    def move(path: str) -> str:
        return new + path[len(old):] if path == old or path.startswith(old + "/") else path

    for m in spec.get("mounts", []):
        m["destination"] = move(m["destination"])
        if "source" in m:
            m["source"] = move(m["source"])
    spec["process"]["cwd"] = move(spec["process"].get("cwd", "/"))
    return spec


def default_image() -> str:
    from fusion_oci.images.spec import resolve_image
    from fusion_oci.runtimes.engine import DEFAULT_IMAGE

    try:
        return resolve_image(DEFAULT_IMAGE).ref
    except Exception:  # no images/ at all: name it, the user points --image elsewhere
        return DEFAULT_IMAGE


# --------------------------------------------------------------------------- shared limits


def _common_unexpressed(src: ExportSource) -> list[str]:
    out = list(src.notes)
    out += [f"tmpfs {m.target} owner {m.uid}:{m.gid} (mode {m.mode}): tmpfs flags cannot set "
            "an owner; it is mode 1777 instead" for m in src.mounts
            if m.kind == "tmpfs" and m.uid not in (None, "0")]
    if src.image_digest:
        out.append(f"image pinning by id: the file names {src.image}; the recorded image id "
                   f"is {src.image_digest} (check with `podman image inspect` / "
                   "`docker image inspect` before trusting a rebuilt tag)")
    if src.masked_paths or src.readonly_paths:
        out.append("maskedPaths/readonlyPaths: not settable here; the engine's own defaults "
                   "(the same /proc and /sys protections for docker and podman) apply")
    return out


def _seccomp_note(src: ExportSource) -> list[str]:
    if not src.seccomp:
        return []
    n = sum(len(s.get("names", [])) for s in src.seccomp.get("syscalls", []))
    return [f"seccomp: the recorded profile ({n} syscall rules) is not embedded; the engine's "
            "default profile applies"]


def _header(lines: Sequence[str], fmt: str, src: ExportSource, prefix: str) -> str:
    head = [f"{prefix} fusion-oci export ({fmt}) of {src.name}: image {src.image}",
            f"{prefix} command: {shlex.join(src.argv)}"]
    if lines:
        head.append(f"{prefix} NOT EXPRESSED in {fmt} (what the sandbox enforced but this "
                    "file cannot):")
        head += [f"{prefix}   - {line}" for line in lines]
    else:
        head.append(f"{prefix} every part of the sandbox's spec is expressed")
    return "\n".join(head) + "\n"


def _mib(value: int) -> str:
    return f"{max(1, value // (1024 * 1024))}m"


def _tmpfs_opt(m: Mount) -> str:
    opts = ["rw"]
    if m.size:
        opts.append(f"size={m.size}")
    mode = m.mode
    if m.uid not in (None, "0") and mode:
        mode = "1777"  # the engines' tmpfs flags cannot set an owner: open it (sticky) instead
    if mode:
        opts.append(f"mode={mode}")
    return ",".join(opts)


def _loopback_note(src: ExportSource, fmt: str) -> list[str]:
    if src.network == "egress":
        return [f"network egress without host loopback: {fmt}'s default network can reach "
                "the host's published ports and the bridge gateway (fusion-oci runs "
                "slirp4netns with --disable-host-loopback, or an isolated network)"]
    return []


# --------------------------------------------------------------------------- compose


def to_compose(src: ExportSource) -> tuple[str, list[str]]:
    missing = [*_common_unexpressed(src), *_seccomp_note(src), *_loopback_note(src, "compose")]
    service: dict[str, Any] = {
        "image": src.image,
        "command": src.argv,
        "working_dir": src.cwd,
        "user": f"{src.uid}:{src.gid}",
        "environment": [k if v is None else f"{k}={v}" for k, v in src.env.items()],
        "read_only": src.read_only_root,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"] if src.no_new_privileges else [],
        "tmpfs": [f"{m.target}:{_tmpfs_opt(m)}" for m in src.mounts if m.kind == "tmpfs"],
        "volumes": [{"type": "bind", "source": m.source, "target": m.target,
                     "read_only": m.read_only} for m in src.mounts if m.kind == "bind"],
        "labels": src.labels | ({"io.fusion-oci.image-digest": src.image_digest}
                                if src.image_digest else {}),
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
        service["ulimits"] = {k: {"soft": s, "hard": h} for k, (s, h) in src.rlimits.items()
                              if s >= 0 and h >= 0}
        unlimited = [k for k, (s, h) in src.rlimits.items() if s < 0 or h < 0]
        if unlimited:
            service["ulimits"].update({k: -1 for k in unlimited})
    body = yaml.safe_dump({"services": {"task": _no_interpolation(service)}}, sort_keys=False)
    return _header(missing, "compose", src, "#") + body, missing


def _no_interpolation(value: Any) -> Any:
    """Compose substitutes ``$NAME`` in the file itself: ``$$`` keeps a ``$`` for the command."""
    if isinstance(value, str):
        return value.replace("$", "$$")
    if isinstance(value, list):
        return [_no_interpolation(v) for v in value]
    if isinstance(value, dict):
        return {k: _no_interpolation(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- devcontainer


def to_devcontainer(src: ExportSource) -> tuple[str, list[str]]:
    missing = [*_common_unexpressed(src), *_seccomp_note(src),
               *_loopback_note(src, "devcontainer"),
               "the command is not run on start (a dev container starts a shell): run it "
               "inside, as written above"]
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
    work = next((m for m in binds if m.target == src.cwd), None) or \
        next((m for m in binds if src.cwd.startswith(m.target + "/")), None)
    mounts = [f"type=bind,source={m.source},target={m.target}"
              + (",readonly" if m.read_only else "") for m in binds if m is not work]
    run_args += [f"--tmpfs={m.target}:{_tmpfs_opt(m)}" for m in src.mounts if m.kind == "tmpfs"]
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
    return _header(missing, "devcontainer", src, "//") + body, missing


# --------------------------------------------------------------------------- kubernetes


def to_kube(src: ExportSource) -> tuple[str, list[str]]:
    missing = [*_common_unexpressed(src)]
    if src.seccomp:
        missing.append("seccomp: the recorded profile is not a Localhost profile on the "
                       "node; the Pod asks for RuntimeDefault")
    if src.pids:
        missing.append(f"pidsLimit {src.pids}: a Pod cannot set it (the kubelet's "
                       "podPidsLimit does, node-wide)")
    if src.rlimits:
        missing.append("rlimits (" + ", ".join(sorted(src.rlimits)) + "): a Pod cannot set "
                       "them (the container runtime's defaults apply; where podman's exceed "
                       "the host's hard limits, set default_ulimits in containers.conf)")
    if src.network == "egress":
        missing.append("network egress without host loopback: the NetworkPolicy allows "
                       "egress except loopback and link-local; the node's own addresses "
                       "depend on the cluster and are not excluded")
    if src.network != "host":
        missing.append("the NetworkPolicy is enforced only by a CNI plugin that supports "
                       "NetworkPolicy (podman kube play ignores it)")
    passed = [k for k, v in src.env.items() if v is None]
    if passed:
        missing.append("caller env (" + ", ".join(passed) + "): read from Secret "
                       f"{src.name}-env (create it; keys are optional)")
    env: list[dict[str, Any]] = []
    for key, value in src.env.items():
        if value is None:
            env.append({"name": key, "valueFrom": {"secretKeyRef": {
                "name": f"{src.name}-env", "key": key, "optional": True}}})
        else:
            env.append({"name": key, "value": value})
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for n, m in enumerate(src.mounts):
        vol = f"v{n}"
        if m.kind == "tmpfs":
            empty: dict[str, Any] = {"medium": "Memory"}
            if m.size:
                empty["sizeLimit"] = _kube_size(m.size)
            volumes.append({"name": vol, "emptyDir": empty})
            if m.mode:
                missing.append(f"tmpfs mode {m.mode} of {m.target}: emptyDir has none")
        else:
            volumes.append({"name": vol, "hostPath": {
                "path": m.source, "type": "File" if m.is_file else "Directory"}})
        mounts.append({"name": vol, "mountPath": m.target, "readOnly": m.read_only})
    resources: dict[str, Any] = {}
    limits: dict[str, str] = {}
    if src.memory_bytes:
        limits["memory"] = f"{max(1, src.memory_bytes // (1024 * 1024))}Mi"
    if src.cpus:
        limits["cpu"] = f"{int(src.cpus * 1000)}m"
    if limits:
        resources = {"limits": limits, "requests": dict(limits)}
    security: dict[str, Any] = {
        "runAsUser": src.uid, "runAsGroup": src.gid, "privileged": False,
        "allowPrivilegeEscalation": not src.no_new_privileges,
        "readOnlyRootFilesystem": src.read_only_root,
        "capabilities": {"drop": ["ALL"],
                         **({"add": [c.removeprefix("CAP_") for c in src.capabilities]}
                            if src.capabilities else {})},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    labels = {"app.kubernetes.io/managed-by": "fusion-oci", "io.fusion-oci/task": src.name}
    container: dict[str, Any] = {
        "name": "task", "image": src.image, "imagePullPolicy": "Never",
        "command": src.argv, "workingDir": src.cwd, "env": env,
        "securityContext": security, "volumeMounts": mounts,
    }
    if resources:
        container["resources"] = resources
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": src.name, "labels": labels,
                     "annotations": {**src.labels, **({"io.fusion-oci/image-digest":
                                                       src.image_digest}
                                                      if src.image_digest else {})}},
        "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                 "enableServiceLinks": False, "containers": [container], "volumes": volumes},
    }
    if src.hostname:
        pod["spec"]["hostname"] = src.hostname
    if src.network == "host":
        pod["spec"]["hostNetwork"] = True
    docs = [pod]
    if src.network != "host":
        policy: dict[str, Any] = {
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{src.name}-net", "labels": labels},
            "spec": {"podSelector": {"matchLabels": {"io.fusion-oci/task": src.name}},
                     "policyTypes": ["Ingress", "Egress"]},
        }
        if src.network == "egress":
            policy["spec"]["egress"] = [{"to": [{"ipBlock": {
                "cidr": "0.0.0.0/0", "except": ["127.0.0.0/8", "169.254.0.0/16"]}}]}]
        docs.append(policy)
    body = yaml.safe_dump_all(docs, sort_keys=False)
    return _header(missing, "kube", src, "#") + body, missing


def _kube_size(size: str) -> str:
    units = {"k": "Ki", "m": "Mi", "g": "Gi"}
    last = size[-1].lower()
    return size[:-1] + units[last] if last in units else size


# --------------------------------------------------------------------------- script


def limit_flags(src: ExportSource) -> list[str]:
    """The spec's memory, CPU, pids and rlimits as docker/podman CLI flags (both exports that
    write a `podman run` use them). Pure."""
    flags: list[str] = []
    if src.memory_bytes:
        flags += [f"--memory={src.memory_bytes}", f"--memory-swap={src.memory_bytes}"]
    if src.cpus:
        flags.append(f"--cpus={src.cpus}")
    if src.pids:
        flags.append(f"--pids-limit={src.pids}")
    for key, (soft, hard) in src.rlimits.items():
        flags.append(f"--ulimit={key}={soft}:{hard}" if soft >= 0 and hard >= 0
                     else f"--ulimit={key}=-1")
    return flags


def podman_argv(src: ExportSource, seccomp_file: str | None) -> list[str]:
    """``podman run`` for the environment. Pure."""
    argv = ["podman", "run", "--rm", "-i", "--user", f"{src.uid}:{src.gid}",
            "--workdir", src.cwd, "--cap-drop=ALL"]
    argv += [f"--cap-add={c.removeprefix('CAP_')}" for c in src.capabilities]
    if src.no_new_privileges:
        argv.append("--security-opt=no-new-privileges")
    if seccomp_file:
        argv.append(f"--security-opt=seccomp={seccomp_file}")
    if src.read_only_root:
        argv += ["--read-only", "--read-only-tmpfs=false"]
    if src.hostname:
        argv += ["--hostname", src.hostname]
    argv.append("--network=none" if src.network == "none" else
                "--network=host" if src.network == "host" else
                "--network=slirp4netns:allow_host_loopback=false")
    argv += limit_flags(src)
    for m in src.mounts:
        if m.kind == "tmpfs":
            argv.append(f"--tmpfs={m.target}:{_tmpfs_opt(m)}")
        else:
            argv.append(f"--mount=type=bind,source={m.source},destination={m.target}"
                        + (",ro=true" if m.read_only else ""))
    for key, value in src.env.items():
        argv += ["--env", key if value is None else f"{key}={value}"]
    for key, value in src.labels.items():
        argv += ["--label", f"{key}={value}"]
    return [*argv, src.image, *src.argv]


def to_script(src: ExportSource) -> tuple[str, list[str]]:
    missing = [*_common_unexpressed(src)]
    lines = ["#!/bin/sh", _header(missing, "script", src, "#").rstrip("\n"),
             "# Env passed by name (their values come from the environment this runs in):",
             "#   " + (", ".join(k for k, v in src.env.items() if v is None) or "none"),
             "set -eu"]
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
    quoted = [shlex.quote(a).replace("@SECCOMP@", '"$seccomp"') if "@SECCOMP@" in a
              else shlex.quote(a) for a in argv]
    # not `exec`: the trap removes the profile file after podman ends; status is podman's.
    lines.append(" \\\n    ".join(quoted))
    return "\n".join(lines) + "\n", missing


WRITERS: dict[str, Callable[[ExportSource], tuple[str, list[str]]]] = {
    "compose": to_compose, "devcontainer": to_devcontainer, "kube": to_kube,
    "script": to_script,
}


def export_run(src: ExportSource, fmt: str) -> tuple[str, list[str]]:
    """The file's text and what it cannot express. Pure."""
    return WRITERS[fmt](src)
