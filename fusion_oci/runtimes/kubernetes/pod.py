"""TaskSpec → Pod: the one translation of a task's sandbox into Kubernetes objects. Pure.

The same function serves the ``kubernetes`` runtime (the agent's pod on a cluster) and
``fusion-oci export --format kube`` (a Pod for ``podman kube play`` or a cluster, from a
recorded run). They differ only in :class:`PodOptions`: whether host paths exist where the pod
runs (export on the same machine: ``hostPath``; a cluster's nodes: they do not, so the
worktree and the git folders become empty folders the runtime's transfer fills).

Security choices, each because Pod Security Admission's ``restricted`` level asks for it and
a sandbox wants it anyway: no service-account token (``automountServiceAccountToken: false``:
a task has no business with the API server), no privilege and no privilege escalation, every
capability dropped, ``runAsNonRoot``, a read-only root with an ``emptyDir`` wherever the spec
has a writable tmpfs, the bundle's seccomp profile as a ``Localhost`` profile when the nodes
have it (``kubernetes.seccompProfile``) and the runtime's ``RuntimeDefault`` otherwise, and
requests equal to limits (a task is not squeezed by a neighbour's burst).

What a Pod cannot say is never dropped: each is a :class:`Gap` with how it is handled —
enforced by the exec agent inside the pod (per-command rlimits), or reported unenforced (the
runtime's ``check`` lists them, export prints them in the file's header).
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fusion_oci.agent.protocol import EGRESS_AGENT
from fusion_oci.models import NetworkMode, ServiceContainer
from fusion_oci.models.hostservice import HostService
from fusion_oci.oci.model import Mount, ProcessSpec, TaskSpec

MANAGED_BY = {"app.kubernetes.io/managed-by": "fusion-oci"}
LABEL_POD = "io.fusion-oci/task"
"""The label a pod's NetworkPolicy selects it by (its own name: one policy per pod)."""
ENGINE_MOUNTS = frozenset({"/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys"})
"""Mounts every container runtime makes itself: the pod gets them without asking."""
RESTRICTED_CAPS = frozenset({"NET_BIND_SERVICE"})
TOOLS_DIR = "/run/fusion-oci-tools"
"""Where the runtime's own programs for the pod are mounted, read-only (`PodOptions.tools`)."""
TOOLS_VOLUME = "fusion-oci-tools"
TOOLS_AGENT = "fusion-oci-agent"
"""The exec agent's key in the tools ConfigMap (its file name under :data:`TOOLS_DIR`)."""
"""The only capability the ``restricted`` level lets a container add."""

Handling = Literal["in-pod", "unenforced", "not-carried"]
SERVICE_PREFIX = "svc-"
"""A service container's name in the pod: ``svc-NAME`` (the task's own is ``task``)."""
READY_PERIOD_S = 1
"""How often the kubelet runs a service's readiness probe (its smallest period)."""


@dataclass(frozen=True)
class PodService:
    """A service container of the task's pod (``policy.services``), with the image reference
    the nodes run it from."""

    service: ServiceContainer
    image: str
    pull_policy: str = "IfNotPresent"
    """Never for an image the runtime knows only the nodes can have (a recipe's local name)."""

    @property
    def container(self) -> str:
        return SERVICE_PREFIX + self.service.name


@dataclass(frozen=True)
class Gap:
    """A part of the spec the Pod does not express, and how it is handled instead.

    ``in-pod``: the exec agent enforces it inside the pod, per command (rlimits); ``unenforced``:
    nothing does here, so ``check`` reports it; ``not-carried``: a host resource the pod does
    not get (a host path is not on a cluster node)."""

    item: str
    handling: Handling
    detail: str

    def text(self) -> str:
        return f"{self.item}: {self.detail}"


