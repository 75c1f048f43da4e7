"""What a replay of a run needs, recorded by the host side of each run.

Per command, :class:`Sandbox` stores a :class:`ReplayRecord` — the resolved spec, the settings
and policy, the command, cwd, the *names* of the env variables passed, the image, the host
facts that shaped the spec and the fusion-oci version — once, content-addressed, under the
project's ``.fusion/replay/`` (which the sandbox sees read-only, so the command cannot forge
what a later replay trusts). The ``sandbox:run`` event names it (``replay``) beside what is
particular to the run: the image digest, the worktree's git state before the command and
digests of what the command printed.

Nothing secret is stored: env values that came from the caller are cut from the spec (only
their names stay), stdin and output are kept as SHA-256 digests only.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from fusion_oci import __version__
from fusion_oci.host.process import probe
from fusion_oci.models import Model, RunOptions
from fusion_oci.models.stdin import StdinStream

if TYPE_CHECKING:
    from fusion_oci.models import PrepareContext
    from fusion_oci.oci.host import HostInfo
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.resolve import ResolvedTask
    from fusion_oci.runtimes.protocol import Runtime

REPLAY_DIR = "replay"
"""Folder under the project's ``.fusion/`` holding the records (``sha256-<hex>.json``)."""
GIT_TIMEOUT_S = 10.0


class WorktreeState(Model):
    """The worktree's git state just before a command (what ``repro`` compares)."""

    head: str | None = None
    """Commit checked out (None: no commit yet, or git could not tell)."""
    status: str | None = None
    """SHA-256 of ``git status --porcelain`` plus the diff against HEAD (None: unknown)."""


class ReplayRecord(Model):
    """Everything a replay of one command needs, nothing particular to one run (so identical
    commands of a task share one stored record)."""

    format: int = 1
    version: str = __version__
    """fusion-oci version that recorded it."""
    task_id: str
    backend: str
    """Runtime that ran it (``native`` after a fallback)."""
    settings: dict[str, Any]
    """The effective settings (their policy is the resolved one)."""
    worktree: str
    project_dir: str | None = None
    image: str | None = None
    """What the context asked for (``node``, a reference) or None: the host's directories."""
    image_ref: str | None = None
    """The reference the runtime resolved it to (container runtimes)."""
    cache_mode: str = "shared"
    command: str | list[str]
    cwd: str | None = None
    timeout_ms: int = 600_000
    max_buffer: int = 10 * 1024 * 1024
    stdin_sha256: str | None = None
    """Digest of the stdin given (None: stdin was closed); the bytes are never stored."""
    env_names: list[str] = Field(default_factory=list)
    """Names of the caller's variables passed in (values are read again at replay)."""
    host: dict[str, Any] = Field(default_factory=dict)
    """The host facts that shaped the spec (uid, gid, arch, rlimits, system mounts, CA)."""
    spec: dict[str, Any]
    """The resolved config.json, caller env values cut (``NAME`` without ``=value``)."""

    def digest(self) -> str:
        return record_digest(self)


def _canonical(record: ReplayRecord) -> bytes:
    return json.dumps(
        record.model_dump(mode="json", by_alias=True), sort_keys=True, separators=(",", ":")
    ).encode()


def record_digest(record: ReplayRecord) -> str:
    return "sha256:" + hashlib.sha256(_canonical(record)).hexdigest()


def record_path(project_dir: Path, digest: str) -> Path:
    return project_dir / ".fusion" / REPLAY_DIR / (digest.replace(":", "-") + ".json")


def redact_spec(spec: dict[str, Any], passed: Sequence[str]) -> dict[str, Any]:
    """The spec with the values of the caller's variables cut and the run id dropped. Pure."""
    from fusion_oci.oci.model import ANN_RUN

    out: dict[str, Any] = json.loads(json.dumps(spec))
    names = set(passed)
    env = []
    for item in out.get("process", {}).get("env", []):
        name = item.split("=", 1)[0]
        env.append(name if name in names else item)
    out.setdefault("process", {})["env"] = env
    out.get("annotations", {}).pop(ANN_RUN, None)
    return out


def host_facts(host: HostInfo) -> dict[str, Any]:
    facts = asdict(host)
    facts["system_mounts"] = [list(m) for m in host.system_mounts]
    facts["etc_entries"] = list(host.etc_entries)
    facts["rlimits"] = {k: list(v) for k, v in host.rlimits.items()}
    facts["kernel"] = platform.release()
    return facts


def build_record(
    *,
    settings: SandboxSettings,
    ctx: PrepareContext,
    requested_image: str | None,
    backend: str,
    spec: dict[str, Any],
    host: HostInfo,
    command: str | Sequence[str],
    opts: RunOptions,
    env_source: Mapping[str, str],
    project_dir: Path,
) -> ReplayRecord:
    """The record of one command. Pure but for reading ``platform.release()``."""
    from fusion_oci.oci.environment import allowed_env

    passed = sorted(allowed_env(ctx.policy.env_allowlist, env_source))
    stdin = (
        None
        if opts.stdin is None
        else opts.stdin.sha256()
        if isinstance(opts.stdin, StdinStream)
        else "sha256:" + hashlib.sha256(opts.stdin).hexdigest()
    )
    resolved = settings.model_copy(update={"policy": ctx.policy})
    return ReplayRecord(
        task_id=ctx.task_id,
        backend=backend,
        settings=resolved.model_dump(mode="json", by_alias=True),
        worktree=ctx.worktree_path,
        project_dir=str(project_dir),
        image=requested_image,
        image_ref=ctx.image if ctx.image != requested_image else None,
        cache_mode=ctx.cache_mode.value,
        command=command if isinstance(command, str) else list(command),
        cwd=opts.cwd,
        timeout_ms=opts.timeout_ms,
        max_buffer=opts.max_buffer,
        stdin_sha256=stdin,
        env_names=passed,
        host=host_facts(host),
        spec=redact_spec(spec, passed),
    )


