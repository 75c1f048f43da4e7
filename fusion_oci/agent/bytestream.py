"""The byte streams an agent can be reached over (PROTOCOL.md, "Over a byte stream").

:class:`ByteStream` is all :class:`~fusion_oci.agent.streamed.StreamedAgent` asks of one; a
pods/exec WebSocket (``runtimes/kubernetes/execstream.py``'s ``ExecStream``) is one as it
is. Here: :class:`PipeStream` over an asyncio reader and writer (a socket), and
:class:`ProcessStream`, a process's stdin and stdout (the mux run here, ``kubectl exec -i``),
its stderr's tail kept to say why it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
from collections.abc import Sequence
from typing import Protocol

from fusion_oci.errors import SandboxSetupError

READ_LIMIT = 1 << 18
STDERR_TAIL = 4096
STDERR_WAIT_S = 0.2
"""At the end of a process's stdout, how long its stderr may take to say why."""


class ByteStream(Protocol):
    """A duplex byte stream: what the agent's host side needs of it."""

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes as they come; b"" at the end of the stream."""
        ...

    async def write(self, data: bytes) -> None:
        """Send ``data``, waiting while the stream is backed up. Only one caller at a time."""
        ...

    def describe(self) -> str:
        """What is at the other end, for error messages (a command, its stderr's tail)."""
        ...

    async def close(self) -> None: ...


class PipeStream:
    """A :class:`ByteStream` over an asyncio reader and writer."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, label: str = ""
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.label = label

    async def read(self, n: int) -> bytes:
        return await self.reader.read(n)

    async def write(self, data: bytes) -> None:
        if self.writer.is_closing():
            raise ConnectionResetError("the stream is closed")
        self.writer.write(data)
        await self.writer.drain()

    def describe(self) -> str:
        return self.label

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await self.writer.wait_closed()


class ProcessStream(PipeStream):
    """A process's stdin and stdout, started in a session of its own; :meth:`close` ends its
    stdin and waits for it (bounded, then its process group is killed)."""

    def __init__(self, proc: asyncio.subprocess.Process, label: str, close_wait_s: float) -> None:
        assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
        super().__init__(proc.stdout, proc.stdin, label)
        self.proc = proc
        self.close_wait_s = close_wait_s
        self._stderr = bytearray()
        self._stderr_task = asyncio.ensure_future(self._keep_stderr(proc.stderr))

    @classmethod
    async def start(cls, argv: Sequence[str], close_wait_s: float = 15.0) -> ProcessStream:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                limit=READ_LIMIT,
            )
        except OSError as exc:
            raise SandboxSetupError(
                "cannot start the exec agent's stream",
                f"{argv[0]}: {exc.strerror or exc}",
                "check the command that reaches the sandbox (python3, kubectl) is installed",
            ) from exc
        shown = shlex.join(argv)
        return cls(proc, shown if len(shown) <= 200 else shown[:197] + "...", close_wait_s)

    async def _keep_stderr(self, stderr: asyncio.StreamReader) -> None:
        while chunk := await stderr.read(65536):
            self._stderr += chunk
            del self._stderr[:-STDERR_TAIL]

    async def read(self, n: int) -> bytes:
        data = await super().read(n)
        if not data:  # a far end that died says why on stderr: give it a moment
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._stderr_task), STDERR_WAIT_S)
        return data

    def describe(self) -> str:
        text = self._stderr.decode(errors="replace").strip()
        return f"{self.label}; its stderr: {text[-400:]}" if text else self.label

    async def close(self) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            await super().close()
        proc = self.proc
        try:
            await asyncio.wait_for(proc.wait(), self.close_wait_s)
        except TimeoutError:
            # A hung far end: its group goes; an agent below it in a session of its own
            # follows by --parent, ending its trees.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        self._stderr_task.cancel()
        await asyncio.gather(self._stderr_task, return_exceptions=True)
