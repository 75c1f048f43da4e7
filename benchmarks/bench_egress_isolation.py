"""One task's flood against another task's proxy on the same proxy loop (issue #31 item 7).

    .venv/bin/python benchmarks/bench_egress_isolation.py [--rounds N] [--markdown PATH]

Two task proxies (A and B) run on the one proxy loop of this process, as in a resident server.
Task B's workload (its own process, as a sandboxed program is): 8 parallel workers opening
CONNECT tunnels through B's proxy to a loopback HTTP server (its own process), one request
each: "install" (40 tunnels per worker, each answer of 64 KB 20 ms late: a registry's round
trip, as a package install meets it) and "heavy" (100 per worker, 16 KB, no delay: B itself
keeps the loop busy). Each runs alone and beside each of task A's floods, taking turns,
``--rounds`` times:

- idle: 1,500 connections to A's proxy that never send a byte (held by another process);
- refused: two processes opening connections to A's proxy as fast as they can, each a
  ``CONNECT`` to a denied name (parse, decide, 403, audit event);
- push bombs: 16 connections at a time (one process, 16 threads), each made to do the work of a
  credentialed ``git push`` whose 64 KB gzip body inflates to 16 MB of ref updates
  (``Session._check_push`` run in A's connection handler in place of the HTTP parsing: the TLS
  of a real brokered push is left out).

Reported: B's wall time (median of the rounds) as a ratio to B alone, the proxy loop's lag
(a 1 ms timer on the loop: how late it fires, p99) and A's measured share of the loop
(:attr:`Limits.loop_share` is what bounds it). The flood's client processes take CPU of their
own: on a machine with few cores part of B's ratio is that, not the proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import markdown_table
from fusion_oci.audit import AuditLog
from fusion_oci.egress import EgressRules, start_proxy
from fusion_oci.egress.loop import call_on_proxy_loop
from fusion_oci.egress.mitm import Exchange, Head, Session, pkt_line
from fusion_oci.egress.proxy import EgressProxy

SERVER = textwrap.dedent("""
    import socket, threading, time

    def serve(conn):
        with conn:
            data = b""
            while b"\\r\\n\\r\\n" not in data:
                more = conn.recv(65536)
                if not more:
                    return
                data += more
            _, delay_ms, size = data.split(b" ", 2)[1].decode().rsplit("/", 2)
            time.sleep(int(delay_ms) / 1000)  # a registry's round trip, stood in for
            conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n"
                         b"Connection: close\\r\\n\\r\\n" % int(size) + b"x" * int(size))

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(128)
    print(srv.getsockname()[1], flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
""")

WORKLOAD = textwrap.dedent("""
    import json, socket, sys, threading, time
    sock_path, port, path, count = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    lat = []

    def one():
        start = time.perf_counter()
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock_path)
        s.sendall(b"CONNECT bench.test:%d HTTP/1.1\\r\\nHost: bench.test\\r\\n\\r\\n" % port)
        head = b""
        while b"\\r\\n\\r\\n" not in head:
            head += s.recv(1)
        assert head.startswith(b"HTTP/1.1 200"), head
        s.sendall(b"GET %s HTTP/1.1\\r\\nHost: bench.test\\r\\n\\r\\n" % path.encode())
        while s.recv(65536):
            pass
        s.close()
        lat.append(time.perf_counter() - start)

    def worker():
        for _ in range(count):
            one()

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(json.dumps({"wall": time.perf_counter() - start, "lat": sorted(lat)}))
""")

IDLE = textwrap.dedent("""
    import socket, sys, time
    held = []
    while len(held) < 1500:
        s = socket.socket(socket.AF_UNIX)
        s.setblocking(False)
        try:
            s.connect(sys.argv[1])
        except BlockingIOError:
            s.close(); time.sleep(0.01); continue
        held.append(s)
    time.sleep(3600)
