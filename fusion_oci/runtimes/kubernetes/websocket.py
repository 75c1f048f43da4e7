"""The client side of RFC 6455 WebSockets that the API server's streaming endpoints need,
with the standard library only (asyncio, ssl, hashlib, os.urandom).

:func:`upgrade` opens a TLS connection with the kubeconfig's credentials (the context is
:func:`~.client.ssl_context`, a bearer token goes in ``Authorization``), sends the upgrade with
a fresh ``Sec-WebSocket-Key`` and checks the server's answer: 101, ``Upgrade: websocket``, the
``Sec-WebSocket-Accept`` derived from our key, one of the subprotocols we offered. A refused
upgrade is the same :class:`~.client.ApiError` (status, the API server's message and reason,
the hint) a JSON call gets. :func:`client_frame` builds a masked frame (clients must mask
every frame, with a fresh key: RFC 6455 5.3), :func:`read_frame` reads one server frame with
its size checked before its payload is read. What a message means is the caller's
(:mod:`.execstream`: Kubernetes' channels).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

from fusion_oci.errors import EngineError
from fusion_oci.runtimes.kubernetes.client import ApiError, status_hint

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0, 1, 2, 8, 9, 10
OPCODES = frozenset({OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG})
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_ERROR_BODY = 1 << 20
READ_LIMIT = 256 << 10
"""asyncio's own buffer under us (and the longest answer head): it stops reading the socket
past twice this, so a caller that stops reading stops the socket."""


class WebSocketError(EngineError):
    """The API server broke the WebSocket protocol (a bad upgrade answer or frame)."""

    def __init__(self, what: str, why: str = "", hint: str = "") -> None:
        super().__init__(
            what, why, hint or "a proxy between here and the API server may not pass WebSockets"
        )


@dataclass(frozen=True)
class Target:
    """Where to upgrade: the API server's address and what to say to it."""

    host: str
    port: int
    ssl: ssl.SSLContext
    token: str | None
    server: str
    """``https://host:port`` as the kubeconfig says, for error messages."""
    server_name: str = ""
    """The name TLS checks the certificate against and ``Host`` names, when it is not
    ``host`` (a connection through a relay; kubeconfig's ``tls-server-name``)."""


def accept_key(key: str) -> str:
    """The ``Sec-WebSocket-Accept`` a server must answer to ``key`` (RFC 6455 4.2.2). Pure."""
    digest = hashlib.sha1(key.encode() + WS_GUID, usedforsecurity=False).digest()
    return base64.b64encode(digest).decode()


def mask(data: bytes | memoryview, key: bytes) -> bytes:
    """``data`` XOR the 4-byte ``key`` repeated (one big-integer XOR, not a byte loop). Pure."""
    n = len(data)
    if not n:
        return b""
    pad = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "little") ^ int.from_bytes(pad, "little")).to_bytes(n, "little")


def client_frame(opcode: int, payload: bytes | memoryview, key: bytes) -> bytes:
    """One final, masked client frame. Pure."""
    n = len(payload)
    if n < 126:
        head = bytes([0x80 | opcode, 0x80 | n])
    elif n < 1 << 16:
        head = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    return head + key + mask(payload, key)


async def read_frame(
    reader: asyncio.StreamReader, max_size: int, label: str
) -> tuple[bool, int, bytes]:
    """(fin, opcode, payload) of the next server frame; its size is checked before its
    payload is read. :class:`asyncio.IncompleteReadError` at the connection's end."""
    b0, b1 = await reader.readexactly(2)
    opcode, size = b0 & 0x0F, b1 & 0x7F
    if b0 & 0x70 or b1 & 0x80 or opcode not in OPCODES:
        # reserved bits (no extension was offered), a masked server frame, an unknown opcode
        raise WebSocketError(f"{label}: a malformed WebSocket frame from the server")
    if size == 126:
        size = int.from_bytes(await reader.readexactly(2), "big")
    elif size == 127:
        size = int.from_bytes(await reader.readexactly(8), "big")
    if opcode >= OP_CLOSE and (size > 125 or not b0 & 0x80):
        raise WebSocketError(f"{label}: a malformed control frame from the server")
    if size > max_size:
        raise WebSocketError(f"{label}: a frame of {size} bytes from the server (max {max_size})")
    return bool(b0 & 0x80), opcode, await reader.readexactly(size) if size else b""


