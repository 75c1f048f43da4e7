"""Pull retries against a real registry (Debian's ``docker-registry``) that the test starts on a
loopback port, behind a small TCP proxy the test controls: the registry is "down" (connections
reset, or HTTP 503) for the first attempts and comes back; unknown images and denied logins fail
on the first attempt with the engine's words; mirrors are tried in order."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.engines import EngineAdapter, engine_targets, open_target
from fusion_oci.errors import ProvisionError
from fusion_oci.images.provision import ProvisionOptions, ensure_image
from fusion_oci.images.retry import RetryPolicy
from fusion_oci.policy.settings import GateSettings, SandboxSettings
from tests.backends import require

pytestmark = [pytest.mark.slow]

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"
TINY = "localhost/fusion-oci-test/tiny:1"
# Real backoff, kept short: 0.2 s, 0.4 s, … capped at 1 s, with up to 0.1 s of jitter.
POLICY = RetryPolicy(attempts=5, initial_s=0.2, max_s=1.0, jitter_s=0.1)
ENGINES = [
    pytest.param("podman", marks=pytest.mark.podman),
    pytest.param("docker", marks=pytest.mark.docker),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- registry


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """docker-registry on 127.0.0.1:PORT with filesystem storage, stopped by its pid."""
    require(
        "podman",
        os.path.exists(REGISTRY_BIN),
        f"{REGISTRY_BIN} is missing (apt-get install docker-registry)",
    )
    root = tmp_path_factory.mktemp("registry")
    port = free_port()
    config = root / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    log = (root / "registry.log").open("wb")
    proc = subprocess.Popen(
        [REGISTRY_BIN, "serve", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            try:
                conn.request("GET", "/v2/")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            finally:
                conn.close()
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"registry did not start: {(root / 'registry.log').read_text()}")
            time.sleep(0.1)
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def podman_client() -> EngineAdapter:
    target = engine_targets(os.environ)["podman"]
    client = open_target(target)
    try:
        client.ping()
    except ProvisionError as exc:
        client.close()
        require("podman", False, str(exc))
    return client


@pytest.fixture(scope="module")
def tiny(registry: int, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A one-file image pushed to the registry as 127.0.0.1:PORT/tiny:1; returns its id."""
    root = tmp_path_factory.mktemp("tiny")
    archive = root / "rootfs.tar"
    with tarfile.open(archive, "w") as tar:
        data = b"hello from the test registry\n"
        info = tarfile.TarInfo("hello.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with podman_client() as client:
        client.import_rootfs(archive, TINY, ['CMD ["/hello.txt"]'])
        # v2s2 manifests, which docker 20.10 and podman both pull
        client.client.images.push(
            TINY, destination=f"127.0.0.1:{registry}/tiny:1", tlsVerify=False, format="v2s2"
        )
        info2 = client.image(TINY)
        assert info2 is not None
        return info2.id


# --------------------------------------------------------------------------- fault proxy


class FaultProxy:
    """Loopback TCP proxy in front of the registry: reset, 503, 401, or forward."""

    def __init__(self, upstream: int, mode: str) -> None:
        self.upstream = upstream
        self.mode = mode
        self.connections: dict[str, int] = {}
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        # shutdown() wakes the thread blocked in accept(); close() alone does not
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            mode = self.mode
            self.connections[mode] = self.connections.get(mode, 0) + 1
            threading.Thread(target=self._handle, args=(conn, mode), daemon=True).start()

    def _handle(self, conn: socket.socket, mode: str) -> None:
        with conn:
            try:
                if mode == "reset":
                    # SO_LINGER 0: close() sends RST, a "connection reset by peer"
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif mode in ("503", "401"):
                    self._read_head(conn)
                    conn.sendall(self._answer(mode))
                else:
                    self._forward(conn)
            except OSError:
                pass

    @staticmethod
    def _answer(mode: str) -> bytes:
        if mode == "503":
            head = "HTTP/1.1 503 Service Unavailable\r\n"
            body = b"registry restarting\n"
        else:
            head = (
                "HTTP/1.1 401 Unauthorized\r\n"
                'WWW-Authenticate: Basic realm="fusion-oci-test"\r\n'
                "Docker-Distribution-Api-Version: registry/2.0\r\n"
                "Content-Type: application/json\r\n"
            )
            body = (
                b'{"errors":[{"code":"UNAUTHORIZED",'
                b'"message":"authentication required","detail":null}]}'
            )
        return f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body

    @staticmethod
    def _read_head(conn: socket.socket) -> None:
        conn.settimeout(5)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                return
            data += chunk
            if data[:1] == b"\x16":
                # a TLS ClientHello: engines try https first; a plain-HTTP port says no at once
                raise OSError("TLS on a plain HTTP port")

    def _forward(self, conn: socket.socket) -> None:
        with (
            socket.create_connection(("127.0.0.1", self.upstream)) as up,
            selectors.DefaultSelector() as sel,
        ):
            sel.register(conn, selectors.EVENT_READ, up)
            sel.register(up, selectors.EVENT_READ, conn)
            open_ends = 2
            while open_ends and not self._stop.is_set():
                ready = sel.select(timeout=30)
                if not ready:
                    return
                for key, _ in ready:
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = src.recv(65536)
                    if data:
                        key.data.sendall(data)
                        continue
                    sel.unregister(src)
                    open_ends -= 1
                    with contextlib.suppress(OSError):
                        key.data.shutdown(socket.SHUT_WR)


@pytest.fixture
def proxy(registry: int) -> Iterator[Callable[[str], FaultProxy]]:
    made: list[FaultProxy] = []

    def make(mode: str) -> FaultProxy:
        made.append(FaultProxy(registry, mode))
        return made[-1]

    yield make
    for p in made:
        p.close()


# --------------------------------------------------------------------------- helpers


def settings() -> SandboxSettings:
    return SandboxSettings(gates=GateSettings(sandbox_provision="allow", network_api="allow"))


def engine_client(engine: str) -> EngineAdapter:
    target = engine_targets(os.environ)[engine]
    client = open_target(target)
    try:
        client.ping()
    except ProvisionError as exc:
        client.close()
        require(engine, False, str(exc))
    return client


def pull(
    engine: str, ref: str, log: AuditLog, tmp_path: Path, mirrors: list[str] | None = None
) -> Any:
    target = engine_targets(os.environ)[engine]
    return asyncio.run(
        ensure_image(
            target.kind,
            target.url,
            ref,
            settings(),
            log,
            "t",
            "r",
            mirrors=mirrors,
            options=ProvisionOptions(
                engine_name=engine, env=dict(os.environ), retry=POLICY, lock_dir=tmp_path / "locks"
            ),
        )
    )


def attempts(events: list[AuditEvent]) -> list[dict[str, Any]]:
    return [
        e.details
        for e in events
        if e.type == "sandbox:provision" and e.details and e.details.get("action") == "pull"
    ]


@pytest.fixture
def cleanup() -> Iterator[list[tuple[str, str]]]:
    """(engine, ref) pairs to remove after the test."""
    refs: list[tuple[str, str]] = []
    yield refs
    for engine, ref in refs:
        with engine_client(engine) as client:
            client.remove_image(ref, force=True)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("fault", ["reset", "503"])
def test_transient_errors_are_retried_until_the_registry_is_back(
    engine: str,
    fault: str,
    tiny: str,
    proxy: Callable[[str], FaultProxy],
    tmp_path: Path,
    cleanup: list[tuple[str, str]],
    record_property: Any,
) -> None:
    engine_client(engine).close()
    p = proxy(fault)
    ref = f"127.0.0.1:{p.port}/tiny:1"
    cleanup.append((engine, ref))
    events: list[AuditEvent] = []
    log = AuditLog()
    log.subscribe(events.append)

    # Down for the first two attempts, whatever the engine retries inside each.
    down_for = 2

    def registry_comes_back(event: AuditEvent) -> None:
        d = event.details or {}
        if (
            d.get("action") == "pull"
            and d.get("outcome") == "retry"
            and (d.get("attempt") == down_for)
        ):
            p.mode = "forward"

    log.subscribe(registry_comes_back)
    t0 = time.perf_counter()
    got = pull(engine, ref, log, tmp_path)
    elapsed = time.perf_counter() - t0
    tries = attempts(events)
    assert [(a["attempt"], a["outcome"]) for a in tries] == [
        *((n, "retry") for n in range(1, down_for + 1)),
        (down_for + 1, "ok"),
    ], tries
    assert all(a["transient"] for a in tries[:down_for])
    assert got.action == "pulled" and got.digest == tiny
    final = [e.details for e in events if e.details and e.details.get("action") == "pulled"]
    assert final[-1]["digest"] == tiny and "@sha256:" in (final[-1]["repo_digest"] or "")
    assert p.connections.get(fault, 0) >= down_for and p.connections.get("forward", 0) >= 1
    for a in tries[:down_for]:
        assert a["error"] and 0.2 <= a["next_wait_s"] <= 1.0
    record_property(f"retry_{engine}_{fault}_s", round(elapsed, 2))
    print(
        f"\n{engine} {fault}: {down_for} failed attempt(s) + success in {elapsed:.2f}s; "
        f"engine said: {tries[0]['error'][:160]}"
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", ["unknown-image", "auth-denied"])
def test_permanent_errors_fail_on_the_first_attempt(
    engine: str, case: str, tiny: str, proxy: Callable[[str], FaultProxy], tmp_path: Path
) -> None:
    engine_client(engine).close()
    p = proxy("forward" if case == "unknown-image" else "401")
    ref = f"127.0.0.1:{p.port}/tiny:" + ("does-not-exist" if case == "unknown-image" else "1")
    events: list[AuditEvent] = []
    log = AuditLog()
    log.subscribe(events.append)
    t0 = time.perf_counter()
    with pytest.raises(ProvisionError) as err:
        pull(engine, ref, log, tmp_path)
    elapsed = time.perf_counter() - t0
    tries = attempts(events)
    assert [(a["attempt"], a["outcome"], a["transient"]) for a in tries] == [
        (1, "failed", False)
    ], tries
    words = (
        ("manifest unknown", "not found")
        if case == "unknown-image"
        else ("unauthorized", "authentication required", "no basic auth credentials")
    )
    assert any(w in str(err.value).lower() for w in words), str(err.value)
    assert elapsed < 10, elapsed
    print(f"\n{engine} {case}: failed once in {elapsed:.2f}s: {tries[0]['error'][:160]}")


@pytest.mark.podman
def test_mirrors_are_tried_in_order(
    registry: int, tiny: str, tmp_path: Path, cleanup: list[tuple[str, str]]
) -> None:
    ref = "registry.fusion-oci.invalid/tiny:1"
    cleanup += [("podman", ref), ("podman", f"127.0.0.1:{registry}/tiny:1")]
    events: list[AuditEvent] = []
    log = AuditLog()
    log.subscribe(events.append)
    got = pull(
        "podman",
        ref,
        log,
        tmp_path,
        mirrors=[f"127.0.0.1:{registry}/not-here", f"127.0.0.1:{registry}"],
    )
    assert got.ref == ref and got.digest == tiny and got.action == "pulled"
    tries = attempts(events)
    assert [(a["source"], a["outcome"]) for a in tries] == [
        (f"127.0.0.1:{registry}/not-here/tiny:1", "failed"),
        (f"127.0.0.1:{registry}/tiny:1", "ok"),
    ]
    with engine_client("podman") as client:
        assert client.image(ref) is not None
