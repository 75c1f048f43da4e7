"""The world the ``network: filtered`` probes reach for, in one place for every runtime: a
network namespace the test creates (never the internet) with HTTP servers on two addresses, the
names the proxy maps to them, and one probe program that a sandboxed command runs.

- :class:`EgressWorld` (:func:`egress_world`): ``ip netns add``, a veth pair (the host end
  10.213.N.1, the namespace's 10.213.N.2 "allowed.test" and 10.213.N.3 "denied.test"), and a
  server there on TCP 8080 (answers ``fusion-egress-ok ADDR``) and UDP 53/5353, which logs every
  peer and datagram: what reached it, and from where, is observed outside the sandbox.
- :func:`resolving`: the task proxy resolves the world's names (``start_proxy``'s
  ``resolve_override``, the proxy's seam for tests); production uses the host's resolver.
- :data:`PROBE_JS` (node: in the host's /usr and in the node image alike) tries everything a
  command could, with and without the proxy variables, and prints one JSON object;
  :func:`judge` turns it, the server's log and a host loopback server's view into one verdict
  per probe (``leaked``: True/False) for tests/security/test_egress.py and the integration test.

Imports nothing of pytest: the rootless driver (tests/integration/rootless_driver.py) uses
:func:`resolving` as the CI user.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusion_oci.models import NetworkMode, SandboxPolicy
from tests.conftest import git, git_init
from tests.netns import drop_stale_namespaces, free_subnet, ip

PNPM_PROJECT = Path(__file__).resolve().parents[1] / "data" / "pnpm-project"

PORT = 8080
METADATA = "169.254.169.254"

SERVER = r"""
import os, socket, sys, threading, time
log = open(sys.argv[1], "a", buffering=1)
def orphaned(parent=os.getppid()):
    # The world (a namespace this process holds) ends with the test process, even a killed one.
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(0)
threading.Thread(target=orphaned, daemon=True).start()
def serve_tcp():
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", PORT)); srv.listen(64)
    while True:
        conn, peer = srv.accept()
        threading.Thread(target=answer, args=(conn, peer), daemon=True).start()
def answer(conn, peer):
    with conn:
        conn.settimeout(5)
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < 8192:
                got = conn.recv(4096)
                if not got: break
                head += got
        except OSError:
            pass
        log.write(f"tcp {peer[0]} {conn.getsockname()[0]} {head[:60]!r}\n")
        body = f"fusion-egress-ok {conn.getsockname()[0]}\n".encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\nConnection: close\r\n\r\n" + body)
