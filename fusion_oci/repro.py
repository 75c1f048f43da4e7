"""``fusion-oci repro``: replay a recorded run here, against a worktree, on a backend.

The run's ``sandbox:run`` events name their :class:`~fusion_oci.replay.ReplayRecord`; each
command is run again in one sandbox with the recorded settings and policy (on the recorded
backend unless another is asked for), the recorded image pinned by digest on the container
engines (a digest the engine no longer has is an error, never a different image), the env
variables the run passed read again by name from this environment. What differs from the
recording — worktree, backend, image, env, stdin — is listed, never silently accepted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fusion_oci.audit import RunEvent, read_events
from fusion_oci.errors import FlagError, ProvisionError, SettingsError
from fusion_oci.models import PrepareContext, RunOptions, RunResult
from fusion_oci.replay import (
    ReplayRecord,
    WorktreeState,
    describe_change,
    load_record,
    output_digest,
    worktree_state,
)

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog
    from fusion_oci.images.gates import AskCallback
    from fusion_oci.policy.settings import SandboxSettings

CONTAINER_BACKENDS = ("podman", "docker")


@dataclass(frozen=True)
class RecordedCommand:
    event: RunEvent
    record: ReplayRecord


def check_log(audit_path: Path, env: Mapping[str, str]) -> str | None:
    """Refuse a log whose chain is broken (a replay would run what a forged line says); the
    MACs are checked where this host's audit key is, else only the ``prev`` chain. Returns a
    note when only the chain could be checked."""
    from fusion_oci.audit import default_key_path, load_key, verify_chain

    key = load_key(default_key_path(env), create=False)
    report = verify_chain(audit_path, key)
    if not report.ok:
        raise SettingsError(
            f"audit log {audit_path} fails its integrity check",
            report.reason or "",
            "restore the log from the recording machine, "
            "or pass --ignore-chain to replay what it says anyway",
        )
    return None if report.keyed else "audit log: no audit key here, only its hash chain checked"


def find_run(audit_path: Path, ident: str, project_dir: Path) -> list[RecordedCommand]:
    """The recorded commands of run ``ident`` (or of the last run of task ``ident``)."""
    runs = [e for e in read_events(audit_path) if isinstance(e, RunEvent)]
    chosen = [e for e in runs if e.run_id == ident]
    if not chosen:
        of_task = [e for e in runs if e.task_id == ident]
        if of_task:
            last = of_task[-1].run_id
            chosen = [e for e in of_task if e.run_id == last]
    if not chosen:
        raise FlagError(
            f"no run or task '{ident}' in {audit_path}",
            "the audit log has no sandbox:run event with that run id or task id",
            "list runs with `fusion-oci audit`, or pass --audit-log / --project-dir",
        )
    missing = [e for e in chosen if e.replay is None]
    if missing:
        raise SettingsError(
            f"run '{chosen[0].run_id}' cannot be replayed",
            "it was recorded without a replay record (an older fusion-oci, "
            "an aborted command, or a custom runtime)",
            "run the command again with this fusion-oci, then repro that run",
        )
    return [RecordedCommand(e, load_record(project_dir, e.replay or "")) for e in chosen]


def _engine_url(
    backend: Literal["podman", "docker"], settings: SandboxSettings, env: Mapping[str, str]
) -> str:
    from fusion_oci.engines import docker_endpoints, podman_endpoints

    if backend == "docker":
        return docker_endpoints(settings.docker.url, env, os.getuid())[0].url
    return podman_endpoints(settings.podman.url, env, os.getuid())[0].url


def pin_image(
    backend: Literal["podman", "docker"],
    digest: str,
    settings: SandboxSettings,
    env: Mapping[str, str],
) -> str:
    """``digest`` when the engine of ``backend`` has that image; else a clear error."""
    from fusion_oci.images.engine import open_engine

    url = _engine_url(backend, settings, env)
    try:
        with open_engine(backend, url, name=backend) as client:
            info = client.image(digest)
    except ProvisionError as exc:
        raise ProvisionError(
            f"cannot check for the recorded image {digest} in {backend}",
            exc.why or str(exc),
            f"start {backend}'s API service (or point sandbox.{backend}Url "
            "at it), or replay on another backend with --backend",
        ) from exc
    if info is None:
        raise ProvisionError(
            f"the recorded image {digest} is not in {backend} at {url}",
            "a replay runs the very image of the recording, never another one",
            "load it there (`fusion-oci images build/pull` the recorded image, or "
            "`docker save | podman load` from a machine that has it), or pass --image REF to "
            "replay on a different image (reported as a difference)",
        )
    return digest


@dataclass
class CommandReplay:
    record: ReplayRecord
    event: RunEvent
    result: RunResult
    image: str | None
    image_digest: str | None

    def to_json(self) -> dict[str, Any]:
        ev, res = self.event, self.result
        return {
            "command": self.record.command,
            "recorded": {
                "backend": ev.backend,
                "image": self.record.image_ref or self.record.image,
                "imageDigest": ev.image_digest,
                "exitCode": ev.exit_code,
                "signal": ev.signal,
                "timedOut": ev.timed_out,
                "endReason": ev.end_reason,
                "stdoutDigest": ev.stdout_digest,
                "stderrDigest": ev.stderr_digest,
            },
            "replay": {
                "backend": res.backend,
                "image": self.image,
                "imageDigest": self.image_digest,
                "exitCode": res.exit_code,
                "signal": res.signal,
                "timedOut": res.timed_out,
                "endReason": res.reason,
                "stdoutDigest": output_digest(res.stdout),
                "stderrDigest": output_digest(res.stderr),
            },
            "sameStdout": ev.stdout_digest == output_digest(res.stdout),
            "sameStatus": (ev.exit_code, ev.signal, bool(ev.timed_out))
            == (res.exit_code, res.signal, res.timed_out),
        }


@dataclass
class ReplayReport:
    run_id: str
    task_id: str
    worktree: str
    worktree_change: str | None
    differences: list[str] = field(default_factory=list)
    commands: list[CommandReplay] = field(default_factory=list)

    @property
    def status(self) -> int:
        return self.commands[-1].result.shell_status if self.commands else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "runId": self.run_id,
            "taskId": self.task_id,
            "worktree": self.worktree,
            "worktreeChanged": self.worktree_change is not None,
            "worktreeChange": self.worktree_change,
            "differences": self.differences,
            "commands": [c.to_json() for c in self.commands],
            "exitStatus": self.status,
        }


def _status(
    exit_code: int | None, signal: str | None, timed_out: bool | None, reason: str | None
) -> str:
    if timed_out:
        return "timeout"
    what = f"exit {exit_code}" if exit_code is not None else f"signal {signal}"
    return what if reason in (None, "exit", "signal") else f"{what} ({reason})"


def render(report: ReplayReport) -> str:
    """The recorded outcome beside the new one, for a terminal."""
    lines = [
        f"fusion-oci repro {report.run_id} (task {report.task_id})",
        f"  worktree   {report.worktree}: "
        + (
            f"CHANGED since the recording ({report.worktree_change})"
            if report.worktree_change
            else "unchanged since the recording"
        ),
    ]
    lines += [f"  differs    {d}" for d in report.differences]
    for n, c in enumerate(report.commands, start=1):
        data = c.to_json()
        rec, new = data["recorded"], data["replay"]
        cmd = c.record.command if isinstance(c.record.command, str) else " ".join(c.record.command)
        lines.append(f"  command {n}  {cmd[:120]}")
        rows = [
            ("backend", rec["backend"], new["backend"]),
            ("image", rec["image"] or "host directories", new["image"] or "host directories"),
            ("digest", rec["imageDigest"] or "-", new["imageDigest"] or "-"),
            (
                "status",
                _status(rec["exitCode"], rec["signal"], rec["timedOut"], rec["endReason"]),
                _status(new["exitCode"], new["signal"], new["timedOut"], new["endReason"]),
            ),
            (
                "stdout",
                (rec["stdoutDigest"] or "-")[:19],
                "same" if data["sameStdout"] else new["stdoutDigest"][:19] + " (differs)",
            ),
        ]
        lines.append(f"    {'':8} {'recorded':40} replay")
        lines += [f"    {k:8} {a!s:40} {b}" for k, a, b in rows]
    return "\n".join(lines) + "\n"


def replay_settings(record: ReplayRecord, backend: str | None) -> SandboxSettings:
    from fusion_oci.policy.settings import SandboxSettings

    settings = SandboxSettings.model_validate(record.settings)
    # The runtime that actually ran (native after a fallback), fail-hard: a replay that
    # quietly fell back would not be the same run.
    return settings.model_copy(
        update={"backend": backend or record.backend, "failure_mode": "fail-hard"}
    )


def choose_worktree(record: ReplayRecord, worktree: Path | None) -> Path:
    if worktree is not None:
        path = worktree.expanduser().absolute()
        if not path.is_dir():
            raise FlagError(
                f"--worktree {path}",
                "it is not a directory",
                "pass the task's worktree (a git work tree)",
            )
        return path
    path = Path(record.worktree)
    if not path.is_dir():
        raise FlagError(
            f"the recorded worktree {path} does not exist here",
            "repro uses the recorded path unless told otherwise",
            "check out the task's commit and pass --worktree DIR",
        )
    return path


async def replay(
    commands: list[RecordedCommand],
    *,
    worktree: Path | None,
    backend: str | None,
    project_dir: Path | None,
    env: Mapping[str, str],
    audit: AuditLog,
    image: str | None = None,
    ask: AskCallback | None = None,
) -> ReplayReport:
    """Run the recorded commands again in one sandbox; the outcomes beside the recorded ones.
    Raises :class:`FusionOCIError` when the sandbox cannot be set up (e.g. image gone)."""
    import asyncio
    import secrets

    from fusion_oci.models import CacheMode
    from fusion_oci.policy.layout import project_root
    from fusion_oci.sandbox import Sandbox

    first = commands[0]
    record = first.record
    settings = replay_settings(record, backend)
    tree = choose_worktree(record, worktree)
    if project_dir is None:
        recorded = Path(record.project_dir) if record.project_dir else None
        project_dir = (
            recorded if worktree is None and recorded and recorded.is_dir() else project_root(tree)
        )
    differences: list[str] = []
    if str(tree) != record.worktree:
        differences.append(f"worktree {record.worktree} -> {tree}")
    if settings.backend != record.backend:
        differences.append(f"backend {record.backend} -> {settings.backend}")

    digest = first.event.image_digest
    chosen = image
    if image is not None:
        differences.append(
            f"image {record.image_ref or record.image or 'host directories'} -> {image} (--image)"
        )
    elif settings.backend in ("podman", "docker") and digest:
        engine: Literal["podman", "docker"] = "docker" if settings.backend == "docker" else "podman"
        chosen = await asyncio.to_thread(pin_image, engine, digest, settings, env)
    elif settings.backend in CONTAINER_BACKENDS:
        chosen = record.image  # None: the backend's default image, reported below
    elif settings.backend == "oci" and record.image:
        chosen = digest or record.image_ref or record.image
    elif record.image:
        differences.append(
            f"image {record.image_ref or record.image} is not used by "
            f"{settings.backend} (it runs on the host's directories)"
        )

    missing = [n for n in record.env_names if n not in env]
    if missing:
        differences.append("env not set here (passed at recording): " + ", ".join(missing))
    if any(c.record.stdin_sha256 for c in commands):
        differences.append("stdin was given at recording; the replay runs with stdin closed")

    state = await asyncio.to_thread(worktree_state, tree)
    then = (
        WorktreeState(head=first.event.worktree_head, status=first.event.worktree_status)
        if first.event.worktree_status or first.event.worktree_head
        else None
    )
    change = describe_change(then, state)

    run_id = f"repro-{secrets.token_hex(3)}-{first.event.run_id}"[:128]
    if settings.backend not in (*CONTAINER_BACKENDS, "oci"):
        # bubblewrap/native take only a rootfs folder, never an image reference
        chosen = record.image if record.image and record.image.startswith("/") else None
    elif chosen is None:
        chosen = settings.image
    ctx = PrepareContext(
        task_id=record.task_id,
        run_id=run_id,
        worktree_path=str(tree),
        policy=settings.policy,
        image=chosen,
        cache_mode=CacheMode(record.cache_mode),
        project_dir=str(project_dir),
    )
    report = ReplayReport(first.event.run_id, record.task_id, str(tree), change, differences)
    async with Sandbox(settings, audit=audit, env=env, ask=ask) as sandbox:
        await sandbox.prepare(ctx)
        runtime = sandbox.runtime
        task = sandbox.task
        # The image the task runs on, as its spec says (podman/docker: the provisioned local
        # reference); the other backends take no image reference.
        used_image = (
            task.spec.image
            if task is not None and settings.backend in (*CONTAINER_BACKENDS, "oci")
            else None
        )
        for cmd in commands:
            opts = RunOptions(
                cwd=cmd.record.cwd,
                timeout_ms=cmd.record.timeout_ms,
                max_buffer=cmd.record.max_buffer,
            )
            result = await sandbox.run(cmd.record.command, opts)
            now_digest = await runtime.image_digest() if runtime is not None else None
            report.commands.append(
                CommandReplay(cmd.record, cmd.event, result, used_image, now_digest)
            )
        if digest is None and used_image and settings.backend in CONTAINER_BACKENDS:
            differences.append(
                f"image host directories -> {used_image} ({settings.backend}'s default image)"
            )
    return report
