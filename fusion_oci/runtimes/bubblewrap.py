"""The bubblewrap runtime: each command in fresh Linux namespaces built by ``bwrap``.

:func:`bwrap_argv` is the whole translation, a pure function of the spec (and a few host facts
in :class:`BwrapHost`), golden-tested per policy. The spec's mounts are replayed in order,
because order is meaning: the git ``hooks/`` and ``config`` of a linked worktree's common
directory are bound read-only *after* the read-write parents they sit in.

What a command gets: a read-only root built from the host's system directories (or an unpacked
image directory), the worktree read-write at its own absolute path, allowedPaths read-only,
writablePaths read-write, private tmpfs ``/tmp`` and ``$HOME``, a fresh ``/proc`` and minimal
``/dev``, every namespace unshared (network kept only for ``host``), ``--die-with-parent``,
``--new-session`` (no TIOCSTI into the caller's terminal), no capabilities, no further user
namespaces, and exactly the spec's environment.

Around the launch (:meth:`BubblewrapRuntime.execute`): bwrap reports its child pid on
``--info-fd`` and waits on ``--block-fd`` while we move the child into its cgroup and attach
slirp4netns for ``egress``; rlimits (RLIMIT_CPU for cpuLimit.maxMs) are set by ``prlimit`` on
the launcher and inherited. Afterwards slirp4netns is stopped and the cgroup killed and removed,
also on timeout, maxBuffer and cancellation.

Package caches (``cacheMode``): in ``shared`` mode the pnpm store and npm cache of a project are
one read-write directory reused by every task, so the second ``pnpm install`` is fast and works
offline. The price is contamination: a command in one task can write into the store a tarball
or unpacked package that a later task will trust (pnpm verifies integrity when it fetches, not
every time it links from the store). ``isolated`` gives each task its own cache (no
cross-task poisoning, a cold first install); ``off`` mounts none.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from fusion_oci.errors import BundleError, SandboxSetupError
from fusion_oci.models import (
    NetworkMode,
    PrepareContext,
    RunOptions,
    RunResult,
    SandboxCapabilities,
)
from fusion_oci.oci.seccomp import OCI_ARCHES, compile_bpf
from fusion_oci.oci.spec import (
    ANN_HOST_ROOTFS,
    ANN_IMAGE,
    Spec,
    spec_capabilities,
    spec_env,
    spec_network,
)
from fusion_oci.process import ProcessOutcome, run_process
from fusion_oci.runtimes.base import (
    Availability,
    LaunchPlan,
    LimitCounters,
    Requirement,
    SpecRuntime,
    classify,
    status_from_code,
)
from fusion_oci.runtimes.linux import cgroups, egress, userns
from fusion_oci.runtimes.linux.cgroups import Cgroup, CgroupEvents, CgroupLimits, CgroupSupport
from fusion_oci.runtimes.linux.pipes import close_all, read_json
from fusion_oci.scratch import make_scratch

INFO_FD = "<info-fd>"
BLOCK_FD = "<block-fd>"
SECCOMP_FD = "<seccomp-fd>"
RESOLV_PLACEHOLDER = "<egress-resolv.conf>"

PRLIMIT_FLAGS = {
    "RLIMIT_CPU": "cpu",
    "RLIMIT_NOFILE": "nofile",
    "RLIMIT_NPROC": "nproc",
    "RLIMIT_CORE": "core",
    "RLIMIT_AS": "as",
    "RLIMIT_FSIZE": "fsize",
}

# /dev sub-mounts of the OCI default that bwrap's --dev already provides (pts, shm).
_COVERED_BY_DEV = ("/dev/pts", "/dev/shm")


@dataclass(frozen=True)
class BwrapHost:
    """The host facts the translation needs: tool paths and what this host supports."""

    bwrap: str = "bwrap"
    prlimit: str | None = "prlimit"
    """None: rlimits are not applied (and CPU time is reported as not enforced)."""
    disable_userns: bool = True
    """bwrap >= 0.8: forbid nested user namespaces inside the sandbox."""
    cgroup_mode: cgroups.Mode = "v1"
    systemd_run: str | None = None
    egress_resolv_conf: str = RESOLV_PLACEHOLDER
    """Host file bound over /etc/resolv.conf in egress mode (slirp's DNS)."""
    path_kinds: tuple[tuple[str, str], ...] | None = None
    """``(path, "file" | "dir")`` for each of the spec's maskedPaths/readonlyPaths that exists
    on this host (bwrap cannot mount over a path that does not exist). None: assume every one
    exists with its usual kind (plans and goldens stay independent of the host)."""


@dataclass(frozen=True)
class LaunchFds:
    """The pipe ends bwrap gets: it writes its child pid to ``info``, waits on ``block`` and
    reads the compiled seccomp filter from ``seccomp``."""

    info: int | str = INFO_FD
    block: int | str = BLOCK_FD
    seccomp: int | str = SECCOMP_FD


def _opt(options: Sequence[str], key: str) -> str | None:
    for item in options:
        if item.startswith(key + "="):
            return item.split("=", 1)[1]
    return None


def _size_bytes(value: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)", value.lower())
    if not m:
        raise BundleError(f"tmpfs size '{value}' is not understood", "expected N, Nk, Nm or Ng",
                          "fix the spec's tmpfs options")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[m.group(2)]


def mount_args(mount: Mapping[str, Any]) -> tuple[list[str], str | None]:
    """One spec mount as bwrap options, or a note saying why it is skipped. Pure."""
    dest, kind = mount["destination"], mount.get("type", "bind")
    opts = list(mount.get("options", []))
    if kind == "proc":
        return ["--proc", dest], None
    if dest == "/dev" and kind == "tmpfs":
        return ["--dev", "/dev"], None
    if dest in _COVERED_BY_DEV:
        return [], None
    if kind == "mqueue":
        return ["--mqueue", dest], None
    if kind == "sysfs":
        return [], f"{dest}: not mounted (bwrap cannot mount a fresh sysfs; the host's stays out)"
    if kind == "tmpfs":
        args: list[str] = []
        mode = _opt(opts, "mode")
        if mode:
            args += ["--perms", mode.rjust(4, "0")]
        size = _opt(opts, "size")
        if size:
            args += ["--size", str(_size_bytes(size))]
        return [*args, "--tmpfs", dest], None
    if kind == "bind" or "bind" in opts or "rbind" in opts:
        flag = "--ro-bind" if "ro" in opts else "--bind"
        return [flag, mount["source"], dest], None
    raise BundleError(f"mount type '{kind}' at {dest} is not supported by bubblewrap",
                      "bwrap can bind, tmpfs, proc, dev and mqueue",
                      "use a container backend for this spec")


def _rootfs_args(spec: Spec) -> list[str]:
    ann = spec.get("annotations", {})
    if ann.get(ANN_HOST_ROOTFS) == "true":
        return []  # the system directories come as ordinary read-only binds
    image = ann.get(ANN_IMAGE) or spec["root"]["path"]
    if not image.startswith("/"):
        raise BundleError(
            f"bubblewrap cannot use image '{image}'",
            "it needs the host's system directories or an unpacked rootfs directory",
            "leave sandbox.image unset for bubblewrap, or set it to an absolute rootfs path",
        )
    return ["--ro-bind", image, "/"]


def prlimit_args(spec: Spec, prlimit: str | None) -> list[str]:
    """``prlimit --cpu=S:H ... --`` for the spec's rlimits (inherited by bwrap's child). Pure."""
    limits = spec["process"].get("rlimits", [])
    if not limits or prlimit is None:
        return []
    out = [prlimit]
    for item in limits:
        flag = PRLIMIT_FLAGS.get(item["type"])
        if flag is None:
            raise BundleError(f"rlimit {item['type']} is not supported by bubblewrap",
                              f"supported: {', '.join(PRLIMIT_FLAGS)}", "drop it from the spec")
        out.append(f"--{flag}={item['soft']}:{item['hard']}")
    return [*out, "--"]


# The usual kind of the OCI default maskedPaths/readonlyPaths (see oci/spec.py).
USUAL_KINDS = {
    "/proc/kcore": "file", "/proc/keys": "file", "/proc/latency_stats": "file",
    "/proc/timer_list": "file", "/proc/timer_stats": "file", "/proc/sched_debug": "file",
    "/proc/sysrq-trigger": "file",
}


def protected_proc_paths(spec: Spec) -> tuple[str, ...]:
    """Every maskedPaths/readonlyPaths entry of the spec, in order."""
    linux = spec.get("linux", {})
    return (*linux.get("maskedPaths", []), *linux.get("readonlyPaths", []))


@cache
def host_path_kinds(paths: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Which of ``paths`` exist on this host, and whether each is a file or a directory."""
    out = []
    for path in paths:
        if Path(path).exists():
            out.append((path, "dir" if Path(path).is_dir() else "file"))
    return tuple(out)


def proc_protection_args(spec: Spec, host: BwrapHost) -> tuple[list[str], list[str]]:
    """The spec's maskedPaths and readonlyPaths as bwrap options, and notes. Pure.

    Dropping them is not an option: as root, uid 0 passes /proc/sys's permission checks
    without any capability, so a writable /proc/sys/kernel/core_pattern is a host root escape.
    readonly: the path bound read-only over itself. masked: a file gets /dev/null, a directory
    an empty read-only tmpfs (what runc does). /sys is not mounted by bwrap at all, so its
    entries are hidden by absence.
    """
    linux = spec.get("linux", {})
    masked, readonly = linux.get("maskedPaths", []), linux.get("readonlyPaths", [])
    kinds = (dict(host.path_kinds) if host.path_kinds is not None
             else {p: USUAL_KINDS.get(p, "dir") for p in (*masked, *readonly)})
    # What bwrap really mounts (not sysfs: it cannot mount a fresh one, the host's stays out).
    mounted = {m["destination"] for m in spec["mounts"] if mount_args(m)[0]}
    args: list[str] = []
    notes: list[str] = []
    for path in [*masked, *readonly]:
        if not any(path == d or path.startswith(d.rstrip("/") + "/") for d in mounted):
            notes.append(f"{path}: hidden (bwrap mounts nothing there)")
            continue
        kind = kinds.get(path)
        if kind is None:
            notes.append(f"{path}: absent on this host, nothing to protect")
        elif path in readonly:
            args += ["--ro-bind", path, path]
        elif kind == "file":
            args += ["--ro-bind", "/dev/null", path]
        else:
            args += ["--perms", "0555", "--tmpfs", path, "--remount-ro", path]
    return args, notes


def needs_launch_hooks(spec: Spec, host: BwrapHost) -> bool:
    """Whether bwrap must pause for us (cgroup move, slirp4netns) before the command runs."""
    direct_cgroup = host.cgroup_mode in ("v1", "v2")
    return spec_network(spec) is NetworkMode.EGRESS or (
        direct_cgroup and bool(CgroupLimits.from_spec(spec).controllers()))


def bwrap_argv(spec: Spec, host: BwrapHost, fds: LaunchFds | None = None) -> list[str]:
    """The whole launch command for a spec. Pure: same spec and host, same argv."""
    proc = spec["process"]
    network = spec_network(spec)
    argv: list[str] = []
    limits = CgroupLimits.from_spec(spec)
    if host.cgroup_mode == "systemd-run" and host.systemd_run and limits.controllers():
        unit = "fusion-oci-" + spec.get("annotations", {}).get("io.fusion-oci.run-id", "run")
        argv += cgroups.systemd_run_prefix(host.systemd_run, unit, limits)
    argv += prlimit_args(spec, host.prlimit)
    argv += [host.bwrap, "--unshare-all", "--unshare-user"]
    if network is NetworkMode.HOST:
        argv.append("--share-net")
    argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for cap in spec_capabilities(spec):  # the spec's bounding set (empty in our bundles)
        argv += ["--cap-add", cap]
    if host.disable_userns:
        argv.append("--disable-userns")
    user = proc.get("user", {})
    argv += ["--uid", str(user.get("uid", 0)), "--gid", str(user.get("gid", 0))]
    if spec.get("hostname"):
        argv += ["--hostname", spec["hostname"]]
    argv += _rootfs_args(spec)
    for mount in spec["mounts"]:
        argv += mount_args(mount)[0]
    argv += proc_protection_args(spec, host)[0]
    if network is NetworkMode.EGRESS:
        argv += ["--ro-bind", host.egress_resolv_conf, "/etc/resolv.conf"]
    if spec["root"].get("readonly", True):
        # Last: mount points above were created in bwrap's tmpfs root; now nothing new can be.
        argv += ["--remount-ro", "/"]
    fds = fds or LaunchFds()
    if needs_launch_hooks(spec, host):
        argv += ["--info-fd", str(fds.info), "--block-fd", str(fds.block)]
    if spec.get("linux", {}).get("seccomp"):
        # Applied by bwrap right before exec, after its own mounts and namespace setup.
        argv += ["--seccomp", str(fds.seccomp)]
    argv.append("--clearenv")
    for key, value in spec_env(spec).items():
        argv += ["--setenv", key, value]
    argv += ["--chdir", proc.get("cwd", "/"), "--", *proc["args"]]
    return argv


def seccomp_program(spec: Spec) -> bytes | None:
    """The spec's seccomp profile as the classic BPF bwrap reads from ``--seccomp``. Pure."""
    profile = spec.get("linux", {}).get("seccomp")
    if not profile:
        return None
    arches = [a for a, names in OCI_ARCHES.items() if set(names) & set(profile["architectures"])]
    if not arches:
        raise BundleError("the seccomp profile cannot be compiled for bubblewrap",
                          f"no supported architecture in {profile.get('architectures')}",
                          f"bubblewrap's seccomp compiler knows {', '.join(OCI_ARCHES)}")
    try:
        return compile_bpf(profile, arches[0])
    except ValueError as exc:
        raise BundleError("the seccomp profile cannot be compiled for bubblewrap", str(exc),
                          "use a container backend for custom seccomp profiles") from exc


def plan_notes(spec: Spec, host: BwrapHost) -> list[str]:
    notes = [n for m in spec["mounts"] if (n := mount_args(m)[1])]
    notes += proc_protection_args(spec, host)[1]
    if spec.get("linux", {}).get("seccomp"):
        notes.append("seccomp: the spec's profile compiled to classic BPF, read by bwrap from "
                     "the seccomp fd")
    network = spec_network(spec)
    if network is NetworkMode.EGRESS:
        notes.append("egress: slirp4netns --configure --disable-host-loopback on the child's "
                     "network namespace before the command starts")
    limits = CgroupLimits.from_spec(spec)
    if limits.controllers():
        notes.append(f"cgroup ({host.cgroup_mode}): " + ", ".join(sorted(limits.controllers())))
    return notes


def split_status(outcome: ProcessOutcome) -> tuple[int | None, str | None]:
    """bwrap's status read back as the command's: 127/126 when bwrap could not exec it, else
    the one 128+N rule (:func:`~fusion_oci.runtimes.base.status_from_code`)."""
    code = outcome.returncode
    if code == 1 and (failed := exec_failure(outcome.stderr)) is not None:
        return failed, None
    return status_from_code(code, outcome.signal)


def exec_failure(stderr: bytes) -> int | None:
    """The shell's status for a command bwrap could not exec (it exits 1 itself and says
    ``bwrap: execvp NAME: REASON`` as its last line): 127 when not found, else 126. Pure."""
    last = stderr.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    if not last.startswith(b"bwrap: execvp "):
        return None
    return 127 if last.endswith(b"No such file or directory") else 126


@dataclass(frozen=True)
class HostProbe:
    """What bubblewrap can do on this host, probed once."""

    bwrap: str | None
    version: str | None = None
    problem: userns.Problem | None = None
    prlimit: str | None = None
    slirp4netns: str | None = None
    egress_problem: str | None = None
    cgroups: CgroupSupport = field(default_factory=lambda: CgroupSupport("none"))
    disable_userns: bool = True


def _version(tool: str) -> str | None:
    try:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=10,
                             check=False, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", out)
    return m.group(1) if m else None


def _at_least(version: str | None, wanted: tuple[int, ...]) -> bool:
    if not version:
        return False
    return tuple(int(p) for p in version.split(".")) >= wanted


@cache
def probe_host_support(path: str, uid: int) -> HostProbe:
    """Probe bwrap, user namespaces, cgroups, slirp4netns and prlimit (cached per process)."""
    bwrap = shutil.which("bwrap", path=path)
    if bwrap is None:
        return HostProbe(None, problem=userns.Problem(
            "bwrap is not installed",
            "apt-get install bubblewrap (Debian/Ubuntu), dnf install bubblewrap (Fedora), "
            "pacman -S bubblewrap (Arch)"))
    version = _version(bwrap)
    disable = _at_least(version, (0, 8))
    result = userns.probe_bwrap(bwrap, uid=uid, disable_userns=disable)
    slirp = shutil.which("slirp4netns", path=path)
    egress_problem = None
    if slirp is None:
        egress_problem = "slirp4netns is not installed (apt-get install slirp4netns)"
    elif not egress.tun_usable():
        egress_problem = "/dev/net/tun is missing or not read-writable (chmod 666 /dev/net/tun)"
    return HostProbe(
        bwrap=bwrap, version=version, problem=result.problem,
        prlimit=shutil.which("prlimit", path=path), slirp4netns=slirp,
        egress_problem=egress_problem, cgroups=cgroups.detect(), disable_userns=disable,
    )


def check_spec(spec: Spec) -> None:
    """Refuse what bwrap would only fail on at launch, with a clearer message: an image that
    is not an unpacked rootfs, a bind mount whose host path is missing. Reads the spec only."""
    image = spec.get("annotations", {}).get(ANN_IMAGE)
    if image and not Path(str(image)).is_dir():
        raise BundleError(f"bubblewrap cannot use image '{image}'",
                          "it runs on the host's system directories or an unpacked rootfs",
                          "leave sandbox.image unset for bubblewrap")
    for mount in spec.get("mounts", []):
        source = str(mount.get("source", ""))
        if mount.get("type") == "bind" and not os.path.lexists(source):
            raise BundleError(f"policy path {source} does not exist",
                              "allowedPaths/writablePaths are bound at their host paths",
                              "create it first or remove it from the policy")


def make_task_scratch(task_id: str) -> Path:
    """Per-task host directory for launcher files (the egress resolv.conf, slirp's log),
    owner-stamped so that gc removes it after a kill -9."""
    scratch = make_scratch("bwrap", task_id)
    (scratch / "resolv.conf").write_text(egress.RESOLV_CONF)
    return scratch


def _pipe_with(data: bytes) -> int:
    """A pipe already holding ``data`` (write end closed); returns the read end."""
    r, w = os.pipe()
    try:
        # A seccomp program is at most 4096 * 8 bytes: within a pipe's 64 KiB buffer.
        os.write(w, data)
    finally:
        os.close(w)
    return r


class BubblewrapRuntime(SpecRuntime):
    """Linux namespaces per command, via bwrap; see the module docstring."""

    id = "bubblewrap"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scratch: Path | None = None
        self._reaping: set[asyncio.Future[None]] = set()

    # ------------------------------------------------------------------ host facts
    @property
    def probe(self) -> HostProbe:
        path = self.env.get("PATH") or os.defpath
        return probe_host_support(path, os.geteuid())

    @property
    def bwrap_host(self) -> BwrapHost:
        p = self.probe
        resolv = str(self._scratch / "resolv.conf") if self._scratch else RESOLV_PLACEHOLDER
        return BwrapHost(
            bwrap=p.bwrap or "bwrap", prlimit=p.prlimit, disable_userns=p.disable_userns,
            cgroup_mode=p.cgroups.mode, systemd_run=p.cgroups.systemd_run,
            egress_resolv_conf=resolv,
        )

    def host_for(self, spec: Spec) -> BwrapHost:
        """:attr:`bwrap_host` with the host's kinds of the spec's masked/readonly paths."""
        kinds = host_path_kinds(protected_proc_paths(spec))
        return dataclasses.replace(self.bwrap_host, path_kinds=kinds)

    def capabilities(self) -> SandboxCapabilities:
        limits = "advanced" if self.probe.cgroups.controllers else "basic"
        return SandboxCapabilities(
            filesystem_isolation="strong", network_policy="coarse", resource_limits=limits,
            requires_install=True, supports_mac=False, supports_linux=True,
            supports_windows=False,
        )

    def availability(self) -> Availability:
        p = self.probe
        details = {
            "bwrap": p.bwrap or "missing",
            "userns": "ok" if p.problem is None else p.problem.reason,
            "cgroups": p.cgroups.describe(),
            "egress": (f"slirp4netns {_version(p.slirp4netns) or '?'} --disable-host-loopback"
                       if p.egress_problem is None and p.slirp4netns else
                       f"unavailable: {p.egress_problem}"),
            "cpu-time": f"RLIMIT_CPU via {p.prlimit}" if p.prlimit else "unavailable: no prlimit",
            "enforces": ", ".join(sorted(r.value for r in self.enforces())),
        }
        if p.problem is not None:
            return Availability(False, p.problem.reason, p.problem.hint, version=p.version,
                                rootless=os.geteuid() != 0, details=details)
        return Availability(True, version=p.version, rootless=os.geteuid() != 0,
                            details=details)

    def enforces(self) -> frozenset[Requirement]:
        p = self.probe
        if p.bwrap is None or p.problem is not None:
            return frozenset()
        # tmpfs sizes: bwrap --size.
        out = {Requirement.FILESYSTEM, Requirement.PROC_PATHS,
               Requirement.ENV, Requirement.NETWORK_NONE,
               Requirement.TMP_SIZE}
        if p.egress_problem is None and p.slirp4netns:
            out.add(Requirement.NETWORK_EGRESS)
        ctl = p.cgroups.controllers
        for name, req in (("memory", Requirement.MEMORY), ("pids", Requirement.PIDS),
                          ("cpu", Requirement.CPU_QUOTA)):
            if name in ctl:
                out.add(req)
        if p.prlimit:
            out |= {Requirement.CPU_TIME, Requirement.FILE_SIZE}
        return frozenset(out)

    def plan(self, spec: Spec) -> LaunchPlan:
        host = self.host_for(spec)
        return LaunchPlan(backend=self.id, argv=bwrap_argv(spec, host), cwd="/",
                          notes=plan_notes(spec, host))

    # ------------------------------------------------------------------ lifecycle
    async def prepare(self, ctx: PrepareContext) -> None:
        await super().prepare(ctx)
        assert self.task_spec is not None
        check_spec(self.task_spec)
        self._scratch = make_task_scratch(ctx.task_id)

    async def dispose(self) -> None:
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)
            self._reaping.clear()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        await super().dispose()

    def _launcher_env(self) -> dict[str, str]:
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "LANG": "C.UTF-8"}
        if self.probe.cgroups.mode == "systemd-run":
            # systemd-run --user finds the user manager through these.
            for key in ("XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS"):
                if key in self.env:
                    env[key] = self.env[key]
        return env

    async def execute(self, spec: Spec, opts: RunOptions) -> RunResult:
        if self._scratch is None:
            raise SandboxSetupError("runtime 'bubblewrap' was not prepared",
                                    "run() came before prepare()", "call prepare(ctx) first")
        host = self.host_for(spec)
        limits = CgroupLimits.from_spec(spec)
        hooks = needs_launch_hooks(spec, host)
        group: Cgroup | None = None
        if host.cgroup_mode in ("v1", "v2") and limits.controllers():
            group = await asyncio.to_thread(Cgroup.create, self.probe.cgroups, limits)
        info_r = info_w = block_r = block_w = seccomp_r = None
        link: egress.Egress | None = None
        run: asyncio.Task[ProcessOutcome] | None = None
        try:
            passed: list[int] = []
            program = seccomp_program(spec)
            if program is not None:
                seccomp_r = _pipe_with(program)
                passed.append(seccomp_r)
            if hooks:
                info_r, info_w = os.pipe()
                block_r, block_w = os.pipe()
                passed += [info_w, block_r]
            fds = LaunchFds(info=info_w if info_w is not None else INFO_FD,
                            block=block_r if block_r is not None else BLOCK_FD,
                            seccomp=seccomp_r if seccomp_r is not None else SECCOMP_FD)
            run = asyncio.create_task(run_process(
                bwrap_argv(spec, host, fds),
                env=self._launcher_env(),
                cwd="/",
                stdin=opts.stdin,
                timeout_s=opts.timeout_ms / 1000,
                max_buffer=opts.max_buffer,
                pass_fds=passed,
                on_output=opts.on_output,
                keep_output=opts.keep_output,
            ))
            if hooks:
                assert info_r is not None and block_w is not None
                link = await self._setup(run, info_r, spec, group)
                close_all(info_w, block_r)
                info_w = block_r = None
                with contextlib.suppress(OSError):
                    os.write(block_w, b"1")  # bwrap's child may already be gone
            outcome = await run
        except BaseException:
            if run is not None and not run.done():
                run.cancel()
                with contextlib.suppress(BaseException):
                    await run
            raise
        finally:
            close_all(info_r, info_w, block_r, block_w, seccomp_r)
            if link is not None:
                # SIGKILLed at once; reaping it waits for the kernel to unregister its tap
                # device (10-40 ms), so that part runs in the background until dispose().
                link.kill()
                self._reaping.add(asyncio.ensure_future(link.stop()))
            events = CgroupEvents()
            if group is not None:
                events = group.events()
                await asyncio.to_thread(group.remove)
        exit_code, signal = split_status(outcome)
        outcome = dataclasses.replace(outcome, returncode=exit_code, signal=signal)
        counters = LimitCounters(oom_kills=events.oom_kills, pids_max=events.pids_max)
        return self.result(outcome, spec, classify(outcome, spec, counters))

    async def _setup(self, run: asyncio.Task[ProcessOutcome], info_r: int, spec: Spec,
                     group: Cgroup | None) -> egress.Egress | None:
        """Between bwrap's fork and the command's exec: cgroup, then network."""
        reading = asyncio.ensure_future(read_json(info_r))
        done, _ = await asyncio.wait({reading, run}, return_when=asyncio.FIRST_COMPLETED)
        if reading not in done:
            reading.cancel()
            return None  # bwrap failed before its child existed; its stderr says why
        info = reading.result()
        if not info or "child-pid" not in info:
            return None
        pid = int(info["child-pid"])
        if group is not None:
            group.add(pid)
        if spec_network(spec) is NetworkMode.EGRESS:
            slirp = self.probe.slirp4netns
            if slirp is None:
                raise SandboxSetupError("network egress needs slirp4netns", "it is not installed",
                                        "apt-get install slirp4netns, or use network none")
            assert self._scratch is not None
            return await egress.Egress.attach(pid, slirp=slirp, log=self._scratch / "slirp.log")
        return None
