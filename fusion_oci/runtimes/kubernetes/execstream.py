"""``pods/exec`` as an asyncio byte stream, with the standard library only.

A command in a Pod's container, its stdin, stdout and stderr carried over the API server's
WebSocket endpoint (``GET .../pods/NAME/exec?command=...``), as ``kubectl exec`` does since
Kubernetes 1.30. :mod:`.websocket` does the upgrade and the framing; this module joins
fragmented messages, answers pings, closes with the closing handshake, and runs Kubernetes'
channel protocol on top: every message starts
with its channel byte — 0 stdin, 1 stdout, 2 stderr, 3 the final ``Status`` (JSON: ``Success``,
or the exit code in ``details.causes[reason=ExitCode]``) and, in ``v5.channel.k8s.io``, 255
"close channel N" (stdin's end of file). When the server picks ``v4.channel.k8s.io`` (before
1.30) everything works the same except that stdin cannot be ended while stdout stays open.

Why not SPDY (kubectl before 1.30) or a package (``kubernetes``, ``websockets``): SPDY is
deprecated upstream and has no stdlib implementation; the WebSocket client is ~200 lines we
can read, and the credentials and TLS are exactly :class:`~.client.KubeClient`'s
(:func:`~.client.ssl_context`).

Bounds: the connection and the upgrade share one timeout; a write waits for the socket at most
``write_timeout_s``; a message in is at most :data:`MAX_MESSAGE` bytes; stdout is buffered up to
``buffer_limit`` (or what one ``readexactly`` asks for) and then the socket is not read until
the caller reads, so TCP carries the backpressure to the command; stderr keeps its last
``stderr_limit`` bytes or goes to a callback. A ping goes out every ``ping_interval_s``; nothing
heard for twice that (while we are reading) and the stream is lost, so a node that vanished
without closing its connections ends the stream instead of hanging it.

Errors (all :class:`~fusion_oci.errors.EngineError`, kind ``engine-error``):
:class:`~.client.ApiError` when the upgrade is refused (a 403 has the hint every API call has),
:class:`ExecError` when the command could not run, :class:`~.websocket.WebSocketError` when the
server broke the protocol during the upgrade, and
:class:`ExecStreamLost` (also a :class:`ConnectionError`) when the stream ended before the
command's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Sequence
from urllib.parse import quote, urlencode, urlsplit

from fusion_oci.errors import CommandTimeoutError, EngineError
from fusion_oci.runtimes.kubernetes.client import ApiError, ssl_context, status_hint
from fusion_oci.runtimes.kubernetes.kubeconfig import ClusterAccess
from fusion_oci.runtimes.kubernetes.websocket import (
    OP_BINARY,
    OP_CLOSE,
    OP_CONT,
    OP_PING,
    OP_PONG,
    Target,
    WebSocketError,
    abort,
    client_frame,
    read_frame,
    upgrade,
)

V5 = "v5.channel.k8s.io"
V4 = "v4.channel.k8s.io"
PROTOCOLS = (V5, V4)
"""Offered in this order: the server picks the first it speaks."""
STDIN, STDOUT, STDERR, STATUS, CLOSE = 0, 1, 2, 3, 255
MAX_MESSAGE = 16 << 20
"""Largest message taken from the server (the API server sends 32 KiB pieces)."""
MAX_STATUS = 64 << 10
STDIN_CHUNK = 64 << 10
"""stdin goes out in frames of at most this much, so a pong is never stuck behind megabytes."""


class ExecError(EngineError):
    """A ``pods/exec`` command could not run, or its stream cannot do what was asked."""

    def __init__(self, what: str, why: str = "", hint: str = "") -> None:
        super().__init__(
            what,
            why,
            hint or "see the message; `kubectl -n NS describe pod POD` shows the pod's state",
        )


class ExecStreamLost(ExecError, ConnectionError):
    """The stream ended before the command's final status: the connection broke, the API
    server or the kubelet closed it, or the pod went away."""


class LineTooLongError(ExecError, ValueError):
    """``readline`` found no newline within its limit."""


def exec_path(
    namespace: str, pod: str, argv: Sequence[str], container: str | None, stdin: bool
) -> str:
    """The ``pods/exec`` URL path and query (one ``command=`` per argument, no tty). Pure."""
    query: list[tuple[str, str]] = [("command", arg) for arg in argv]
    if container:
        query.append(("container", container))
    if stdin:
        query.append(("stdin", "true"))
    query += [("stdout", "true"), ("stderr", "true")]
    return f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(pod)}/exec?{urlencode(query)}"


def exit_status(raw: bytes, label: str) -> int:
    """The exit code in the final ``Status`` of channel 3: 0 for ``Success``, else the
    ``ExitCode`` cause. A failure without one (the command did not start) raises. Pure."""
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ExecError(f"{label}: the final status is not JSON", repr(raw[:200])) from exc
    if not isinstance(doc, dict):
        raise ExecError(f"{label}: the final status is not a JSON object", repr(raw[:200]))
    if doc.get("status") == "Success":
        return 0
    details = doc.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    for cause in causes if isinstance(causes, list) else []:
        if isinstance(cause, dict) and cause.get("reason") == "ExitCode":
            try:
                return int(str(cause.get("message")))
            except ValueError:
                break
    raise ExecError(
        f"the command {label} could not run",
        str(doc.get("message") or doc.get("reason") or raw[:200]),
        "check the command exists in the image and the container is running "
        "(`kubectl -n NS describe pod POD`)",
    )


def _shown(argv: Sequence[str]) -> str:
    return " ".join(a if len(a) < 80 else "<script>" for a in argv)


class PodExec:
    """Opens ``pods/exec`` streams on one API server, with its TLS context built once."""

    def __init__(self, access: ClusterAccess, timeout_s: float = 10.0) -> None:
        self.access = access
        self.timeout_s = timeout_s
        split = urlsplit(access.server)
        self._prefix = split.path.rstrip("/")
        self._target = Target(
            split.hostname or "", split.port or 443, ssl_context(access), access.token,
            access.server,
        )  # fmt: skip

    async def open(
        self,
        namespace: str,
        pod: str,
        argv: Sequence[str],
        *,
        container: str | None = None,
        stdin: bool = True,
        on_stderr: Callable[[bytes], None] | None = None,
        buffer_limit: int = 1 << 20,
        stderr_limit: int = 64 << 10,
        ping_interval_s: float = 15.0,
        write_timeout_s: float = 120.0,
    ) -> ExecStream:
        """Start ``argv`` in ``pod`` and return its stream. Raises :class:`ApiError` when the
        API server refuses (403: the identity lacks ``pods/exec``) or does not answer."""
        path = exec_path(namespace, pod, argv, container, stdin)
        call = f"GET {path.partition('?')[0]}"
        label = f"{namespace}/{pod}{f' [{container}]' if container else ''} -- {_shown(argv)}"
        try:
            # PROTOCOLS read here, not bound at import: the tests make the server pick v4
            reader, writer, protocol = await asyncio.wait_for(
                upgrade(self._target, self._prefix + path, PROTOCOLS, call), self.timeout_s
            )
        except TimeoutError as exc:
            raise ApiError(
                call, 0, f"no upgrade from {self.access.server} within {self.timeout_s} s",
                status_hint(0),
            ) from exc  # fmt: skip
        return ExecStream(
            reader, writer, protocol, label, stdin=stdin, on_stderr=on_stderr,
            buffer_limit=buffer_limit, stderr_limit=stderr_limit,
            ping_interval_s=ping_interval_s, write_timeout_s=write_timeout_s,
            close_timeout_s=min(self.timeout_s, 5.0),
        )  # fmt: skip


class ExecStream:
    """One running ``pods/exec`` command: stdin out, stdout in (a reader for one consumer at
    a time: ``read``/``readline``/``readexactly``), stderr kept or handed on, the exit code.

    Satisfies :class:`~.sync.stream.ByteStream`. Use as ``async with`` or call :meth:`close`.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        protocol: str,
        label: str,
        *,
        stdin: bool,
        on_stderr: Callable[[bytes], None] | None,
        buffer_limit: int,
        stderr_limit: int,
        ping_interval_s: float,
        write_timeout_s: float,
        close_timeout_s: float,
    ) -> None:
        self.protocol = protocol
        """The subprotocol the server chose (:data:`V5` or :data:`V4`)."""
        self.label = label
        self._reader = reader
        self._writer = writer
        self._on_stderr = on_stderr
        self._buffer_limit = buffer_limit
        self._stderr_limit = stderr_limit
        self._ping_s = ping_interval_s
        self._write_s = write_timeout_s
        self._close_s = close_timeout_s
        self._stdout = bytearray()
        self._stderr = bytearray()
        self._status = bytearray()
        self._want = 0
        self._eof = False
        self._paused = False
        self._closing = False
        self._close_sent = False
        self._stdin_open = stdin
        self._lost: ExecStreamLost | None = None
        self._lost_why = ""
        self._data = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._done = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._last_heard = loop.time()
        self._pump_task = loop.create_task(self._pump())
        self._ping_task = loop.create_task(self._keepalive())

    async def __aenter__(self) -> ExecStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- stdin ------------------------------------------------------------------------------

    async def write(self, data: bytes) -> None:
        """Send ``data`` to the command's stdin, waiting while the socket is full."""
        if not self._stdin_open:
            raise ExecError(f"cannot write to the stdin of {self.label}", "stdin is closed")
        view = memoryview(data)
        for start in range(0, len(view), STDIN_CHUNK):
            self._send(OP_BINARY, b"\x00" + view[start : start + STDIN_CHUNK])
            await self._drain()

    async def close_stdin(self) -> None:
        """End the command's stdin (its reads see end of file); stdout stays open."""
        if not self._stdin_open:
            return
        if self.protocol != V5:
            raise ExecError(
                f"cannot end the stdin of {self.label} alone",
                f"the API server chose {self.protocol}, which has no way to close one channel "
                f"({V5}, Kubernetes 1.30+, has)",
                "end the command another way (close the whole stream), or upgrade the "
                "cluster to Kubernetes 1.30 or later",
            )
        self._send(OP_BINARY, bytes([CLOSE, STDIN]))
        self._stdin_open = False
        await self._drain()

    def _send(self, opcode: int, payload: bytes | memoryview) -> None:
        # One write() per frame: asyncio never interleaves two writes, so a pong sent by the
        # pump cannot land inside a stdin frame.
        self._check_sendable()
        self._writer.write(client_frame(opcode, payload, os.urandom(4)))

    def _check_sendable(self) -> None:
        if self._lost is not None:
            raise self._lost
        if self._done.is_set() or self._writer.is_closing():
            raise ExecStreamLost(
                f"the exec stream {self.label} has ended", "nothing more can be sent to it"
            )

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(self._writer.drain(), self._write_s)
        except TimeoutError as exc:
            raise ExecError(
                f"the command {self.label} took no stdin",
                f"the socket stayed full for {self._write_s:.0f} s",
                "the command does not read its stdin: close the stream",
            ) from exc
        except OSError as exc:
            raise self._lose(f"writing failed: {exc!r}") from exc

    # -- stdout -----------------------------------------------------------------------------

    async def read(self, n: int = 65536) -> bytes:
        """Up to ``n`` bytes of stdout as soon as there are some; b"" at its end."""
        while not self._stdout and not self._eof:
            await self._more()
        if not self._stdout:
            self._raise_lost()
            return b""
        return self._take(min(n, len(self._stdout)))

    async def readline(self, limit: int = 65536) -> bytes:
        """One line of stdout with its newline, at most ``limit`` bytes; the rest at the end
        (b"" when nothing is left). :class:`LineTooLongError` past ``limit``."""
        seen = 0
        while True:
            i = self._stdout.find(b"\n", seen)
            if 0 <= i < limit:
                return self._take(i + 1)
            if i >= limit or len(self._stdout) >= limit:
                raise LineTooLongError(
                    f"a line of {self.label}'s stdout is longer than {limit} bytes"
                )
            if self._eof:
                self._raise_lost()
                return self._take(len(self._stdout))
            seen = len(self._stdout)
            self._want = limit
            try:
                await self._more()
            finally:
                self._want = 0

    async def readexactly(self, n: int) -> bytes:
        """Exactly ``n`` bytes of stdout; :class:`asyncio.IncompleteReadError` when it ends
        sooner (:class:`ExecStreamLost` when the stream broke)."""
        self._want = n  # the buffer may grow to what the caller asked for, not beyond
        try:
            while len(self._stdout) < n:
                if self._eof:
                    self._raise_lost()
                    raise asyncio.IncompleteReadError(self._take(len(self._stdout)), n)
                await self._more()
        finally:
            self._want = 0
        return self._take(n)

    def _take(self, n: int) -> bytes:
        out = bytes(self._stdout[:n])
        del self._stdout[:n]
        if len(self._stdout) < self._high():
            self._room.set()
        return out

    def _high(self) -> int:
        return max(self._buffer_limit, self._want)

    async def _more(self) -> None:
        self._data.clear()
        if len(self._stdout) < self._high():
            self._room.set()
        await self._data.wait()

    def _raise_lost(self) -> None:
        if self._lost is not None:
            raise self._lost

    # -- stderr, status ---------------------------------------------------------------------

    @property
    def stderr(self) -> bytes:
        """The last ``stderr_limit`` bytes of stderr (empty when a callback takes it)."""
        return bytes(self._stderr)

    async def wait(self, timeout_s: float | None = None) -> int:
        """The command's exit code, once it ended (stdout must be read or the stream's
        buffer fills and the command waits: read it, or close the stream)."""
        try:
            await asyncio.wait_for(self._done.wait(), timeout_s)
        except TimeoutError as exc:
            raise CommandTimeoutError(
                f"the command {self.label} did not end", f"within {timeout_s} s",
                "wait again, or close() the stream (that ends the command's stdin and output)",
            ) from exc  # fmt: skip
        if self._status:
            return exit_status(bytes(self._status), self.label)
        self._raise_lost()
        raise ExecStreamLost(f"the exec stream {self.label} ended without a status")

    def describe(self) -> str:
        """What is at the other end, for error messages."""
        if not self._done.is_set():
            state = "running"
        elif self._status:
            try:
                state = f"exit {exit_status(bytes(self._status), self.label)}"
            except ExecError as exc:
                state = f"failed: {exc.why}"
        else:
            state = f"lost: {self._lost_why or 'closed'}"
        tail = self._stderr.decode(errors="replace").strip()[-600:]
        return f"pods/exec {self.label} ({state}); stderr: {tail or '-'}"

    # -- the socket -------------------------------------------------------------------------

    async def _pump(self) -> None:
        why = ""
        try:
            while True:
                opcode, payload = await self._message()
                if opcode == OP_CLOSE:
                    if not self._close_sent:
                        with contextlib.suppress(ExecError, OSError):
                            self._send(OP_CLOSE, payload[:2])
                            self._close_sent = True
                    code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
                    why = f"the server closed the stream (code {code} {payload[2:125]!r})"
                    break
                await self._deliver(payload)
        except asyncio.IncompleteReadError:
            why = "the connection was closed without a WebSocket close"
        except OSError as exc:
            why = f"the connection broke: {exc!r}"
        except (ExecError, WebSocketError) as exc:
            why = exc.what
        except asyncio.CancelledError:
            why = "closed by the caller"
        finally:
            self._finish(why)

    def _finish(self, why: str) -> None:
        if not self._status and self._lost is None:
            self._lose(why or "the stream ended without a status")
        self._eof = True
        self._data.set()
        self._room.set()
        self._done.set()
        self._ping_task.cancel()

    def _lose(self, why: str) -> ExecStreamLost:
        if self._lost is None:
            self._lost_why = self._lost_why or why
            self._lost = ExecStreamLost(
                f"the exec stream {self.label} ended before the command's status",
                self._lost_why,
                "the pod, its node or the API server went away (`kubectl -n NS get pod POD`); "
                "start the command again in a new stream",
            )
        return self._lost

    async def _message(self) -> tuple[int, bytes]:
        """The next data message (fragments joined) or a close; answers pings on the way."""
        parts: list[bytes] = []
        size = 0
        first: int | None = None
        while True:
            fin, opcode, payload = await read_frame(self._reader, MAX_MESSAGE, self.label)
            self._last_heard = asyncio.get_running_loop().time()
            if opcode == OP_PING:
                with contextlib.suppress(ExecError, OSError):
                    self._send(OP_PONG, payload)
                continue
            if opcode == OP_PONG:
                continue
            if opcode == OP_CLOSE:
                return OP_CLOSE, payload
            if (opcode == OP_CONT) == (first is None):
                raise WebSocketError(f"{self.label}: a fragment out of order from the server")
            first = opcode if first is None else first
            size += len(payload)
            if size > MAX_MESSAGE:
                raise WebSocketError(f"{self.label}: a message over {MAX_MESSAGE} bytes")
            parts.append(payload)
            if fin:
                return first, b"".join(parts)

    async def _deliver(self, message: bytes) -> None:
        if not message:
            return
        channel, data = message[0], memoryview(message)[1:]
        if channel == STDOUT and data and not self._closing:
            self._stdout += data
            self._data.set()
            while len(self._stdout) >= self._high() and not self._closing:
                # Backpressure: stop reading the socket until the caller takes some.
                self._room.clear()
                self._paused = True
                try:
                    await self._room.wait()
                finally:
                    self._paused = False
                    self._last_heard = asyncio.get_running_loop().time()
        elif channel == STDERR and data:
            if self._on_stderr is not None:
                self._on_stderr(bytes(data))
            else:
                self._stderr += data
                del self._stderr[: -self._stderr_limit]
        elif channel == STATUS and len(self._status) + len(data) <= MAX_STATUS:
            self._status += data
        # other channels (4: terminal resize) are not used without a tty

    async def _keepalive(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._done.is_set():
            await asyncio.sleep(self._ping_s)
            if self._paused:
                continue  # our own choice not to read: silence proves nothing
            if loop.time() - self._last_heard > 2 * self._ping_s:
                self._lose(f"nothing heard from the API server for {2 * self._ping_s:.0f} s")
                abort(self._writer)  # the pump sees the end and finishes
                return
            with contextlib.suppress(ExecError, OSError):
                self._send(OP_PING, b"")

    async def close(self) -> None:
        """End the stream: a WebSocket close (the command's stdin and output end with it),
        then the connection. Idempotent; the exit code stays readable if it had come."""
        if self._closing:
            return
        self._closing = True
        self._room.set()
        self._stdout.clear()
        if not self._done.is_set():
            with contextlib.suppress(ExecError, OSError):
                self._send(OP_CLOSE, (1000).to_bytes(2, "big"))
                self._close_sent = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._done.wait()), self._close_s)
        self._pump_task.cancel()
        self._ping_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pump_task
        self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), self._close_s)
        except TimeoutError:
            abort(self._writer)
        except OSError:
            pass  # the server had already dropped the connection: nothing is left open


__all__ = [
    "V4",
    "V5",
    "ExecError",
    "ExecStream",
    "ExecStreamLost",
    "LineTooLongError",
    "PodExec",
]