@dataclass(frozen=True)
class PodOptions:
    """What the translation needs beyond the spec (all values, no I/O)."""

    name: str
    """The pod's name (a DNS label); its NetworkPolicy is ``NAME-net``."""
    image: str
    host_paths: bool = False
    """True: bind mounts become ``hostPath`` volumes (export, run where the host is); False:
    the pod runs on a cluster node, where host paths do not exist."""
    transferred: tuple[str, ...] = ()
    """Destinations the runtime's transfer fills (the worktree, its git folders): each a
    writable ``emptyDir``; bind mounts beneath them are part of the transfer, not volumes."""
    files: frozenset[str] = frozenset()
    """Destinations whose source is a file (the caller looked; this function reads no disk)."""
    passed_env: frozenset[str] = frozenset()
    """Caller variables passed by name: read from the optional Secret ``NAME-env``."""
    skip: frozenset[str] = frozenset()
    """Destinations the image replaces (a host-rootfs run's system directories)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Extra labels (the owner, for gc), made label-safe here."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    runtime_class: str | None = None
    seccomp_profile: str | None = None
    """A Localhost profile path on the nodes holding the bundle's profile; None:
    RuntimeDefault."""
    grace_s: int | None = None
    """``terminationGracePeriodSeconds``; None: the cluster's default (30 s)."""
    image_pull_policy: str = "Never"
    """Never: the image is on the nodes already (no registry is needed)."""
    files_from: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """Bind-mounted host files the runtime carries to the nodes in a ConfigMap: destination →
    (ConfigMap name, key). Read-only, as the bind is (the host's CA bundle: without it no
    TLS client in the pod trusts an intercepting proxy the host trusts)."""
    blocked_networks: tuple[str, ...] = ()
    """CIDRs ``egress`` may not reach besides loopback and link-local (the nodes')."""
    tools: str | None = None
    """A ConfigMap holding the runtime's programs for the pod (the exec agent, its stream
    relay, the worktree transfer's remote side), mounted read-only at :data:`TOOLS_DIR`:
    nothing to bake into the image, no registry, nothing a command can rewrite. None: none
    (export)."""
    services: tuple[PodService, ...] = ()
    """The task's service containers (the spec names them, ``policy.services`` defines them):
    containers beside the task's in its pod. A service the spec names that is not here is a
    gap (export: a recording holds no service definitions)."""


@dataclass(frozen=True)
class PodMapping:
    pod: dict[str, Any]
    network_policy: dict[str, Any] | None
    """None for ``network: host`` (nothing to restrict)."""
    gaps: tuple[Gap, ...]
    transferred: tuple[str, ...] = ()
    """The bind mounts the transfer carries instead of a volume (shown, not gaps)."""

    @property
    def unenforced(self) -> list[str]:
        """What ``check`` reports: the restrictions nothing enforces here, sorted."""
        return sorted(g.text() for g in self.gaps if g.handling == "unenforced")

    @property
    def not_carried(self) -> list[str]:
        """Host resources the pod does not get (less access, not less isolation), sorted:
        shown by ``plan``, not refused."""
        return sorted(g.text() for g in self.gaps if g.handling == "not-carried")


def label_key(key: str) -> str:
    """An engine label key as a Kubernetes one: ``io.fusion-oci.owner-pid`` →
    ``io.fusion-oci/owner-pid``. Prefixed with our domain, because agent-sandbox (and policy
    tooling) refuse an unprefixed key on pods: it could opt into someone else's policy. Pure."""
    if "/" in key:
        return key
    return "io.fusion-oci/" + key.removeprefix("io.fusion-oci.")


def label_value(text: str) -> str:
    """``text`` as a label value (at most 63 of ``[A-Za-z0-9-_.]``, alphanumeric at both ends);
    changed text gets a short hash so two values never meet. Pure."""
    clean = re.sub(r"[^A-Za-z0-9_.-]", "-", text).strip("-_.")
    if clean == text and len(text) <= 63:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{clean[:54].rstrip('-_.')}-{digest}".lstrip("-")


def owner_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """Labels with Kubernetes keys and values (:func:`label_key`, :func:`label_value`). Pure."""
    return {label_key(k): label_value(v) for k, v in labels.items()}


