"""The landlock runtime's lifecycle: a confined exec agent started at prepare (the shim of
fusion_oci/shims/confine.py), commands through it, read-only paths restored after each."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_oci.egress.loop import on_proxy_loop
from fusion_oci.errors import PolicyNotEnforceableError, SandboxSetupError
from fusion_oci.host.process import kill_group, reaper_argv
from fusion_oci.models import NetworkMode, RunOptions
from fusion_oci.oci.model import ProcessSpec, TaskSpec
from fusion_oci.runtimes.box import Box
from fusion_oci.runtimes.hostproc import HostProcessRuntime, native_env
from fusion_oci.runtimes.landlock.host import host_abi, userns_problem, workload_note
from fusion_oci.runtimes.landlock.published import BoundPorts
from fusion_oci.runtimes.landlock.rules import (
    ABI_FEATURES,
    MIN_FS_ABI,
    MIN_NET_ABI,
    MIN_SCOPE_ABI,
    LandlockRules,
    enforced_requirements,
    landlock_env,
    landlock_rules,
    launch_config,
    launch_text,
    service_redirects,
)
from fusion_oci.runtimes.plans import AgentPlan, SandboxLaunch, spawn_of
from fusion_oci.runtimes.protocol import Availability
from fusion_oci.runtimes.requirements import Requirement

if TYPE_CHECKING:
    from fusion_oci.host.process import ProcessOutcome
    from fusion_oci.resolve import ResolvedTask

CONFINE_FAILED = b"fusion-oci: cannot confine the command"


START_TIMEOUT_S = 10.0
"""How long prepare waits for the confined agent's hello."""
LAUNCH_ENV: dict[str, str] = {}
"""The shim's and the agent's own environment: nothing of the caller's (each command's comes
in its spawn frame)."""
PLAN_FD = "N"
"""The connection's fd number in a plan made before prepare (chosen when the agent starts)."""


@dataclass(frozen=True)
class LandlockPlan(AgentPlan):
    """A spawn frame to the task's confined exec agent, with the ruleset its launch held
    (not in :meth:`to_json`: the notes say it in words) and the scratch it was planned for."""

    rules: LandlockRules = field(kw_only=True, repr=False, compare=False)
    scratch: str | None = field(kw_only=True, repr=False, compare=False)
    """The task scratch of the prepare the plan was made after (None: before any)."""


