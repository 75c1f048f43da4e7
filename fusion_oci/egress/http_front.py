"""The proxy's HTTP front: a CONNECT or a plain ``http://`` request, read and checked, then
handed to the core (:class:`~fusion_oci.egress.wire.Core`) to decide and connect.

With a broker (``sandbox.credentials``), plain requests are never spliced: each is checked
whole, head and body, and so is every request pipelined after it (:func:`_plain`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import urllib.parse
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fusion_oci.egress.wire import Connection, Core, Refused, bad_name
from fusion_oci.models.hostpattern import name_problem, normalize_host

if TYPE_CHECKING:
    from fusion_oci.egress.credentials import Brokered

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
    }
)
"""Headers that belong to one hop (RFC 9110 7.6.1); Transfer-Encoding stays: the body is
forwarded as the client framed it."""

_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def http_response(status: int, text: str) -> bytes:
    body = (text + "\n").encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        "X-Fusion-OCI-Egress: refused\r\n\r\n"
    )
    return head.encode() + body


def split_host_port(target: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` -> (host, port); ValueError when it is not one."""
    if target.startswith("["):
        end = target.find("]")
        if end < 0:
            raise ValueError(target)
        host, rest = target[1:end], target[end + 1 :]
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port_text = target.rpartition(":")
        if not sep:
            host, port_text = target, ""
    if not port_text:
        if default_port is None:
            raise ValueError(target)
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(target)
    return host, int(port_text)


def rewrite_request(lines: list[str], path: str, netloc: str) -> bytes:
    """A request head for the origin: origin-form target, hop-by-hop headers dropped (also
    those ``Connection`` names), ``Host`` set, one request per connection."""
    method, _, version = lines[0].split(" ", 2)
    named: set[str] = set()
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
        if name.strip().lower() in ("connection", "proxy-connection"):
            named.update(v.strip().lower() for v in value.split(","))
    out = [f"{method} {path} {version}", f"Host: {netloc}"]
    for name, value in headers:
        low = name.lower()
        if low in HOP_BY_HOP or low in named or low == "host":
            continue
        out.append(f"{name}: {value}")
    out.append("Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")


async def serve_http(
    proxy: Core,
    first: bytes,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    conn: Connection,
) -> None:
    try:
        rest = await asyncio.wait_for(
            reader.readuntil(b"\r\n\r\n"), proxy.limits.handshake_timeout_s
        )
    except asyncio.LimitOverrunError:
        return await refuse(
            writer,
            conn,
            Refused(
                431,
                0,
                "fusion-oci egress: request head larger than "
                f"{proxy.limits.max_header_bytes} bytes",
            ),
        )
    except TimeoutError:
        return await refuse(
            writer, conn, Refused(408, 0, "fusion-oci egress: no complete request head in time")
        )
    head = (first + rest).decode("latin-1")
    lines = head.split("\r\n")[:-2]
    parts = lines[0].split(" ") if lines else []
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return await refuse(
            writer, conn, Refused(400, 0, "fusion-oci egress: not an HTTP proxy request")
        )
    method, target, _ = parts
    try:
        if method.upper() == "CONNECT":
            conn.host, conn.port = split_host_port(target)
            path = netloc = ""
        else:
            url = urllib.parse.urlsplit(target)
            if url.scheme.lower() != "http" or not url.hostname:
                raise ValueError(target)
            path = (url.path or "/") + (f"?{url.query}" if url.query else "")
            netloc = url.netloc.rpartition("@")[2]
            # The host as written (urlsplit's hostname is str.lower()ed, which folds
            # the Kelvin sign into 'k'): the name check below sees what came.
            conn.host, conn.port = split_host_port(netloc, 80)
    except ValueError:
        return await refuse(
            writer,
            conn,
            Refused(
                400,
                0,
                f"fusion-oci egress: '{target}' is not host:port (CONNECT) or an "
                "http:// absolute URI",
            ),
        )
    problem = name_problem(conn.host)
    if problem is not None:
        return await refuse(writer, conn, bad_name(problem))
    cred = None
    if proxy.broker is not None:
        leaked = proxy.broker.find_sentinel(head.encode("latin-1"))
        cred = proxy.broker.for_host(normalize_host(conn.host))
        if leaked is not None:
            # A sentinel in a head the proxy forwards as is (plain HTTP, a CONNECT's own
            # headers): never swapped there, and the attempt is on record.
            proxy.leak(conn, leaked.spec.name, "in a request the proxy does not swap in")
            return await refuse(
                writer,
                conn,
                Refused(
                    403,
                    0,
                    f"fusion-oci egress: request to {conn.host} denied: it carries "
                    f"the sentinel of {leaked.spec.name}, which is swapped only in the "
                    "Authorization header of HTTPS requests to its hosts",
                ),
            )
    try:
        up = await proxy.open(conn)
    except Refused as refused:
        return await refuse(writer, conn, refused)
    if cred is not None and method.upper() == "CONNECT":
        return await proxy.intercept(up, reader, writer, conn, cred)
    if method.upper() == "CONNECT":
        await proxy.splice(
            up, reader, writer, conn, answer=b"HTTP/1.1 200 Connection established\r\n\r\n"
        )
    elif proxy.broker is None:
        await proxy.splice(up, reader, writer, conn, first=rewrite_request(lines, path, netloc))
    else:
        await _plain(proxy, up, reader, writer, conn, lines, path, netloc)


