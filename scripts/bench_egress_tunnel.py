"""The cost of where a filtered task's egress proxy runs (issue #34): a connection's setup and
its throughput through the task's proxy, from a kubernetes pod (the tunnel back through the
agent's stream) beside a local runtime (bubblewrap: the agent's forwarder on a unix socket).

    eval "$(bash scripts/cluster.sh env)"
    .venv/bin/python scripts/bench_egress_tunnel.py [kubernetes bubblewrap] [--mb 32] [--n 20]

A sink on this host's first non-loopback address (allowed by name and address, as a private
address must be) answers each connection with one byte, then sends or takes MB megabytes.
The sandboxed client (python3) connects to the proxy variables' 127.0.0.1:3128, says
CONNECT, and times: setup (connect to the first byte from the sink, through the proxy's
CONNECT), download and upload. Medians of N setups; one transfer each way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusion_oci.models import NetworkMode, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.sandbox import SyncSandbox
from tests.backends import backend_settings
from tests.security.egress_world import resolving

CLIENT = r"""
import json, socket, statistics, sys, time
port, mb, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def open_(mode):
    t = time.perf_counter()
    s = socket.create_connection(("127.0.0.1", 3128))
    s.sendall(b"CONNECT sink.test:%d HTTP/1.1\r\nHost: sink.test:%d\r\n\r\n" % (port, port))
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert b" 200" in head.split(b"\r\n")[0], head
    s.sendall(mode)
    assert s.recv(1) == b"k"
    return s, time.perf_counter() - t
setups = []
for _ in range(n):
    s, took = open_(b"s")
    setups.append(took * 1000)
    s.close()
s, _ = open_(b"d")
t, got = time.perf_counter(), 0
while chunk := s.recv(1 << 16):
    got += len(chunk)
down = time.perf_counter() - t
assert got == mb << 20, got
s.close()
s, _ = open_(b"u")
t = time.perf_counter()
block = b"u" * (1 << 16)
for _ in range((mb << 20) // len(block)):
    s.sendall(block)
s.shutdown(socket.SHUT_WR)
assert s.recv(16) == b"done"
up = time.perf_counter() - t
print(json.dumps({"setup_ms_median": round(statistics.median(setups), 2),
                  "setup_ms_min": round(min(setups), 2),
                  "down_MBps": round(mb / down, 1), "up_MBps": round(mb / up, 1)}))
"""


def host_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet: the route's source address
        return str(s.getsockname()[0])


@contextlib.contextmanager
def sink(addr: str, mb: int) -> Iterator[int]:
    server = socket.create_server((addr, 0))
    port = int(server.getsockname()[1])
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            mode = conn.recv(1)
            conn.sendall(b"k")
            if mode == b"d":
                block = b"d" * (1 << 16)
                for _ in range((mb << 20) // len(block)):
                    conn.sendall(block)
            elif mode == b"u":
                while conn.recv(1 << 16):
                    pass
                conn.sendall(b"done")

    def loop() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = server.accept()
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join()
        server.close()


def measure(backend: str, addr: str, port: int, mb: int, n: int) -> dict[str, object]:
    policy = SandboxPolicy(
        network=NetworkMode.FILTERED, allowed_domains=["sink.test", f"{addr}/32"]
    )
    with tempfile.TemporaryDirectory(prefix="bench-egress-") as base:
        wt = Path(base) / "wt"
        wt.mkdir()
        (wt / "client.py").write_text(CLIENT)
        subprocess.run(["git", "init", "-q", str(wt)], check=True)
        settings = backend_settings(backend, policy=policy)
        ctx = PrepareContext(
            task_id=f"bench-egress-{backend}", run_id="r", worktree_path=str(wt), policy=policy
        )
        with (
            resolving({"sink.test": [addr]}),
            SyncSandbox(settings, cache_root=Path(base) / "cache") as sb,
        ):
            sb.prepare(ctx)
            r = sb.run(f"python3 client.py {port} {mb} {n}", RunOptions(timeout_ms=300_000))
            if r.exit_code != 0:
                raise SystemExit(f"{backend}: {r.stdout[-1000:]}\n{r.stderr[-2000:]}")
            return {"backend": backend, **json.loads(r.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backends", nargs="*", default=["kubernetes", "bubblewrap"])
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--n", type=int, default=20)
    args = parser.parse_args()
    addr = host_address()
    with sink(addr, args.mb) as port:
        for backend in args.backends:
            print(json.dumps(measure(backend, addr, port, args.mb, args.n)), flush=True)


if __name__ == "__main__":
    main()
