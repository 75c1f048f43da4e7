"""A small typed client of the Kubernetes API: JSON over HTTPS with the kubeconfig's
credentials, every call bounded by a timeout.

Why not the official ``kubernetes`` package: what the runtime asks of the API server is a
handful of REST calls (discovery, access reviews, create/get/delete of a few kinds, a dry
run), which ``http.client`` and ``ssl`` do in ~150 lines we can read; the official client
would add ~40 MB of generated models, a slow import on every ``doctor``, its own kubeconfig
loader (which runs ``exec`` credential plugins: we refuse those, :mod:`.kubeconfig`) and its
own exception tree to translate. ``pods/exec`` is a WebSocket upgrade with the same
credentials and TLS (:mod:`.execstream`, :mod:`.websocket`). Output of ``kubectl`` is never
read.

Errors leave this module as :class:`ApiError` (an :class:`~fusion_oci.errors.EngineError`,
kind ``engine-error``) with the call, the HTTP status, the API server's own message and a
hint; ``transient`` marks the ones worth another try (no answer, 429, 5xx), which
:func:`retrying` retries with tenacity (provisioning only; tests pass a zero wait).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import ssl
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

from fusion_oci.errors import EngineError
from fusion_oci.runtimes.kubernetes.kubeconfig import ClusterAccess

T = TypeVar("T")
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})


class ApiError(EngineError):
    """A call to the API server failed (``status`` 0: no HTTP answer at all)."""

    def __init__(self, call: str, status: int, why: str, hint: str, *, reason: str = "") -> None:
        self.call = call
        self.status = status
        self.reason = reason
        """The API's machine reason (``Forbidden``, ``NotFound``, ``AlreadyExists``...)."""
        self.transient = status == 0 or status in TRANSIENT_STATUS
        super().__init__(f"Kubernetes API call {call} failed", why, hint)


def status_hint(status: int) -> str:
    """The fix for an API server's answer ``status`` (0: no answer)."""
    if status == 0:
        return (
            "check that the API server in the kubeconfig answers (`kubectl cluster-info`) and "
            "that this host can reach it"
        )
    if status == 401:
        return "the kubeconfig's credentials are not accepted: renew the certificate or token"
    if status == 403:
        return (
            "the executor's identity lacks a permission: bind it to the Role in "
            "docs/kubernetes.md (`fusion-oci doctor` lists what is missing)"
        )
    if status == 404:
        return "the object or the API is not there (doctor says which APIs the cluster serves)"
    return "see the API server's message; retry if the cluster was busy"


