"""Policy → OCI runtime-spec ``config.json``, as data.

A default spec plus small operations that each change one thing (runc/containerd style).
Everything here is pure: the same inputs give the same spec, so the golden tests can compare it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fusion_oci.hostservice import HostService, no_proxy
from fusion_oci.models import NetworkMode, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.host import HostInfo
from fusion_oci.oci.model import (
    ANN_CACHE_MODE,
    ANN_HOST_ROOTFS,
    ANN_HOST_SERVICES,
    ANN_IMAGE,
    ANN_NETWORK,
    ANN_POLICY,
    ANN_PUBLISH,
    ANN_RUN,
    ANN_SERVICES,
    ANN_TASK,
    ProcessSpec,
    TaskSpec,
    config_json,
)
from fusion_oci.policy.layout import CA_IN_SANDBOX, TaskLayout
from fusion_oci.publishport import PublishedPort

Spec = dict[str, Any]

OCI_VERSION = "1.0.2"
SANDBOX_HOME = "/home/sandbox"
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The annotations (fusion_oci.oci.model) are listed, with what each means, in
# docs/spec-annotations.md: they say
# only what the OCI fields cannot (OCI has no "egress without host loopback", no image
# reference, no cache scope).

# Environment variables that tools read to trust an extra CA bundle.
CA_ENV_VARS = (
    "NODE_EXTRA_CA_CERTS",
    "npm_config_cafile",
    "GIT_SSL_CAINFO",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
)
NO_UPDATE_CHECKS = {
    "npm_config_update_notifier": "false",
    "pnpm_config_update_notifier": "false",
    "NO_UPDATE_NOTIFIER": "1",
}
"""No package manager asks its registry for a newer version of itself. They remember the
last check in ``$HOME/.local/state`` and ask once a day, but a sandbox's home is new with each
task, so pnpm asked at every task's first command: a request to its registry (~120 ms of
each new task's ``pnpm install`` here, measured) and an egress event, for a version the image
pins anyway. npm and pnpm up to 10 read ``npm_config_*``, pnpm 11 ``pnpm_config_*``,
the ``update-notifier`` package of other CLIs ``NO_UPDATE_NOTIFIER``. The allowlist can pass
the caller's own value."""
NODE_OPENSSL_CA = "--use-openssl-ca"
"""Node.js trusts OpenSSL's store (``SSL_CERT_FILE``: the shared bundle) in place of its own
roots. Used instead of ``NODE_EXTRA_CA_CERTS`` when the bundle is the host's whole trust store
(``TaskLayout.ca_complete``): that variable makes every Node.js start parse its own roots and
the bundle before running anything (45 ms a start here, measured: 144 certificates; with one,
still 28 ms), where OpenSSL's store is read at a process's first TLS handshake only. A task's
commands start Node.js many times (pnpm, then the tool it runs, then its children)."""

MASKED_PATHS = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
READONLY_PATHS = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
)

DEFAULT_NOFILE = 65536


def default_spec() -> Spec:
    """The base every bundle starts from: runc's default, with no capabilities at all."""
    return {
        "ociVersion": OCI_VERSION,
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sh"],
            "env": [f"PATH={SANDBOX_PATH}"],
            "cwd": "/",
            "capabilities": {
                "bounding": [],
                "effective": [],
                "inheritable": [],
                "permitted": [],
                "ambient": [],
            },
            "rlimits": [],
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": "fusion-sandbox",
        "mounts": [
            {
                "destination": "/proc",
                "type": "proc",
                "source": "proc",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            },
            {
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
                {"type": "cgroup"},
            ],
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
        },
        "annotations": {},
    }


def _copy_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_json(v) for v in value]
    return value  # str, int, float, bool, None: immutable


def _copy(spec: Spec) -> Spec:
    # A spec is plain JSON data: a walk over dicts and lists is several times cheaper than
    # copy.deepcopy's memo machinery, and every op copies, on every command.
    result: Spec = _copy_json(spec)
    return result


def bind(dest: str, source: str, *, writable: bool) -> dict[str, Any]:
    opts = ["rbind", "rw" if writable else "ro", "nosuid", "nodev"]
    return {"destination": dest, "type": "bind", "source": source, "options": opts}


def tmpfs(
    dest: str,
    *,
    mode: str = "1777",
    uid: int | None = None,
    gid: int | None = None,
    size: str | None = None,
) -> dict[str, Any]:
    opts = ["nosuid", "nodev", f"mode={mode}"]
    if uid is not None:
        opts.append(f"uid={uid}")
    if gid is not None:
        opts.append(f"gid={gid}")
    if size:
        opts.append(f"size={size}")
    return {"destination": dest, "type": "tmpfs", "source": "tmpfs", "options": opts}