def serve_udp(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", port))
    while True:
        data, peer = s.recvfrom(65536)
        log.write(f"udp {peer[0]} {port} {len(data)}\n")
for p in (53, 5353):
    threading.Thread(target=serve_udp, args=(p,), daemon=True).start()
serve_tcp()
""".replace("PORT", str(PORT))


@dataclass(frozen=True)
class EgressWorld:
    """The namespace, its addresses and the server's log (see the module docstring)."""

    netns: str
    """Its name under /run/netns (``ip netns exec``); :meth:`inside` does not need it."""
    host_addr: str
    allowed_addr: str
    denied_addr: str
    log: Path
    pid: int = 0
    """The server's pid: the namespace lives as long as it does."""

    def inside(self, argv: list[str]) -> list[str]:
        """``argv`` run in the world's namespace, entered by the server's pid (a name under
        /run/netns can be hidden by another process re-mounting that folder meanwhile)."""
        return ["nsenter", f"--net=/proc/{self.pid}/ns/net", "--", *argv]

    @property
    def names(self) -> dict[str, list[str]]:
        """What the proxy resolves each test name to."""
        return {
            "allowed.test": [self.allowed_addr],
            "denied.test": [self.denied_addr],
            "other.test": [self.allowed_addr],
            "loop.test": ["127.0.0.1"],
            "meta.test": [METADATA],
        }

    def policy(self) -> SandboxPolicy:
        """filtered: allowed.test (and its private address, which the proxy refuses unless
        named), loop.test and meta.test allowed by name (their addresses still refused),
        denied.test denied; other.test not listed."""
        return SandboxPolicy(
            network=NetworkMode.FILTERED,
            allowed_domains=["allowed.test", f"{self.allowed_addr}/32", "loop.test", "meta.test"],
            denied_domains=["denied.test"],
        )

    def config(self, host_port: int) -> str:
        """The probe program's argument."""
        return json.dumps(
            {
                "allowed": "allowed.test",
                "denied": "denied.test",
                "unlisted": "other.test",
                "loop": "loop.test",
                "meta": "meta.test",
                "port": PORT,
                "allowedAddr": self.allowed_addr,
                "deniedAddr": self.denied_addr,
                "hostPort": host_port,
                "metadata": METADATA,
            }
        )

    def seen(self) -> list[str]:
        """The server's log lines so far."""
        try:
            return self.log.read_text().splitlines()
        except OSError:
            return []


@contextlib.contextmanager
def egress_world(base: Path) -> Iterator[EgressWorld]:
    """Create the namespace and its server; remove both at the end (and what a killed run of
    an earlier process left)."""
    drop_stale_namespaces("fusion-egress-")
    netns, host_if, ns_if = f"fusion-egress-{os.getpid()}", f"fe{os.getpid()}h", f"fe{os.getpid()}n"
    prefix = free_subnet("10.213", os.getpid())
    log = base / "egress-world.log"
    log.touch()
    log.chmod(0o644)
    server: subprocess.Popen[bytes] | None = None
    script = base / "egress-world-server.py"
    script.write_text(SERVER)
    errors = base / "egress-world-server.err"
    try:
        # The server makes the namespace (unshare execs it) and holds it: no name to lose.
        with errors.open("wb") as err:
            server = subprocess.Popen(
                ["unshare", "--net", "--", sys.executable, str(script), str(log)],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        inside = ["nsenter", f"--net=/proc/{server.pid}/ns/net", "--", "ip"]
        ip("link", "add", host_if[:15], "type", "veth", "peer", "name", ns_if[:15])
        ip("link", "set", ns_if[:15], "netns", str(server.pid))
        ip("addr", "add", f"{prefix}.1/24", "dev", host_if[:15])
        ip("link", "set", host_if[:15], "up")
        for addr in (f"{prefix}.2/24", f"{prefix}.3/24"):
            _run([*inside, "addr", "add", addr, "dev", ns_if[:15]])
        _run([*inside, "link", "set", ns_if[:15], "up"])
        _run([*inside, "link", "set", "lo", "up"])
        # A name as well, for `ip netns exec` (best effort: the pid is what this module uses).
        subprocess.run(
            ["ip", "netns", "attach", netns, str(server.pid)],
            capture_output=True,
            timeout=30,
            check=False,
        )
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError):
                import socket

                with socket.create_connection((f"{prefix}.2", PORT), timeout=1) as probe:
                    probe.sendall(b"GET /ready HTTP/1.0\r\n\r\n")
                    probe.recv(100)
                break
            assert server.poll() is None and time.monotonic() < deadline, (
                f"the egress world's server did not start: {errors.read_text()[-1000:]}"
            )
            time.sleep(0.1)
        log.write_text("")  # the readiness check is not a probe's connection
        yield EgressWorld(netns, f"{prefix}.1", f"{prefix}.2", f"{prefix}.3", log, server.pid)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        for argv in (["ip", "link", "del", host_if[:15]], ["ip", "netns", "del", netns]):
            subprocess.run(argv, capture_output=True, timeout=30, check=False)


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def resolving(names: Mapping[str, list[str]] | None) -> Iterator[None]:
    """Task proxies started meanwhile (in this process) resolve ``names`` only."""
    if not names:
        yield
        return
    import fusion_oci.egress.task as task

    real = task.start_proxy

    async def start_proxy(**kw: Any) -> Any:
        return await real(**kw, resolve_override=dict(names))

    task.start_proxy = start_proxy  # type: ignore[assignment]
    try:
        yield
    finally:
        task.start_proxy = real


PROBE_JS = r"""
const net = require('net'), dgram = require('dgram'), dns = require('dns');
const c = JSON.parse(process.argv[1]);
const proxy = (process.env.HTTP_PROXY || '').replace('http://', '').replace(/\/$/, '');
const [ph, pp] = proxy ? [proxy.slice(0, proxy.lastIndexOf(':')),
                          +proxy.slice(proxy.lastIndexOf(':') + 1)] : ['', 0];
function talk(host, port, first, then, ms = 6000) {
  return new Promise(res => {
    let buf = '', done = false, sent = false;
    const s = net.connect({host, port});
    const fin = v => { if (!done) { done = true; s.destroy(); res(v); } };
    s.setTimeout(ms, () => fin(buf ? buf : 'error timeout'));
    s.on('connect', () => { if (first) s.write(first); });
    s.on('data', d => {
      buf += d;
      if (then && !sent && buf.includes('\r\n\r\n')) {
        if (!/^HTTP\/1\.. 200/.test(buf)) return fin(buf);
        sent = true; buf = ''; s.write(then);
      }
    });
    s.on('end', () => fin(buf));
    s.on('error', e => fin(buf ? buf : 'error ' + e.code));
  });
}
const get = h => `GET / HTTP/1.1\r\nHost: ${h}\r\nConnection: close\r\n\r\n`;
const connect = (h, p) => `CONNECT ${h}:${p} HTTP/1.1\r\nHost: ${h}:${p}\r\n\r\n`;
const viaConnect = (h, p) => proxy ? talk(ph, pp, connect(h, p), get(h)) : 'error no proxy';
const viaPlain = (h, p) => proxy ? talk(ph, pp, `GET http://${h}:${p}/ HTTP/1.1\r\n` +
  `Host: ${h}:${p}\r\nConnection: close\r\n\r\n`) : 'error no proxy';
const udp = (addr, port) => new Promise(res => {
  const s = dgram.createSocket('udp4');
  // Where socket() itself is refused (landlock), node reports it as an 'error' event.
  s.on('error', e => { s.close(); res('error ' + e.code); });
  s.send(Buffer.from('fusion-egress-probe'), port, addr, e => {
    s.close(); res(e ? 'error ' + e.code : 'sent'); });
});
const outsideDns = () => new Promise(res => {
  const r = new dns.Resolver({timeout: 2000, tries: 1});
  r.setServers([c.allowedAddr]);
  r.resolve4(c.allowed, (e, a) => res(e ? 'error ' + e.code : 'answer ' + a));
});
const lookup = h => new Promise(res => dns.lookup(h, (e, a) => res(e ? 'error ' + e.code
                                                                     : 'answer ' + a)));
(async () => {
  const out = {};
  out.allowed_connect = await viaConnect(c.allowed, c.port);
  out.allowed_plain = await viaPlain(c.allowed, c.port);
  out.denied = await viaConnect(c.denied, c.port);
  out.denied_plain = await viaPlain(c.denied, c.port);
  out.unlisted = await viaConnect(c.unlisted, c.port);
  out.loop = await viaConnect(c.loop, c.hostPort);
  out.host_loopback_proxy = await viaConnect('127.0.0.1', c.hostPort);
  out.metadata_proxy = await viaConnect(c.metadata, 80);
  out.metadata_name = await viaConnect(c.meta, 80);
  out.direct_allowed = await talk(c.allowedAddr, c.port, get(c.allowed));
  out.direct_denied = await talk(c.deniedAddr, c.port, get(c.denied));
  out.direct_host_loopback = await talk('127.0.0.1', c.hostPort, 'probe\n', null, 3000);
  out.direct_slirp_gateway = await talk('10.0.2.2', c.hostPort, 'probe\n', null, 3000);
  out.direct_metadata = await talk(c.metadata, 80, get(c.metadata), null, 3000);
  out.direct_name = await talk(c.allowed, c.port, get(c.allowed), null, 3000);
  out.udp = await udp(c.allowedAddr, 5353);
  out.dns_outside = await outsideDns();
  out.dns_system = await lookup(c.allowed);
  console.log('EGRESS-PROBE ' + JSON.stringify(out));
})();
"""


def probe_command(world: EgressWorld, host_port: int) -> list[str]:
    """The command a sandbox runs: the probe program with the world's names and addresses."""
    return ["node", "-e", PROBE_JS, world.config(host_port)]


def tagged_answer(stdout: str, tag: str, what: str) -> dict[str, str]:
    """The JSON object a probe program printed on its first line starting ``<tag> ``; none
    fails the test, naming the probe (``what``) and showing the end of ``stdout``."""
    for line in stdout.splitlines():
        if line.startswith(f"{tag} "):
            answer: dict[str, str] = json.loads(line.removeprefix(f"{tag} "))
            return answer
    raise AssertionError(f"the {what} probe printed no answer: {stdout[-2000:]!r}")


def parse(stdout: str) -> dict[str, str]:
    """The probe program's answer."""
    return tagged_answer(stdout, "EGRESS-PROBE", "egress")


OK = "fusion-egress-ok"


def refused(answer: str, *words: str) -> bool:
    """A 403 from the proxy whose text names ``words`` (the host, the rule)."""
    return answer.startswith("HTTP/1.1 403") and all(w in answer for w in words)


def failed(answer: str) -> bool:
    """A direct attempt that reached nothing (an error, never an answer)."""
    return answer.startswith("error ")


def judge(
    out: Mapping[str, str], world: EgressWorld, loopback_seen: list[str]
) -> dict[str, tuple[bool, str]]:
    """probe id -> (leaked, detail): what the sandbox's command got, what the world's server
    logged (every peer must be the host end, i.e. the proxy), what the host loopback server
    saw (nothing)."""
    log = world.seen()
    strangers = [
        line for line in log if line.startswith("tcp ") and line.split()[1] != world.host_addr
    ]
    datagrams = [line for line in log if line.startswith("udp ")]
    verdicts = {
        "egress-denied-host": not (
            refused(out["denied"], "denied.test", "deniedDomains")
            and refused(out["denied_plain"], "denied.test")
            and refused(out["unlisted"], "other.test", "allowedDomains")
        ),
        "egress-direct-connect": not (
            failed(out["direct_allowed"]) and failed(out["direct_denied"])
        )
        or bool(strangers),
        "egress-raw-udp": bool(datagrams),
        "egress-outside-dns": not failed(out["dns_outside"])
        or not failed(out["dns_system"])
        or bool(datagrams),
        "egress-host-loopback": bool(loopback_seen)
        or not (
            refused(out["host_loopback_proxy"])
            and OK not in out["direct_host_loopback"]
            and failed(out["direct_slirp_gateway"])
        ),
        "egress-metadata": not (
            refused(out["metadata_proxy"])
            and refused(out["metadata_name"])
            and failed(out["direct_metadata"])
        ),
        "egress-rebind-loopback": bool(loopback_seen) or not refused(out["loop"], "loop.test"),
        "egress-ignores-proxy": not (failed(out["direct_name"]) and failed(out["direct_allowed"])),
    }
    detail = json.dumps(
        {
            "answers": {k: v[:200] for k, v in out.items()},
            "server": log[-20:],
            "loopback_seen": loopback_seen,
        }
    )
    return {probe: (leaked, detail) for probe, leaked in verdicts.items()}


def allowed_answers(out: Mapping[str, str], world: EgressWorld) -> bool:
    """The allowed host answered through the proxy (CONNECT and plain HTTP)."""
    return all(f"{OK} {world.allowed_addr}" in out[k] for k in ("allowed_connect", "allowed_plain"))


def pnpm_worktree_with_remote(base: Path, world: EgressWorld, port: int) -> tuple[Path, Path]:
    """A copy of the pnpm project as a git worktree whose ``origin`` is a bare repository
    (one commit, "remote commit") for ``serving`` at the allowed address on ``port``: the
    folder to serve and the worktree."""
    bare = base / "served" / "remote.git"
    seed = git_init(base / "seed")
    (seed / "README").write_text("from the remote\n")
    git(seed, "add", "README")
    git(seed, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "remote commit")
    git(base, "clone", "-q", "--bare", str(seed), str(bare))
    git(bare, "update-server-info")
    worktree = base / "wt"
    shutil.copytree(PNPM_PROJECT, worktree)
    git_init(worktree)
    git(worktree, "remote", "add", "origin", f"http://{world.allowed_addr}:{port}/remote.git")
    return bare.parent, worktree


@contextlib.contextmanager
def serving(world: EgressWorld, root: Path, port: int) -> Iterator[None]:
    """``root`` served over plain HTTP at the allowed address (a dumb-HTTP git remote)."""
    import socket

    errors = root.parent / f"http-server-{port}.err"
    with errors.open("wb") as err:
        proc = subprocess.Popen(
            world.inside(
                [
                    sys.executable,
                    "-m",
                    "http.server",
                    str(port),
                    "--bind",
                    world.allowed_addr,
                    "--directory",
                    str(root),
                ]
            ),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection((world.allowed_addr, port), timeout=1),
            ):
                break
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"no http.server: {errors.read_text()[-1000:]}"
            )
            time.sleep(0.1)
        yield
    finally:
        proc.kill()
        proc.wait()