class KubeClient:
    """JSON calls to one API server over kept-alive connections (a TLS handshake costs more
    than most calls here); safe to share between threads: each call takes its own
    connection from the idle ones or opens one."""

    MAX_IDLE = 4

    def __init__(self, access: ClusterAccess, timeout_s: float = 10.0) -> None:
        self.access = access
        self.timeout_s = timeout_s
        split = urlsplit(access.server)
        self._host = split.hostname or ""
        self._port = split.port or 443
        self._prefix = split.path.rstrip("/")
        self._ssl = ssl_context(access)
        self._idle: list[http.client.HTTPSConnection] = []
        self._lock = threading.Lock()

    def _headers(self, body: bool) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "fusion-oci"}
        if body:
            headers["Content-Type"] = "application/json"
        if self.access.token:
            headers["Authorization"] = f"Bearer {self.access.token}"
        return headers

    def _connect(self, timeout_s: float) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(
            self._host, self._port, context=self._ssl, timeout=timeout_s
        )

    def _take(self, timeout_s: float) -> tuple[http.client.HTTPSConnection, bool]:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            return self._connect(timeout_s), False
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        conn.timeout = timeout_s
        return conn, True

    def _give_back(self, conn: http.client.HTTPSConnection) -> None:
        with self._lock:
            if len(self._idle) < self.MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections (a call after this opens a new one)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __del__(self) -> None:
        # a client nobody closed still closes its kept-alive sockets, not the garbage collector
        # one by one (each a ResourceWarning)
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        query: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """``method path`` with a JSON body; the JSON answer. Raises :class:`ApiError`."""
        url = self._prefix + path + (f"?{urlencode(query)}" if query else "")
        call = f"{method} {path}"
        data = json.dumps(body).encode() if body is not None else None
        headers = self._headers(body is not None)
        timeout = timeout_s or self.timeout_s
        while True:
            conn, reused = self._take(timeout)
            try:
                conn.request(method, url, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read(64 << 20)
            except (OSError, http.client.HTTPException) as exc:  # TimeoutError is an OSError
                conn.close()
                if reused and isinstance(exc, _CLOSED_IDLE):
                    # the server closed the idle connection before it read this request
                    continue
                raise ApiError(
                    call, 0, f"no answer from {self.access.server}: {exc}", status_hint(0)
                ) from exc
            break
        if resp.will_close:
            conn.close()
        else:
            self._give_back(conn)
        try:
            doc = json.loads(raw) if raw else {}
        except ValueError:
            doc = {"message": raw[:500].decode(errors="replace")}
        if resp.status >= 400:
            raise _api_error(call, resp.status, resp.reason, doc)
        return doc if isinstance(doc, dict) else {"items": doc}

    def watch(
        self,
        collection: str,
        name: str,
        resource_version: str,
        until: Callable[[dict[str, Any]], T | None],
        timeout_s: float,
    ) -> T | None:
        """Watch the object ``name`` of ``collection`` from ``resource_version`` until
        ``until(object)`` answers; None when the watch ended first (its timeout, the server
        closing it, the object deleted): the caller reads the object again and decides.
        A watch that cannot start (410 Gone: the version is too old) is an :class:`ApiError`."""
        query = {
            "watch": "1",
            "fieldSelector": f"metadata.name={name}",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(max(1, int(timeout_s))),
        }
        call = f"WATCH {collection}/{name}"
        conn = self._connect(timeout_s + 5)
        try:
            conn.request(
                "GET",
                f"{self._prefix}{collection}?{urlencode(query)}",
                headers=self._headers(False),
            )
            resp = conn.getresponse()
            if resp.status >= 400:
                raw = resp.read(1 << 20)
                try:
                    doc = json.loads(raw) if raw else {}
                except ValueError:
                    doc = {"message": raw[:500].decode(errors="replace")}
                raise _api_error(call, resp.status, resp.reason, doc)
            while True:
                line = resp.readline(16 << 20)
                if not line:
                    return None
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise _api_error(call, int(obj.get("code") or 500), "", obj)
                if kind == "DELETED":
                    return None
                if kind in ("ADDED", "MODIFIED"):
                    got = until(obj)
                    if got is not None:
                        return got
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise ApiError(
                call, 0, f"the watch on {self.access.server} broke: {exc}", status_hint(0)
            ) from exc
        finally:
            conn.close()

    def get(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self.request("GET", path, **kwargs)

    def create(
        self, path: str, body: Mapping[str, Any], *, dry_run: bool = False
    ) -> dict[str, Any]:
        """POST ``body`` to the collection ``path``; ``dry_run``: the server admits and
        validates it (unknown fields refused) but stores nothing."""
        query = {"fieldValidation": "Strict"}
        if dry_run:
            query["dryRun"] = "All"
        return self.request("POST", path, body, query=query)

    def delete(self, path: str, *, dry_run: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
        }
        if dry_run:
            body["dryRun"] = ["All"]
        return self.request("DELETE", path, body)


_CLOSED_IDLE = (
    http.client.RemoteDisconnected,
    BrokenPipeError,
    ConnectionResetError,
    http.client.CannotSendRequest,
)
"""What a kept-alive connection the server closed meanwhile raises: the request never
reached it, so it is sent again on a new connection."""


def _api_error(call: str, status: int, reason: str, doc: Any) -> ApiError:
    message = str(doc.get("message") or reason) if isinstance(doc, dict) else ""
    kind = str(doc.get("reason") or "") if isinstance(doc, dict) else ""
    return ApiError(
        call, status, f"HTTP {status}: {message}", status_hint(status), reason=kind
    )  # fmt: skip


def collection(api_version: str, plural: str, namespace: str | None = None) -> str:
    """The REST path of a kind's collection (``v1`` → /api/v1, a group → /apis/...). Pure."""
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"


PLURALS = {
    "Pod": "pods",
    "Secret": "secrets",
    "ConfigMap": "configmaps",
    "NetworkPolicy": "networkpolicies",
    "SandboxTemplate": "sandboxtemplates",
    "SandboxWarmPool": "sandboxwarmpools",
    "SandboxClaim": "sandboxclaims",
}
"""The kinds the mapping makes, by the plural their REST paths use."""


def path_of(obj: Mapping[str, Any], namespace: str) -> str:
    """The collection a manifest is created in. Pure."""
    return collection(str(obj["apiVersion"]), PLURALS[str(obj["kind"])], namespace)


def retrying(
    fn: Callable[[], T],
    *,
    attempts: int = 4,
    wait_s: float = 1.0,
    sleep: Callable[[float], None] | None = None,
) -> T:
    """``fn()``, retried on transient :class:`ApiError` (tenacity, exponential backoff)."""
    import tenacity

    kwargs: dict[str, Any] = {"sleep": sleep} if sleep is not None else {}
    for attempt in tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_exponential(multiplier=wait_s, max=10 * wait_s)
        if wait_s
        else tenacity.wait_none(),
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, ApiError) and e.transient),
        reraise=True,
        **kwargs,
    ):
        with attempt:
            return fn()
    raise AssertionError("unreachable: tenacity re-raises the last error")  # pragma: no cover


def ssl_context(access: ClusterAccess) -> ssl.SSLContext:
    """TLS as the kubeconfig says (CA, client certificate, skip-verify); shared with the
    ``pods/exec`` stream (:mod:`.execstream`)."""
    ctx = ssl.create_default_context()
    if access.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif access.ca_file or access.ca_data:
        ctx.load_verify_locations(
            cafile=access.ca_file,
            cadata=access.ca_data.decode() if access.ca_data else None,
        )
    if access.cert_file or access.cert_data:
        with _key_files(access) as (cert, key):
            ctx.load_cert_chain(cert, key)
    return ctx


@contextmanager
def _key_files(access: ClusterAccess) -> Iterator[tuple[str, str | None]]:
    """The client certificate and key as files (ssl loads a chain only from files): inline
    kubeconfig data goes to a private folder that is removed as soon as ssl has read it."""
    if access.cert_file and (access.key_file or not access.key_data):
        yield access.cert_file, access.key_file
        return
    with tempfile.TemporaryDirectory(prefix="fusion-oci-kube-") as tmp:
        Path(tmp).chmod(0o700)
        cert = access.cert_file or _private(Path(tmp) / "cert.pem", access.cert_data or b"")
        key = access.key_file or _private(Path(tmp) / "key.pem", access.key_data or b"")
        yield cert, key


def _private(path: Path, data: bytes) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return str(path)
