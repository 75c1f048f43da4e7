"""Host services by grant (``policy.hostServices``) against direct loopback, in the same run.

    .venv/bin/python benchmarks/bench_services.py [--runs N] [--mb M] [--rounds R]
        [--backends bubblewrap,landlock,oci,podman,docker] [--markdown PATH]

A TCP server (its own process) listens on the host's 127.0.0.1. One client program (Python,
its own process) measures, taking turns round by round:

- **direct**: on the host, to 127.0.0.1:PORT (what a command gets with ``network: host``);
- **through the grant**: inside a sandbox of each backend whose policy grants exactly
  ``127.0.0.1:PORT`` (``network: none``), to the same address: the client's connect is
  answered by the exec agent with a host socket of its pool connected to the server, in the
  client's own socket's place (the task's relay, in this process on the proxy thread,
  supplies the sockets and writes a real audit log: one chained event per connection);
  landlock: the command's own socket, connected to the server by the connect supervisor;
  gVisor: the agent's listener, through the relay.

Per connection: connect, one byte each way, close (median of N per round). Throughput: one
connection downloading M MB (median of the rounds). Quote the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import markdown_table
from fusion_oci.audit import AuditLog
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.sandbox import SyncSandbox
from tests.backends import backend_settings

SERVER = textwrap.dedent("""
    import socket, struct, threading
    CHUNK = b"x" * (1 << 20)

    def serve(conn):
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            op = conn.recv(1)
            if op == b"p":
                conn.sendall(b"o")
            elif op == b"r":  # round trips on one connection: echo each byte until EOF
                conn.sendall(b"r")
                while True:
                    b = conn.recv(1)
                    if not b:
                        break
                    conn.sendall(b)
            elif op == b"d":
                size = struct.unpack("!Q", conn.recv(8))[0]
                while size > 0:
                    part = CHUNK[: min(size, len(CHUNK))]
                    conn.sendall(part)
                    size -= len(part)

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(256)
    print(srv.getsockname()[1], flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
""")

CLIENT = textwrap.dedent("""
    import json, socket, struct, sys, time
    port, runs, mb = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    buf = bytearray(1 << 20)

    def ping():
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"p")
        assert s.recv(1) == b"o"
        s.close()

    for _ in range(10):
        ping()
    lat = []
    for _ in range(runs):
        t = time.perf_counter()
        ping()
        lat.append((time.perf_counter() - t) * 1000)
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"r")
    assert s.recv(1) == b"r"
    rtt = []
    for _ in range(runs):
        t = time.perf_counter()
        s.sendall(b"q")
        assert s.recv(1) == b"q"
        rtt.append((time.perf_counter() - t) * 1000)
    s.close()
    size = mb * 1000 * 1000
    s = socket.create_connection(("127.0.0.1", port))
    t = time.perf_counter()
    s.sendall(b"d" + struct.pack("!Q", size))
    got = 0
    while got < size:
        n = s.recv_into(buf)
        if not n:
            break
        got += n
    dl = time.perf_counter() - t
    s.close()
    assert got == size, got
    print(json.dumps({"lat": lat, "rtt": rtt, "dl": dl}))
""")


NODE_CLIENT = textwrap.dedent("""
    // The same client in Node.js (the container images have node, not python3).
    const net = require('net');
    const [port, runs, mb] = process.argv.slice(2).map(Number);
    const open = () => new Promise((res, rej) => {
      const s = net.connect({ host: '127.0.0.1', port, noDelay: true }, () => res(s));
      s.on('error', rej);
    });
    const once = (s, n) => new Promise((res) => {
      let got = Buffer.alloc(0);
      const on = (d) => {
        got = Buffer.concat([got, d]);
        if (got.length >= n) { s.off('data', on); res(got); }
      };
      s.on('data', on);
    });
    (async () => {
      const ping = async () => {
        const s = await open(); const r = once(s, 1); s.write('p'); await r; s.destroy();
      };
      for (let i = 0; i < 10; i++) await ping();
      const lat = [];
      for (let i = 0; i < runs; i++) {
        const t = process.hrtime.bigint(); await ping();
        lat.push(Number(process.hrtime.bigint() - t) / 1e6);
      }
      const s = await open();
      let r = once(s, 1); s.write('r'); await r;
      const rtt = [];
      for (let i = 0; i < runs; i++) {
        const t = process.hrtime.bigint(); r = once(s, 1); s.write('q'); await r;
        rtt.push(Number(process.hrtime.bigint() - t) / 1e6);
      }
      s.destroy();
      const size = mb * 1000 * 1000;
      const d = await open();
      const head = Buffer.alloc(9); head.write('d'); head.writeBigUInt64BE(BigInt(size), 1);
      const t = process.hrtime.bigint();
      let got = 0;
      await new Promise((res) => {
        d.on('data', (b) => { got += b.length; if (got >= size) res(); });
        d.on('end', res);
        d.write(head);
      });
      const dl = Number(process.hrtime.bigint() - t) / 1e9;
      d.destroy();
      console.log(JSON.stringify({ lat, rtt, dl }));
    })();
