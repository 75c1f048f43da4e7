"""The dashboard's ASGI app: the page, the task view, the JSON API and the event stream.

Everything the browser shows is computed here (summaries, percentiles, buckets); the page gets
a few kilobytes of JSON however long the log is. One :class:`DashboardState` owns the tail of
the log; requests and streams share it, and the blocking parts (reading the file, building the
summary, verifying the chain) run in worker threads so the event loop keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from datetime import datetime
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from fusion_oci.dashboard.chain import chain_status
from fusion_oci.dashboard.tail import LogTail

HERE = Path(__file__).parent
TOKEN_COOKIE = "fusion_oci_dashboard"  # noqa: S105 (the cookie's name, not a secret)
SECURITY_HEADERS = {
    # Scripts only from this server (no inline script), so text from the log cannot run.
    "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    # The token may be in the page's URL: never send it on as a referrer.
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
CHAIN_INTERVAL_S = 2.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class DashboardState:
    """The tail of one audit log, its cached summary and its last chain verification."""

    def __init__(
        self, path: Path, *, poll_interval: float = 0.5, chain_key: bytes | None = None
    ) -> None:
        self.path = path
        self.chain_key = chain_key
        self.tail = LogTail(path)
        self.poll_interval = poll_interval
        self._lock = asyncio.Lock()
        self._summary_key: tuple[int, int] | None = None
        self._summary: dict[str, Any] = {}
        self.chain: dict[str, Any] = {
            "status": "pending",
            "lines": None,
            "firstBadLine": None,
            "reason": "not checked yet",
            "keyed": bool(chain_key),
        }
        self.chain_version = 0
        self._chain_key: tuple[Any, ...] | None = None
        self._chain_task: asyncio.Task[None] | None = None
        self._chain_at = 0.0
        self._chain_cost = 0.0

    def key(self) -> tuple[int, int, int, str | None]:
        return self.tail.generation, self.tail.version, self.chain_version, self.tail.error

    async def refresh(self) -> None:
        async with self._lock:
            await anyio.to_thread.run_sync(self.tail.poll)
            self._maybe_verify_chain()

    def _maybe_verify_chain(self) -> None:
        key = (self.tail.identity, self.tail.offset)
        if key == self._chain_key or (self._chain_task and not self._chain_task.done()):
            return
        # A full verification reads the whole file: while lines keep coming, run it at most
        # every CHAIN_INTERVAL_S and never more than ~10% of the time.
        if self._chain_key is not None and time.monotonic() - self._chain_at < max(
            CHAIN_INTERVAL_S, 10 * self._chain_cost
        ):
            return
        self._chain_key, self._chain_at = key, time.monotonic()

        async def check() -> None:
            started = time.monotonic()
            status = await anyio.to_thread.run_sync(chain_status, self.path, self.chain_key)
            self._chain_cost = time.monotonic() - started
            if status != self.chain:
                self.chain, self.chain_version = status, self.chain_version + 1

        self._chain_task = asyncio.get_running_loop().create_task(check())

    async def summary(self) -> dict[str, Any]:
        await self.refresh()
        async with self._lock:
            key = (self.tail.generation, self.tail.version)
            if key != self._summary_key or not self._summary:
                self._summary = await anyio.to_thread.run_sync(self.tail.summary.result)
                self._summary_key = key
            tail = self.tail
            return {
                **self._summary,
                "chain": self.chain,
                "source": {
                    "path": str(self.path),
                    "bytes": tail.offset,
                    "cursor": tail.cursor,
                    "generation": tail.generation,
                    "error": tail.error,
                },
            }

    async def events(self, **kwargs: Any) -> tuple[list[dict[str, Any]], int]:
        await self.refresh()
        async with self._lock:
            return await anyio.to_thread.run_sync(lambda: self.tail.events(**kwargs))

    async def close(self) -> None:
        if self._chain_task is not None:
            self._chain_task.cancel()


# --- access control ---------------------------------------------------------------------------


def token_guard(app: ASGIApp, token: str) -> ASGIApp:
    """Every request carries the token: ``Authorization: Bearer``, ``?token=`` (then a cookie
    is set so the page's own requests carry it), or that cookie."""
    expected = token.encode()

    def given(scope: Scope) -> tuple[bytes | None, bool]:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        if auth.lower().startswith(b"bearer "):
            return auth[7:].strip(), False
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if "token" in query:
            return query["token"][0].encode(), True
        cookie: SimpleCookie = SimpleCookie()
        try:
            cookie.load(headers.get(b"cookie", b"").decode("latin-1"))
        except Exception:
            return None, False
        morsel = cookie.get(TOKEN_COOKIE)
        return (morsel.value.encode() if morsel else None), False

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        value, from_query = given(scope)
        if value is None or not hmac.compare_digest(value, expected):
            response = PlainTextResponse(
                "fusion-oci dashboard: a valid token is required (the one `fusion-oci "
                "dashboard` printed): Authorization: Bearer TOKEN, or ?token=TOKEN\n",
                status_code=401,
                headers={"www-authenticate": "Bearer", **SECURITY_HEADERS},
            )
            await response(scope, receive, send)
            return
        if not from_query:
            await app(scope, receive, send)
            return

        async def send_with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                cookie = f"{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
                message["headers"] = [*message.get("headers", []), (b"set-cookie", cookie.encode())]
            await send(message)

        await app(scope, receive, send_with_cookie)

    return guarded


def host_name(header: bytes) -> str:
    """The host of a ``Host`` header, without its port (``[::1]:80`` -> ``::1``)."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def host_guard(app: ASGIApp, allowed: frozenset[str]) -> ASGIApp:
    """Answer only requests whose ``Host`` is one of ``allowed``: a page elsewhere whose name
    resolves to 127.0.0.1 (DNS rebinding) reaches the socket but not the data."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = host_name(dict(scope.get("headers") or []).get(b"host", b""))
            if host not in allowed:
                response = PlainTextResponse(
                    "fusion-oci dashboard: unexpected Host header\n",
                    status_code=400,
                    headers=SECURITY_HEADERS,
                )
                await response(scope, receive, send)
                return
        await app(scope, receive, send)

    return guarded


def security_headers(app: ASGIApp) -> ASGIApp:
    extra = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await app(scope, receive, send_headers if scope["type"] == "http" else send)

    return wrapped


# --- routes -----------------------------------------------------------------------------------


def _since(value: str | None) -> int | float | None:
    """An integer is a line cursor; anything else an ISO-8601 time."""
    if value in (None, ""):
        return None
    assert value is not None
    if value.lstrip("-").isdigit():
        return int(value)
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError as exc:
        raise ValueError(
            f"since={value!r} is neither a line cursor (an integer) nor an "
            "ISO-8601 time such as 2026-12-01T09:00:00+00:00"
        ) from exc


def _sse(event: str, data: Any, event_id: int | None = None) -> bytes:
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return (head + "data: " + json.dumps(data, separators=(",", ":")) + "\n\n").encode()


def create_app(
    audit_path: Path,
    *,
    token: str | None = None,
    allowed_hosts: list[str] | None = None,
    poll_interval: float = 0.5,
    chain_key: bytes | None = None,
) -> ASGIApp:
    """The dashboard for ``audit_path``. ``token``: required on every request when set.
    ``allowed_hosts``: the Host headers accepted (None: any), which stops DNS rebinding.
    ``chain_key``: the audit key, so the chain check covers MACs (None: hashes only)."""
    state = DashboardState(audit_path, poll_interval=poll_interval, chain_key=chain_key)
    templates = Jinja2Templates(directory=str(HERE / "templates"))

    async def index(request: Request) -> Response:
        return templates.TemplateResponse(request, "index.html", {"path": str(audit_path)})

    async def task_page(request: Request) -> Response:
        task_id = request.path_params["task_id"]
        events, cursor = await state.events(task=task_id, limit=10_000)
        policy = next(
            (
                (e.get("policyHash"), e.get("policySummary"))
                for e in reversed(events)
                if e.get("policyHash")
            ),
            (None, None),
        )
        return templates.TemplateResponse(
            request,
            "task.html",
            {
                "task_id": task_id,
                "events": events,
                "cursor": cursor,
                "policy_hash": policy[0],
                "policy_summary": policy[1],
                "path": str(audit_path),
            },
            status_code=200 if events else 404,
        )

    async def api_summary(request: Request) -> Response:
        return JSONResponse(await state.summary())

    async def api_events(request: Request) -> Response:
        q = request.query_params
        try:
            since = _since(q.get("since"))
            limit = int(q.get("limit", "1000"))
            if not 1 <= limit <= 10_000:
                raise ValueError("limit must be between 1 and 10000")
        except ValueError as exc:
            return JSONResponse({"error": {"kind": "bad-flags", "what": str(exc)}}, status_code=400)
        events, cursor = await state.events(task=q.get("task") or None, since=since, limit=limit)
        return JSONResponse({"events": events, "next": cursor})

    async def api_stream(request: Request) -> Response:
        task = request.query_params.get("task") or None
        want_summary = request.query_params.get("summary", "1") != "0"
        want_events = request.query_params.get("events", "1") != "0"
        # Resume after a line: ?since=N, or the id of the last event a reconnecting
        # EventSource saw; else only events appended from now on.
        start = request.headers.get("last-event-id") or request.query_params.get("since")
        if start is not None and not start.isdigit():
            return JSONResponse(
                {"error": {"kind": "bad-flags", "what": f"since={start!r} is not a line cursor"}},
                status_code=400,
            )

        async def stream() -> AsyncIterator[bytes]:
            # The starting point is fixed before the first byte (and so the response
            # headers) goes out: whatever is appended after a client sees the headers is
            # delivered to it. The `ready` event tells it where the stream starts.
            await state.refresh()
            cursor = int(start) if start is not None else state.tail.cursor
            yield b"retry: 2000\n\n" + _sse("ready", {"cursor": cursor})
            generation = state.tail.generation
            last: tuple[int, int, int, str | None] | None = None
            idle = 0.0
            while True:
                await state.refresh()
                if state.tail.generation != generation:  # the log was replaced
                    generation, cursor = state.tail.generation, 0
                    yield _sse("reset", {"generation": generation})
                if state.key() != last:
                    while want_events:
                        events, nxt = await state.events(task=task, since=cursor, limit=500)
                        for event in events:
                            yield _sse("audit", event, event["line"])
                        cursor = nxt
                        if len(events) < 500:
                            break
                    if not want_events:
                        cursor = state.tail.cursor
                    if want_summary:
                        yield _sse("summary", await state.summary(), cursor)
                    last = state.key()
                    idle = 0.0
                elif idle >= 15:
                    yield b": keep-alive\n\n"  # proxies close silent connections
                    idle = 0.0
                await asyncio.sleep(state.poll_interval)
                idle += state.poll_interval

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"x-accel-buffering": "no"}
        )

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        # Start reading the log now, not on the first request: a large log is then ready
        # (or nearly) when the page first asks.
        warm = asyncio.get_running_loop().create_task(state.refresh())
        yield
        warm.cancel()
        await state.close()

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/task/{task_id:path}", task_page),
            Route("/api/summary", api_summary),
            Route("/api/events", api_events),
            Route("/api/stream", api_stream),
            Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
        ],
        lifespan=lifespan,
    )
    app.state.dashboard = state
    wrapped: ASGIApp = security_headers(app)
    if allowed_hosts is not None:
        wrapped = host_guard(wrapped, frozenset(h.lower() for h in allowed_hosts))
    if token is not None:
        wrapped = token_guard(wrapped, token)
    return wrapped