def pod_manifest(task: TaskSpec, process: ProcessSpec, opts: PodOptions) -> PodMapping:
    """The Pod (and its NetworkPolicy) of ``task`` running ``process`` as its one container's
    process (the runtime's exec agent; export's command). Pure."""
    gaps: list[Gap] = []
    volumes, mounts, carried = _volumes(task, opts, gaps)
    # a unix grant's socket is made by the pod's relay at the granted path: in a folder of
    # its own where no writable one is (hostservices.py; check refuses a system folder)
    writable = [m["mountPath"] for m in mounts if not m.get("readOnly")]
    gaps += unix_folder_gaps(task.host_services, writable)
    for folder in unix_folders(task.host_services, writable):
        vol = f"v{len(volumes)}"
        volumes.append({"name": vol, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}})
        mounts.append({"name": vol, "mountPath": folder, "readOnly": False})
    if opts.tools is not None:
        volumes.append(
            {"name": TOOLS_VOLUME, "configMap": {"name": opts.tools, "defaultMode": 0o555}}
        )
        mounts.append({"name": TOOLS_VOLUME, "mountPath": TOOLS_DIR, "readOnly": True})
        if task.network == NetworkMode.FILTERED:
            # where a filtered sandbox's GIT_SSH_COMMAND finds the agent (its `connect` mode is
            # ssh's ProxyCommand through the egress proxy), as on every local runtime
            mounts.append({
                "name": TOOLS_VOLUME, "mountPath": EGRESS_AGENT, "subPath": TOOLS_AGENT,
                "readOnly": True,
            })  # fmt: skip
    env = _env(process, opts, gaps)
    gaps += _process_gaps(task, process)
    security, pod_security = _security(task, process, opts, gaps)
    labels = {**MANAGED_BY, **owner_labels(opts.labels)}
    labels[LABEL_POD] = label_value(opts.name)
    container: dict[str, Any] = {
        "name": "task",
        "image": opts.image,
        "imagePullPolicy": opts.image_pull_policy,
        "command": list(process.args),
        "workingDir": process.cwd,
        "env": env,
        "securityContext": security,
        "volumeMounts": mounts,
    }
    resources = _resources(task)
    if resources:
        container["resources"] = resources
    services = _services(task, opts, gaps)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security,
        "containers": [container, *services],
        "volumes": volumes,
    }
    if services:
        # Each service's name on the pod's own loopback, as the local runtimes' hosts file
        # says: the containers of a pod share its network namespace.
        names = [c["name"].removeprefix(SERVICE_PREFIX) for c in services]
        spec["hostAliases"] = [{"ip": "127.0.0.1", "hostnames": names}]
    if opts.grace_s is not None:
        spec["terminationGracePeriodSeconds"] = opts.grace_s
    if not opts.host_paths:
        # Tasks spread over the nodes (a soft rule: a full node still takes one): standalone
        # pods get no default spreading, and one node's loss should take as few tasks as can be.
        spec["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": dict(MANAGED_BY)},
            }
        ]
    if task.hostname:
        spec["hostname"] = task.hostname
    if opts.runtime_class:
        spec["runtimeClassName"] = opts.runtime_class
    network = task.network
    if network == NetworkMode.HOST:
        spec["hostNetwork"] = True
        gaps.append(
            Gap(
                "network host",
                "unenforced",
                "hostNetwork gives the pod the node's network (the `restricted` level refuses it)",
            )
        )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": opts.name,
            "labels": labels,
            "annotations": dict(opts.annotations),
        },
        "spec": spec,
    }
    policy = None
    if network != NetworkMode.HOST:
        policy = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"{opts.name}-net", "labels": labels},
            "spec": {
                "podSelector": {"matchLabels": {LABEL_POD: labels[LABEL_POD]}},
                "policyTypes": ["Ingress", "Egress"],
                **policy_rules(network, opts.blocked_networks),
            },
        }
        gaps += _network_gaps(network)
    return PodMapping(pod, policy, tuple(gaps), tuple(carried))


def _services(task: TaskSpec, opts: PodOptions, gaps: list[Gap]) -> list[dict[str, Any]]:
    """The service containers of the pod, in the spec's order.

    They share the pod's network namespace: each listens on the pod's own 127.0.0.1:PORT,
    where the task's commands reach it directly (no relay: nothing of ours in the data path),
    and the pod's NetworkPolicy (no ingress, the task's egress) keeps everything else away,
    as the local runtimes' network-less containers do. Not its pid or mount namespace: a
    pod does not share processes unless asked (``shareProcessNamespace``), and each
    container has its own root. Each runs as its image's user (no ``runAsUser``: the pod's
    is the task's, set on the task's container), which ``runAsNonRoot`` asks to be a
    numeric non-root uid (images/postgres and images/redis are 999), with every capability
    dropped and no privilege escalation (`restricted`); its root is writable (a database
    writes its files there), and it gets no volume, no token and none of the task's
    environment. Ready: its ``ready`` command as the kubelet's readiness probe, else its
    port listening on the pod's loopback (read from /proc/net, as the kubelet's own TCP
    probe dials the pod's address, where a service on 127.0.0.1 does not answer)."""
    defined = {s.service.name: s for s in opts.services}
    out: list[dict[str, Any]] = []
    for name, port in task.service_containers:
        svc = defined.get(name)
        if svc is None or svc.service.port != port:
            gaps.append(
                Gap(
                    f"services {name}",
                    "unenforced",
                    "the pod has no container for it (the spec holds no definition of it: "
                    "a record made before definitions were kept)",
                )
            )
            continue
        if len(svc.container) > 63:
            gaps.append(
                Gap(
                    f"services {name}",
                    "unenforced",
                    f"a container name is at most 63 characters: '{svc.container}' is longer; "
                    "shorten the service's name",
                )
            )
            continue
        out.append(_service_container(svc))
    return out