async def _plain(
    proxy: Core,
    up: socket.socket,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    conn: Connection,
    lines: list[str],
    path: str,
    netloc: str,
) -> None:
    """Plain HTTP when the task has a broker: the request checked whole, its body scanned
    as it streams (a sentinel there: 403 and a leak event, the request never completes
    upstream), the answer sent back with ``Connection: close``; then each request the
    client sent after it on the connection (pipelined) is read and checked the same way,
    refused if it carries a sentinel, else dropped (the client sends it again on a new
    connection, as it must after ``Connection: close``). Never spliced: what passes is
    what was read."""
    from fusion_oci.egress.mitm import Head, Scanner, body_chunks, sentinel_in_head

    assert proxy.broker is not None
    head = Head(lines[0], [_header(line) for line in lines[1:]])
    ureader, uwriter = await asyncio.open_connection(sock=up, limit=proxy.limits.max_header_bytes)
    try:
        leaked = sentinel_in_head(head, proxy.broker)
        if leaked is None:
            dropped = set()
            if "100-continue" in head.tokens("expect"):
                # Answered here: the body is read (and scanned) before the host answers.
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                dropped.add("expect")
            chunked = "chunked" in head.tokens("transfer-encoding")
            if chunked:
                dropped.add("content-length")  # beside chunked framing: never both on
            lines = [x for x in lines if _header(x)[0].lower() not in dropped]
            rewritten = rewrite_request(lines, path, netloc)
            uwriter.write(rewritten)
            conn.bytes_up += len(rewritten)
            scanner = Scanner([n for n, _ in proxy.broker.sentinel_bytes()])
            idle = proxy.limits.idle_timeout_s
            async for data in _idle(body_chunks(reader, head, response=False), idle):
                safe, found = scanner.feed(data)
                if found is not None:
                    leaked = proxy.broker.find_sentinel(found)
                    break
                _send_piece(uwriter, safe, chunked, conn, "up")
                await uwriter.drain()
            else:
                _send_piece(uwriter, scanner.flush(), chunked, conn, "up")
                if chunked:
                    uwriter.write(b"0\r\n\r\n")
                await uwriter.drain()
        if leaked is not None:
            return await _plain_leak(proxy, writer, conn, leaked, "request")
        method = lines[0].split(" ", 1)[0].upper()
        await _plain_answer(proxy, ureader, writer, conn, method)
    finally:
        uwriter.close()
    await _plain_pipelined(proxy, reader, writer, conn)