""")

HAMMER = textwrap.dedent("""
    import socket, sys, threading
    first = sys.argv[2].encode()

    def hammer():
        while True:
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(sys.argv[1])
                s.sendall(first)
                while s.recv(65536):
                    pass
            except OSError:
                pass
            finally:
                s.close()

    for _ in range(int(sys.argv[3])):
        threading.Thread(target=hammer, daemon=True).start()
    threading.Event().wait()
""")


def _bomb() -> bytes:
    line = pkt_line(f"{'0' * 40} {'1' * 40} refs/heads/{'x' * 40}\n".encode())
    return gzip.compress(line * (16 * 1024 * 1024 // len(line)), 9)


def _bombing(proxy: EgressProxy, bomb: bytes) -> None:
    """A's handler does a push check on a bomb for each connection (the HTTP parse skipped)."""
    session: Any = Session.__new__(Session)
    session.host = "git.bench"
    session.cred = SimpleNamespace(
        spec=SimpleNamespace(name="gh", allowed_repos=None, allowed_refs=["refs/heads/*"])
    )

    async def serve(reader: Any, writer: Any, conn: Any) -> None:
        async def body() -> AsyncIterator[bytes]:
            yield bomb
            yield b"PACK"

        head = Head("POST /a/b.git/git-receive-pack HTTP/1.1", [("Content-Encoding", "gzip")])
        ex = Exchange(method="POST", path="/a/b.git/git-receive-pack")
        await session._check_push(head, ex, body())
        # As an intercepted request's end does (EgressProxy._exchange): its audit event,
        # which counts a refusal against the task.
        proxy._credential_event(
            conn, "gh", allowed=ex.refused is None, reason=ex.refused, details={}
        )
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    proxy._serve = serve  # type: ignore[method-assign]