def _service_container(svc: PodService) -> dict[str, Any]:
    s = svc.service
    listening = f"grep -qi ':{s.port:04X} 0\\{{8,32\\}}:0000 0A' /proc/net/tcp /proc/net/tcp6"
    probe = ["/bin/sh", "-c", s.ready or listening]
    container: dict[str, Any] = {
        "name": svc.container,
        "image": svc.image,
        "imagePullPolicy": svc.pull_policy,
        "securityContext": {
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "readinessProbe": {
            "exec": {"command": probe},
            "periodSeconds": READY_PERIOD_S,
            "timeoutSeconds": 5,
            "successThreshold": 1,
            "failureThreshold": 1,
        },
    }
    if s.env:
        container["env"] = [{"name": k, "value": v} for k, v in sorted(s.env.items())]
    if s.command is not None:
        # the engine's `command` of a service is the image's CMD replaced: a Pod's `args`
        container["args"] = list(s.command)
    return container


def pod_grants(task: TaskSpec) -> tuple[HostService, ...]:
    """The host services the pod's relay carries back to the executor: the spec's grants but
    its service containers' endpoints, which the pod serves itself. Pure."""
    own = {f"127.0.0.1:{port}" for _, port in task.service_containers}
    return tuple(g for g in task.host_services if str(g) not in own)


def policy_rules(network: NetworkMode, blocked: Sequence[str] = ()) -> dict[str, Any]:
    """The NetworkPolicy's rules for a network mode: no ingress ever; egress only for
    ``egress`` (anywhere but loopback and link-local, where node and cloud metadata services
    answer). ``none`` and ``filtered`` allow no egress (filtered's proxy is the task's)."""
    if network != NetworkMode.EGRESS:
        return {}
    v4 = [b for b in blocked if ":" not in b]
    block = {"cidr": "0.0.0.0/0", "except": ["127.0.0.0/8", "169.254.0.0/16", *v4]}
    return {"egress": [{"to": [{"ipBlock": block}]}]}


def _network_gaps(network: NetworkMode) -> list[Gap]:
    gaps = [
        Gap(
            "NetworkPolicy",
            "unenforced",
            "enforced only by a CNI plugin that implements NetworkPolicy (podman kube play "
            "ignores it; `fusion-oci doctor` says whether the cluster has one)",
        )
    ]
    if network == NetworkMode.EGRESS:
        gaps.append(
            Gap(
                "network egress without host loopback",
                "unenforced",
                "the NetworkPolicy allows egress except loopback and link-local; the node's "
                "own addresses depend on the cluster and are not excluded",
            )
        )
    if network == NetworkMode.FILTERED:
        gaps.append(
            Gap(
                "network filtered",
                "unenforced",
                "no egress proxy runs beside the pod: the NetworkPolicy denies all egress, so "
                "the allowed domains are unreachable too",
            )
        )
    return gaps


def _volumes(
    task: TaskSpec, opts: PodOptions, gaps: list[Gap]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    carried: list[str] = []
    skip = ENGINE_MOUNTS | opts.skip
    for m in task.mounts:
        dest = m.destination
        if dest in skip:
            continue
        vol = f"v{len(volumes)}"
        if m.type == "tmpfs":
            volumes.append({"name": vol, "emptyDir": _empty_dir(m)})
            mode, uid = m.option("mode"), m.option("uid")
            if mode or uid not in (None, "0"):
                gaps.append(
                    Gap(
                        f"tmpfs {dest}",
                        "unenforced",
                        f"mode {mode or '-'}, owner {uid or '0'}:{m.option('gid') or '0'}: an "
                        "emptyDir is mode 0777, owned by root",
                    )
                )
        elif not _is_bind(m):
            gaps.append(Gap(f"mount {dest}", "not-carried", f"a {m.type} mount has no volume"))
            continue
        elif _under(dest, opts.transferred):
            if dest not in opts.transferred:
                carried.append(dest)
                continue
            # Writable in the pod, even where the host's bind is read-only (a git common
            # dir): the read-only parts are protected on the host, where the transfer checks
            # what comes back and never writes hooks, config or protected paths.
            volumes.append({"name": vol, "emptyDir": {}})
            mounts.append({"name": vol, "mountPath": dest, "readOnly": False})
            continue
        elif dest in opts.files_from:
            config_map, key = opts.files_from[dest]
            item = {"key": key, "path": key}
            volumes.append({"name": vol, "configMap": {"name": config_map, "items": [item]}})
            mounts.append({"name": vol, "mountPath": dest, "subPath": key, "readOnly": True})
            continue
        elif opts.host_paths:
            src = m.source or dest
            kind = "File" if dest in opts.files else "Directory"
            volumes.append({"name": vol, "hostPath": {"path": src, "type": kind}})
        else:
            gaps.append(
                Gap(
                    f"host path {m.source or dest}",
                    "not-carried",
                    f"not on the cluster's nodes; the pod has an empty folder at {dest}",
                )
            )
            volumes.append({"name": vol, "emptyDir": {}})
        mounts.append({"name": vol, "mountPath": dest, "readOnly": m.readonly})
    made = {m["mountPath"] for m in mounts}
    for dest in opts.transferred:
        if dest not in made:
            # a folder the transfer fills that is no mount of the spec (the worktree's parent)
            vol = f"v{len(volumes)}"
            volumes.append({"name": vol, "emptyDir": {}})
            mounts.append({"name": vol, "mountPath": dest, "readOnly": False})
    return volumes, mounts, carried


SYSTEM_FOLDERS = frozenset(
    ("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/sbin", "/sys", "/usr",
     "/var", "/run", "/home", "/root", "/opt", "/srv", "/tmp")
)  # fmt: skip
"""Folders a unix grant's socket may not sit in directly unless the pod writes there already:
an empty volume there would hide the image's own."""


def _socket_folders(grants: Iterable[HostService], writable: Sequence[str]) -> list[str]:
    """Each unix grant's socket folder that no ``writable`` mount holds, once each."""
    out: list[str] = []
    for g in grants:
        if g.kind != "unix":
            continue
        folder = posixpath.dirname(g.path)
        inside = any(folder == w or folder.startswith(w.rstrip("/") + "/") for w in writable)
        if not inside and folder not in out:
            out.append(folder)
    return out


def unix_folders(grants: Iterable[HostService], writable: Sequence[str]) -> list[str]:
    """The folders the pod needs as empty, writable volumes for its unix grants' sockets:
    each socket's folder, unless it lies in one of the pod's ``writable`` mounts already
    (the worktree, /tmp) or is a system folder (:func:`unix_folder_gaps`). Pure."""
    return [f for f in _socket_folders(grants, writable) if f not in SYSTEM_FOLDERS]


def unix_folder_gaps(grants: Iterable[HostService], writable: Sequence[str]) -> list[Gap]:
    """The unix grants a pod cannot carry: a socket directly in a system folder the pod does
    not write (``/run``, ``/var``), which would need an empty volume over the image's own.
    Unenforced: ``check`` refuses the task. Pure."""
    folders = set(_socket_folders(grants, writable)) & SYSTEM_FOLDERS
    return [
        Gap(
            f"hostServices {g}",
            "unenforced",
            f"its folder {posixpath.dirname(g.path)} would be an empty volume over the "
            "image's own in the pod; grant the service's TCP address (127.0.0.1:PORT) or a "
            "socket in a folder of its own (/run/postgresql/...)",
        )
        for g in grants
        if g.kind == "unix" and posixpath.dirname(g.path) in folders
    ]


def writable_folders(task: TaskSpec) -> list[str]:
    """The folders the task's pod can write (its spec's writable mounts, which become
    writable volumes): where a unix grant's socket needs no volume of its own. Pure."""
    return [
        m.destination for m in task.mounts if not m.readonly and m.destination not in ENGINE_MOUNTS
    ]


def _empty_dir(m: Mount) -> dict[str, Any]:
    out: dict[str, Any] = {"medium": "Memory"}
    size = m.option("size")
    if size:
        out["sizeLimit"] = quantity(size)
    return out


def _is_bind(m: Mount) -> bool:
    return m.type == "bind" or bool({"bind", "rbind"} & set(m.options or []))


def _under(dest: str, roots: Sequence[str]) -> bool:
    return any(dest == r or dest.startswith(r.rstrip("/") + "/") for r in roots)


def quantity(size: str) -> str:
    """A tmpfs ``size=`` (``64m``, ``65536k``, bytes) as a Kubernetes quantity. Pure."""
    units = {"k": "Ki", "m": "Mi", "g": "Gi"}
    last = size[-1].lower()
    return size[:-1] + units[last] if last in units else size


def _env(process: ProcessSpec, opts: PodOptions, gaps: list[Gap]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = []
    passed: list[str] = []
    for item in process.env:
        key, eq, value = item.partition("=")
        if key in opts.passed_env or not eq:
            passed.append(key)
            ref = {"name": f"{opts.name}-env", "key": key, "optional": True}
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
        else:
            env.append({"name": key, "value": value})
    if passed:
        gaps.append(
            Gap(
                "caller env (" + ", ".join(passed) + ")",
                "not-carried",
                f"read from Secret {opts.name}-env (create it; keys are optional)",
            )
        )
    return env


def _process_gaps(task: TaskSpec, process: ProcessSpec) -> list[Gap]:
    gaps: list[Gap] = []
    if process.rlimits:
        shown = ", ".join(f"{n}={s}/{h}" for n, s, h in process.limits())
        gaps.append(
            Gap(
                f"rlimits ({shown})",
                "in-pod",
                "a Pod cannot set them: the exec agent sets them on each command it spawns "
                "(a process started another way gets the container runtime's defaults)",
            )
        )
    res = task.resources
    if res.pids is not None:
        gaps.append(
            Gap(
                f"pidsLimit {res.pids.limit}",
                "unenforced",
                "a Pod cannot set it (the kubelet's podPidsLimit does, node-wide)",
            )
        )
    if task.linux.masked_paths or task.linux.readonly_paths:
        gaps.append(
            Gap(
                "maskedPaths/readonlyPaths",
                "unenforced",
                "not settable in a Pod; the container runtime's defaults (procMount Default: "
                "the same /proc and /sys protections) apply",
            )
        )
    return gaps


def _security(
    task: TaskSpec, process: ProcessSpec, opts: PodOptions, gaps: list[Gap]
) -> tuple[dict[str, Any], dict[str, Any]]:
    uid, gid = process.user.uid, process.user.gid
    if uid == 0:
        gaps.append(
            Gap(
                "user 0",
                "unenforced",
                "the process runs as root: runAsNonRoot cannot be set, and a namespace "
                "enforcing the `restricted` level refuses the pod",
            )
        )
    if not process.no_new_privileges:
        gaps.append(
            Gap(
                "noNewPrivileges false",
                "unenforced",
                "the Pod sets allowPrivilegeEscalation: false anyway (`restricted` asks it)",
            )
        )
    kept = [c.removeprefix("CAP_") for c in process.kept_capabilities()]
    beyond = sorted(set(kept) - RESTRICTED_CAPS)
    if beyond:
        gaps.append(
            Gap(
                "capabilities " + ", ".join(beyond),
                "unenforced",
                "added, but a namespace enforcing the `restricted` level refuses them",
            )
        )
    seccomp: dict[str, Any] = {"type": "RuntimeDefault"}
    if opts.seccomp_profile:
        seccomp = {"type": "Localhost", "localhostProfile": opts.seccomp_profile}
    elif task.linux.seccomp is not None:
        rules = sum(len(s.names) for s in task.linux.seccomp.syscalls or [])
        gaps.append(
            Gap(
                "seccomp",
                "unenforced",
                f"the bundle's profile ({rules} syscall rules) is not on the nodes; the Pod "
                "asks for RuntimeDefault (kubernetes.seccompProfile names a Localhost copy)",
            )
        )
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if kept:
        caps["add"] = kept
    # The task's user on its own container, not the pod: a service container beside it
    # runs as its image's user.
    container = {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": bool(task.root.readonly),
        "capabilities": caps,
        "runAsUser": uid,
        "runAsGroup": gid,
    }
    pod: dict[str, Any] = {
        "runAsNonRoot": uid != 0,
        "seccompProfile": seccomp,
    }
    return container, pod


def _resources(task: TaskSpec) -> dict[str, Any]:
    res = task.resources
    limits: dict[str, str] = {}
    if res.memory is not None and res.memory.limit:
        mib, rest = divmod(res.memory.limit, 1024 * 1024)
        limits["memory"] = f"{mib}Mi" if not rest and mib else str(res.memory.limit)
    cpu = res.cpu
    if cpu is not None and cpu.quota:
        limits["cpu"] = f"{cpu.quota * 1000 // (cpu.period or 100_000)}m"
    return {"limits": limits, "requests": dict(limits)} if limits else {}