async def upgrade(
    target: Target, path: str, protocols: Sequence[str], call: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    """A WebSocket on ``path`` (URL path and query) and the subprotocol the server chose.
    Unbounded: the caller puts its timeout around it (a cancellation leaves no socket)."""
    try:
        reader, writer = await asyncio.open_connection(
            target.host, target.port, ssl=target.ssl,
            server_hostname=target.server_name or target.host,
            limit=READ_LIMIT,
        )  # fmt: skip
    except OSError as exc:  # ssl.SSLError is one too
        raise ApiError(call, 0, f"no answer from {target.server}: {exc}", status_hint(0)) from exc
    try:
        protocol = await _handshake(reader, writer, target, path, protocols, call)
    except BaseException:  # a refusal, a timeout, a cancellation: no socket left open
        abort(writer)
        raise
    return reader, writer, protocol


async def _handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    target: Target,
    path: str,
    protocols: Sequence[str],
    call: str,
) -> str:
    key = base64.b64encode(os.urandom(16)).decode()
    name = target.server_name or target.host
    host = f"[{name}]" if ":" in name else name
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: {host}:{target.port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
        f"Sec-WebSocket-Protocol: {', '.join(protocols)}",
        "User-Agent: fusion-oci",
    ]
    if target.token:
        lines.append(f"Authorization: Bearer {target.token}")
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise ApiError(
            call, 0, f"the upgrade to a WebSocket broke: {exc!r}", status_hint(0)
        ) from exc
    status, headers = _parse_head(head, call)
    if status != 101:
        raise _refused(call, status, await _error_body(reader, headers))
    if headers.get("upgrade", "").lower() != "websocket" or "upgrade" not in (
        headers.get("connection", "").lower()
    ):
        raise WebSocketError(f"{call}: the API server answered 101 without a WebSocket upgrade")
    if headers.get("sec-websocket-accept") != accept_key(key):
        raise WebSocketError(f"{call}: the API server's Sec-WebSocket-Accept does not match")
    protocol = headers.get("sec-websocket-protocol", "")
    if protocol not in protocols:
        raise WebSocketError(
            f"{call}: the API server chose subprotocol {protocol!r}",
            f"only {', '.join(protocols)} are spoken",
            "use a cluster of Kubernetes 1.30 or later (v5.channel.k8s.io)",
        )
    return protocol


def _parse_head(head: bytes, call: str) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ApiError(call, 0, f"not an HTTP answer: {lines[0][:100]!r}", status_hint(0))
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _error_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """The body of a refused upgrade, bounded (it is the API server's Status JSON)."""
    length = headers.get("content-length", "")
    with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError):
        if length.isdigit():
            return await asyncio.wait_for(reader.readexactly(min(int(length), MAX_ERROR_BODY)), 5.0)
        return await asyncio.wait_for(reader.read(MAX_ERROR_BODY), 5.0)
    return b""


def _refused(call: str, status: int, body: bytes) -> ApiError:
    """The same error a JSON call refused with ``status`` raises (client.py's hint)."""
    try:
        doc = json.loads(body) if body else {}
    except ValueError:
        doc = {"message": body[:500].decode(errors="replace")}
    doc = doc if isinstance(doc, dict) else {}
    message = str(doc.get("message") or body[:200].decode(errors="replace") or "no message")
    return ApiError(
        call, status, f"HTTP {status}: {message}", status_hint(status),
        reason=str(doc.get("reason") or ""),
    )  # fmt: skip


def abort(writer: asyncio.StreamWriter) -> None:
    """Drop the connection now. Python 3.11's SSL transport raises AttributeError when it
    was already closed underneath (its protocol is gone): then there is nothing to drop."""
    with contextlib.suppress(AttributeError, OSError):
        writer.transport.abort()


__all__ = [
    "OP_BINARY",
    "OP_CLOSE",
    "OP_CONT",
    "OP_PING",
    "OP_PONG",
    "OP_TEXT",
    "Target",
    "WebSocketError",
    "abort",
    "accept_key",
    "client_frame",
    "mask",
    "read_frame",
    "upgrade",
]
