"""The intercepted connection of a credentialed host: TLS terminated with the task's CA,
each HTTP/1.1 request checked and its ``Authorization`` sentinel swapped for the value, then
re-encrypted to the real host with normal certificate checks.

Per request, in order (the first failure ends the connection with a 403 and an event):
the sentinel anywhere but the ``Authorization`` header (request line, another header, the
body: scanned as it streams, never buffered whole) is a leak attempt; so is the sentinel in
a request for another origin (its ``Host`` or absolute-form authority not the CONNECTed
host and port: a shared front end routes by those); a request outside the credential's
``scope`` / ``allowedRequests`` that carries the sentinel is refused, never swapped; a ``git
push`` (``POST .../git-receive-pack``) to a ref outside the credential's ``allowedRefs`` is
refused with git's own report-status (``! [remote rejected] ... (fusion-oci: ...)``).
Every request asks for ``Accept-Encoding: identity``; a response body the host encoded
anyway is decoded (gzip, deflate) and sent on decoded, or refused (502) when it is in an
encoding not read here. The value in a response (its header or body, in the forms of
:func:`echo_needles`) cuts the connection. Keep-alive holds across requests; bodies stream
in both directions.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fusion_oci.egress.credentials import (
    Broker,
    Brokered,
    basic_sentinel,
    in_scope,
    push_repo,
    ref_allowed,
    repo_allowed,
    request_origin,
    swap_authorization,
)

CHUNK = 64 * 1024
NO_BODY_STATUS = frozenset({204, 304})
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authorization",
        "te",
        "trailer",
        "upgrade",
    }
)


class Leak(Exception):
    """A sentinel where it must not go: the reason a program reads (never the value)."""


class OutOfScope(Leak):
    """The sentinel in a request the credential is not for (its scope): refused, not a leak."""


class Echo(ConnectionError):
    """The real host sent the value back: the connection is cut mid-response."""


@dataclass
class Exchange:
    """What one request did (its ``sandbox:credential`` event)."""

    method: str = ""
    path: str = ""
    status: int | None = None
    swapped: bool = False
    leak: str | None = None
    refused: str | None = None
    refs: list[str] = field(default_factory=list)


Report = Callable[[Exchange], None]


@dataclass
class Head:
    first: str
    headers: list[tuple[str, str]]

    def get(self, name: str) -> str | None:
        low = name.lower()
        for key, value in self.headers:
            if key.lower() == low:
                return value
        return None

    def tokens(self, name: str) -> set[str]:
        return {
            t.strip().lower()
            for k, v in self.headers
            if k.lower() == name.lower()
            for t in v.split(",")
        }

    def encode(self) -> bytes:
        lines = [self.first] + [f"{k}: {v}" for k, v in self.headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def read_head(reader: asyncio.StreamReader) -> Head | None:
    """One message head; None on a clean end of the connection before one."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise
    lines = raw.decode("latin-1").split("\r\n")[:-2]
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return Head(lines[0], headers)


async def _exactly(reader: asyncio.StreamReader, size: int) -> AsyncIterator[bytes]:
    """``size`` bytes of ``reader`` in chunks of at most CHUNK; short is an error."""
    remaining = size
    while remaining:
        data = await reader.read(min(remaining, CHUNK))
        if not data:
            raise asyncio.IncompleteReadError(b"", remaining)
        remaining -= len(data)
        yield data


async def body_chunks(
    reader: asyncio.StreamReader,
    head: Head,
    *,
    response: bool,
    status: int = 200,
    method: str = "GET",
) -> AsyncIterator[bytes]:
    """The body's bytes, de-chunked; ends at its framing (or the connection's end)."""
    if response and (method == "HEAD" or status in NO_BODY_STATUS or 100 <= status < 200):
        return
    if "chunked" in head.tokens("transfer-encoding"):
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers: dropped
                return
            async for data in _exactly(reader, size):
                yield data
            await reader.readexactly(2)
        return
    length = head.get("content-length")
    if length is not None:
        async for data in _exactly(reader, int(length)):
            yield data
        return
    if response:  # until the connection ends
        while data := await reader.read(CHUNK):
            yield data


class Scanner:
    """Finds any of some needles in a stream, across chunk boundaries, holding back only
    what could be the start of one (so nothing of a needle is ever forwarded)."""

    def __init__(self, needles: list[bytes]) -> None:
        self.needles = [n for n in needles if n]
        self.keep = max((len(n) for n in self.needles), default=1) - 1
        self.tail = b""

    def feed(self, data: bytes) -> tuple[bytes, bytes | None]:
        """(bytes safe to forward, the needle found or None)."""
        buf = self.tail + data
        for needle in self.needles:
            if needle in buf:
                return b"", needle
        cut = max(len(buf) - self.keep, 0)
        self.tail = buf[cut:]
        return buf[:cut], None

    def flush(self) -> bytes:
        out, self.tail = self.tail, b""
        return out


