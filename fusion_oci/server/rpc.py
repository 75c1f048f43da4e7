"""JSON-RPC 2.0 over one framed byte stream, both ways: the client's requests are dispatched
concurrently (a long ``run`` does not hold up a ``cancel``), and the server sends its own
requests (an ``ask`` gate) and notifications (``output``).

Every bad message gets a JSON-RPC error and the connection keeps serving, except a stream that
is not framed at all (see :class:`~fusion_oci.server.framing.FrameError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeGuard

from fusion_oci.errors import error_body
from fusion_oci.server.framing import FrameError, Oversized, frame, read_frame

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
SANDBOX_ERROR = -32000
"""A FusionOCIError: ``data`` is its ``to_json()["error"]`` (kind, what, why, hint)."""
REQUEST_CANCELLED = -32800

OUTPUT_HIGH_WATER = 1 << 20
"""Bytes queued for a client past which a run's output is no longer read (see Writer.behind)."""

RequestId = int | str
Params = dict[str, Any]
Handler = Callable[[Params, RequestId | None], Awaitable[Any]]


class RpcError(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            body["data"] = self.data
        return body


def bad_request(kind: str, what: str, code: int = INVALID_REQUEST, hint: str = "") -> RpcError:
    """An error with the same ``data`` shape as a FusionOCIError's."""
    return RpcError(code, what, error_body(kind, what, hint=hint))


class Writer:
    """Where framed messages go; the transports wrap a StreamWriter or a pipe in this."""

    def __init__(self, stream: asyncio.StreamWriter) -> None:
        self.stream = stream

    def write(self, data: bytes) -> None:
        if not self.stream.is_closing():
            self.stream.write(data)

    def behind(self, limit: int = OUTPUT_HIGH_WATER) -> asyncio.Future[None] | None:
        """Backpressure for a slow client: past ``limit`` bytes not yet sent, a future done
        when the client has taken most of them (None: not behind). A run's output callback
        returns it, and the command's pipes are not read until it is done, so the server
        never buffers more than about ``limit`` per connection."""
        if self.stream.is_closing() or self.stream.transport.get_write_buffer_size() <= limit:
            return None

        async def drained() -> None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.stream.drain()

        return asyncio.ensure_future(drained())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.close()


class Connection:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: Writer,
        handlers: Mapping[str, Handler],
        *,
        max_bytes: int,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.handlers = handlers
        self.max_bytes = max_bytes
        self._tasks: dict[asyncio.Task[None], RequestId | None] = {}
        self._by_id: dict[RequestId, asyncio.Task[None]] = {}
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self.closed = asyncio.Event()

    # --- sending ------------------------------------------------------------------------

    def _send(self, message: Mapping[str, Any]) -> None:
        body = json.dumps(
            {"jsonrpc": "2.0", **message}, separators=(",", ":"), ensure_ascii=False
        ).encode()
        self.writer.write(frame(body))

    def notify(self, method: str, params: Params) -> None:
        if not self.closed.is_set():
            self._send({"method": method, "params": params})

    async def request(self, method: str, params: Params) -> Any:
        """Ask the client; raises RpcError with its error, ConnectionError when it is gone."""
        if self.closed.is_set():
            raise ConnectionError("the client has gone")
        rid = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            self._send({"id": rid, "method": method, "params": params})
            return await future
        finally:
            self._pending.pop(rid, None)

    # --- receiving ----------------------------------------------------------------------

    async def serve(self) -> None:
        """Read and dispatch until the client closes the stream (or breaks the framing)."""
        try:
            while True:
                try:
                    body = await read_frame(self.reader, self.max_bytes)
                except FrameError as exc:
                    self._send(
                        {
                            "id": None,
                            "error": bad_request(
                                "bad-request", f"unreadable message: {exc}", PARSE_ERROR
                            ).to_json(),
                        }
                    )
                    return
                except (ConnectionError, OSError):
                    return
                if body is None:
                    return
                if isinstance(body, Oversized):
                    self._send(
                        {
                            "id": None,
                            "error": bad_request(
                                "bad-request",
                                f"message of {body.size} bytes is over the limit of "
                                f"{self.max_bytes}",
                                hint="send less at once (stdin, settings), or start the server "
                                "with a larger --max-message-bytes",
                            ).to_json(),
                        }
                    )
                    continue
                self._receive(body)
        finally:
            await self.close()

    def _receive(self, body: bytes) -> None:
        try:
            message = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            self._send(
                {
                    "id": None,
                    "error": bad_request("bad-request", f"not JSON: {exc}", PARSE_ERROR).to_json(),
                }
            )
            return
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            what = (
                "batches are not supported"
                if isinstance(message, list)
                else "not a JSON-RPC 2.0 message"
            )
            rid = message.get("id") if isinstance(message, dict) else None
            self._send(
                {
                    "id": rid if _valid_id(rid) else None,
                    "error": bad_request("bad-request", what).to_json(),
                }
            )
            return
        if "method" not in message:
            self._response(message)
            return
        method, rid, params = message["method"], message.get("id"), message.get("params", {})
        is_request = "id" in message
        if not isinstance(method, str) or (is_request and not _valid_id(rid)):
            self._send(
                {
                    "id": rid if _valid_id(rid) else None,
                    "error": bad_request("bad-request", "bad method or id").to_json(),
                }
            )
            return
        if not isinstance(params, dict):
            if is_request:
                self._send(
                    {
                        "id": rid,
                        "error": bad_request(
                            "bad-flags", "params must be an object (by name)", INVALID_PARAMS
                        ).to_json(),
                    }
                )
            return
        task = asyncio.ensure_future(
            self._dispatch(method, params, rid if is_request else None, is_request)
        )
        self._tasks[task] = rid if is_request else None
        if is_request and _valid_id(rid):
            self._by_id[rid] = task
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        rid = self._tasks.pop(task, None)
        if rid is not None and self._by_id.get(rid) is task:
            del self._by_id[rid]

    def _response(self, message: dict[str, Any]) -> None:
        future = self._pending.get(message.get("id"))  # type: ignore[arg-type]
        if future is None or future.done():
            return
        if "error" in message:
            err = message["error"] if isinstance(message["error"], dict) else {}
            future.set_exception(
                RpcError(
                    int(err.get("code", INTERNAL_ERROR)),
                    str(err.get("message", "")),
                    err.get("data"),
                )
            )
        else:
            future.set_result(message.get("result"))

    async def _dispatch(
        self, method: str, params: Params, rid: RequestId | None, is_request: bool
    ) -> None:
        handler = self.handlers.get(method)
        if handler is None:
            if is_request:  # unknown notifications are ignored, as JSON-RPC says
                self._send(
                    {
                        "id": rid,
                        "error": bad_request(
                            "bad-request",
                            f"unknown method '{method}'",
                            METHOD_NOT_FOUND,
                            hint="methods: "
                            + ", ".join(sorted(m for m in self.handlers if not m.startswith("$/"))),
                        ).to_json(),
                    }
                )
            return
        try:
            result = await handler(params, rid)
        except asyncio.CancelledError:
            if is_request and not self.closed.is_set():
                self._send(
                    {
                        "id": rid,
                        "error": {"code": REQUEST_CANCELLED, "message": "request cancelled"},
                    }
                )
            raise
        except Exception as exc:
            if is_request:
                self._send({"id": rid, "error": error_json(exc)})
            return
        if is_request:
            self._send({"id": rid, "result": result})

    def cancel_request(self, rid: RequestId) -> bool:
        task = self._by_id.get(rid)
        if task is None:
            return False
        task.cancel()
        return True

    async def close(self) -> None:
        """Cancel what is still running (each handler cleans up), fail our pending requests."""
        if self.closed.is_set():
            return
        self.closed.set()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the client has gone"))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.writer.close()


def _valid_id(rid: object) -> TypeGuard[RequestId]:
    return isinstance(rid, (int, str)) and not isinstance(rid, bool)


def error_json(exc: BaseException) -> dict[str, Any]:
    """A handler's exception as a JSON-RPC error object."""
    from pydantic import ValidationError

    from fusion_oci.errors import FusionOCIError

    if isinstance(exc, RpcError):
        return exc.to_json()
    if isinstance(exc, FusionOCIError):
        return {"code": SANDBOX_ERROR, "message": exc.render(), "data": exc.to_json()["error"]}
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "params"
        return bad_request(
            "bad-flags",
            f"{where}: {first['msg']}",
            INVALID_PARAMS,
            hint="see docs/protocol.md for the method's params",
        ).to_json()
    print(f"fusion-oci serve: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
    return {
        "code": INTERNAL_ERROR,
        "message": f"internal error: {type(exc).__name__}: {exc}",
        "data": error_body("internal", str(exc), type(exc).__name__),
    }
