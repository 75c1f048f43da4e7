"""Host-side observers shared by the runtime and security tests: processes found by a marker
in their command line, and a loopback TCP server that records who connected."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path


def pids_with(marker: str) -> list[int]:
    """Pids of host processes whose command line contains ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
    return found


@contextlib.contextmanager
def tcp_server(host: str = "127.0.0.1", greeting: bytes = b"") -> Iterator[tuple[int, list[str]]]:
    """A TCP server on ``host`` (random port) recording each client's address."""
    srv = socket.socket()
    srv.bind((host, 0))
    srv.listen(8)
    srv.settimeout(0.2)
    seen: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = srv.accept()
            except (TimeoutError, OSError):
                continue
            seen.append(peer[0])
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    def answer(conn: socket.socket) -> None:
        # Greet, end our side, then read what the client sent before closing: closing with
        # its request unread makes the kernel answer with a reset, which curl reports as
        # "Recv failure: Connection reset by peer" after the greeting (a flake in CI).
        with conn, contextlib.suppress(OSError):
            conn.sendall(greeting)
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(2)
            while conn.recv(65536):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1], seen
    finally:
        stop.set()
        thread.join(2)
        srv.close()