def sentinel_in_head(head: Head, broker: Broker) -> Brokered | None:
    """The credential whose sentinel a head carries anywhere (plain, or base64 in a basic
    ``Authorization`` / ``Proxy-Authorization``), or None."""
    found = broker.find_sentinel(head.encode())
    for _, value in head.headers:
        found = found or basic_sentinel(value, broker)
    return found


def pkt_line(payload: bytes) -> bytes:
    return b"%04x" % (len(payload) + 4) + payload


PUSH_COMMANDS_MAX = 1024 * 1024
"""The most bytes of a push's ref-update pkt-lines read (inflated) before deciding; a push
whose commands run longer is refused whole."""


_PUSH_STEP = 64 * 1024
"""Bytes of a push's commands inflated and framed per loop step."""


def parse_commands(data: bytes) -> tuple[list[str], set[str], bool]:
    """(refs updated, capabilities, complete) from the start of a receive-pack request.
    Linear in ``data``; callers bound its size (:data:`PUSH_COMMANDS_MAX`)."""
    refs: list[str] = []
    caps: set[str] = set()
    pos = 0
    while pos + 4 <= len(data):
        size = int(data[pos : pos + 4], 16)
        if size == 0:
            return refs, caps, True
        if pos + size > len(data):
            break
        line = data[pos + 4 : pos + size].rstrip(b"\n")
        pos += size
        text, _, cap_text = line.partition(b"\0")
        if cap_text:
            caps = set(cap_text.decode("latin-1").split())
        parts = text.decode("latin-1").split(" ")
        if parts[0] == "shallow":
            continue
        if len(parts) == 3:
            refs.append(parts[2])
    return refs, caps, False


def push_refusal(refs: list[str], bad: list[str], caps: set[str], reason: str) -> bytes:
    """A receive-pack result refusing every ref, as git prints it (``! [remote rejected]``)."""
    # Linear in the refs (a set, one join): it runs on the loop every task shares, for up
    # to PUSH_COMMANDS_MAX bytes of ref updates.
    bad_set = set(bad)
    lines = [pkt_line(b"unpack ok\n")]
    for ref in refs:
        why = reason if ref in bad_set else "fusion-oci: refused with the rest of this push"
        lines.append(pkt_line(f"ng {ref} {why}\n".encode()))
    report = b"".join(lines) + b"0000"
    if "side-band-64k" in caps or "side-band" in caps:
        step = 990 if "side-band" in caps and "side-band-64k" not in caps else 65000
        out = [pkt_line(b"\x02" + f"{reason}\n".encode())]
        for i in range(0, len(report), step):
            out.append(pkt_line(b"\x01" + report[i : i + step]))
        return b"".join(out) + b"0000"
    return report


def http_text(status: int, text: str, reason: str = "Forbidden") -> bytes:
    body = (text + "\n").encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        "X-Fusion-OCI-Egress: refused\r\n\r\n"
    ).encode() + body