def with_mounts(spec: Spec, mounts: Sequence[Mapping[str, Any]]) -> Spec:
    """Append mounts; later mounts cover earlier ones (order is meaning)."""
    out = _copy(spec)
    out["mounts"].extend(dict(m) for m in mounts)
    return out


def with_host_rootfs(spec: Spec, host: HostInfo) -> Spec:
    """Share the host's system directories read-only (no image: native, bubblewrap, runc)."""
    mounts = [bind(dest, src, writable=False) for dest, src in host.system_mounts]
    mounts += [bind(f"/etc/{n}", f"/etc/{n}", writable=False) for n in host.etc_entries]
    out = with_mounts(spec, mounts)
    out["annotations"][ANN_HOST_ROOTFS] = "true"
    return out


def with_image(spec: Spec, image: str) -> Spec:
    out = _copy(spec)
    out["annotations"][ANN_IMAGE] = image
    return out


def with_network(spec: Spec, mode: NetworkMode) -> Spec:
    """none and egress get their own network namespace; only host shares the host's.

    egress in plain OCI terms is an empty namespace: a runtime that cannot attach an outbound
    path (slirp4netns, a container network) leaves it closed rather than open.
    """
    out = _copy(spec)
    ns = [n for n in out["linux"]["namespaces"] if n["type"] != "network"]
    if mode is not NetworkMode.HOST:
        ns.append({"type": "network"})
    out["linux"]["namespaces"] = ns
    out["annotations"][ANN_NETWORK] = mode.value
    return out


def with_host_services(spec: Spec, grants: Sequence[HostService]) -> Spec:
    """The host services granted to the task, space-separated canonical forms (OCI has no
    field for them: each runtime serves them, or its check lists them unenforced)."""
    if not grants:
        return spec
    out = _copy(spec)
    out["annotations"][ANN_HOST_SERVICES] = " ".join(str(g) for g in grants)
    return out


def with_published_ports(spec: Spec, ports: Sequence[PublishedPort]) -> Spec:
    """The ports published on the host, space-separated canonical forms
    (``127.0.0.1:8080:80``, ``127.0.0.1::3000`` for a free host port). OCI's ``ports`` are
    an engine's, not the runtime spec's: each runtime serves them, or its check lists them
    unenforced."""
    if not ports:
        return spec
    out = _copy(spec)
    out["annotations"][ANN_PUBLISH] = " ".join(str(p) for p in ports)
    return out


def with_service_containers(spec: Spec, services: Sequence[tuple[str, int]]) -> Spec:
    """The task's service containers, ``NAME=PORT`` space-separated (OCI has no field for
    them: the lifecycle starts them, each runtime's relays make them appear inside)."""
    if not services:
        return spec
    out = _copy(spec)
    out["annotations"][ANN_SERVICES] = " ".join(f"{name}={port}" for name, port in services)
    return out


def with_memory_limit(spec: Spec, mib: int | None) -> Spec:
    out = _copy(spec)
    if mib:
        limit = mib * 1024 * 1024
        # swap == limit: no swap beyond the memory limit.
        out["linux"]["resources"]["memory"] = {"limit": limit, "swap": limit}
    return out


def with_cpu_quota(spec: Spec, cores: float | None, period_us: int = 100_000) -> Spec:
    out = _copy(spec)
    if cores:
        out["linux"]["resources"]["cpu"] = {
            "quota": max(1000, round(cores * period_us)),
            "period": period_us,
        }
    return out


def with_pids_limit(spec: Spec, pids: int | None) -> Spec:
    out = _copy(spec)
    if pids:
        out["linux"]["resources"]["pids"] = {"limit": pids}
    return out


def _within_hard(value: int, hard: int) -> int:
    return value if hard < 0 else min(value, hard)


