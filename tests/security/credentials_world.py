"""The world the credential tests (issue #24) push and fetch in: a network namespace the test
creates (never the internet) with TLS servers signed by a test CA, and the names the task's
proxy maps to them.

- ``git.test`` (10.214.N.2:443): smart HTTP, ``git http-backend`` run as CGI behind a small
  Python TLS server (repositories ``repo.git`` and ``other.git``); it answers 401 until a
  request's basic auth is the real token.
- ``registry.test`` (10.214.N.3:443): registry-like; a package document for ``Bearer <real>``,
  401 otherwise. With the real token, ``/echo...`` echoes the request's headers as an
  attacker's endpoint would: ``/echo`` and ``/echo/headers`` as JSON, ``/echo-gzip``
  gzip-compressed (``Content-Encoding: gzip``, whatever the request accepts),
  ``/echo-base64`` base64-encoded, ``/echo-reversed`` reversed, ``/echo-half1`` and
  ``/echo-half2`` each one half of the ``Authorization`` header. ``/gz-pkg`` and ``/br-pkg``:
  the package document gzip- or (not really) brotli-encoded, whatever the request accepts.
- ``other.test`` (10.214.N.4): allowed but no credential's host: plain HTTP on 8080 and TLS on
  443; it answers ``other-ok``. ``/pipelined-first`` keeps the connection open even when
  asked to close (a server that answers requests pipelined after it).

Every server logs each request's line and headers (``log``), so a test sees on the far side
what arrived: the real token only where it belongs, a sentinel never swapped elsewhere.
Imports nothing of pytest.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.netns import drop_stale_namespaces, free_subnet, ip

SERVER = r"""
import http.server, json, os, socketserver, ssl, subprocess, sys, threading, base64, time, gzip
def orphaned(parent=os.getppid()):
    # The world ends with the test process, even a killed one.
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(0)
threading.Thread(target=orphaned, daemon=True).start()
root, token, log_path, certs, addrs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], \
    sys.argv[5].split(",")
log = open(log_path, "a", buffering=1)
git_addr, reg_addr, other_addr = addrs

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b""): pass
                    return out
                out += self.rfile.read(size); self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))
    def answer(self, status, body, ctype="text/plain", extra=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra: self.send_header(k, v)
        self.end_headers(); self.wfile.write(body)
    def handle_any(self):
        host = self.server.name
        data = self.body()
        log.write(json.dumps({"host": host, "line": self.requestline,
                              "headers": dict(self.headers),
                              "body": data[:4096].decode("latin-1")}) + "\n")
        auth = self.headers.get("Authorization", "")
        if host == "git.test":
            want = "Basic " + base64.b64encode(f"x-access-token:{token}".encode()).decode()
            if auth != want:
                return self.answer(401, b"auth\n",
                                   extra=[("WWW-Authenticate", 'Basic realm="git"')])
            return self.git(data)
        if host == "registry.test":
            basic = "Basic " + base64.b64encode(f"x:{token}".encode()).decode()
            if auth not in (f"Bearer {token}", basic):
                return self.answer(401, b'{"error":"unauthorized"}', "application/json")
            if self.path.startswith("/echo"):
                seen = json.dumps(dict(self.headers)).encode()
                half = len(auth) // 2
                forms = {"/echo-gzip": gzip.compress(seen), "/echo-base64": base64.b64encode(seen),
                         "/echo-reversed": seen[::-1], "/echo-half1": auth[:half].encode(),
                         "/echo-half2": auth[half:].encode()}
                extra = [("Content-Encoding", "gzip")] if self.path == "/echo-gzip" else []
                return self.answer(200, forms.get(self.path, seen), "application/json", extra)
            doc = {"name": "private-pkg", "dist-tags": {"latest": "4.2.0"},
                   "versions": {"4.2.0": {"name": "private-pkg", "version": "4.2.0",
                   "dist": {"tarball": "https://registry.test/private-pkg/-/private-pkg-4.2.0.tgz"}}}}
            if self.path in ("/gz-pkg", "/br-pkg"):  # encoded whatever the request accepts
                coded = self.path == "/gz-pkg"
                body = gzip.compress(json.dumps(doc).encode()) if coded else b"\x0b\x02\x80{}\x03"
                return self.answer(200, body, "application/json",
                                   [("Content-Encoding", "gzip" if coded else "br")])
            return self.answer(200, json.dumps(doc).encode(), "application/json")
        self.answer(200, b"other-ok\n")
        if self.path == "/pipelined-first":
            self.close_connection = False
    do_GET = do_POST = do_PUT = handle_any
    def git(self, data):
        path, _, query = self.path.partition("?")
        env = {"GIT_PROJECT_ROOT": root, "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path,
               "QUERY_STRING": query, "REQUEST_METHOD": self.command,
               "REMOTE_USER": "x-access-token",
               "REMOTE_ADDR": "10.0.0.1", "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(data)), "PATH": "/usr/bin:/bin",
               "GIT_PROTOCOL": self.headers.get("Git-Protocol", "")}
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        out = subprocess.run(["git", "http-backend"], input=data, env=env,
                             capture_output=True).stdout
        head, _, body = out.partition(b"\r\n\r\n")
        status, headers = 200, []
        for line in head.decode().split("\r\n"):
            k, _, v = line.partition(":")
            if k.lower() == "status": status = int(v.split()[0])
            elif k: headers.append((k, v.strip()))
        self.send_response(status)
        for k, v in headers: self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)