class LandlockRuntime(HostProcessRuntime):
    id = "landlock"
    egress_via_tcp = True
    """No network namespace: the task's egress proxy also listens on host 127.0.0.1:<port>,
    the one TCP destination a ``filtered`` command may connect to."""
    _proxy_port: int | None = None
    """``filtered``: that port, from prepare."""
    _services: tuple[tuple[str, str], ...] = ()
    """``hostServices``: the connect supervisor's redirects to the relays, from prepare."""
    _bound: BoundPorts | None = None
    """``publishPorts``: the supervisor's bind reports and the ports' carrier, from prepare."""
    _rules: LandlockRules | None = None
    """The task's ruleset, made at prepare (it depends on the task spec only)."""
    plan_type = LandlockPlan
    box: Box[SandboxLaunch, None] | None
    """The task's confined exec agent, and how prepare started it (the shim's argv with its
    real fd)."""

    def host_capabilities(self) -> dict[str, str]:
        # Below MIN_FS_ABI Landlock governs no file access at all.
        return {} if Requirement.FILESYSTEM in self.enforces() else {"filesystem_isolation": "none"}

    def availability(self) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability(
                False, "Landlock is a Linux security module", "use sandbox-exec on macOS"
            )
        abi = host_abi()
        if abi < 1:
            return Availability(
                False,
                "this kernel offers no Landlock (it needs Linux 5.13+ built with "
                "CONFIG_SECURITY_LANDLOCK, and 'landlock' in the lsm= boot list)",
                "boot with lsm=landlock,... or choose bubblewrap",
            )
        details = {"abi": str(abi)}
        for version, what in ABI_FEATURES.items():
            details[f"abi{version}"] = ("" if version <= abi else "missing: ") + what
        if abi < MIN_FS_ABI:
            details["filesystem"] = (
                f"not enforced: ABI {abi} < {MIN_FS_ABI} lets read-only files be truncated"
            )
        details["network"] = (
            "none: socket() refused by seccomp, TCP bind/connect denied"
            + (" by Landlock" if abi >= 4 else " (no Landlock TCP rules)")
            + "; egress without host loopback: not enforced (no network "
            "namespace); host: AF_UNIX refused; filtered: "
            + (
                "TCP connect only to the task's proxy on host loopback "
                "(Landlock port rule, every connect() checked by the "
                "supervisor), TCP and unix stream sockets only"
                if abi >= MIN_NET_ABI
                else f"not enforced (needs ABI {MIN_NET_ABI})"
            )
        )
        details["publishPorts"] = (
            "network none and filtered: a bind to a published port is the supervisor's, to "
            "host loopback at an ephemeral port, and the host carries each client there"
            if abi >= MIN_NET_ABI
            else f"refused (needs ABI {MIN_NET_ABI}: Landlock must deny every other TCP bind)"
        )
        details["workloads"] = workload_note(abi)
        from fusion_oci.agent.client import BUILD_HINT, agent_binary

        try:
            details["agent"] = str(agent_binary())
        except SandboxSetupError as exc:
            return Availability(False, f"the exec agent is missing: {exc.why}", BUILD_HINT)
        details["limits"] = (
            "rlimits (CPU time, file size, open files) only; memory, pids, "
            "CPU quota and tmpSizeMb are not enforced (no cgroup)"
        )
        details["processes"] = (
            "rlimits, priorities, I/O priorities, affinity and scheduling of other "
            "processes: refused (seccomp; a command changes only its own)"
        )
        if abi < MIN_SCOPE_ABI:
            details["signals"] = (
                "not scoped: the command can signal the caller's other processes, the task's "
                f"owner among them (needs ABI {MIN_SCOPE_ABI}); 'host processes' is listed "
                "as not enforced (refused under fail-hard)"
            )
        problem = userns_problem()
        details["userns"] = problem or "ok"
        if problem:
            details["recommendation"] = (
                f"user namespaces are forbidden here ({problem}): "
                "bubblewrap and rootless engines cannot start; "
                "landlock is the runtime that still isolates"
            )
        return Availability(
            True, version=f"landlock ABI {abi}", rootless=os.geteuid() != 0, details=details
        )

    def enforces(self) -> frozenset[Requirement]:
        return enforced_requirements(host_abi())

    def rules(self, spec: TaskSpec) -> LandlockRules:
        home, tmp = self._dirs()
        return landlock_rules(
            spec,
            home,
            tmp,
            self._proxy_port,
            self._agent(),
            services=self._services,
            bind_report=str(self._bound.path) if self._bound is not None else None,
        )

    @staticmethod
    def _agent() -> str:
        """The shipped agent's host path (not checked here, so plans need none; prepare
        checks it)."""
        from fusion_oci.agent import client

        return str(Path(client.__file__).with_name(client.BINARY_NAME))

    def _launch_path(self) -> str:
        where = str(self._scratch) if self._scratch is not None else "<task scratch>"
        return f"{where}/launch"

    def launch_command(self, launch: str, fd: int | str) -> list[str]:
        """The task's launch, for plan and prepare alike: the subreaper shim (the seccomp
        supervisor, outside the sandbox) with the launch file, whose confined child execs the
        exec agent on the connection ``fd`` (the shim adds ``--parent``, its own pid)."""
        agent = [self._agent(), "--fd", str(fd), "--dumpable"]
        if host_abi() >= MIN_SCOPE_ABI:
            # Each run in a domain nested in the agent's: no command signals the agent or a
            # keeper (Landlock lets a domain signal its own and nested ones only).
            agent.append("--scope-runs")
        argv = reaper_argv(agent)
        at = argv.index("--")
        argv[at:at] = [f"SANDBOX={launch}", f"AGENT={fd}"]
        return argv

    def plan(self, process: ProcessSpec) -> LandlockPlan:
        """The spawn frame :meth:`execute` sends, beside the launch prepare made (or would
        make: its fd and scratch as placeholders before prepare)."""
        home, tmp = self._dirs()
        spec = self.task_spec
        rules = self._rules if self._rules is not None else self.rules(spec)
        abi = host_abi()
        notes = [
            "runs on the host as the caller, confined before the agent's exec: capabilities "
            f"dropped, no_new_privs, Landlock ABI {abi} ruleset, seccomp",
            "through the task's exec agent (started at prepare under the reaper shim, whose "
            "child confines itself and execs it; the reaper stays outside as the seccomp "
            "supervisor of its whole tree): the spawn frame's fields above; a keeper per run "
            "ends the whole tree",
            "read-write: " + ", ".join(p for p, a in rules.paths if "write_file" in a),
            "network "
            + rules.network
            + {
                "none": ": every socket() refused",
                "host": ": AF_UNIX sockets refused",
                "filtered": f": TCP connect only to the task's egress proxy at 127.0.0.1:"
                f"{rules.proxy_port or '<port chosen at prepare>'} (Landlock port "
                "rule; every connect() checked by the supervisor), TCP bind "
                "denied; TCP and unix stream sockets only (no UDP, raw, packet, "
                "netlink); unix connects only beneath writable paths",
            }[rules.network],
            process.shown_limits(),
        ]
        if rules.published:
            notes.append(
                "published ports "
                + ", ".join(map(str, rules.published))
                + ": the command's bind to one (loopback or wildcard) is the supervisor's, "
                "to host loopback at an ephemeral port (what getsockname shows), reported to "
                "the host, which carries each client of the host's port there while that "
                "port's listener is still the command's socket; every other TCP bind denied"
            )
        notes += [
            f"not read-only during the command (restored after it): {p}" for p in rules.restored
        ]
        launch = (
            self.box.launch
            if self.box is not None
            else SandboxLaunch(
                argv=self.launch_command(self._launch_path(), PLAN_FD), env=LAUNCH_ENV, cwd="/"
            )
        )
        env = landlock_env(native_env(spec, process, home, tmp), rules, self._agent())
        return LandlockPlan(
            backend=self.id,
            spawn=spawn_of(process, env=env),
            sandbox=launch,
            notes=notes,
            process=process,
            rules=rules,
            scratch=str(self._scratch) if self._scratch is not None else None,
        )

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        task = await super().prepare(task)
        try:
            if task.spec.network is NetworkMode.FILTERED:
                if task.egress is None or task.egress.tcp_port is None:
                    raise SandboxSetupError(
                        "network filtered needs the task's egress proxy on host loopback",
                        "none was started for this task (the landlock runtime asks for a "
                        "TCP listener: egress_via_tcp)",
                        "prepare the task through fusion_oci.Sandbox",
                    )
                self._proxy_port = task.egress.tcp_port
            self._services = service_redirects(task.services)
            if task.spec.published_ports:
                await self._listen_for_binds(task)
            if task.spec.image:
                raise SandboxSetupError(
                    "the landlock runtime cannot use an image",
                    "it runs the command on the host's own system directories",
                    "drop sandbox.image, or choose podman, docker or oci for images",
                )
            # The carve-outs depend on the task's layout only: known before anything runs.
            probe = self._rules = self.rules(task.spec)
            fusion = task.layout.fusion_dir()
            exposed = [
                p
                for p in probe.restored
                if p == fusion or p.startswith(fusion + "/") or fusion.startswith(p + "/")
            ]
            if exposed:
                # Keep-and-restore is not enough here: the settings would be writable while the
                # command runs, and restoring the folder would drop the audit lines the host
                # appends for other commands meanwhile. Refused, never weakened.
                raise PolicyNotEnforceableError(
                    self.id,
                    [
                        f"protectedPaths: {fusion}/ (the project's settings and audit "
                        "log, inside the writable worktree)"
                    ],
                    "use a linked worktree (git worktree add) or --project-dir outside the "
                    "worktree, whose .fusion/ the command cannot reach; or bubblewrap where "
                    "user namespaces are allowed",
                )
            if probe.restored and self.layout is not None:
                # Listed as not read-only (the lifecycle reports layout.unprotected), though
                # put back after every command.
                extra = tuple(
                    f"{p} (writable during the command: Landlock cannot make it "
                    "read-only inside the writable worktree; restored after each "
                    "command)"
                    for p in probe.restored
                )
                self.layout = replace(self.layout, unprotected=(*self.layout.unprotected, *extra))
                task = replace(task, layout=self.layout)
                self.adopt(task)
            # Last: a task refused above starts nothing.
            self.box = await self._start_agent(probe)
            if task.services is not None:
                # The shim is the connect supervisor: its reports of the TCP grants'
                # connects are the only ones the relays take.
                task.services.reporter_pid = self.box.agent.peer_pid
            if self._bound is not None:
                self._bound.reporter_pid = self.box.agent.peer_pid  # its binds, likewise
                if task.ports is not None:
                    # On the proxy loop: clients between a SyncSandbox's calls are carried.
                    await task.ports.carry(self._bound.carry, on_proxy=True)
        except BaseException:
            await self.dispose()
            raise
        return task

    async def _listen_for_binds(self, task: ResolvedTask) -> None:
        """The report socket of the supervisor's binds for published ports, in the task's
        scratch (no command is granted it); refused where Landlock cannot deny the
        command's own TCP binds."""
        if task.spec.network is NetworkMode.HOST or host_abi() < MIN_NET_ABI:
            raise PolicyNotEnforceableError(
                self.id,
                [
                    "publishPorts (needs network none or filtered and Landlock ABI "
                    f"{MIN_NET_ABI}+, so that every TCP bind but the published ports' is "
                    "denied)"
                ],
                "use network none or filtered on a kernel with Landlock ABI 4 (Linux 6.7+), "
                "or bubblewrap where user namespaces are allowed",
            )
        assert self._scratch is not None
        bound = BoundPorts(self._scratch / "binds")
        await on_proxy_loop(bound.start())
        self._bound = bound

    async def _start_agent(self, rules: LandlockRules) -> Box[SandboxLaunch, None]:
        """The shim and, as its confined child, the task's exec agent; greeted before this
        returns. The launch file is gone afterwards, whatever happened."""
        import platform

        from fusion_oci.agent.client import Agent, agent_binary

        agent_binary()  # a clear setup error (how to build it) when it is missing
        assert self._scratch is not None
        launch = self._scratch / "launch"
        log_path = self._scratch / "agent.log"
        # Beside HOME and TMPDIR, not in them: no command can read or change it.
        _write_launch(launch, launch_text(launch_config(rules, host_abi(), platform.machine())))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = self.launch_command(str(launch), theirs.fileno())
        proc: asyncio.subprocess.Process | None = None
        try:
            # The shim's errors and the agent's last words go to a log read on failure (not a
            # pipe: nobody would drain it for the task's life).
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    env=LAUNCH_ENV,
                    cwd="/",
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
            finally:
                os.close(log)
            theirs.close()
            agent = await Agent.over(ours, proc, START_TIMEOUT_S)
        except BaseException as exc:
            ours.close()
            await kill_group(proc)
            said = _tail(log_path)
            if CONFINE_FAILED.decode() in said:
                raise SandboxSetupError(
                    "the landlock runtime could not confine the task's commands",
                    said,
                    "see `fusion-oci doctor` for this kernel's Landlock ABI",
                ) from exc
            if isinstance(exc, OSError):
                raise SandboxSetupError(
                    "the landlock runtime could not start its exec agent",
                    str(exc),
                    "check the host's process and file limits (ulimit -a)",
                ) from exc
            raise
        finally:
            theirs.close()  # idempotent
            _remove_launch(launch)
        return Box(agent=agent, launch=SandboxLaunch(argv=argv, env=LAUNCH_ENV, cwd="/"))

    def check_plan(self, plan: AgentPlan, box: Box[Any, Any]) -> None:
        scratch = plan.scratch if isinstance(plan, LandlockPlan) else None
        if self._scratch is None or scratch != str(self._scratch):
            raise SandboxSetupError(
                f"runtime '{self.id}' was not prepared",
                "its exec agent is not running, or the plan was made before prepare()",
                "call prepare(ctx) first, then plan the command",
            )

    async def run_spawn(
        self, box: Box[Any, Any], plan: AgentPlan, opts: RunOptions
    ) -> ProcessOutcome:
        """The spawn on the confined agent, with the read-only paths Landlock cannot express
        kept before and restored after it."""
        assert isinstance(plan, LandlockPlan)  # execute's own
        rules = plan.rules
        from fusion_oci.runtimes.linux import snapshot

        kept = snapshot.take(rules.restored, holes=rules.holes)
        try:
            outcome = await box.agent.run_command(plan.spawn, opts)
        finally:
            # The run's keeper ended the command's whole tree before it reported: nothing of
            # it can race the restore.
            changed = snapshot.restore(kept)
        notes = []
        if changed:
            notes.append(
                "restored what the command changed in read-only paths: "
                + ", ".join(changed[:10])
                + ("" if len(changed) <= 10 else ", ...")
            )
        if kept.too_big:
            notes.append(
                "not kept, so not restored (too large to copy per command): "
                + ", ".join(kept.too_big[:10])
            )
        if notes:
            text = "".join(f"fusion-oci: {n}\n" for n in notes)
            outcome = replace(outcome, stderr=outcome.stderr + text.encode())
        return outcome

    async def dispose(self) -> None:
        box, self.box = self.box, None
        bound, self._bound = self._bound, None
        self._proxy_port = None
        self._services = ()
        self._rules = None
        try:
            if box is not None:
                await box.agent.close()
        finally:
            try:
                if bound is not None:  # its carried connections closed (and audited)
                    await on_proxy_loop(bound.stop())
            finally:
                await super().dispose()


def _write_launch(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")  # a few KiB in the task's scratch: not worth a thread


def _remove_launch(path: Path) -> None:
    path.unlink(missing_ok=True)


def _tail(path: Path, limit: int = 500) -> str:
    """The last words of the shim and the agent (empty when they left none)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()[-limit:]
    except OSError:
        return ""
