"""The egress proxy (``network: filtered``) against direct connections, on loopback.

    .venv/bin/python benchmarks/bench_egress.py [--runs N] [--mb M] [--markdown PATH]

An HTTP server (its own process) listens on 127.0.0.1; a client (its own process, as a
sandboxed program is) measures, taking turns between the cases so load falls on both alike:

- connection set-up: connect, send a small GET, read the whole answer; directly over TCP vs
  through the proxy's unix socket (``CONNECT``, then the same GET in the tunnel): the
  proxy's own cost per connection (decide, resolve, connect upstream, one audit event);
- throughput: a download of M MB (default 100) direct vs through a CONNECT tunnel;
- memory: the RSS growth of this process for 50 started, idle proxies (each its own listener
  and socket folder), per proxy.

The proxy runs in this process on its proxy thread, as in an owner process; its audit log is
a real file (every connection appends one chained event). Quote the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import markdown_table
from fusion_oci.audit import AuditLog
from fusion_oci.egress import EgressRules, start_proxy

SERVER = textwrap.dedent("""
    import socket, sys, threading
    CHUNK = b"x" * (1 << 20)

    def serve(conn):
        with conn:
            data = b""
            while b"\\r\\n\\r\\n" not in data:
                more = conn.recv(65536)
                if not more:
                    return
                data += more
            path = data.split(b" ", 2)[1].decode()
            size = int(path.rsplit("/", 1)[1]) if path.startswith("/bytes/") else 2
            conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n"
                         b"Connection: close\\r\\n\\r\\n" % size)
            while size > 0:
                part = CHUNK[:min(size, len(CHUNK))]
                conn.sendall(part)
                size -= len(part)

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(128)
    print(srv.getsockname()[1], flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
""")

CLIENT = textwrap.dedent("""
    import json, socket, statistics, sys, time
    port, sock_path, runs, mb, dl_runs = (int(sys.argv[1]), sys.argv[2], int(sys.argv[3]),
                                          int(sys.argv[4]), int(sys.argv[5]))
    buf = bytearray(1 << 20)

    def open_direct():
        s = socket.create_connection(("127.0.0.1", port))
        return s

    def open_proxy():
        s = socket.socket(socket.AF_UNIX)
        s.connect(sock_path)
        s.sendall(b"CONNECT bench.test:%d HTTP/1.1\\r\\nHost: bench.test\\r\\n\\r\\n" % port)
        head = b""
        while b"\\r\\n\\r\\n" not in head:
            head += s.recv(1)
        assert head.startswith(b"HTTP/1.1 200"), head
        return s

    def get(opener, path):
        s = opener()
        s.sendall(b"GET " + path + b" HTTP/1.1\\r\\nHost: bench.test\\r\\n\\r\\n")
        total = 0
        while True:
            n = s.recv_into(buf)
            if not n:
                break
            total += n
        s.close()
        return total

    def timed(opener, path):
        start = time.perf_counter()
        got = get(opener, path)
        return time.perf_counter() - start, got

    out = {"setup_direct": [], "setup_proxy": [], "dl_direct": [], "dl_proxy": []}
    for _ in range(5):
        get(open_direct, b"/small"); get(open_proxy, b"/small")
    for _ in range(runs):
        out["setup_direct"].append(timed(open_direct, b"/small")[0] * 1000)
        out["setup_proxy"].append(timed(open_proxy, b"/small")[0] * 1000)
    size = mb * 1000 * 1000
    for _ in range(dl_runs):
        t, got = timed(open_direct, b"/bytes/%d" % size)
        assert got > size
        out["dl_direct"].append(t)
        t, got = timed(open_proxy, b"/bytes/%d" % size)
        assert got > size
        out["dl_proxy"].append(t)
    print(json.dumps(out))
""")


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def idle_memory(count: int, base: Path) -> tuple[float, float]:
    """(RSS KiB with one proxy, KiB per further idle proxy) for ``count`` proxies."""
    rules = EgressRules(allowed=("registry.npmjs.org:443", "github.com:22"))
    # One proxy first: the thread, its loop and the modules are a once-per-process cost
    # (this process has run a proxy already: the modules are loaded).
    first = await start_proxy(task_id="warm", rules=rules, state_dir=base / "warm", audit=None)
    gc.collect()
    before = rss_kib()
    proxies = []
    for i in range(count):
        d = base / f"p{i}"
        d.mkdir()
        proxies.append(
            await start_proxy(
                task_id=f"task-{i}",
                rules=rules,
                state_dir=d,
                audit=AuditLog(d / "audit.jsonl", key=b"k"),
            )
        )
    gc.collect()
    after = rss_kib()
    for p in [first, *proxies]:
        await p.stop()
    return before, (after - before) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument(
        "--downloads", type=int, default=15, help="downloads of each kind (taking turns)"
    )
    parser.add_argument("--markdown", help="write the docs/performance.md section here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="fusion-oci-bench-egress-") as tmp:
        base = Path(tmp)
        (base / "warm").mkdir()
        server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            rules = EgressRules(allowed=("bench.test",), allow_addresses=("127.0.0.1/32",))
            proxy_dir = base / "proxy"
            proxy_dir.mkdir()
            audit = AuditLog(proxy_dir / "audit.jsonl", key=b"k" * 32)
            proxy = asyncio.run(
                start_proxy(
                    task_id="bench",
                    rules=rules,
                    state_dir=proxy_dir,
                    audit=audit,
                    resolve_override={"bench.test": ["127.0.0.1"]},
                )
            )
            cpu = resource.getrusage(resource.RUSAGE_SELF)
            try:
                done = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        CLIENT,
                        str(port),
                        str(proxy.unix_socket),
                        str(args.runs),
                        str(args.mb),
                        str(args.downloads),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                )
            finally:
                asyncio.run(proxy.stop())
            used = resource.getrusage(resource.RUSAGE_SELF)
            proxy_cpu_s = (used.ru_utime - cpu.ru_utime) + (used.ru_stime - cpu.ru_stime)
            data = json.loads(done.stdout)
            events = sum(1 for _ in (proxy_dir / "audit.jsonl").open())
            before, per_proxy = asyncio.run(idle_memory(50, base))
            # 50 proxies fit in a few pages: 500 more give the per-proxy figure its resolution.
            many = base / "many"
            many.mkdir()
            (many / "warm").mkdir()
            _, per_proxy_500 = asyncio.run(idle_memory(500, many))
        finally:
            server.kill()
            server.wait()
            if server.stdout is not None:
                server.stdout.close()

    sd, sp = statistics.median(data["setup_direct"]), statistics.median(data["setup_proxy"])
    dd, dp = statistics.median(data["dl_direct"]), statistics.median(data["dl_proxy"])
    mbps_d, mbps_p = args.mb / dd, args.mb / dp
    # Each proxied download against the direct one just before it: the machine's load
    # changes between pairs more than within one.
    pair = statistics.median(
        d / p for d, p in zip(data["dl_direct"], data["dl_proxy"], strict=True)
    )
    setup_rows = [
        ("direct TCP to 127.0.0.1", f"{sd:.3f}", "1.00x"),
        ("through the proxy (unix socket, CONNECT)", f"{sp:.3f}", f"{sp / sd:.2f}x"),
        ("proxy's added time per connection", f"+{sp - sd:.3f}", "target: +1 ms"),
    ]
    dl_rows = [
        ("direct", round(mbps_d), "1.00x"),
        ("through a CONNECT tunnel", round(mbps_p), f"{mbps_p / mbps_d:.2f}x"),
        ("median of the paired ratios (tunnel / direct)", "", f"{pair:.2f}x"),
    ]
    mem_rows = [
        ("RSS of the owner with one proxy running (MiB)", round(before / 1024, 1)),
        ("RSS growth per idle proxy, 50 started (KiB)", round(per_proxy, 1)),
        ("RSS growth per idle proxy, 500 started (KiB)", round(per_proxy_500, 1)),
    ]
    print(f"set-up: direct {sd:.3f} ms, proxy {sp:.3f} ms (+{sp - sd:.3f} ms)")
    print(
        f"download {args.mb} MB: direct {mbps_d:.0f} MB/s, proxy {mbps_p:.0f} MB/s "
        f"({mbps_p / mbps_d:.2f}x; paired {pair:.2f}x)"
    )
    moved_gb = args.downloads * args.mb / 1000
    print(
        f"idle proxy: {per_proxy:.1f} KiB each (of 50), {per_proxy_500:.1f} KiB (of 500); "
        f"{events} audit events written; proxy CPU "
        f"{proxy_cpu_s:.2f} s for {events} connections and {moved_gb:.1f} GB"
    )
    if args.markdown:
        text = (
            "## Egress proxy (`network: filtered`)\n\n"
            f"`benchmarks/bench_egress.py --runs {args.runs} --mb {args.mb}`: a loopback "
            "HTTP server and a client in their own processes, the proxy on its thread in "
            "the benchmark's process with a real audit log (one chained event per "
            f"connection: {events} written in this run).\n\n"
            f"**connection set-up: connect, small GET, whole answer (median of "
            f"{args.runs})**\n\n"
            + markdown_table(["case", "median ms", "ratio"], setup_rows)
            + f"\n**download of {args.mb} MB (median of {args.downloads} each, taking "
            "turns)**\n\n"
            + markdown_table(["case", "MB/s", "ratio"], dl_rows)
            + f"\nThe proxy's own CPU time over the whole client run ({events} connections, "
            f"{moved_gb:.1f} GB moved by splice(2)): {proxy_cpu_s:.2f} s, i.e. about "
            f"{proxy_cpu_s / moved_gb * 1000:.0f} ms per GB at most (the connections' "
            "share included): a load-independent view of the same cost.\n"
            + "\n**memory of idle proxies (RSS of the owner process)**\n\n"
            + markdown_table(["case", "value"], mem_rows)
            + "\nReading it: targets are +1 ms median per connection, a download within "
            "10% of direct, and at most 5 MiB per idle task. The tunnel adds a third "
            "busy process (the proxy) to the download: on a machine whose cores are "
            "taken the ratio follows the load more than the proxy; its own CPU per GB "
            "above is the figure that does not.\n"
        )
        Path(args.markdown).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
