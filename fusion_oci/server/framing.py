"""Message framing: the LSP base protocol (``Content-Length: N\\r\\n\\r\\n`` + N bytes of JSON).

The same framing vscode-jsonrpc speaks, so the TypeScript client uses that kept library as is.
A message over ``max_bytes`` is skipped without being held in memory, and reported, so one bad
message costs the client one error, not the connection.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

MAX_HEADER_BYTES = 8192


class FrameError(Exception):
    """The stream is not LSP-framed: it cannot be resynchronised, so the connection ends
    (after a parse error is sent). Bad JSON inside a good frame is not a FrameError."""


@dataclass(frozen=True)
class Oversized:
    """A message that was skipped because it is larger than allowed."""

    size: int


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | Oversized | None:
    """The next message body; None at a clean end of stream."""
    length: int | None = None
    header_bytes = 0
    while True:
        try:
            line = await reader.readuntil(b"\r\n")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial and header_bytes == 0:
                return None
            raise FrameError("the stream ended inside a message header") from exc
        except asyncio.LimitOverrunError as exc:
            raise FrameError("a header line is too long") from exc
        header_bytes += len(line)
        if header_bytes > MAX_HEADER_BYTES:
            raise FrameError("the message header is too long")
        if line == b"\r\n":
            if header_bytes == 2:
                continue  # a stray blank line between messages
            break
        name, sep, value = line.decode("ascii", errors="replace").partition(":")
        if not sep:
            raise FrameError(f"not a header line: {line[:80]!r}")
        if name.strip().lower() == "content-length":
            try:
                length = int(value.strip())
            except ValueError:
                raise FrameError(f"bad Content-Length: {value.strip()[:40]!r}") from None
            if length < 0:
                raise FrameError("negative Content-Length")
    if length is None:
        raise FrameError("a message header without Content-Length")
    if length > max_bytes:
        left = length
        while left:
            chunk = await reader.read(min(left, 1 << 16))
            if not chunk:
                raise FrameError("the stream ended inside a message")
            left -= len(chunk)
        return Oversized(length)
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise FrameError("the stream ended inside a message") from exc


def frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