class Session:
    """One intercepted connection (module docstring)."""

    def __init__(
        self,
        broker: Broker,
        cred: Brokered,
        host: str,
        report: Report,
        idle_timeout_s: float = 600.0,
        port: int = 443,
    ) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.broker = broker
        self.cred = cred
        self.host = host
        self.port = port
        """The CONNECTed port: a request's Host and authority must name it too."""
        self.report = report
        self.bytes_up = 0
        self.bytes_down = 0

    def _leak_in_head(self, head: Head) -> str | None:
        for needle, other in self.broker.sentinel_bytes():
            if needle.decode() in head.first:
                return f"the sentinel of {other.spec.name} in the request line"
        for name, value in head.headers:
            if name.lower() == "authorization":
                continue
            found = self.broker.find_sentinel(value.encode("latin-1")) or basic_sentinel(
                value, self.broker
            )
            if found is not None:
                return f"the sentinel of {found.spec.name} in the {name} header"
        auth = head.get("authorization")
        if auth is not None:
            for needle, other in self.broker.sentinel_bytes():
                if other is not self.cred and (
                    needle.decode() in auth or basic_sentinel(auth, self.broker) is other
                ):
                    return (
                        f"the sentinel of {other.spec.name} sent to {self.host}, "
                        f"which it is not for"
                    )
        return None

    async def run(
        self,
        creader: asyncio.StreamReader,
        cwriter: asyncio.StreamWriter,
        ureader: asyncio.StreamReader,
        uwriter: asyncio.StreamWriter,
    ) -> None:
        while True:
            try:
                head = await asyncio.wait_for(read_head(creader), self.idle_timeout_s)
            except TimeoutError:
                return  # an idle keep-alive connection, as a tunnel's idle limit
            if head is None:
                return
            ex = Exchange()
            parts = head.first.split(" ")
            ex.method = parts[0] if parts else ""
            target = parts[1] if len(parts) > 1 else ""
            ex.path = target.split("?", 1)[0]
            try:
                keep = await self._one(head, ex, creader, cwriter, ureader, uwriter)
            except OutOfScope as refused:
                ex.refused = f"fusion-oci egress: {refused}"
                text = f"fusion-oci egress: request to {self.host} denied: {refused}"
                self.report(ex)
                with contextlib.suppress(ConnectionError, RuntimeError):
                    cwriter.write(http_text(403, text))
                    await cwriter.drain()
                return
            except Leak as leak:
                ex.leak = str(leak)
                text = (
                    f"fusion-oci egress: request to {self.host} denied: {leak}; a "
                    "credential's sentinel is swapped only in the Authorization header "
                    "of requests to its hosts"
                )
                self.report(ex)
                with contextlib.suppress(ConnectionError, RuntimeError):
                    cwriter.write(http_text(403, text))
                    await cwriter.drain()
                return
            except Echo as echo:
                ex.refused = f"fusion-oci egress: {echo}; the response was cut"
                self.report(ex)
                return
            self.report(ex)
            if not keep:
                return

    async def _one(
        self,
        head: Head,
        ex: Exchange,
        creader: asyncio.StreamReader,
        cwriter: asyncio.StreamWriter,
        ureader: asyncio.StreamReader,
        uwriter: asyncio.StreamWriter,
    ) -> bool:
        leak = self._leak_in_head(head)
        if leak:
            raise Leak(leak)
        auth = head.get("authorization")
        if auth is not None and swap_authorization(auth, self.cred) is not None:
            self._check_swap(head, ex)
        client_close = "close" in head.tokens("connection")
        chunked = "chunked" in head.tokens("transfer-encoding")
        if "100-continue" in head.tokens("expect"):
            # Answered here: the proxy reads the body (to scan it) before the real host's
            # answer could arrive, so waiting for the host's 100 would stall the client.
            cwriter.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await cwriter.drain()
        out_headers = []
        for name, value in head.headers:
            low = name.lower()
            if low in _HOP or low == "expect" or (chunked and low == "content-length"):
                continue  # (a length beside chunked framing: never both to the host)
            if low == "accept-encoding":
                continue  # identity, below
            if low == "authorization":
                swapped = swap_authorization(value, self.cred)
                if swapped is not None:
                    value, ex.swapped = swapped, True
                    self.broker.echo_forms.add(swapped.partition(" ")[2].strip().encode())
            out_headers.append((name, value))
        # A body the host does not encode is one the response scan reads as sent.
        out_headers.append(("Accept-Encoding", "identity"))
        out = Head(head.first, out_headers)
        body = body_chunks(creader, head, response=False)
        if ex.method == "POST" and ex.path.endswith("/git-receive-pack"):
            answer, body = await self._check_push(head, ex, body)
            if answer is not None:
                async for _ in body:
                    pass  # the rest of the pack: read and dropped, then git reads the report
                cwriter.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-git-receive-"
                    b"pack-result\r\nCache-Control: no-cache\r\nContent-Length: "
                    + str(len(answer)).encode()
                    + b"\r\nConnection: close\r\n\r\n"
                    + answer
                )
                await cwriter.drain()
                ex.status = 200
                return False
        uwriter.write(out.encode())
        scanner = Scanner([n for n, _ in self.broker.sentinel_bytes()])
        async for data in body:
            safe, found = scanner.feed(data)
            if found is not None:
                uwriter.close()  # the request never completes upstream
                owner = self.broker.find_sentinel(found)
                raise Leak(
                    f"the sentinel of {owner.spec.name if owner else '?'} in the request body"
                )
            self._send(uwriter, safe, chunked)
        self._send(uwriter, scanner.flush(), chunked)
        if chunked:
            uwriter.write(b"0\r\n\r\n")
        await uwriter.drain()
        return await self._response(ex, client_close, cwriter, ureader)

    def _check_swap(self, head: Head, ex: Exchange) -> None:
        """The request would get the value: it must be for the CONNECTed origin (else a leak
        attempt) and within the credential's scope (else refused)."""
        parts = head.first.split(" ")
        target = parts[1] if len(parts) > 1 else ""
        hosts = [v for k, v in head.headers if k.lower() == "host"]
        path, why = request_origin(target, hosts, self.host, self.port)
        spec = self.cred.spec
        if why is not None:
            raise Leak(
                f"the sentinel of {spec.name} in a request for another origin than "
                f"{self.host}:{self.port} ({why})"
            )
        ex.path = path.split("?", 1)[0]
        if not in_scope(spec, ex.method, path):
            shown = ", ".join(spec.scope) or "none"
            raise OutOfScope(
                f"{ex.method} {ex.path[:200]} is outside the scope of {spec.name} "
                f"(scope: {shown}; allowedRequests: {len(spec.allowed_requests)}), so its "
                "sentinel is not swapped for the value there; if the request is one the "
                f"credential is for, add '{ex.method} <path glob>' to sandbox.credentials "
                f"{spec.name} allowedRequests, or set its scope"
            )

    def _send(self, writer: asyncio.StreamWriter, data: bytes, chunked: bool) -> None:
        if not data:
            return
        self.bytes_up += len(data)
        writer.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)

    async def _check_push(
        self, head: Head, ex: Exchange, body: AsyncIterator[bytes]
    ) -> tuple[bytes | None, AsyncIterator[bytes]]:
        """Read the push's ref updates (the first pkt-lines) and decide: (git's refusal or
        None, the whole body again)."""
        gzip = "gzip" in head.tokens("content-encoding")
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzip else None
        raw = bytearray()
        plain = bytearray()
        pos = 0  # the end of the complete pkt-lines in ``plain``: each byte is framed once
        complete = False
        size = 4
        # Bounded work on the loop every task shares: at most PUSH_COMMANDS_MAX bytes are
        # inflated (max_length; a 16 KB gzip body inflates to 16 MB otherwise) and framed
        # once each, a slice of 64 KiB per loop step (other tasks' steps run between), and
        # the commands are parsed once, at the end.
        done = False
        async for data in body:
            raw += data
            pending = data
            while not done:
                if inflate is None:
                    piece, pending = pending[:_PUSH_STEP], pending[_PUSH_STEP:]
                else:
                    # Input beyond the slice stays in unconsumed_tail, not inflated yet.
                    room = min(_PUSH_STEP, PUSH_COMMANDS_MAX + 1 - len(plain))
                    piece, pending = inflate.decompress(pending, room), inflate.unconsumed_tail
                plain += piece
                while pos + 4 <= len(plain):
                    size = int(plain[pos : pos + 4], 16)
                    if size == 0:
                        complete = True
                        break
                    if size < 4 or pos + size > len(plain):
                        break
                    pos += size
                done = complete or size < 4 or len(plain) > PUSH_COMMANDS_MAX
                if not pending:
                    break
                await asyncio.sleep(0)
            if done:
                break
        refs, caps, complete = parse_commands(bytes(plain[: pos + 4 if complete else pos]))
        if not complete:
            # Refs past the cap would go unchecked: the whole push is refused instead.
            ex.refs = refs
            reason = (
                f"fusion-oci: the push's ref updates did not end within "
                f"{PUSH_COMMANDS_MAX // 1024} KiB (inflated); push fewer refs at once"
            )
            ex.refused = reason
            return push_refusal(refs, list(refs), caps, reason), _prepend(bytes(raw), body)
        ex.refs = refs
        spec = self.cred.spec
        rest = _prepend(bytes(raw), body)
        repo = push_repo(ex.path)
        if not repo_allowed(repo, spec.allowed_repos):
            bad = list(refs)
            shown = ", ".join(spec.allowed_repos or []) or "none"
            reason = (
                f"fusion-oci: {self.host}/{repo} is outside allowedRepos of {spec.name} "
                f"({shown}); push to a repository it allows, or add it to "
                "sandbox.credentials allowedRepos"
            )
        else:
            bad = [r for r in refs if not ref_allowed(r, spec.allowed_refs)]
            if not bad:
                return None, rest
            shown = ", ".join(spec.allowed_refs or []) or "none (this credential may not push)"
            reason = (
                f"fusion-oci: {bad[0]} is outside allowedRefs of {spec.name} "
                f"({shown}); push to a ref it allows, or add the ref to "
                "sandbox.credentials allowedRefs"
            )
        ex.refused = reason
        return push_refusal(refs, bad, caps, reason), rest

    async def _response(
        self,
        ex: Exchange,
        client_close: bool,
        cwriter: asyncio.StreamWriter,
        ureader: asyncio.StreamReader,
    ) -> bool:
        while True:
            head = await read_head(ureader)
            if head is None:
                raise ConnectionError(f"{self.host} closed the connection")
            status = int(head.first.split(" ")[1])
            ex.status = status
            if 100 <= status < 200:  # answered already (Expect) or informational: dropped
                continue
            break
        needles = [*self.broker.echo_needles(), *self.broker.echo_forms]
        if any(n in head.encode() for n in needles):
            raise Echo(f"{self.host} echoed the credential in a response header")
        has_body = not (ex.method == "HEAD" or status in NO_BODY_STATUS or 100 <= status < 200)
        encoding = ",".join(sorted(head.tokens("content-encoding") - {"identity", ""}))
        if encoding and has_body and encoding not in _DECODED:
            # Asked for identity; what came is a format the scan cannot read.
            ex.refused = (
                f"fusion-oci egress: {self.host} answered in Content-Encoding {encoding}, "
                "which the response scan cannot read (it reads gzip and deflate); the "
                "response was not forwarded"
            )
            cwriter.write(http_text(502, ex.refused, "Bad Gateway"))
            await cwriter.drain()
            return False
        decode = bool(encoding) and has_body
        framed = (
            head.get("content-length") is not None
            or "chunked" in head.tokens("transfer-encoding")
            or ex.method == "HEAD"
            or status in NO_BODY_STATUS
        )
        keep = framed and not client_close and "close" not in head.tokens("connection")
        chunked = "chunked" in head.tokens("transfer-encoding") or decode
        dropped = _HOP | (_ENCODED if decode else frozenset())
        headers = [(k, v) for k, v in head.headers if k.lower() not in dropped]
        if decode:
            # Sent on decoded (what was scanned is what the client gets), framed anew.
            headers.append(("Transfer-Encoding", "chunked"))
        headers.append(("Connection", "keep-alive" if keep else "close"))
        cwriter.write(Head(head.first, headers).encode())
        scanner = Scanner(needles)
        body = body_chunks(ureader, head, response=True, status=status, method=ex.method)
        if decode:
            body = decoded(body)
        async for data in body:
            safe, found = scanner.feed(data)
            if found is not None:
                # Never forward the value: cut the connection mid-body.
                raise Echo(f"{self.host} echoed the credential in a response")
            self._recv(cwriter, safe, chunked)
            await cwriter.drain()
        self._recv(cwriter, scanner.flush(), chunked)
        if chunked:
            cwriter.write(b"0\r\n\r\n")
        await cwriter.drain()
        return keep

    def _recv(self, writer: asyncio.StreamWriter, data: bytes, chunked: bool) -> None:
        if not data:
            return
        self.bytes_down += len(data)
        writer.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)


