"""The byte stream the transfer runs over, and its frames.

The transfer needs one thing from a runtime: a byte stream to the remote script
(:mod:`.remote`), kept open for the task. :class:`ProcessStream` is a process's stdin and
stdout — the script run locally (the tests, the benchmark), or ``kubectl exec -i POD --
python3 -S -E -c SOURCE REPO`` — and a ``pods/exec`` stream is one more implementation of
:class:`ByteStream`. Frames are read with bounds fixed before a byte is read: a remote that
announces more than the limit is refused without reading it, and the stream is closed (it
cannot be trusted to be in step any more).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from fusion_oci.host.process import kill_group
from fusion_oci.runtimes.kubernetes.sync.errors import SyncRefusedError, WorktreeSyncError
from fusion_oci.runtimes.kubernetes.sync.remote import MAX_HEAD, MAX_META, frame, parse_head

REMOTE_SCRIPT = Path(__file__).with_name("remote.py")
STDERR_TAIL = 4096


class ByteStream(Protocol):
    """A duplex byte stream to the remote script."""

    async def write(self, data: bytes) -> None: ...

    async def readline(self, limit: int) -> bytes:
        """One line with its newline, at most ``limit`` bytes; b"" at the end."""
        ...

    async def readexactly(self, size: int) -> bytes: ...

    def describe(self) -> str:
        """What is at the other end, for error messages (a command, its stderr's tail)."""
        ...

    async def close(self) -> None: ...


def remote_argv(repo: str, python: str = "python3", by_path: str | None = None) -> list[str]:
    """The argv that starts the remote script: by its path in the image when given, else
    with its source on the command line (nothing to install in the image)."""
    if by_path is not None:
        return [python, "-S", "-E", by_path, repo]
    return [python, "-S", "-E", "-c", REMOTE_SCRIPT.read_text(encoding="utf-8"), repo]


class ProcessStream:
    """stdin/stdout of a child process in a session of its own."""

    def __init__(self, proc: asyncio.subprocess.Process, label: str) -> None:
        self._proc = proc
        self._label = label
        self._stderr = bytearray()
        self._drain = asyncio.ensure_future(self._keep_stderr())

    @classmethod
    async def start(
        cls, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> ProcessStream:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            limit=MAX_HEAD,
        )
        shown = [a if len(a) < 80 else "<script>" for a in argv]
        return cls(proc, " ".join(shown))

    async def _keep_stderr(self) -> None:
        assert self._proc.stderr is not None
        while chunk := await self._proc.stderr.read(65536):
            self._stderr += chunk
            del self._stderr[:-STDERR_TAIL]

    async def write(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(data)
        await self._proc.stdin.drain()

    async def readline(self, limit: int) -> bytes:
        assert self._proc.stdout is not None
        try:
            line = await self._proc.stdout.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            return exc.partial
        except asyncio.LimitOverrunError as exc:
            raise SyncRefusedError("a frame header longer than its limit") from exc
        if len(line) > limit:
            raise SyncRefusedError("a frame header longer than its limit")
        return line

    async def readexactly(self, size: int) -> bytes:
        assert self._proc.stdout is not None
        return await self._proc.stdout.readexactly(size)

    def describe(self) -> str:
        tail = self._stderr.decode(errors="replace").strip()[-600:]
        return f"{self._label} (exit {self._proc.returncode}); stderr: {tail or '-'}"

    async def close(self) -> None:
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        # Read out what is left (a reply the host refused to read, say): asyncio reaps the
        # child only once its pipes are closed, and a paused pipe never would be.
        discard = asyncio.ensure_future(self._discard())
        try:
            await asyncio.wait_for(asyncio.shield(self._proc.wait()), 2.0)
        except TimeoutError:
            await kill_group(self._proc)
        finally:
            discard.cancel()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._drain, 1.0)

    async def _discard(self) -> None:
        assert self._proc.stdout is not None
        with contextlib.suppress(OSError):
            while await self._proc.stdout.read(1 << 20):
                pass


async def request(
    stream: ByteStream,
    meta: dict[str, Any],
    payload: bytes,
    *,
    max_payload: int,
    timeout_s: float,
) -> tuple[dict[str, Any], bytes]:
    """Send one frame and read the reply: its meta (a JSON object) and payload, each within
    its bound. A failure leaves the stream unusable (the caller closes it)."""

    async def exchange() -> tuple[dict[str, Any], bytes]:
        await stream.write(frame(meta, payload))
        line = await stream.readline(MAX_HEAD)
        if not line:
            raise WorktreeSyncError(
                "the sandbox's transfer script ended", f"it said: {stream.describe()}"
            )
        try:
            meta_size, payload_size = parse_head(line)
        except ValueError as exc:
            raise SyncRefusedError(str(exc)) from exc
        if meta_size > MAX_META:
            raise SyncRefusedError(f"a reply of {meta_size} bytes of metadata")
        if payload_size > max_payload:
            raise SyncRefusedError(
                f"a pack of {payload_size} bytes (the limit is {max_payload}: maxTransferMb)"
            )
        body = await stream.readexactly(meta_size)
        try:
            reply = json.loads(body)
        except ValueError as exc:
            raise SyncRefusedError("a reply that is not JSON") from exc
        if not isinstance(reply, dict):
            raise SyncRefusedError("a reply that is not a JSON object")
        return reply, await stream.readexactly(payload_size)

    try:
        return await asyncio.wait_for(exchange(), timeout_s)
    except TimeoutError as exc:
        raise WorktreeSyncError(
            "the sandbox's transfer script did not answer", f"after {timeout_s:.0f} s"
        ) from exc
    except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError) as exc:
        raise WorktreeSyncError(
            "the stream to the sandbox's transfer script broke", stream.describe()
        ) from exc


def local_python() -> str:
    """The interpreter for a local remote side (tests, benchmark): Debian's python3 when
    present, as in the task image, else this one."""
    return "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


__all__ = ["ByteStream", "ProcessStream", "remote_argv", "request"]
