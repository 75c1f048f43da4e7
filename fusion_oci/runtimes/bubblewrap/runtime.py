"""The bubblewrap runtime: one sandbox per task, Linux namespaces built by ``bwrap``, and each
command run in it by the exec agent (fusion_oci/agent) that is the sandbox's PID 1.

The translation is :mod:`.argv` (:func:`bwrap_argv` for the sandbox,
:func:`bwrap_spawn` for each command: pure functions of the spec, golden-tested per policy);
this module is the runtime around it: host probes, prepare, launch, clean-up.

What a command gets: a read-only root built from the host's system directories (or an unpacked
image directory), the worktree read-write at its own absolute path, allowedPaths read-only,
writablePaths read-write, private tmpfs ``/tmp`` and ``$HOME`` (the task's: they last while the
sandbox does, as a container's do), a fresh ``/proc`` and minimal ``/dev``, every namespace
unshared (network kept only for ``host``; ``filtered`` is the empty namespace with the agent's
forwarder to the task's egress proxy socket, no slirp4netns), ``--die-with-parent``, its own
session (no TIOCSTI into the caller's terminal), no capabilities, no further user namespaces,
the bundle's seccomp profile, exactly the spec's environment, and the spec's rlimits.

At prepare, once per task: the host probes (once per process), the seccomp profile compiled to
BPF by libseccomp, the cgroup (memory, pids, cpu) and slirp4netns for ``egress``, and the
sandbox itself: ``bwrap --args FD ... -- fusion-oci-agent --fd N`` on a socketpair, with
``--info-fd``/``--block-fd`` holding it while its first process is moved into the cgroup and
slirp4netns is attached. Per command: one spawn frame to the agent (~2 ms, no bwrap, no
interpreter); the agent's keeper ends the command's whole tree when it exits, on timeout,
maxBuffer and abort, and the pipes come straight to this process. A command whose spec needs
another sandbox (other mounts, namespaces, seccomp profile) is refused, never run in this one.
At dispose the agent ends everything it runs and exits, which ends the pid namespace; then
slirp4netns is stopped and the cgroup killed and removed.

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
import resource
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_oci.agent.client import Agent, agent_binary
from fusion_oci.errors import BundleError, SandboxSetupError
from fusion_oci.host.process import kill_group, probe
from fusion_oci.host.scratch import make_scratch
from fusion_oci.models import NetworkMode
from fusion_oci.oci.model import ProcessSpec, TaskSpec
from fusion_oci.oci.seccomp import LIBSECCOMP_HINT, libseccomp_problem
from fusion_oci.runtimes.box import Box, group_dirs
from fusion_oci.runtimes.bubblewrap.argv import (
    BLOCK_FD,
    EGRESS_PLACEHOLDER,
    INFO_FD,
    RESOLV_PLACEHOLDER,
    SECCOMP_FD,
    BwrapHost,
    LaunchFds,
    agent_rlimits,
    args_launch,
    bwrap_argv,
    bwrap_spawn,
    needs_launch_hooks,
    plan_notes,
    protected_proc_paths,
    seccomp_program,
    with_fds,
)
from fusion_oci.runtimes.linux import cgroups, egress, userns
from fusion_oci.runtimes.linux.cgroups import Cgroup, CgroupEvents, CgroupLimits, CgroupSupport
from fusion_oci.runtimes.linux.pipes import close_all, read_json
from fusion_oci.runtimes.plans import AgentPlan, SandboxLaunch
from fusion_oci.runtimes.protocol import Availability
from fusion_oci.runtimes.requirements import SANDBOXED, Requirement
from fusion_oci.runtimes.skeleton import SpecRuntime

if TYPE_CHECKING:
    from fusion_oci.resolve import ResolvedTask

__all__ = [
    "BubblewrapRuntime",
    "HostProbe",
    "check_spec",
    "host_path_kinds",
    "make_task_scratch",
    "probe_host_support",
]

START_TIMEOUT_S = 20.0
"""How long bwrap may take to build the sandbox and its agent to say hello (a busy host)."""


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
    done = probe([tool, "--version"])
    if done.returncode is None:
        return None
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", done.text())
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
        return HostProbe(
            None,
            problem=userns.Problem(
                "bwrap is not installed",
                "apt-get install bubblewrap (Debian/Ubuntu), dnf install bubblewrap (Fedora), "
                "pacman -S bubblewrap (Arch)",
            ),
        )
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
        bwrap=bwrap,
        version=version,
        problem=result.problem,
        slirp4netns=slirp,
        egress_problem=egress_problem,
        cgroups=cgroups.detect(),
        disable_userns=disable,
        seccomp_problem=libseccomp_problem(),
        slirp_version=_version(slirp) if slirp else None,
    )


def check_spec(task: TaskSpec) -> None:
    """Refuse what bwrap would only fail on at launch, with a clearer message: an image that
    is not an unpacked rootfs, a bind mount whose host path is missing. Reads the spec only."""
    image = task.image
    if image and not Path(image).is_dir():
        raise BundleError(
            f"bubblewrap cannot use image '{image}'",
            "it runs on the host's system directories or an unpacked rootfs",
            "leave sandbox.image unset for bubblewrap",
        )
    for mount in task.mounts:
        source = mount.source or ""
        if mount.type == "bind" and not os.path.lexists(source):
            raise BundleError(
                f"policy path {source} does not exist",
                "allowedPaths/writablePaths are bound at their host paths",
                "create it first or remove it from the policy",
            )


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
class BwrapPlan(AgentPlan):
    """A bubblewrap plan: the command's spawn frame to the agent of the task's sandbox (its
    bwrap argv beside it); with the task spec and host facts it was made for.

    Its notes (words beside what runs) are written when the plan is shown, not per command:
    :func:`plan_notes` costs more than the frame."""

    task: TaskSpec = field(kw_only=True, repr=False, compare=False)
    host: BwrapHost = field(kw_only=True, repr=False, compare=False)

    def shown_notes(self) -> list[str]:
        return [*self.notes, *plan_notes(self.task, self.process, self.host)]


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
    """One bwrap sandbox per task, its commands through the exec agent; see the module
    docstring."""

    id = "bubblewrap"
    streams_stdin = True  # the agent client writes a StdinStream's chunks as they come

    plan_type = BwrapPlan
    runs_in = "its sandbox"
    box: Box[SandboxLaunch, egress.Egress] | None
    _scratch: Path | None = None
    _bpf: bytes | None = None
    """The BPF of the task's seccomp profile: compiled once at prepare."""
    _egress_socket: str | None = None
    """``filtered``: the host path of the task's egress proxy socket (from prepare)."""
    _service_relays: tuple[tuple[str, str], ...] | None = None
    """``hostServices``: the relays' sockets (from prepare)."""

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
            bwrap=p.bwrap or "bwrap",
            disable_userns=p.disable_userns,
            cgroup_mode=p.cgroups.mode,
            systemd_run=p.cgroups.systemd_run,
            egress_resolv_conf=resolv,
            agent=str(agent_binary()),
            egress_socket=self._egress_socket or EGRESS_PLACEHOLDER,
            service_relays=self._service_relays,
        )

    def host_for(self, task: TaskSpec) -> BwrapHost:
        """:attr:`bwrap_host` with the host's kinds of the spec's masked/readonly paths."""
        kinds = host_path_kinds(protected_proc_paths(task))
        return dataclasses.replace(self.bwrap_host, path_kinds=kinds)

    @property
    def seccomp_bpf(self) -> bytes | None:
        """The BPF of the task's seccomp profile, compiled at prepare (None before, or when
        the spec has no profile)."""
        return self._bpf

    def host_capabilities(self) -> dict[str, str]:
        return {} if self.probe.cgroups.controllers else {"resource_limits": "basic"}

    def availability(self) -> Availability:
        p = self.probe
        details = {
            "bwrap": p.bwrap or "missing",
            "userns": "ok" if p.problem is None else p.problem.reason,
            "cgroups": p.cgroups.describe(),
            # (versions come from the probe: availability() runs at every prepare)
            "egress": (
                f"slirp4netns {p.slirp_version or '?'} --disable-host-loopback"
                if p.egress_problem is None and p.slirp4netns
                else f"unavailable: {p.egress_problem}"
            ),
            "filtered": "an empty network namespace; the agent forwards 127.0.0.1:3128 to the "
            "task's egress proxy socket",
            "cpu-time": "RLIMIT_CPU, set with prlimit(2) on bwrap before it forks",
            "seccomp": p.seccomp_problem or "the bundle's profile, compiled by libseccomp",
            "enforces": ", ".join(sorted(r.value for r in self.enforces())),
        }
        if p.problem is not None:
            return Availability(
                False,
                p.problem.reason,
                p.problem.hint,
                version=p.version,
                rootless=os.geteuid() != 0,
                details=details,
            )
        if p.seccomp_problem is not None:
            return Availability(
                False,
                "the bundle's seccomp profile cannot be compiled here",
                LIBSECCOMP_HINT,
                version=p.version,
                rootless=os.geteuid() != 0,
                details=details,
            )
        return Availability(True, version=p.version, rootless=os.geteuid() != 0, details=details)

    def enforces(self) -> frozenset[Requirement]:
        p = self.probe
        if p.bwrap is None or p.problem is not None:
            return frozenset()
        # tmpfs sizes: bwrap --size.
        # filtered: an empty network namespace and the agent's forwarder to the task's proxy
        # (nothing of the host's beyond bwrap itself).
        # HOST_PROCESSES: --unshare-all's pid namespace hides every host process.
        # RLIMIT_CPU and RLIMIT_FSIZE: prlimit(2), always there on Linux.
        out = set(SANDBOXED)
        if p.egress_problem is None and p.slirp4netns:
            out.add(Requirement.NETWORK_EGRESS)
        # publishPorts: the agent (the sandbox's init) is handed each inbound connection.
        out.add(Requirement.PUBLISHED_PORTS)
        ctl = p.cgroups.controllers
        for name, req in (
            ("memory", Requirement.MEMORY),
            ("pids", Requirement.PIDS),
            ("cpu", Requirement.CPU_QUOTA),
        ):
            if name in ctl:
                out.add(req)
        return frozenset(out)

    def sandbox_launch(self) -> SandboxLaunch:
        """The adopted task's sandbox: its bwrap argv (placeholder fds), environment, cwd."""
        if self.box is not None:
            return self.box.launch
        task = self.adopted()
        return SandboxLaunch(
            argv=bwrap_argv(task.spec, task.user, self.host_for(task.spec)),
            env=self._launcher_env(),
            cwd="/",
        )

    def plan(self, process: ProcessSpec) -> BwrapPlan:
        """The command's spawn frame to the agent (:func:`bwrap_spawn`), beside the task's
        sandbox (:func:`bwrap_argv`, made at prepare)."""
        task = self.task_spec
        return BwrapPlan(
            backend=self.id,
            spawn=bwrap_spawn(process),
            sandbox=self.sandbox_launch(),
            process=process,
            task=task,
            host=self.host_for(task),
        )

    # ------------------------------------------------------------------ lifecycle
    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        task = await super().prepare(task)
        check_spec(task.spec)
        self._egress_socket = egress.proxy_socket(task)
        self._service_relays = egress.service_relays(task)
        self._scratch = make_task_scratch(task.spec.task_id)
        try:
            self._bpf = seccomp_program(task.spec)
            self.box = await self._start(task)
        except BaseException:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
            raise
        return task

    async def _start(self, task: ResolvedTask) -> Box[SandboxLaunch, egress.Egress]:
        """Start the task's sandbox: bwrap with the agent as its PID 1, moved into its cgroup
        and given its network before the agent runs; returns once the agent said hello."""
        assert self._scratch is not None
        spec = task.spec
        host = self.host_for(spec)
        planned = bwrap_argv(spec, task.user, host)
        limits = CgroupLimits.from_task(spec)
        hooks = needs_launch_hooks(spec, host)
        group: Cgroup | None = None
        link: egress.Egress | None = None
        proc: asyncio.subprocess.Process | None = None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        info_r = info_w = block_r = block_w = seccomp_r = args_r = args_w = None
        log_path = self._scratch / "bwrap.log"
        try:
            if host.cgroup_mode in ("v1", "v2") and limits.controllers():
                group = await asyncio.to_thread(Cgroup.create, self.probe.cgroups, limits)
            passed: list[int] = [theirs.fileno()]
            program = self._bpf
            if program is not None:
                seccomp_r = _pipe_with(program)
                passed.append(seccomp_r)
            if hooks:
                info_r, info_w = os.pipe()
                block_r, block_w = os.pipe()
                passed += [info_w, block_r]
            args_r, args_w = os.pipe()
            passed.append(args_r)
            fds = LaunchFds(
                info=info_w if info_w is not None else INFO_FD,
                block=block_r if block_r is not None else BLOCK_FD,
                seccomp=seccomp_r if seccomp_r is not None else SECCOMP_FD,
                agent=theirs.fileno(),
            )
            launch, options = args_launch(with_fds(planned, fds), host, args_r)
            # bwrap's errors, and the agent's own last words, go to a log read on failure.
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                proc = await asyncio.create_subprocess_exec(
                    *launch,
                    env=self._launcher_env(),
                    cwd="/",
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=passed,
                    start_new_session=True,
                )
            finally:
                os.close(log)
            # bwrap (or systemd-run in front of it) waits for its options: nothing has forked
            # yet, so a hard limit raised now is one the agent may give a command.
            _raise_hard_limits(proc.pid, agent_rlimits(task.rlimits))
            close_all(seccomp_r, args_r, info_w, block_r)
            seccomp_r = args_r = info_w = block_r = None
            theirs.close()
            _write_all(args_w, options)
            args_w = None
            if hooks:
                assert info_r is not None and block_w is not None
                link = await self._setup(proc, info_r, spec, group)
                with contextlib.suppress(OSError):
                    os.write(block_w, b"1")  # bwrap's child may already be gone
            agent = await Agent.over(ours, proc, START_TIMEOUT_S)
        except BaseException as exc:
            ours.close()
            await kill_group(proc)
            if link is not None:
                await link.stop()
            if group is not None:
                await asyncio.to_thread(group.remove)
            if isinstance(exc, OSError):  # EMFILE, EAGAIN, ...: nothing ran
                raise SandboxSetupError(
                    "bwrap could not be started",
                    str(exc),
                    "check the host's process and file limits (ulimit -a)",
                ) from exc
            if isinstance(exc, SandboxSetupError) and proc is not None:
                said = _last_lines(log_path)
                if said:
                    raise SandboxSetupError(
                        "bwrap could not build the sandbox",
                        said,
                        "check the policy's paths and this host's user "
                        "namespaces (fusion-oci doctor)",
                    ) from exc
            raise
        finally:
            theirs.close()  # idempotent
            close_all(info_r, info_w, block_r, block_w, seccomp_r, args_r, args_w)
        events = group.events() if group is not None else CgroupEvents()
        return Box(
            agent=agent,
            launch=SandboxLaunch(argv=planned, env=self._launcher_env(), cwd="/"),
            group=group,
            link=link,
            cgroup=group_dirs(group),
            events=events,
            # Did the sandbox's pids or memory limit hold a command? Asked of a command that
            # failed only: a success leaves the counters' baseline where it was.
            every_command=False,
        )

    async def _setup(
        self, proc: asyncio.subprocess.Process, info_r: int, spec: TaskSpec, group: Cgroup | None
    ) -> egress.Egress | None:
        """Between bwrap's fork and the agent's exec: cgroup, then network."""
        reading = asyncio.ensure_future(read_json(info_r))
        waiting = asyncio.ensure_future(proc.wait())
        try:
            done, _ = await asyncio.wait(
                {reading, waiting}, timeout=START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiting.cancel()
        if reading not in done:
            reading.cancel()
            return None  # bwrap failed before its child existed; its log says why
        info = reading.result()
        if not info or "child-pid" not in info:
            return None
        pid = int(info["child-pid"])
        if group is not None:
            group.add(pid)
        if spec.network is NetworkMode.EGRESS:
            slirp = self.probe.slirp4netns
            if slirp is None:
                raise SandboxSetupError(
                    "network egress needs slirp4netns",
                    "it is not installed",
                    "apt-get install slirp4netns, or use network none",
                )
            assert self._scratch is not None
            return await egress.Egress.attach(pid, slirp=slirp, log=self._scratch / "slirp.log")
        return None

    async def dispose(self) -> None:
        box, self.box = self.box, None
        try:
            if box is not None:
                try:
                    await box.agent.close()  # ends every tree; PID 1's exit ends the rest
                finally:
                    if box.link is not None:
                        await box.link.stop()
                    if box.group is not None:
                        await asyncio.to_thread(box.group.remove)
        finally:
            self._bpf = None
            self._egress_socket = None
            self._service_relays = None
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None
            await super().dispose()

    def _launcher_env(self) -> dict[str, str]:
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
        }
        if self.probe.cgroups.mode == "systemd-run":
            # systemd-run --user finds the user manager through these.
            for key in ("XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS"):
                if key in self.env:
                    env[key] = self.env[key]
        return env


def _last_lines(path: Path, n: int = 5) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-n:])


def _raise_hard_limits(pid: int, rlimits: list[tuple[str, int, int, int]]) -> None:
    """Raise, on the waiting bwrap, each hard limit a command's rlimit needs above this
    process's own (root may; the agent, without capabilities, may only lower them). Soft
    limits, and RLIMIT_CPU's which would count the agent's own time, stay as they are: each
    command's exact limits are the agent's setrlimit."""
    for name, res, _soft, hard in rlimits:
        cur_soft, cur_hard = resource.getrlimit(res)
        if (
            cur_hard == resource.RLIM_INFINITY
            or (0 <= hard <= cur_hard)
            or hard == resource.RLIM_INFINITY
        ):
            continue
        try:
            resource.prlimit(pid, res, (cur_soft, hard))
        except (OSError, ValueError) as exc:
            raise SandboxSetupError(
                f"cannot raise {name}'s hard limit to {hard} for the sandbox",
                str(exc),
                "lower the limit to at most this process's hard limit (ulimit -H), or run as root",
            ) from exc


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` and close ``fd`` (bwrap reads to EOF); a bwrap that already died has its
    own error on stderr."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)