_DECODED = frozenset({"gzip", "x-gzip", "deflate"})
"""Content-Encodings the response scan reads (decoded, then sent on decoded)."""
_ENCODED = frozenset({"content-encoding", "content-length", "transfer-encoding"})


async def decoded(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A gzip or deflate body decoded, in pieces of at most CHUNK (a small body that inflates
    to much is never held whole); gzip members one after another, zlib or raw deflate."""
    inflate: zlib._Decompress | None = None
    data = b""
    async for more in body:
        data += more
        while data:
            if inflate is None:
                if len(data) < 2:
                    break  # the format is told by two bytes
                # gzip or zlib by their header; a raw deflate stream (what some servers send
                # as "deflate") has neither.
                zlib_head = (data[0] & 0x0F) == 8 and int.from_bytes(data[:2], "big") % 31 == 0
                raw = data[:2] != b"\x1f\x8b" and not zlib_head
                inflate = zlib.decompressobj(-zlib.MAX_WBITS if raw else 32 + zlib.MAX_WBITS)
            try:
                out = inflate.decompress(data, CHUNK)
            except zlib.error as exc:
                raise ConnectionError(f"a response body that does not decode ({exc})") from None
            if out:
                yield out
            if inflate.eof:
                data, inflate = inflate.unused_data, None
            else:
                data = inflate.unconsumed_tail
    if inflate is not None:
        while True:
            out = inflate.decompress(inflate.unconsumed_tail, CHUNK)
            if not out:
                break
            yield out
    elif data:
        raise ConnectionError("a response body that does not decode (truncated)")


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for data in rest:
        yield data