def process_rlimits(
    host: HostInfo, cpu_ms: int | None, file_size_mb: int | None = None
) -> list[dict[str, Any]]:
    """RLIMIT_NOFILE, RLIMIT_CPU and RLIMIT_FSIZE, never above the host's current hard limits.

    Raising a limit past the hard limit is refused by the kernel (and makes runc fail), so
    every value is clamped to what this process may set. Pure.
    """
    limits: list[dict[str, Any]] = []
    _, nhard = host.rlimits.get("RLIMIT_NOFILE", (1024, 1024))
    hard = nhard if nhard >= 0 else DEFAULT_NOFILE
    limits.append(
        {"type": "RLIMIT_NOFILE", "soft": _within_hard(DEFAULT_NOFILE, hard), "hard": hard}
    )
    if cpu_ms:
        _, chard = host.rlimits.get("RLIMIT_CPU", (-1, -1))
        secs = max(1, math.ceil(cpu_ms / 1000))
        # SIGXCPU at the soft limit, SIGKILL one second later at the hard limit.
        limits.append(
            {
                "type": "RLIMIT_CPU",
                "soft": _within_hard(secs, chard),
                "hard": _within_hard(secs + 1, chard),
            }
        )
    if file_size_mb:
        _, fhard = host.rlimits.get("RLIMIT_FSIZE", (-1, -1))
        size = _within_hard(file_size_mb * 1024 * 1024, fhard)
        limits.append({"type": "RLIMIT_FSIZE", "soft": size, "hard": size})
    return limits


def with_seccomp(spec: Spec, arch: str) -> Spec:
    """The default seccomp profile (see fusion_oci.oci.seccomp), shared by every runtime."""
    from fusion_oci.oci.seccomp import default_profile

    out = _copy(spec)
    out["linux"]["seccomp"] = default_profile(arch)
    return out


def with_annotations(spec: Spec, annotations: Mapping[str, str]) -> Spec:
    out = _copy(spec)
    out["annotations"].update(annotations)
    return out


def task_mounts(layout: TaskLayout, policy: SandboxPolicy, host: HostInfo) -> list[dict[str, Any]]:
    """The task's own mounts, in the order that gives read-only the last word where it must."""
    size = f"{policy.tmp_size_mb}m" if policy.tmp_size_mb else None
    mounts: list[dict[str, Any]] = [
        tmpfs("/tmp", mode="1777", size=size),
        tmpfs(SANDBOX_HOME, mode="700", uid=host.uid, gid=host.gid, size=size),
    ]
    mounts += [bind(p, p, writable=False) for p in policy.allowed_paths]
    mounts += [bind(p, p, writable=True) for p in policy.writable_paths]
    mounts += [bind(c.sandbox_path, c.host_path, writable=True) for c in layout.caches]
    if layout.ca_bundle:
        mounts.append(bind(CA_IN_SANDBOX, layout.ca_bundle, writable=False))
    if layout.hosts_file:
        # After the system's /etc entries (with_host_rootfs): the services' names win.
        mounts.append(bind("/etc/hosts", layout.hosts_file, writable=False))
    mounts.append(bind(layout.worktree, layout.worktree, writable=True))
    git = layout.git
    dotgit = f"{layout.worktree.rstrip('/')}/.git"
    if git is not None:
        common = git.common_dir
        if git.kind == "linked":
            # The .git file names the git dir: read-only (and a mount point, so it cannot be
            # replaced by a .git/ folder of the command's making, with hooks of its own).
            mounts.append(bind(dotgit, dotgit, writable=False))
            # The common dir read-only, then only what commits need writable.
            mounts.append(bind(common, common, writable=False))
            for sub in ("objects", "refs", "logs"):
                mounts.append(bind(f"{common}/{sub}", f"{common}/{sub}", writable=True))
            mounts.append(bind(git.git_dir, git.git_dir, writable=True))
        else:
            # .git/ over itself: a mount point cannot be renamed, so the command cannot swap
            # in a .git/ of its own around the read-only hooks and config below.
            mounts.append(bind(dotgit, dotgit, writable=True))
        # Last word: hooks and config stay read-only, so nothing planted here runs on the host.
        mounts.append(bind(f"{common}/hooks", f"{common}/hooks", writable=False))
        mounts.append(bind(f"{common}/config", f"{common}/config", writable=False))
        if git.worktree_config:
            mounts.append(bind(git.worktree_config, git.worktree_config, writable=False))
    bound_ro = {m["destination"] for m in mounts if "ro" in m["options"]}
    protected = [p for p in layout.protected if p not in bound_ro]
    mounts += [bind(p, p, writable=False) for p in protected]
    # A writablePaths entry inside a protected path (e.g. .fusion/fusion.db) stays writable.
    mounts += [
        bind(p, p, writable=True)
        for p in policy.writable_paths
        if any(p.startswith(q.rstrip("/") + "/") for q in protected)
    ]
    return mounts


