"""An incremental reader of the JSONL audit log: each poll reads only the bytes appended since.

It keeps where each event sits in the file (offset, length), not the event itself, so the
events of one task or after a cursor are read back with ``pread`` on demand and memory stays
small for large logs. A file that shrank or was replaced (another inode) is read again from
the start (``generation`` counts those restarts).
"""

from __future__ import annotations

import bisect
import json
import os
from array import array
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fusion_oci.audit import parse_event
from fusion_oci.dashboard.summary import SummaryBuilder, _epoch

CHUNK = 1 << 20
MAX_LINE = 1 << 20
"""A line longer than this is malformed: a broken writer must not make the reader buffer an
unbounded line in memory."""


class LogTail:
    """Not thread-safe: one caller at a time (the server serialises polls with a lock)."""

    def __init__(self, path: Path, *, task: str | None = None) -> None:
        """``task``: keep only that task's events (malformed lines are still counted)."""
        self.path = path
        self.task_filter = task
        self.generation = 0
        self.error: str | None = None
        """Why the log could not be read at the last poll (None: it could, or it is absent)."""
        self._reset()

    def _reset(self) -> None:
        self.offset = 0
        self.line_no = 0
        self.identity: tuple[int, int] | None = None
        self._pending = b""
        self._skipping = False  # inside an over-long line, dropping bytes until its newline
        self.summary = SummaryBuilder()
        self.lines: array[int] = array("q")  # per event: its line number (1-based)
        self.offsets: array[int] = array("q")
        self.lengths: array[int] = array("q")
        self.epochs: array[float] = array("d")
        self.by_task: dict[str, array[int]] = {}
        self.version = 0

    @property
    def cursor(self) -> int:
        """The number of the last complete line read so far."""
        return self.line_no

    def poll(self) -> bool:
        """Read what was appended; True when anything changed (new lines, or a restart)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            if self.identity is None and self.line_no == 0:
                return False
            self.generation += 1
            self._reset()
            self.version = -self.generation  # distinct from every earlier version
            return True
        identity = (st.st_dev, st.st_ino)
        restarted = False
        if self.identity is not None and (
            identity != self.identity or st.st_size < self.offset + len(self._pending)
        ):
            self.generation += 1
            self._reset()
            restarted = True
        self.identity = identity
        read_to = self.offset + len(self._pending)
        if st.st_size == read_to:
            if restarted:
                self.version = -self.generation
            return restarted
        try:
            with self.path.open("rb") as fh:
                fh.seek(read_to)
                while chunk := fh.read(CHUNK):
                    self._feed(chunk)
        except OSError as exc:  # unreadable (permissions, a directory): say so, keep serving
            changed = self.error != str(exc)
            self.error = str(exc)
            return changed
        self.error = None
        self.version += 1
        return True

    def _feed(self, chunk: bytes) -> None:
        data = self._pending + chunk
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            line = data[start:end]
            line_offset = self.offset
            self.offset += end + 1 - start
            start = end + 1
            if self._skipping:
                self._skipping = False
                continue
            self._line(line, line_offset)
        rest = data[start:]
        if len(rest) > MAX_LINE and not self._skipping:
            self.line_no += 1
            self.summary.add_malformed(self.line_no)
            self._skipping = True
        if self._skipping:
            self.offset += len(rest)
            rest = b""
        self._pending = rest

    def _line(self, line: bytes, offset: int) -> None:
        self.line_no += 1
        if not line.strip():
            return
        try:
            event = parse_event(line)
        except (ValidationError, ValueError):
            self.summary.add_malformed(self.line_no)
            return
        if self.task_filter is not None and event.task_id != self.task_filter:
            return
        index = len(self.lines)
        self.lines.append(self.line_no)
        self.offsets.append(offset)
        self.lengths.append(len(line))
        self.epochs.append(_epoch(event.ts) or 0.0)
        self.by_task.setdefault(event.task_id, array("q")).append(index)
        self.summary.add(self.line_no, event)

    # --- reading events back ------------------------------------------------------------------

    def events(
        self, *, task: str | None = None, since: int | float | None = None, limit: int = 1000
    ) -> tuple[list[dict[str, Any]], int]:
        """Events in log order, each with its ``line``: after line ``since`` when it is an int,
        after that epoch time when it is a float; at most ``limit``. Returns them and the
        cursor to pass as ``since`` next time."""
        if task is not None:
            indices: array[int] | range = self.by_task.get(task, array("q"))
        else:
            indices = range(len(self.lines))
        if isinstance(since, int):
            lines = self.lines
            lo = bisect.bisect_right(indices, since, key=lambda i: lines[i])
            chosen = [indices[i] for i in range(lo, min(len(indices), lo + limit))]
        elif isinstance(since, float):
            chosen = [i for i in indices if self.epochs[i] > since][:limit]
        else:
            chosen = list(indices[:limit])
        out = self._read(chosen)
        cursor = self.lines[chosen[-1]] if len(chosen) == limit else self.line_no
        return out, cursor

    def _read(self, indices: list[int]) -> list[dict[str, Any]]:
        if not indices:
            return []
        out: list[dict[str, Any]] = []
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.identity:
                return []  # replaced since the last poll: the next poll starts over
            for i in indices:
                raw = os.pread(fd, self.lengths[i], self.offsets[i])
                try:
                    item = json.loads(raw)
                except ValueError:
                    continue  # rewritten in place under us; nothing trustworthy to show
                if isinstance(item, dict):
                    item["line"] = self.lines[i]
                    out.append(item)
        finally:
            os.close(fd)
        return out


def summarize_file(path: Path, task: str | None = None) -> dict[str, Any]:
    """The summary of a whole log (of one task's events when ``task`` is given)."""
    tail = LogTail(path, task=task)
    tail.poll()
    return tail.summary.result()
