"""A real host service for the host-services tests: Debian's PostgreSQL, started by the test as
the ``postgres`` user on the host's loopback (a free port, 127.0.0.1 and ::1) and on a unix
socket in a folder of the test's, never on another address; and a client that runs in every
sandbox: a PostgreSQL wire-protocol client in plain Node.js (the task images have node, not
psql), plus ``psql`` where the host's /usr is the sandbox's.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PG_BIN = Path("/usr/lib/postgresql/15/bin")

PG_CLIENT_JS = r"""
// node pg.js TARGET SQL: TARGET is HOST:PORT, [V6]:PORT or /unix/socket/path. Prints each
// row's first column; exit 0 when the query answered, 2 when no connection, 3 on a bad answer.
const net = require('net');
const [target, sql] = process.argv.slice(2);
let opts;
if (target.startsWith('/')) opts = { path: target };
else {
  const m = /^\[?([^\]]*)\]?:(\d+)$/.exec(target);
  opts = { host: m[1], port: +m[2] };
}
const c = net.connect(opts);
c.setTimeout(8000, () => { console.log('timeout'); process.exit(2); });
c.on('error', (e) => { console.log('error ' + e.code); process.exit(2); });
const body = Buffer.from('user\0postgres\0database\0postgres\0\0');
const head = Buffer.alloc(8); head.writeInt32BE(8 + body.length, 0); head.writeInt32BE(196608, 4);
c.write(Buffer.concat([head, body]));
let buf = Buffer.alloc(0), sent = false, rows = [];
c.on('data', (d) => {
  buf = Buffer.concat([buf, d]);
  while (buf.length >= 5) {
    const type = String.fromCharCode(buf[0]), len = buf.readInt32BE(1);
    if (buf.length < 1 + len) break;
    const msg = buf.subarray(5, 1 + len); buf = buf.subarray(1 + len);
    if (type === 'E') {
      console.log('pg error ' + msg.toString().replace(/\0/g, ' '));
      process.exit(3);
    }
    if (type === 'D') {
      const n = msg.readInt32BE(2);
      rows.push(msg.subarray(6, 6 + n).toString());
    }
    if (type === 'Z' && !sent) {
      sent = true;
      const q = Buffer.from(sql + '\0');
      const h = Buffer.alloc(5);
      h.write('Q');
      h.writeInt32BE(4 + q.length, 1);
      c.write(Buffer.concat([h, q]));
    } else if (type === 'Z') {
      rows.forEach((r) => console.log(r)); c.end(Buffer.from([88, 0, 0, 0, 4])); process.exit(0);
    }
  }
});
"""


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(20):
        with socket.socket(family) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port != 4040:
            return port
    raise RuntimeError("no free port")


@dataclass(frozen=True)
class Postgres:
    port: int
    socket_dir: Path

    @property
    def unix_socket(self) -> str:
        return f"{self.socket_dir}/.s.PGSQL.{self.port}"


def postgres_available() -> str | None:
    """Why no PostgreSQL can be started here (None: it can)."""
    if not (PG_BIN / "postgres").exists():
        return f"{PG_BIN}/postgres missing (Debian package postgresql)"
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "no postgres user (Debian package postgresql)"
    if os.geteuid() != 0:
        return "starting PostgreSQL as the postgres user needs root"
    return None


@contextlib.contextmanager
def postgres_server() -> Iterator[Postgres]:
    """A PostgreSQL of the test's own: trust authentication, loopback and a unix socket only,
    fsync off; stopped (its pid, which we started) and removed after. Fails the test (never
    skips it) where it cannot start."""
    why = postgres_available()
    if why is not None:
        import pytest

        pytest.fail(f"PostgreSQL cannot be started here: {why} (scripts/install.sh installs it)")
    user = pwd.getpwnam("postgres")
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-pg-"))
    base.chmod(0o755)
    data, sockets = base / "data", base / "run"
    sockets.mkdir()
    os.chown(base, user.pw_uid, user.pw_gid)
    os.chown(sockets, user.pw_uid, user.pw_gid)
    as_pg = ["runuser", "-u", "postgres", "--"]
    subprocess.run(
        [*as_pg, str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "-N"],
        check=True,
        capture_output=True,
        cwd="/",
        timeout=120,
    )
    port = free_port()
    log = (base / "log").open("wb")
    proc = subprocess.Popen(
        [
            *as_pg,
            str(PG_BIN / "postgres"),
            "-D",
            str(data),
            "-p",
            str(port),
            "-k",
            str(sockets),
            "-c",
            "listen_addresses=127.0.0.1,::1",
            "-c",
            "fsync=off",
            "-c",
            "max_connections=200",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd="/",
        start_new_session=True,
    )
    try:
        pg = Postgres(port, sockets)
        deadline = time.monotonic() + 60
        while not Path(pg.unix_socket).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("postgres did not start: " + (base / "log").read_text()[-2000:])
            time.sleep(0.05)
        yield pg
    finally:
        proc.terminate()  # runuser forwards it to postgres (a fast shutdown)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class Listening:
    """Servers of the test's own that record every connection: TCP on 127.0.0.1 and ::1 at one
    port, and unix sockets by path. ``seen``: ``"tcp4"``, ``"tcp6"`` or the socket's path, one
    per connection accepted."""

    port: int
    sockets: list[str]
    seen: list[str]


@contextlib.contextmanager
def listening(unix: list[Path] = ()) -> Iterator[Listening]:  # type: ignore[assignment]
    """Record connections to 127.0.0.1:P, [::1]:P (one free P) and each path of ``unix``
    (made world-connectable: a rootless task's relay runs as the CI user)."""
    import threading

    servers: list[tuple[socket.socket, str]] = []
    for _ in range(20):
        port = free_port()
        try:
            v4 = socket.socket(socket.AF_INET)
            v4.bind(("127.0.0.1", port))
            v6 = socket.socket(socket.AF_INET6)
            v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            v6.bind(("::1", port))
        except OSError:
            continue
        servers += [(v4, "tcp4"), (v6, "tcp6")]
        break
    for path in unix:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        os.chmod(path, 0o777)
        servers.append((s, str(path)))
    seen: list[str] = []
    stop = threading.Event()

    def serve(srv: socket.socket, label: str) -> None:
        # A backlog for a burst: 40 connections at once overflowed 16, and a dropped SYN is
        # retried after 1 s, 2 s, 4 s... (a test of 40 at once read as a slow relay).
        srv.listen(256)
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            seen.append(label)
            with contextlib.suppress(OSError):
                conn.sendall(b"hello\n")
            conn.close()

    threads = [threading.Thread(target=serve, args=s, daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        yield Listening(port, [str(p) for p in unix], seen)
    finally:
        stop.set()
        for t in threads:
            t.join(2)
        for srv, _ in servers:
            srv.close()


PROBE_JS = r"""
// node probe.js JSON: connect to each target ({host, port} or {path}), send `send`, and print
// "LABEL connected" or "LABEL CODE". The host decides what got through (its servers' logs).
const net = require('net');
const cfg = JSON.parse(process.argv[2]);
(async () => {
  for (const t of cfg.targets) {
    const label = t.path || `${t.host}:${t.port}`;
    const r = await new Promise((res) => {
      const c = net.connect(t.path ? { path: t.path } : { host: t.host, port: t.port });
      const done = (x) => { c.destroy(); res(x); };
      c.setTimeout(3000, () => done('timeout'));
      c.on('connect', () => {
        c.write(cfg.send || 'probe\n');
        setTimeout(() => done('connected'), 300);
      });
      c.on('error', (e) => done(e.code));
    });
    console.log(label + ' ' + r);
  }
})();
"""