def store_record(project_dir: Path, record: ReplayRecord) -> str:
    """Write the record once (atomic rename; an existing file is the same content); its id."""
    digest = record.digest()
    path = record_path(project_dir, digest)
    if path.is_file():
        return digest
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".record-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(_canonical(record))
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest


def load_record(project_dir: Path, digest: str) -> ReplayRecord:
    """The stored record; refused when missing or when its content does not hash to its name
    (edited after the run)."""
    from fusion_oci.errors import SettingsError

    path = record_path(project_dir, digest)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SettingsError(
            f"replay record {digest} is missing",
            f"{path}: {exc.strerror}",
            "replay on the machine (or a copy of the project's .fusion/) that recorded the run",
        ) from exc
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise SettingsError(
            f"replay record {path} was changed after the run",
            "its content does not hash to its name",
            "restore .fusion/replay from the recording machine",
        )
    return ReplayRecord.model_validate(json.loads(data))


def _git(worktree: Path, *args: str) -> bytes | None:
    # The worktree is the command's: hooks and fsmonitor stay off for these reads.
    argv = [
        "git",
        "-C",
        str(worktree),
        "-c",
        "core.fsmonitor=false",
        "-c",
        "core.hooksPath=/dev/null",
        *args,
    ]
    done = probe(
        argv,
        timeout_s=GIT_TIMEOUT_S,
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_OPTIONAL_LOCKS": "0",
            "HOME": "/nonexistent",
        },
    )
    return done.stdout if done.ok else None


def worktree_state(worktree: Path) -> WorktreeState:
    """HEAD and a digest of what differs from it. Blocking; read-only. One git call for a
    clean tree (``status --branch`` names HEAD too), a second for the diff of a dirty one."""
    status = _git(worktree, "status", "--porcelain=v2", "--branch", "-z", "--untracked-files=all")
    if status is None:
        return WorktreeState()
    head: str | None = None
    changes: list[bytes] = []
    for entry in status.split(b"\0"):
        if entry.startswith(b"# branch.oid "):
            oid = entry[len(b"# branch.oid ") :].decode(errors="replace")
            head = None if oid == "(initial)" else oid
        elif entry and not entry.startswith(b"# "):
            changes.append(entry)
    body = b"\0".join(changes)
    if changes and head is not None:
        body += b"\0" + (
            _git(worktree, "diff", "--no-ext-diff", "--no-textconv", "--binary", "HEAD") or b""
        )
    return WorktreeState(head=head, status="sha256:" + hashlib.sha256(body).hexdigest())


def describe_change(then: WorktreeState | None, now: WorktreeState) -> str | None:
    """Why the worktree is not the recorded one (None: the same, or nothing was recorded)."""
    if then is None:
        return None
    if then.head != now.head:
        return f"HEAD was {then.head or 'none'}, is {now.head or 'none'}"
    if then.status != now.status:
        return "uncommitted changes differ from the recording"
    return None


def output_digest(data: str) -> str:
    return "sha256:" + hashlib.sha256(data.encode("utf-8", errors="replace")).hexdigest()


async def record_run(
    runtime: Runtime,
    task: ResolvedTask,
    spec: dict[str, Any],
    ctx: PrepareContext,
    settings: SandboxSettings,
    command: str | Sequence[str],
    opts: RunOptions,
    state: WorktreeState | None,
    stdout: str,
    stderr: str,
) -> dict[str, Any]:
    """Store the record of the command ``runtime`` just ran from ``spec`` (compiled by the
    lifecycle from ``task``, whatever the runtime derives from); the ``sandbox:run`` fields
    that name it. ``ctx`` is the caller's context (the image it asked for)."""
    import asyncio

    from fusion_oci.policy.layout import task_project

    fields: dict[str, Any] = {
        "version": __version__,
        "cwd": opts.cwd,
        "stdout_digest": output_digest(stdout),
        "stderr_digest": output_digest(stderr),
    }
    if state is not None:
        fields.update(worktree_head=state.head, worktree_status=state.status)
    fields["image_digest"] = await runtime.image_digest()
    project = task_project(ctx)
    record = build_record(
        settings=settings,
        ctx=task.ctx,
        requested_image=ctx.image or settings.image,
        backend=runtime.id,
        spec=spec,
        host=task.host,
        command=command,
        opts=opts,
        env_source=opts.env if opts.env is not None else task.env,
        project_dir=project,
    )
    fields["replay"] = await asyncio.to_thread(store_record, project, record)
    fields["env_names"] = record.env_names or None
    return fields
