"""Run-audit events (brief 4.2): typed, appended as JSON lines, delivered to subscribers.

Events record env var *names*, never values. Each event is one ``write()`` of one line to a file
opened with O_APPEND, under an exclusive ``flock``, so concurrent writers never tear a line.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from fusion_oci.models import Model

EventType = Literal[
    "sandbox:prepare",
    "sandbox:run",
    "sandbox:failure",
    "sandbox:fallback",
    "sandbox:dispose",
    "sandbox:provision",
    "sandbox:gate",
]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class AuditEvent(Model):
    type: EventType
    ts: str = Field(default_factory=_now)
    task_id: str
    run_id: str
    backend: str
    policy_hash: str | None = None
    policy_summary: str | None = None
    reason: str | None = None
    duration_ms: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    timed_out: bool | None = None
    end_reason: str | None = None
    fell_back: bool | None = None
    unenforced: list[str] | None = None
    env_names: list[str] | None = None
    command: str | None = None
    details: dict[str, Any] | None = None


Subscriber = Callable[[AuditEvent], None]


class AuditLog:
    """Where events go: an optional JSONL file and any number of in-process subscribers."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._subscribers: list[Subscriber] = []

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Deliver every later event to ``callback``; returns a function that unsubscribes."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def emit(self, event: AuditEvent) -> None:
        if self.path is not None:
            line = event.model_dump_json(by_alias=True, exclude_none=True) + "\n"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                data = line.encode()
                while data:
                    written = os.write(fd, data)
                    data = data[written:]
            finally:
                os.close(fd)
        for callback in list(self._subscribers):
            callback(event)


def read_events(path: Path) -> Iterator[AuditEvent]:
    """Events from a JSONL audit file; lines that do not parse are skipped."""
    try:
        fh = path.open(encoding="utf-8")
    except FileNotFoundError:
        return
    with fh:
        for line in fh:
            try:
                yield AuditEvent.model_validate(json.loads(line))
            except ValueError:
                continue


def default_audit_path(project_dir: Path) -> Path:
    return project_dir / ".fusion" / "sandbox-audit.jsonl"
