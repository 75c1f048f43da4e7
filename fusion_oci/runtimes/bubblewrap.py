"""The bubblewrap runtime: each command in fresh Linux namespaces built by ``bwrap``.

The translation is :mod:`.bubblewrap_argv` (:func:`bwrap_argv`, a pure function of the spec
and a few host facts, golden-tested per policy); this module is the runtime around it: host
probes, prepare, launch, clean-up.

What a command gets: a read-only root built from the host's system directories (or an unpacked
image directory), the worktree read-write at its own absolute path, allowedPaths read-only,
writablePaths read-write, private tmpfs ``/tmp`` and ``$HOME``, a fresh ``/proc`` and minimal
``/dev``, every namespace unshared (network kept only for ``host``), ``--die-with-parent``,
``--new-session`` (no TIOCSTI into the caller's terminal), no capabilities, no further user
namespaces, the bundle's seccomp profile, and exactly the spec's environment.

Per task, at prepare: the host probes (once per process), the seccomp profile compiled to BPF
by libseccomp, the kinds of the protected /proc paths. Per command: :meth:`~BubblewrapRuntime.plan`
is :func:`bwrap_argv` with placeholder fds; :meth:`~BubblewrapRuntime.execute` puts the real pipe
ends in their places (:func:`with_fds`) and starts that as ``bwrap --args FD -- COMMAND`` and,
while it waits for its options on FD, gets the spec's rlimits with prlimit(2) (inherited by
the command: no ``prlimit`` exec); then the options are written. With cgroup limits or
``egress``, bwrap reports its child pid on ``--info-fd`` and waits on ``--block-fd`` while we
move the child into its cgroup and attach slirp4netns. Afterwards slirp4netns is stopped and
the cgroup killed and removed, also on timeout, maxBuffer and cancellation.

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
import errno
import os
import re
import resource
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_oci.agent.client import agent_binary
from fusion_oci.agent.protocol import parse_exec_status
from fusion_oci.errors import BundleError, SandboxSetupError
from fusion_oci.models import NetworkMode, RunOptions, RunResult, SandboxCapabilities
from fusion_oci.oci.seccomp import LIBSECCOMP_HINT, libseccomp_problem
from fusion_oci.oci.spec import ANN_IMAGE, Spec, spec_network
from fusion_oci.process import ProcessOutcome, run_process
from fusion_oci.runtimes.base import (
    Availability,
    LaunchPlan,
    LimitCounters,
    Requirement,
    SpecRuntime,
    classify,
    own_plan,
)

# The translation, re-exported: callers and tests name it from here.
from fusion_oci.runtimes.bubblewrap_argv import (
    BLOCK_FD,
    INFO_FD,
    RESOLV_PLACEHOLDER,
    RLIMITS,
    SECCOMP_FD,
    USUAL_KINDS,
    BwrapHost,
    LaunchFds,
    args_launch,
    bwrap_argv,
    exec_failure,
    mount_args,
    needs_launch_hooks,
    plan_notes,
    proc_protection_args,
    protected_proc_paths,
    seccomp_program,
    spec_rlimits,
    split_status,
    with_fds,
)
from fusion_oci.runtimes.linux import cgroups, egress, userns
from fusion_oci.runtimes.linux.cgroups import Cgroup, CgroupEvents, CgroupLimits, CgroupSupport
from fusion_oci.runtimes.linux.pipes import close_all, read_json
from fusion_oci.scratch import make_scratch

if TYPE_CHECKING:
    from collections.abc import Mapping

    from fusion_oci.oci.host import HostInfo
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.resolve import ResolvedTask

__all__ = [
    "BLOCK_FD", "INFO_FD", "RESOLV_PLACEHOLDER", "RLIMITS", "SECCOMP_FD", "USUAL_KINDS",
    "BubblewrapRuntime", "BwrapHost", "HostProbe", "LaunchFds", "args_launch", "bwrap_argv",
    "check_spec", "exec_failure", "host_path_kinds", "make_task_scratch", "mount_args",
    "needs_launch_hooks", "plan_notes", "probe_host_support", "proc_protection_args",
    "protected_proc_paths", "seccomp_program", "spec_rlimits", "split_status", "with_fds",
]


@dataclass(frozen=True)
class HostProbe:
    """What bubblewrap can do on this host, probed once."""

    bwrap: str | None
    version: str | None = None
    problem: userns.Problem | None = None
    slirp4netns: str | None = None
    egress_problem: str | None = None
    cgroups: CgroupSupport = field(default_factory=lambda: CgroupSupport("none"))
    disable_userns: bool = True
    seccomp_problem: str | None = None
    """Why the bundle's seccomp profile cannot be compiled here (no libseccomp), or None."""
    slirp_version: str | None = None


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
    """Probe bwrap, user namespaces, cgroups, slirp4netns and libseccomp (cached per
    process)."""
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
        slirp4netns=slirp, egress_problem=egress_problem, cgroups=cgroups.detect(),
        disable_userns=disable, seccomp_problem=libseccomp_problem(),
        slirp_version=_version(slirp) if slirp else None,
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


