"""The audit log (brief 4.2): events appended as JSON lines, delivered to subscribers.

Events record env var *names*, never values. Each event is one ``write()`` of one line to a file
opened with O_APPEND, under an exclusive ``flock``, so concurrent writers never tear a line.

Tamper evidence: every line carries ``prev``, the SHA-256 of the line before it (the first line
of a log: :data:`GENESIS`), and ``mac``, an HMAC-SHA256 of the line itself under a key kept in
the user's state folder (``$XDG_STATE_HOME/fusion-oci/audit.key``, mode 0600), which no
isolating runtime mounts. :func:`verify_chain` names the first line that was edited, removed or
forged: an edit breaks that line's MAC and the next line's ``prev``, a removal breaks the next
line's ``prev``, a forged line has no valid MAC. Without the key (another machine) only the
``prev`` chain is checked. Cutting lines off the end is not detectable from the file alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fusion_oci.audit.events import AuditEvent, parse_event

Subscriber = Callable[[AuditEvent], None]

GENESIS = "sha256:" + "0" * 64
_MAC_TAIL = re.compile(r',"mac":"(hmac-sha256:[0-9a-f]{64})"}$')


def line_hash(line: bytes) -> str:
    return "sha256:" + hashlib.sha256(line.rstrip(b"\n")).hexdigest()


def line_mac(key: bytes, body: str) -> str:
    return "hmac-sha256:" + hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def default_key_path(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME", "/")) / ".local" / "state")
    return Path(base) / "fusion-oci" / "audit.key"


def load_key(path: Path, *, create: bool) -> bytes | None:
    """The audit key at ``path``; made (32 random bytes, 0600) when missing and ``create``."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        if not create:
            return None
    except OSError:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return path.read_bytes()  # a concurrent writer made it first
    except OSError:
        return None
    with os.fdopen(fd, "wb") as fh:
        fh.write(secrets.token_bytes(32))
    return path.read_bytes()


