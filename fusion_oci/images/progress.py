"""Progress of long builds and pulls: a rich live display on a terminal, plain lines otherwise.

Engines stream JSON events (``stream`` lines of a build, ``status``/``progressDetail`` of a docker
pull, ``stream`` lines of a podman pull). A reporter turns them into something a person can
follow; :class:`NullReporter` (the default inside runtimes) keeps the executor's output clean.
"""

from __future__ import annotations

import re
import sys
import time
from collections import deque
from typing import IO, Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

_STEP = re.compile(r"^(STEP \d+/\d+|Step \d+/\d+)\s*:?\s*(.*)")


class Reporter(Protocol):
    """What provisioning tells the person waiting."""

    def start(self, title: str) -> None: ...

    def event(self, event: dict[str, Any]) -> None: ...

    def note(self, text: str) -> None: ...

    def finish(self, text: str) -> None: ...

    def tail(self) -> str:
        """The last lines of engine output (for error messages and build-failure triage)."""
        ...


class _Tail:
    def __init__(self, keep: int = 40) -> None:
        self._lines: deque[str] = deque(maxlen=keep)

    def add(self, text: str) -> None:
        for line in text.splitlines():
            if line.strip():
                self._lines.append(line.rstrip())

    def text(self) -> str:
        return "\n".join(self._lines)


def _event_text(event: dict[str, Any]) -> str:
    text = event.get("stream") or event.get("status") or ""
    if event.get("id") and event.get("status"):
        text = f"{event['id']}: {event['status']}"
    return str(text).rstrip()


class NullReporter:
    """Keeps only the tail (for errors); prints nothing."""

    def __init__(self) -> None:
        self._tail = _Tail()

    def start(self, title: str) -> None:
        self._tail.add(title)

    def event(self, event: dict[str, Any]) -> None:
        self._tail.add(_event_text(event))

    def note(self, text: str) -> None:
        self._tail.add(text)

    def finish(self, text: str) -> None:
        self._tail.add(text)

    def tail(self) -> str:
        return self._tail.text()


class PlainReporter(NullReporter):
    """One line per build step / pull status change, prefixed, for logs and CI."""

    def __init__(self, out: IO[str] | None = None, *, verbose: bool = False) -> None:
        super().__init__()
        self.out = out or sys.stderr
        self.verbose = verbose
        self._t0 = time.monotonic()
        self._title = ""
        self._last_status: dict[str, str] = {}

    def _print(self, text: str) -> None:
        self.out.write(f"[{self._title} {time.monotonic() - self._t0:6.1f}s] {text}\n")
        self.out.flush()

    def start(self, title: str) -> None:
        super().start(title)
        self._title = title
        self._t0 = time.monotonic()
        self._print("started")

    def event(self, event: dict[str, Any]) -> None:
        super().event(event)
        text = _event_text(event)
        if not text:
            return
        if "status" in event and event.get("id"):
            # A docker pull repeats "Downloading" per chunk: print status changes only.
            if self._last_status.get(str(event["id"])) == event["status"]:
                return
            self._last_status[str(event["id"])] = str(event["status"])
        elif not self.verbose and "stream" in event and not _STEP.match(text):
            return
        self._print(text)

    def note(self, text: str) -> None:
        super().note(text)
        self._print(text)

    def finish(self, text: str) -> None:
        super().finish(text)
        self._print(text)


class RichReporter(NullReporter):
    """A live display: the current build step with a spinner, one bar per pulled layer."""

    def __init__(self, console: Console | None = None) -> None:
        super().__init__()
        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._main: TaskID | None = None
        self._layers: dict[str, TaskID] = {}

    def start(self, title: str) -> None:
        super().start(title)
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._progress.start()
        self._main = self._progress.add_task(title, total=None)

    def event(self, event: dict[str, Any]) -> None:
        super().event(event)
        if self._progress is None or self._main is None:
            return
        text = _event_text(event)
        detail = event.get("progressDetail") or {}
        layer = event.get("id")
        if layer and detail.get("total"):
            task = self._layers.get(str(layer))
            if task is None:
                task = self._progress.add_task(f"  {layer}", total=detail["total"])
                self._layers[str(layer)] = task
            self._progress.update(task, completed=detail.get("current", 0))
            return
        step = _STEP.match(text)
        if step:
            self._progress.console.print(
                f"[bold]{step.group(1)}[/bold] {step.group(2)[:120]}", highlight=False
            )
            self._progress.update(self._main, description=f"{step.group(1)}")
        elif text:
            self._progress.update(self._main, description=text.splitlines()[-1][:80])

    def note(self, text: str) -> None:
        super().note(text)
        target = self._progress.console if self._progress else self.console
        target.print(text, highlight=False)

    def finish(self, text: str) -> None:
        super().finish(text)
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self.console.print(text, highlight=False)


def default_reporter(stream: IO[str] | None = None) -> Reporter:
    """Rich on a terminal, plain lines otherwise."""
    out = stream or sys.stderr
    if out.isatty():
        return RichReporter(Console(file=out))
    return PlainReporter(out)