def sandbox_env(
    policy: SandboxPolicy,
    layout: TaskLayout,
    source: Mapping[str, str],
) -> dict[str, str]:
    """The command's whole environment: a fixed minimal set plus the allow-listed names.

    Nothing else of the caller's environment passes: tokens and keys stay out unless named.
    """
    env = {
        "PATH": SANDBOX_PATH,
        "HOME": SANDBOX_HOME,
        "TMPDIR": "/tmp",
        "LANG": source.get("LANG", "C.UTF-8"),
        "TERM": source.get("TERM", "dumb"),
        **NO_UPDATE_CHECKS,
    }
    for cache in layout.caches:
        env.update(dict(cache.env))
    if layout.ca_bundle:
        env.update({name: CA_IN_SANDBOX for name in CA_ENV_VARS})
        if layout.ca_complete:
            del env["NODE_EXTRA_CA_CERTS"]
            env["NODE_OPTIONS"] = NODE_OPENSSL_CA
    if layout.git is not None:
        # The worktree belongs to the caller, maybe under another uid inside a container.
        env["GIT_CONFIG_COUNT"] = "1"
        env["GIT_CONFIG_KEY_0"] = "safe.directory"
        env["GIT_CONFIG_VALUE_0"] = "*"
    allowed = allowed_env(policy.env_allowlist, source)
    if "NODE_OPTIONS" in allowed and env.get("NODE_OPTIONS") == NODE_OPENSSL_CA:
        merged = node_options(allowed["NODE_OPTIONS"])
        if merged is None:  # theirs stands; the bundle is added as a partial one would be
            env["NODE_EXTRA_CA_CERTS"] = CA_IN_SANDBOX
        else:
            allowed["NODE_OPTIONS"] = merged
    env.update(allowed)
    # After the allowlist: a brokered variable holds its sentinel even where the allowlist
    # names it (the value must never pass).
    env.update(credential_env(layout, env))
    if policy.network_mode is NetworkMode.FILTERED:
        # Last: the allowlist cannot point a tool past the proxy (it could not reach anything
        # anyway: the sandbox's only way out is the forwarder on 127.0.0.1:3128).
        env.update(filtered_env())
        if bypass := no_proxy(policy.relayed()):
            # Granted services and service containers, directly (by their names too).
            names = ",".join(s.name for s in policy.services)
            bypass = f"{bypass},{names}" if names else bypass
            env["NO_PROXY"] = env["no_proxy"] = bypass
    return env


def node_options(theirs: str) -> str | None:
    """The caller's allow-listed ``NODE_OPTIONS`` after :data:`NODE_OPENSSL_CA`, or None where
    theirs names Node.js's own store (``--use-bundled-ca``, which Node.js refuses beside it).
    Pure."""
    words = theirs.split()
    if "--use-bundled-ca" in words:
        return None
    return " ".join([NODE_OPENSSL_CA, *(w for w in words if w != NODE_OPENSSL_CA)])


def credential_env(layout: TaskLayout, env: Mapping[str, str]) -> dict[str, str]:
    """The sentinels of brokered credentials, and git's credential helper for their hosts
    (it prints the sentinel; the proxy swaps it in the Authorization header). Pure."""
    out = dict(layout.sentinels)
    count = int(env.get("GIT_CONFIG_COUNT", "0"))
    for host, user, name in layout.git_credentials:
        helper = (
            f'!f() {{ test "$1" = get && echo username={user} && echo "password=${name}"; }}; f'
        )
        # ssh remotes of the host go over https: there is no key inside to sign with, and
        # only https carries the brokered token.
        for key, value in (
            (f"credential.https://{host}.helper", helper),
            (f"url.https://{host}/.insteadOf", f"git@{host}:"),
            (f"url.https://{host}/.insteadOf", f"ssh://git@{host}/"),
        ):
            out[f"GIT_CONFIG_KEY_{count}"] = key
            out[f"GIT_CONFIG_VALUE_{count}"] = value
            count += 1
    if layout.git_credentials:
        out["GIT_CONFIG_COUNT"] = str(count)
    return out


def filtered_env() -> dict[str, str]:
    """The proxy environment of a ``filtered`` sandbox's commands: every tool's proxy variables
    at the agent's forwarder, ssh through the agent's ``connect`` mode at the path every
    runtime binds it to. Pure."""
    from fusion_oci.agent.protocol import EGRESS_AGENT, EGRESS_PORT
    from fusion_oci.egress.env import proxy_env

    return proxy_env("127.0.0.1", EGRESS_PORT, agent=EGRESS_AGENT)