async def _plain_answer(
    proxy: Core,
    ureader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    conn: Connection,
    method: str,
) -> None:
    """The destination's answer to a plain request, with ``Connection: close``."""
    from fusion_oci.egress.mitm import Head, body_chunks, read_head

    idle = proxy.limits.idle_timeout_s
    while True:
        head = await asyncio.wait_for(read_head(ureader), idle)
        if head is None:
            raise ConnectionError(f"{conn.host} closed the connection without an answer")
        status = int(head.first.split(" ")[1])
        if not 100 <= status < 200:  # (a 100 was answered here already)
            break
    chunked = "chunked" in head.tokens("transfer-encoding")
    headers = [(k, v) for k, v in head.headers if k.lower() not in HOP_BY_HOP]
    headers.append(("Connection", "close"))
    writer.write(Head(head.first, headers).encode())
    body = body_chunks(ureader, head, response=True, status=status, method=method)
    async for data in _idle(body, idle):
        _send_piece(writer, data, chunked, conn, "down")
        await writer.drain()
    if chunked:
        writer.write(b"0\r\n\r\n")
    await writer.drain()


async def _plain_pipelined(
    proxy: Core, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection
) -> None:
    """Requests the client sent after the one answered (see :func:`_plain`): each
    checked, head and body, until the client closes or sends nothing more."""
    from fusion_oci.egress.mitm import Scanner, body_chunks, read_head, sentinel_in_head

    assert proxy.broker is not None
    for _ in range(PIPELINED_CHECKED):
        try:
            head = await asyncio.wait_for(read_head(reader), PIPELINED_WAIT_S)
            if head is None:
                return
            leaked = sentinel_in_head(head, proxy.broker)
            scanner = Scanner([n for n, _ in proxy.broker.sentinel_bytes()])
            if leaked is None:
                async with asyncio.timeout(proxy.limits.handshake_timeout_s):
                    async for data in body_chunks(reader, head, response=False):
                        found = scanner.feed(data)[1]
                        if found is not None:
                            leaked = proxy.broker.find_sentinel(found)
                            break
        except (
            TimeoutError,
            ValueError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            return
        if leaked is not None:
            return await _plain_leak(proxy, writer, conn, leaked, "request pipelined after another")


async def _plain_leak(
    proxy: Core, writer: asyncio.StreamWriter, conn: Connection, leaked: Brokered, what: str
) -> None:
    proxy.leak(conn, leaked.spec.name, f"in a plain HTTP {what} (its body or head)")
    await refuse(
        writer,
        conn,
        Refused(
            403,
            0,
            f"fusion-oci egress: request to {conn.host} denied: a plain HTTP {what} "
            f"carries the sentinel of {leaked.spec.name}, which is swapped only in the "
            "Authorization header of HTTPS requests to its hosts",
        ),
    )


async def refuse(writer: asyncio.StreamWriter, conn: Connection, refused: Refused) -> None:
    conn.reason = refused.text
    conn.rule = conn.rule or refused.rule
    writer.write(http_response(refused.status, refused.text))
    with contextlib.suppress(ConnectionError):
        await writer.drain()


PIPELINED_CHECKED = 16
"""Requests read and checked after a plain request's answer, at most (then the connection
ends)."""
PIPELINED_WAIT_S = 1.0
"""How long a plain connection waits for a pipelined request after its answer: the client
was told ``Connection: close``, so it closes at once or sends nothing more."""


def _header(line: str) -> tuple[str, str]:
    name, _, value = line.partition(":")
    return name.strip(), value.strip()


async def _idle(pieces: AsyncIterator[bytes], timeout_s: float) -> AsyncIterator[bytes]:
    """``pieces``, ended by TimeoutError when none comes for ``timeout_s`` (a tunnel's idle
    limit: a long transfer that keeps moving is never cut)."""
    it = aiter(pieces)
    while True:
        try:
            piece = await asyncio.wait_for(anext(it), timeout_s)
        except StopAsyncIteration:
            return
        yield piece


def _send_piece(
    writer: asyncio.StreamWriter, data: bytes, chunked: bool, conn: Connection, way: str
) -> None:
    """Body bytes on, framed as they came (chunked: one chunk), counted for the audit."""
    if not data:
        return
    if way == "up":
        conn.bytes_up += len(data)
    else:
        conn.bytes_down += len(data)
    writer.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
