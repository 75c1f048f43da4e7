"""The proxy's SOCKS5 front (RFC 1928): "no authentication" and CONNECT only, the name or
address handed to the core (:class:`~fusion_oci.egress.wire.Core`) to decide and connect."""

from __future__ import annotations

import asyncio
import socket

from fusion_oci.egress.wire import (
    SOCKS_BAD_ADDRESS,
    SOCKS_BAD_COMMAND,
    SOCKS_OK,
    Connection,
    Core,
    Refused,
    bad_name,
)
from fusion_oci.models.hostpattern import name_problem


async def serve_socks(
    proxy: Core,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    conn: Connection,
) -> None:
    try:
        refusal = await asyncio.wait_for(
            _request(proxy, reader, writer, conn), proxy.limits.handshake_timeout_s
        )
    except TimeoutError:
        conn.reason = "fusion-oci egress: no complete SOCKS5 request in time"
        return
    if refusal is not None:
        return refuse(writer, conn, refusal)
    if conn.host is None:
        return  # negotiation failed; the reason is set
    try:
        up = await proxy.open(conn)
    except Refused as refused:
        return refuse(writer, conn, refused)
    await proxy.splice(
        up, reader, writer, conn, answer=bytes([5, SOCKS_OK, 0, 1, 0, 0, 0, 0, 0, 0])
    )


async def _request(
    proxy: Core, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection
) -> Refused | None:
    """The method negotiation and the request (RFC 1928 sections 3 and 4): sets
    ``conn.host``/``conn.port``, or returns the refusal for a request we do not serve."""
    count = (await reader.readexactly(1))[0]
    methods = await reader.readexactly(count)
    if 0x00 not in methods:
        writer.write(b"\x05\xff")  # only "no authentication" is offered
        conn.reason = "fusion-oci egress: SOCKS5 client offered no 'no auth' method"
        return None
    writer.write(b"\x05\x00")
    ver, cmd, _, atyp = await reader.readexactly(4)
    if ver != 5:
        conn.reason = "fusion-oci egress: not a SOCKS5 request"
        return None
    if atyp == 0x01:
        host = socket.inet_ntop(socket.AF_INET, await reader.readexactly(4))
    elif atyp == 0x04:
        host = socket.inet_ntop(socket.AF_INET6, await reader.readexactly(16))
    elif atyp == 0x03:
        size = (await reader.readexactly(1))[0]
        # latin-1: every byte stays itself (and visible to the name check below).
        host = (await reader.readexactly(size)).decode("latin-1")
    else:
        conn.host = "?"
        return Refused(
            0, SOCKS_BAD_ADDRESS, f"fusion-oci egress: SOCKS address type {atyp} unknown"
        )
    conn.host, conn.port = host, int.from_bytes(await reader.readexactly(2), "big")
    problem = name_problem(host)
    if problem is not None:
        return bad_name(problem)
    if cmd != 0x01:
        return Refused(
            0,
            SOCKS_BAD_COMMAND,
            f"fusion-oci egress: SOCKS command {cmd} not supported (only CONNECT)",
        )
    return None


def refuse(writer: asyncio.StreamWriter, conn: Connection, refused: Refused) -> None:
    conn.reason = refused.text
    conn.rule = conn.rule or refused.rule
    writer.write(bytes([5, refused.socks, 0, 1, 0, 0, 0, 0, 0, 0]))
