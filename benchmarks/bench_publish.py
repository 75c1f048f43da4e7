"""Published ports (``policy.publishPorts``) against direct loopback, in the same run.

    .venv/bin/python benchmarks/bench_publish.py [--runs N] [--mb M] [--rounds R]
        [--backends bubblewrap,landlock,oci,oci-runsc,podman,docker] [--markdown PATH]

One small TCP server (node: on the host and in the task images) answers a byte with a byte
(``p``) or streams M MB (``d``). One client program (Python, its own process on the host)
measures, taking turns round by round:

- **direct**: the server run on the host, at 127.0.0.1:PORT;
- **published**: the same server run inside a sandbox of each backend (``network: none``,
  ``publishPorts: ["PORT"]``), reached at the free host port the task reports: the task's
  listener in this process (on the proxy thread) connects inside the sandbox's network
  namespace and splices, writing a real audit log (one chained ``sandbox:inbound`` event per
  connection).

Per connection: connect, one byte each way, close (median of N per round). Throughput: one
connection downloading M MB (median of the rounds). Quote the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import markdown_table
from fusion_oci.audit import AuditLog
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.sandbox import Sandbox
from tests.backends import backend_settings

PORT = 9077
AUDIT = True
"""False (``--no-audit``): no audit log, to see what the events cost."""
SERVER_JS = textwrap.dedent("""
    const net = require('net');
    const chunk = Buffer.alloc(1 << 20, 120);
    net.createServer((c) => {
      c.setNoDelay(true);
      let got = Buffer.alloc(0);
      c.on('data', (d) => {
        got = Buffer.concat([got, d]);
        if (got[0] === 112) { c.end('o'); return; }
        if (got[0] === 100 && got.length >= 9) {
          c.removeAllListeners('data');
          let left = Number(got.readBigUInt64BE(1));
          const pump = () => {
            while (left > 0) {
              const n = Math.min(left, chunk.length);
              left -= n;
              if (!c.write(n === chunk.length ? chunk : chunk.subarray(0, n))) {
                c.once('drain', pump); return;
              }
            }
            c.end();
          };
          pump();
        }
      });
      c.on('error', () => {});
    }).listen(Number(process.argv[process.argv.length - 1]), '127.0.0.1');
""")

CLIENT = textwrap.dedent("""
    import json, socket, statistics, struct, sys, time
    port, runs, mb = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    def ping():
        t = time.perf_counter()
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"p"); assert s.recv(1) == b"o"; s.close()
        return (time.perf_counter() - t) * 1000
    ping()
    lat = statistics.median(ping() for _ in range(runs))
    s = socket.create_connection(("127.0.0.1", port))
    t = time.perf_counter()
    s.sendall(b"d" + struct.pack("!Q", mb << 20))
    got = 0
    while True:
        b = s.recv(1 << 20)
        if not b: break
        got += len(b)
    dt = time.perf_counter() - t
    assert got == mb << 20, got
    print(json.dumps({"lat": lat, "mbps": mb / dt}))
""")


def client(port: int, runs: int, mb: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, str(port), str(runs), str(mb)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return dict(json.loads(out.stdout))


async def published(
    backend: str, work: Path, rounds: int, runs: int, mb: int
) -> list[dict[str, float]]:
    wt = work / f"wt-{backend}"
    wt.mkdir()
    await asyncio.to_thread(subprocess.run, ["git", "init", "-q", str(wt)], check=True)
    (wt / "server.js").write_text(SERVER_JS)
    policy = SandboxPolicy(allow_network=False, publish_ports=[str(PORT)])
    project = work / f"project-{backend}"  # outside the worktree (landlock needs it there)
    project.mkdir()
    ctx = PrepareContext(
        task_id=f"bench-{backend}",
        run_id="r",
        policy=policy,
        worktree_path=str(wt),
        project_dir=str(project),
    )
    audit = AuditLog(work / f"audit-{backend}.jsonl") if AUDIT else None
    sb = Sandbox(backend_settings(backend, policy=policy), audit=audit, cache_root=work / "c")
    out: list[dict[str, float]] = []
    try:
        await sb.prepare(ctx)
        host_port = int(sb.published()[0]["hostPort"])  # type: ignore[call-overload]
        run = asyncio.ensure_future(
            sb.run(["node", "server.js", str(PORT)], RunOptions(timeout_ms=600_000))
        )
        for _ in range(100):
            with contextlib.suppress(subprocess.CalledProcessError):
                await asyncio.to_thread(client, host_port, 1, 1)
                break
            await asyncio.sleep(0.1)
        for _ in range(rounds):
            out.append(await asyncio.to_thread(client, host_port, runs, mb))
        sb.abort()
        with contextlib.suppress(BaseException):
            await run
    finally:
        await sb.dispose()
    return out


def direct(work: Path, rounds: int, runs: int, mb: int) -> list[dict[str, float]]:
    (work / "server.js").write_text(SERVER_JS)
    server = subprocess.Popen(["node", str(work / "server.js"), str(PORT + 1)])
    try:
        time.sleep(0.5)
        return [client(PORT + 1, runs, mb) for _ in range(rounds)]
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backends", default="bubblewrap,oci,podman,docker")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--no-audit", action="store_true")
    args = parser.parse_args()
    global AUDIT
    AUDIT = not args.no_audit
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp:
        work = Path(tmp)
        results = {"direct": direct(work, args.rounds, args.runs, args.mb)}
        for backend in args.backends.split(","):
            results[backend] = asyncio.run(
                published(backend, work, args.rounds, args.runs, args.mb)
            )
    base_lat = statistics.median(r["lat"] for r in results["direct"])
    base_mbps = statistics.median(r["mbps"] for r in results["direct"])
    rows = []
    for case, rs in results.items():
        lat = statistics.median(r["lat"] for r in rs)
        mbps = statistics.median(r["mbps"] for r in rs)
        rows.append(
            [
                case,
                f"{lat:.3f}",
                f"{lat - base_lat:+.3f}",
                f"{mbps:.0f}",
                f"{100 * mbps / base_mbps:.0f}%",
            ]
        )
    table = markdown_table(
        ["case", "connect + 1 byte each way (ms)", "added (ms)", "MB/s", "vs direct"], rows
    )
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")


if __name__ == "__main__":
    main()