# Names that look like credentials. They pass only when the allowlist names them exactly:
# a glob such as `CI_*` or `*` never lets `CI_JOB_TOKEN` or `AWS_SECRET_ACCESS_KEY` through.
SECRET_PATTERNS = (
    "*TOKEN*",
    "*SECRET*",
    "*PASSWORD*",
    "*PASSWD*",
    "*CREDENTIAL*",
    "*PRIVATE*KEY*",
    "*API*KEY*",
    "*ACCESS*KEY*",
    "*_KEY",
    "*SESSION*",
    "*COOKIE*",
    "*AUTH*",
    "AWS_*",
    "AZURE_*",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GCP_*",
    "SSH_AUTH_SOCK",
    "DOCKER_HOST",
    "CONTAINER_HOST",
    "KUBECONFIG",
    "VAULT_*",
    "NPM_CONFIG__AUTH*",
)


def is_secret_name(name: str) -> bool:
    from fnmatch import fnmatchcase

    upper = name.upper()
    return any(fnmatchcase(upper, pattern) for pattern in SECRET_PATTERNS)


def allowed_env(allowlist: Sequence[str], source: Mapping[str, str]) -> dict[str, str]:
    """The caller's variables the allowlist lets through (exact names or globs)."""
    from fnmatch import fnmatchcase

    exact = {name for name in allowlist if not any(c in name for c in "*?[")}
    globs = [name for name in allowlist if name not in exact]
    out = {}
    for name, value in source.items():
        if name in exact or (any(fnmatchcase(name, g) for g in globs) and not is_secret_name(name)):
            out[name] = value
    return out


def command_argv(command: str | Sequence[str]) -> list[str]:
    """One string is a shell command line (``/bin/sh -c``); a sequence is an argv."""
    if isinstance(command, str):
        return ["/bin/sh", "-c", command]
    return list(command)


def _cwd(cwd: str | None, worktree: str) -> str:
    if not cwd:
        return worktree
    return cwd if cwd.startswith("/") else f"{worktree.rstrip('/')}/{cwd}"


def compile_task(ctx: PrepareContext, layout: TaskLayout, host: HostInfo) -> TaskSpec:
    """The task's sandbox: the OCI config without ``process``, shared by every command. Pure."""
    policy = ctx.policy
    # Every op copies its input (they are pure), so the small parts go first and the large
    # ones last: the mounts and the seccomp profile are copied once, not by every later op.
    # Only the order of the mounts among themselves carries meaning, and it is kept.
    spec = default_spec()
    del spec["process"]
    spec = with_network(spec, policy.network_mode)
    # Service containers are served by relays as host services are: one annotation lists
    # every endpoint a relay serves inside; the services annotation names the containers.
    spec = with_host_services(spec, policy.relayed())
    spec = with_service_containers(spec, [(s.name, s.port) for s in policy.services])
    spec = with_published_ports(spec, policy.published())
    spec = with_memory_limit(spec, policy.memory_limit_mb)
    cpu = policy.cpu_limit
    spec = with_cpu_quota(spec, cpu.max_cores if cpu else None)
    spec = with_pids_limit(spec, policy.pids_limit)
    spec = with_annotations(
        spec,
        {
            ANN_TASK: ctx.task_id,
            ANN_RUN: ctx.run_id,
            ANN_POLICY: policy.digest(),
            ANN_CACHE_MODE: ctx.cache_mode.value,
        },
    )
    spec = with_image(spec, ctx.image) if ctx.image else with_host_rootfs(spec, host)
    spec = with_mounts(spec, task_mounts(layout, policy, host))
    spec = with_seccomp(spec, host.arch)
    return TaskSpec.model_validate(spec)


def compile_process(
    ctx: PrepareContext,
    layout: TaskLayout,
    host: HostInfo,
    command: str | Sequence[str],
    opts: RunOptions,
    env_source: Mapping[str, str],
) -> ProcessSpec:
    """One command's OCI ``process``: argv, cwd, the sandbox environment, the policy's
    rlimits, the caller's ids, no capabilities. Pure."""
    policy = ctx.policy
    cpu = policy.cpu_limit
    process = dict(default_spec()["process"])
    process.update(
        user={"uid": host.uid, "gid": host.gid},
        args=command_argv(command),
        cwd=_cwd(opts.cwd, layout.worktree),
        env=[f"{k}={v}" for k, v in sorted(sandbox_env(policy, layout, env_source).items())],
        rlimits=process_rlimits(host, cpu.max_ms if cpu else None, policy.file_size_limit_mb),
    )
    return ProcessSpec.model_validate(process)


def compile_spec(
    ctx: PrepareContext,
    layout: TaskLayout,
    host: HostInfo,
    command: str | Sequence[str],
    opts: RunOptions,
    env_source: Mapping[str, str],
) -> Spec:
    """The whole ``config.json`` for one command (a bundle, ``fusion-oci plan``). Pure."""
    return config_json(
        compile_task(ctx, layout, host),
        compile_process(ctx, layout, host, command, opts, env_source),
    )