""")
CONTAINERS = {"podman", "docker"}
"""Backends whose sandbox runs the task image (node, no python3): the Node.js client, against
its own direct run on the host."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="bubblewrap,landlock,oci,podman,docker")
    parser.add_argument("--markdown", help="write the docs/performance.md section here")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]

    with tempfile.TemporaryDirectory(prefix="fusion-oci-bench-svc-") as tmp:
        base = Path(tmp)
        server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        sandboxes: dict[str, SyncSandbox] = {}
        audits: dict[str, Path] = {}
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            from tests.conftest import git_init

            policy = SandboxPolicy(allow_network=False, host_services=[f"127.0.0.1:{port}"])
            for b in backends:
                wt = git_init(base / f"wt-{b}")
                (wt / "client.py").write_text(CLIENT)
                (wt / "client.js").write_text(NODE_CLIENT)
                project = base / f"project-{b}"
                project.mkdir()
                audits[b] = base / f"audit-{b}.jsonl"
                sb = SyncSandbox(
                    backend_settings(b, policy=policy),
                    audit=AuditLog(audits[b], key=b"k" * 32),
                    cache_root=base / "cache",
                )
                sb.prepare(
                    PrepareContext(
                        task_id=f"bench-{b}",
                        run_id="r1",
                        policy=policy,
                        worktree_path=str(wt),
                        project_dir=str(project),
                    )
                )
                sandboxes[b] = sb
            host_client = base / "client.py"
            host_client.write_text(CLIENT)
            (base / "client.js").write_text(NODE_CLIENT)
            node = any(b in CONTAINERS for b in backends)
            results: dict[str, list[dict[str, object]]] = {
                "direct": [],
                "direct-node": [],
                **{b: [] for b in backends},
            }
            argv = [str(port), str(args.runs), str(args.mb)]
            for _ in range(args.rounds):
                done = subprocess.run(
                    [sys.executable, str(host_client), *argv],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                results["direct"].append(json.loads(done.stdout))
                if node:
                    done = subprocess.run(
                        ["node", str(base / "client.js"), *argv],
                        check=True,
                        capture_output=True,
                        text=True,
                    )
                    results["direct-node"].append(json.loads(done.stdout))
                for b, sb in sandboxes.items():
                    client = ["node", "client.js"] if b in CONTAINERS else ["python3", "client.py"]
                    r = sb.run([*client, *argv], RunOptions(timeout_ms=600_000))
                    assert r.exit_code == 0, (b, r.stderr[-2000:])
                    results[b].append(json.loads(r.stdout))
        finally:
            for sb in sandboxes.values():
                sb.dispose()
            server.kill()
            server.wait()
            if server.stdout is not None:
                server.stdout.close()
        events = {b: sum(1 for _ in audits[b].open()) for b in backends}

    def lat(case: str, key: str = "lat") -> float:
        return statistics.median(x for r in results[case] for x in r[key])  # type: ignore[attr-defined]

    def mbps(case: str) -> float:
        return args.mb / statistics.median(float(r["dl"]) for r in results[case])  # type: ignore[arg-type]

    def base_of(case: str) -> str:
        return "direct-node" if case in CONTAINERS else "direct"

    def paired(case: str) -> float:
        # each round's grant download against the direct one of the same round
        return statistics.median(
            float(d["dl"]) / float(g["dl"])  # type: ignore[arg-type]
            for d, g in zip(results[base_of(case)], results[case], strict=True)
        )

    lat_rows: list[tuple[str, str, str, str]] = []
    rtt_rows: list[tuple[str, str, str]] = []
    dl_rows: list[tuple[str, object, str, str]] = []
    groups = [("Python", "direct", [b for b in backends if b not in CONTAINERS])]
    groups.append(("Node.js", "direct-node", [b for b in backends if b in CONTAINERS]))
    for lang, direct, members in groups:
        if not members:
            continue
        ld, md, rd = lat(direct), mbps(direct), lat(direct, "rtt")
        lat_rows.append((f"direct, on the host ({lang} client)", f"{ld:.3f}", "", ""))
        rtt_rows.append((f"direct, on the host ({lang} client)", f"{rd:.3f}", ""))
        dl_rows.append((f"direct, on the host ({lang} client)", round(md), "1.00x", ""))
        for b in members:
            lb, rb = lat(b), lat(b, "rtt")
            lat_rows.append(
                (f"through the grant, inside {b}", f"{lb:.3f}", f"+{lb - ld:.3f}", "+0.1 ms")
            )
            rtt_rows.append((f"through the grant, inside {b}", f"{rb:.3f}", f"+{rb - rd:.3f}"))
            dl_rows.append(
                (
                    f"through the grant, inside {b}",
                    round(mbps(b)),
                    f"{mbps(b) / md:.2f}x",
                    f"{paired(b):.2f}x",
                )
            )
    for row in lat_rows:
        print(" | ".join(str(c) for c in row))
    for row in [*rtt_rows, *dl_rows]:
        print(" | ".join(str(c) for c in row))
    print("audit events:", events)
    if args.markdown:
        text = (
            "## Host services by grant (`policy.hostServices`)\n\n"
            f"`benchmarks/bench_services.py --runs {args.runs} --mb {args.mb} --rounds "
            f"{args.rounds}`: a loopback TCP server; the same client on the host "
            "(direct) and inside a `network: none` sandbox granted exactly that address "
            "(Python; Node.js for podman and docker, whose task image has no python3, against "
            "a direct Node.js run), "
            "taking turns, round by round. The relays run in the benchmark's process with a "
            "real audit log (one chained event per connection: "
            + ", ".join(f"{b} {n}" for b, n in events.items())
            + ").\n\n"
            f"**per connection: connect, one byte each way, close (median of "
            f"{args.runs} x {args.rounds})**\n\n"
            + markdown_table(["case", "median ms", "added", "target"], lat_rows)
            + f"\n**a round trip on an open connection (one byte each way; median of "
            f"{args.runs} x {args.rounds}): what each query of a database client pays**\n\n"
            + markdown_table(["case", "median ms", "added"], rtt_rows)
            + f"\n**one connection downloading {args.mb} MB (median of {args.rounds})**\n\n"
            + markdown_table(["case", "MB/s", "ratio", "paired ratio"], dl_rows)
        )
        Path(args.markdown).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