def _last_line(fd: int) -> bytes | None:
    """The file's last complete line (without reading the whole file)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return None
    block, data, pos = 65536, b"", size
    while pos > 0:
        step = min(block, pos)
        pos -= step
        data = os.pread(fd, step, pos) + data
        body = data.rstrip(b"\n")
        cut = body.rfind(b"\n")
        if cut >= 0:
            return body[cut + 1 :]
    return data.rstrip(b"\n")


class AuditLog:
    """Where events go: an optional JSONL file and any number of in-process subscribers.

    ``key``: the HMAC key of the chain; None: the host's default key file (made on first use,
    in the user's state folder); ``b""``: no MAC, only the ``prev`` chain.
    """

    def __init__(self, path: Path | None = None, *, key: bytes | None = None) -> None:
        self.path = path
        self._key = key
        self._subscribers: list[Subscriber] = []

    def _mac_key(self) -> bytes:
        if self._key is None:
            self._key = load_key(default_key_path(os.environ), create=True) or b""
        return self._key

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Deliver every later event to ``callback``; returns a function that unsubscribes.
        ``sandbox:egress`` events are delivered from the egress proxy's thread."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def emit(self, event: AuditEvent) -> None:
        self.emit_many([event])

    def emit_many(self, events: Sequence[AuditEvent]) -> None:
        """Append ``events`` in order, each chained to the one before, in one ``write()``
        under one ``flock``: a task's connections are audited in batches (one open, lock,
        read of the last line and write per batch, not per event;
        :class:`fusion_oci.egress.budget.BudgetedEvents`), and the lines are the same as
        one :meth:`emit` each would write."""
        if not events:
            return
        if self.path is not None:
            key = self._mac_key()
            flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
            try:
                fd = os.open(self.path, flags, 0o600)
            except FileNotFoundError:  # its folder first: not a mkdir per event
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, flags, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                last = _last_line(fd)
                prev = GENESIS if last is None else line_hash(last)
                lines = []
                for event in events:
                    line = _chained_line(event, prev, key)
                    lines.append(line)
                    prev = line_hash(line)
                data = b"".join(lines)
                while data:
                    written = os.write(fd, data)
                    data = data[written:]
            finally:
                os.close(fd)
        # Every event to every subscriber even when one raises (then the first error, after):
        # one subscriber's bug must not keep the batch's later events from the others.
        failed: Exception | None = None
        for event in events:
            for callback in list(self._subscribers):
                try:
                    callback(event)
                except Exception as exc:
                    failed = failed or exc
        if failed is not None:
            raise failed


def _chained_line(event: AuditEvent, prev: str, key: bytes) -> bytes:
    """``event``'s line (with its newline) after the line whose hash is ``prev``. ``prev``
    and ``mac`` are every model's last two fields (:mod:`.events`), so they are spliced onto
    the serialised rest: the bytes ``model_copy(update=...).model_dump_json()`` gave, without
    the copy."""
    body = event.model_dump_json(by_alias=True, exclude_none=True, exclude=_CHAIN_FIELDS)
    body = f'{body[:-1]}{"," if len(body) > 2 else ""}"prev":"{prev}"}}'
    if key:
        body = f'{body[:-1]},"mac":"{line_mac(key, body)}"}}'
    return (body + "\n").encode()


_CHAIN_FIELDS = {"prev", "mac"}


def read_events(path: Path) -> Iterator[AuditEvent]:
    """Events from a JSONL audit file; lines that do not parse are skipped."""
    try:
        fh = path.open(encoding="utf-8")
    except FileNotFoundError:
        return
    with fh:
        for line in fh:
            try:
                yield parse_event(json.loads(line))
            except ValueError:
                continue


def default_audit_path(project_dir: Path) -> Path:
    return project_dir / ".fusion" / "sandbox-audit.jsonl"


@dataclass(frozen=True)
class ChainReport:
    """What :func:`verify_chain` found. ``first_bad_line`` is 1-based."""

    ok: bool
    lines: int
    first_bad_line: int | None = None
    reason: str | None = None
    keyed: bool = False
    """Whether MACs were checked (the key was there) or only the ``prev`` chain."""


def verify_chain(path: Path, key: bytes | None = None) -> ChainReport:
    """Check every line's ``prev`` and (with ``key``) its MAC; stop at the first bad line.

    Lines written before the log had a chain (no ``prev`` at all) are accepted only before the
    first chained line.
    """
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        return ChainReport(True, 0, keyed=bool(key))
    prev_line: bytes | None = None
    chained = False
    count = 0

    def bad(n: int, why: str) -> ChainReport:
        return ChainReport(False, n, n, why, keyed=bool(key))

    with fh:
        for count, raw in enumerate(fh, start=1):
            line = raw.rstrip(b"\n")
            try:
                text = line.decode("utf-8")
                data = json.loads(text)
                if not isinstance(data, dict):
                    raise ValueError("not an object")
            except ValueError:
                return bad(count, f"line {count} is not an audit event (edited or forged)")
            if "prev" not in data:
                if chained:
                    return bad(
                        count,
                        f"line {count} has no chain hash (forged, or written around fusion-oci)",
                    )
                prev_line = line
                continue
            want = GENESIS if prev_line is None else line_hash(prev_line)
            if data["prev"] != want:
                where = "the start of the log" if prev_line is None else f"line {count - 1}"
                return bad(
                    count,
                    f"line {count} does not follow {where}: a line before it "
                    "was removed or edited, or this one was forged",
                )
            if key:
                match = _MAC_TAIL.search(text)
                if match is None:
                    return bad(count, f"line {count} has no MAC (forged)")
                body = text[: match.start()] + "}"
                if not hmac.compare_digest(match.group(1), line_mac(key, body)):
                    return bad(count, f"line {count} was edited or forged (its MAC does not match)")
            chained = True
            prev_line = line
    return ChainReport(True, count, keyed=bool(key))