class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

def serve(name, addr, port, tls):
    srv = Server((addr, port), Handler); srv.name = name
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(f"{certs}/{name}.pem")
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()

serve("git.test", git_addr, 443, True)
serve("registry.test", reg_addr, 443, True)
serve("other.test", other_addr, 443, True)
serve("other.test", other_addr, 8080, False)
log.write('{"ready": true}\n')
threading.Event().wait()
"""


@dataclass(frozen=True)
class CredentialsWorld:
    """The namespace, its servers, the test CA and the real token (module docstring)."""

    netns: str
    prefix: str
    token: str
    ca_file: Path
    repo: Path
    log: Path

    @property
    def names(self) -> dict[str, list[str]]:
        """What the task's proxy resolves each test name to."""
        return {
            "git.test": [f"{self.prefix}.2"],
            "registry.test": [f"{self.prefix}.3"],
            "other.test": [f"{self.prefix}.4"],
        }

    @property
    def allowed_domains(self) -> list[str]:
        return ["git.test", "registry.test", "other.test", f"{self.prefix}.0/24"]

    def credentials(self, refs: list[str] | None = None) -> list[dict[str, object]]:
        """The settings' ``credentials`` entries (the value read from the env var)."""
        return [
            {
                "name": "GITHUB_TOKEN",
                "hosts": ["git.test"],
                "from": {"env": "FUSION_TEST_TOKEN"},
                "allowedRefs": refs if refs is not None else ["refs/heads/fusion/*"],
                "allowedRepos": ["repo"],
                "caFile": str(self.ca_file),
            },
            {
                "name": "NPM_TOKEN",
                "hosts": ["registry.test"],
                "from": {"command": ["printenv", "FUSION_TEST_TOKEN"]},
                "caFile": str(self.ca_file),
            },
        ]

    def seen(self) -> str:
        """Everything the servers logged so far."""
        try:
            return self.log.read_text()
        except OSError:
            return ""

    def ref(self, ref: str) -> str | None:
        """The commit a ref of the server's repository points to, or None."""
        done = subprocess.run(
            ["git", "-C", str(self.repo / "repo.git"), "rev-parse", "--verify", "-q", ref],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout.strip() or None


def _cert(name: str, ca_key: object, ca_cert: object, out: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    assert isinstance(ca_cert, x509.Certificate) and isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    out.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _test_ca(folder: Path) -> Path:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fusion-oci credentials test CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    ca_file = folder / "test-ca.pem"
    ca_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    for host in ("git.test", "registry.test", "other.test"):
        _cert(host, key, cert, folder / f"{host}.pem")
    return ca_file


def _git(*args: str, cwd: Path | None = None) -> None:
    subprocess.run(
        ["git", *args],
        check=True,
        capture_output=True,
        timeout=60,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd or "/"), "GIT_CONFIG_NOSYSTEM": "1"},
    )


@contextlib.contextmanager
def credentials_world(base: Path, token: str) -> Iterator[CredentialsWorld]:
    """Create the namespace, the test CA, the bare repository and the servers; remove them
    (and what a killed run of an earlier process left)."""
    drop_stale_namespaces("fusion-cred-")
    pid = os.getpid()
    netns, host_if, ns_if = f"fusion-cred-{pid}", f"fc{pid}h"[:15], f"fc{pid}n"[:15]
    prefix = free_subnet("10.214", pid)
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)
    certs = base / "certs"
    certs.mkdir()
    ca_file = _test_ca(certs)
    ca_file.chmod(0o644)
    repos = base / "repos"
    repos.mkdir()
    for name in ("repo.git", "other.git"):  # other.git: a repository no credential may push to
        _git("init", "-q", "--bare", "-b", "main", str(repos / name))
        _git("-C", str(repos / name), "config", "http.receivepack", "true")
    log = base / "credentials-world.log"
    log.touch()
    server: subprocess.Popen[bytes] | None = None
    ip("netns", "add", netns)
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", netns)
        ip("addr", "add", f"{prefix}.1/24", "dev", host_if)
        ip("link", "set", host_if, "up")
        for n in (2, 3, 4):
            ip("-n", netns, "addr", "add", f"{prefix}.{n}/24", "dev", ns_if)
        ip("-n", netns, "link", "set", ns_if, "up")
        ip("-n", netns, "link", "set", "lo", "up")
        script = base / "credentials-world-server.py"
        script.write_text(SERVER)
        errors = base / "credentials-world-server.err"
        with errors.open("wb") as err:
            server = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    netns,
                    sys.executable,
                    str(script),
                    str(repos),
                    token,
                    str(log),
                    str(certs),
                    ",".join(f"{prefix}.{n}" for n in (2, 3, 4)),
                ],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        deadline = time.monotonic() + 15
        while '"ready"' not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, (
                f"the credentials world's server did not start: {errors.read_text()[-1000:]}"
            )
            time.sleep(0.1)
        with contextlib.suppress(OSError), socket.create_connection((f"{prefix}.4", 8080), 2):
            pass
        log.write_text("")
        yield CredentialsWorld(netns, prefix, token, ca_file, repos, log)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        with contextlib.suppress(subprocess.CalledProcessError):
            ip("link", "del", host_if)
        ip("netns", "del", netns)