@cache
def host_path_kinds(paths: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Which of ``paths`` exist on this host, and whether each is a file or a directory."""
    out = []
    for path in paths:
        if Path(path).exists():
            out.append((path, "dir" if Path(path).is_dir() else "file"))
    return tuple(out)


@dataclass(frozen=True)
class BwrapPlan(LaunchPlan):
    """A bubblewrap launch plan, with the host facts it was made for (execute's input too).

    Its notes (words beside the argv, not part of what runs) are written when the plan is
    shown (:meth:`to_json`), not per command: :func:`plan_notes` costs more than the argv."""

    host: BwrapHost = field(kw_only=True, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        notes = [*self.notes, *plan_notes(self.spec, self.host)]
        if notes:
            data["notes"] = notes
        return data


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
    streams_stdin = True  # run_process writes a StdinStream's chunks as they come

    def __init__(self, settings: SandboxSettings, env: Mapping[str, str],
                 cache_root: Path | None = None, host: HostInfo | None = None) -> None:
        super().__init__(settings, env, cache_root=cache_root, host=host)
        self._scratch: Path | None = None
        self._reaping: set[asyncio.Future[None]] = set()
        self._bpf: tuple[Any, bytes | None] | None = None
        """(profile, its BPF): compiled once at prepare, reused while the profile is equal."""

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
            bwrap=p.bwrap or "bwrap", disable_userns=p.disable_userns,
            cgroup_mode=p.cgroups.mode, systemd_run=p.cgroups.systemd_run,
            egress_resolv_conf=resolv, exec_status=str(agent_binary()),
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
            # (versions come from the probe: availability() runs at every prepare)
            "egress": (f"slirp4netns {p.slirp_version or '?'} --disable-host-loopback"
                       if p.egress_problem is None and p.slirp4netns else
                       f"unavailable: {p.egress_problem}"),
            "cpu-time": "RLIMIT_CPU, set with prlimit(2) on bwrap before it forks",
            "seccomp": p.seccomp_problem or "the bundle's profile, compiled by libseccomp",
            "enforces": ", ".join(sorted(r.value for r in self.enforces())),
        }
        if p.problem is not None:
            return Availability(False, p.problem.reason, p.problem.hint, version=p.version,
                                rootless=os.geteuid() != 0, details=details)
        if p.seccomp_problem is not None:
            return Availability(False, "the bundle's seccomp profile cannot be compiled here",
                                LIBSECCOMP_HINT, version=p.version,
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
        # RLIMIT_CPU and RLIMIT_FSIZE: prlimit(2), always there on Linux.
        out |= {Requirement.CPU_TIME, Requirement.FILE_SIZE}
        return frozenset(out)

    def plan(self, spec: Spec) -> BwrapPlan:
        """:func:`bwrap_argv` with the placeholder fds (:class:`LaunchFds`) that
        :meth:`execute` fills with its pipe ends; bwrap's own environment and cwd."""
        host = self.host_for(spec)
        return BwrapPlan(backend=self.id, argv=bwrap_argv(spec, host), env=self._launcher_env(),
                         cwd="/", spec=spec, host=host)

    # ------------------------------------------------------------------ lifecycle
    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        task = await super().prepare(task)
        assert self.task_spec is not None
        check_spec(self.task_spec)
        self._scratch = make_task_scratch(task.ctx.task_id)
        self._warm(self.compile(["true"], RunOptions()))
        return task

    def _warm(self, spec: Spec) -> None:
        """What every command of the task shares, done once: the seccomp BPF (libseccomp),
        the host's kinds of the protected /proc paths."""
        profile = spec.get("linux", {}).get("seccomp")
        self._bpf = (profile, seccomp_program(spec))
        self.host_for(spec)

    def seccomp_for(self, spec: Spec) -> bytes | None:
        """The BPF of the spec's seccomp profile: the one compiled at prepare while the
        command's profile is the task's (it always is today), else compiled now."""
        profile = spec.get("linux", {}).get("seccomp")
        if self._bpf is not None and self._bpf[0] == profile:
            return self._bpf[1]
        return seccomp_program(spec)

    async def dispose(self) -> None:
        self._bpf = None
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

    async def execute(self, plan: LaunchPlan, opts: RunOptions) -> RunResult:
        launch_plan = own_plan(self, plan, BwrapPlan)
        spec, host = launch_plan.spec, launch_plan.host
        if self._scratch is None or host.egress_resolv_conf == RESOLV_PLACEHOLDER:
            raise SandboxSetupError("runtime 'bubblewrap' was not prepared",
                                    "the plan was made before prepare()",
                                    "call prepare(ctx) first, then plan the command")
        assert launch_plan.argv is not None
        limits = CgroupLimits.from_spec(spec)
        hooks = needs_launch_hooks(spec, host)
        group: Cgroup | None = None
        if host.cgroup_mode in ("v1", "v2") and limits.controllers():
            group = await asyncio.to_thread(Cgroup.create, self.probe.cgroups, limits)
        info_r = info_w = block_r = block_w = seccomp_r = args_r = args_w = None
        status_r, status_fd = os.pipe()  # the command's own wait status (--exec-status)
        status_w = [status_fd]  # our copy of the write end, until bwrap has its own
        os.set_blocking(status_r, False)
        pending: list[int] = []  # the --args write end until it is handed over
        link: egress.Egress | None = None
        run: asyncio.Task[ProcessOutcome] | None = None
        try:
            passed: list[int] = [status_fd]
            program = self.seccomp_for(spec)
            if program is not None:
                seccomp_r = _pipe_with(program)
                passed.append(seccomp_r)
            if hooks:
                info_r, info_w = os.pipe()
                block_r, block_w = os.pipe()
                passed += [info_w, block_r]
            fds = LaunchFds(info=info_w if info_w is not None else INFO_FD,
                            block=block_r if block_r is not None else BLOCK_FD,
                            seccomp=seccomp_r if seccomp_r is not None else SECCOMP_FD,
                            status=status_fd)
            args_r, args_w = os.pipe()
            passed.append(args_r)
            launch, options = args_launch(with_fds(launch_plan.argv, spec, fds), spec, host,
                                          args_r, status_fd)
            rlimits = spec_rlimits(spec)
            pending.append(args_w)
            args_w = None

            def hand_over(pid: int) -> None:
                # bwrap (or systemd-run in front of it) waits for its options: nothing has
                # forked yet, so what is set now is inherited by the command.
                _set_rlimits(pid, rlimits)
                close_all(*status_w)  # bwrap holds it now: EOF once every holder is gone
                status_w.clear()
                _write_all(pending.pop(), options)

            run = asyncio.create_task(run_process(
                launch,
                env=launch_plan.env,
                cwd=launch_plan.cwd,
                stdin=opts.stdin,
                timeout_s=opts.timeout_ms / 1000,
                max_buffer=opts.max_buffer,
                pass_fds=passed,
                on_output=opts.on_output,
                keep_output=opts.keep_output,
                on_spawn=hand_over,
            ))
            if hooks:
                assert info_r is not None and block_w is not None
                link = await self._setup(run, info_r, spec, group)
                close_all(info_w, block_r)
                info_w = block_r = None
                with contextlib.suppress(OSError):
                    os.write(block_w, b"1")  # bwrap's child may already be gone
            outcome = await run
            said = _read_status(status_r)
        except BaseException as exc:
            if run is not None and not run.done():
                run.cancel()
                with contextlib.suppress(BaseException):
                    await run
            if isinstance(exc, OSError):  # E2BIG, EMFILE, ...: nothing ran
                hint = ("one argument or environment value is limited to 128 KiB: pass large "
                        "data through stdin or a file" if exc.errno == errno.E2BIG else
                        "check the host's process and file limits (ulimit -a)")
                raise SandboxSetupError("bwrap could not be started", str(exc), hint) from exc
            raise
        finally:
            close_all(info_r, info_w, block_r, block_w, seccomp_r, args_r, args_w, status_r,
                      *status_w, *pending)
            if link is not None:
                # SIGKILLed at once; reaping it waits for the kernel to unregister its tap
                # device (10-40 ms), so that part runs in the background until dispose().
                link.kill()
                reaping = asyncio.ensure_future(link.stop())
                self._reaping.add(reaping)  # a long task's reaped ones do not pile up
                reaping.add_done_callback(self._reaping.discard)
            events = CgroupEvents()
            if group is not None:
                events = group.events()
                await asyncio.to_thread(group.remove)
        exit_code, signal = said if said is not None else split_status(outcome)
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


def _read_status(fd: int) -> tuple[int | None, str | None] | None:
    """The helper's ``exit N`` / ``signal N``, once the run is over (every writer is gone);
    None when it wrote nothing (killed with the tree, or bwrap failed before the command)."""
    try:
        return parse_exec_status(os.read(fd, 64).decode("ascii", "replace"))
    except OSError:
        return None


def _set_rlimits(pid: int, rlimits: list[tuple[str, int, int, int]]) -> None:
    for name, res, soft, hard in rlimits:
        try:
            resource.prlimit(pid, res, (soft, hard))
        except (OSError, ValueError) as exc:
            raise SandboxSetupError(f"cannot set {name}={soft}:{hard} on the sandbox",
                                    str(exc), "lower the limit to at most this process's hard "
                                    "limit (ulimit -H), or run as root") from exc


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` and close ``fd`` (bwrap reads to EOF); a bwrap that already died has its
    own error on stderr."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)