async def _lag_probe(stop: asyncio.Event, out: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        start = loop.time()
        await asyncio.sleep(0.001)
        out.append((loop.time() - start - 0.001) * 1000)


def _spawn(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


WORKLOADS = {
    "heavy": ("/d/0/16384", 100),
    "install": ("/d/20/65536", 40),
}
"""B's workloads: (path: /d/DELAY_MS/BYTES, tunnels per worker of 8). heavy: back to back on
loopback, B itself keeps the loop busy; install: each answer 20 ms late (a registry's round
trip), as a package install meets it."""


def _measure(
    proxy_a: EgressProxy, proxy_b: EgressProxy, port: int, mode: str, workload: str
) -> dict[str, float]:
    flood: list[subprocess.Popen[bytes]] = []
    a_sock = str(proxy_a.unix_socket)
    if mode == "idle":
        flood.append(_spawn(IDLE, a_sock))
    elif mode == "refused":
        request = "CONNECT denied.test:443 HTTP/1.1\r\nHost: denied.test\r\n\r\n"
        flood += [_spawn(HAMMER, a_sock, request, "1") for _ in range(2)]
    elif mode == "bombs":
        flood.append(_spawn(HAMMER, a_sock, "x", "16"))
    try:
        if flood:
            time.sleep(1.5)  # the flood is under way (and past its burst) before B starts
        stop = asyncio.Event()
        lags: list[float] = []
        loop = call_on_proxy_loop(_start_probe(stop, lags))
        used, used_b = proxy_a.meter.loop_seconds, proxy_b.meter.loop_seconds
        started = time.monotonic()
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                WORKLOAD,
                str(proxy_b.unix_socket),
                str(port),
                *map(str, WORKLOADS[workload]),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        loop.call_soon_threadsafe(stop.set)
        elapsed = time.monotonic() - started
        # A's (and B's) measured loop time over B's run.
        share = (proxy_a.meter.loop_seconds - used) / elapsed
        share_b = (proxy_b.meter.loop_seconds - used_b) / elapsed
    finally:
        for proc in flood:
            proc.kill()
            proc.wait()
    data = json.loads(done.stdout)
    lags.sort()
    return {
        "wall": data["wall"],
        "lat_p99": data["lat"][int(len(data["lat"]) * 0.99)] * 1000,
        "lag_p99": lags[int(len(lags) * 0.99)] if lags else 0.0,
        "a_share": share,
        "b_share": share_b,
    }


async def _start_probe(stop: asyncio.Event, lags: list[float]) -> asyncio.AbstractEventLoop:
    asyncio.get_running_loop().create_task(_lag_probe(stop, lags))
    return asyncio.get_running_loop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", help="write the docs/performance.md section here")
    args = parser.parse_args()
    modes = ["alone", "idle", "refused", "bombs"]
    bomb = _bomb()
    runs = [(w, m) for w in WORKLOADS for m in modes]
    results: dict[tuple[str, str], list[dict[str, float]]] = {run: [] for run in runs}
    with tempfile.TemporaryDirectory(prefix="fusion-oci-bench-isolation-") as tmp:
        base = Path(tmp)
        server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            rules = EgressRules(
                allowed=("bench.test",), denied=("denied.test",), allow_addresses=("127.0.0.1/32",)
            )
            for r in range(args.rounds):
                for workload, mode in runs:
                    proxies = []
                    for task in ("a", "b"):
                        folder = base / f"{workload}-{mode}-{r}-{task}"
                        folder.mkdir()
                        proxies.append(
                            asyncio.run(
                                start_proxy(
                                    task_id=f"task-{task}",
                                    rules=rules,
                                    state_dir=folder,
                                    audit=AuditLog(folder / "audit.jsonl", key=b"k" * 32),
                                    resolve_override={"bench.test": ["127.0.0.1"]},
                                )
                            )
                        )
                    if mode == "bombs":
                        _bombing(proxies[0], bomb)
                    try:
                        got = _measure(proxies[0], proxies[1], port, mode, workload)
                    finally:
                        for proxy in proxies:
                            asyncio.run(proxy.stop())
                    results[(workload, mode)].append(got)
                    print(workload, mode, r, json.dumps({k: round(v, 3) for k, v in got.items()}))
        finally:
            server.kill()
            server.wait()
            if server.stdout is not None:
                server.stdout.close()

    labels = {
        "alone": "alone",
        "idle": "beside A's 1,500 idle connections",
        "refused": "beside A's refused-CONNECT flood (2 processes)",
        "bombs": "beside A's gzip push bombs (16 at a time)",
    }

    def med(workload: str, mode: str, key: str) -> float:
        return statistics.median(x[key] for x in results[(workload, mode)])

    def pct(value: float) -> str:
        return "-" if value < 0 else f"{value * 100:.1f}%"

    rows = []
    for workload, mode in runs:
        wall, alone = med(workload, mode, "wall"), med(workload, "alone", "wall")
        rows.append(
            (
                f"{workload}: {labels[mode]}",
                f"{wall * 1000:.0f}",
                f"{wall / alone:.2f}x",
                f"{med(workload, mode, 'lat_p99'):.1f}",
                f"{med(workload, mode, 'lag_p99'):.1f}",
                "-" if mode == "alone" else pct(med(workload, mode, "a_share")),
                pct(med(workload, mode, "b_share")),
            )
        )
    table = markdown_table(
        [
            "task B's workload",
            "B wall ms",
            "ratio",
            "B tunnel p99 ms",
            "loop lag p99 ms",
            "A's loop share",
            "B's loop share",
        ],
        rows,
    )
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(
            "## Egress isolation: one task's flood beside another's proxy\n\n"
            f"`benchmarks/bench_egress_isolation.py --rounds {args.rounds}` (median of the "
            "rounds, the cases taking turns): two task proxies on one proxy loop; task B's "
            "tunnels (8 workers; heavy: 800 back to back, 16 KB each; install: 320, each "
            "answer 64 KB after 20 ms) alone and beside task A's floods; the module docstring "
            "says what each flood is. A's and B's loop shares are the proxies' own meters.\n\n"
            + table,
            encoding="utf-8",
        )


if __name__ == "__main__":
    main()
