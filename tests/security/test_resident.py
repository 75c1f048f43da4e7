"""The fast CLI's resident server (fusion_oci/cli/fast.py) is out of the command's reach.

The server runs commands for whoever holds its token, natively if asked: a sandboxed command
that could connect to its socket *and* read the token beside it would walk out of the sandbox.
The probe starts a real server in a runtime dir under /run (where $XDG_RUNTIME_DIR lives), then
from inside the sandbox looks for the socket and the token and, where python3 is there, asks
the server to create a file on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.conftest import Prober
from tests.security.test_probes import check

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, os, socket, sys
folder, marker = sys.argv[1], sys.argv[2]
names = os.listdir(folder)
sock_path = os.path.join(folder, [n for n in names if n.endswith(".sock")][0])
token = open(os.path.join(folder, "token")).read().strip()
s = socket.socket(socket.AF_UNIX)
s.connect(sock_path)
for m in ({"id": 1, "method": "initialize", "params": {"token": token}},
          {"id": 2, "method": "cli/run", "params": {
              "argv": ["--backend", "native", "--unsafe-worktree", "--worktree", "/", "--",
                       "touch", marker],
              "cwd": "/", "env": dict(os.environ)}}):
    body = json.dumps({"jsonrpc": "2.0", **m}).encode()
    s.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
s.settimeout(30)
while s.recv(65536):
    if os.path.exists(marker):
        break
"""


@pytest.fixture
def resident_dir(tmp_path: Path) -> Iterator[Path]:
    """A resident server started by the host user's fast CLI, in a runtime dir under /run."""
    base = Path("/run") / f"fusion-oci-probe-{secrets.token_hex(4)}"
    base.mkdir(mode=0o700)
    wt = tmp_path / "host-wt"
    wt.mkdir()
    subprocess.run(["git", "init", "-q", str(wt)], check=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "XDG_RUNTIME_DIR": str(base),
        "FUSION_OCI_SERVER_IDLE": "120",
    }
    started = subprocess.run(
        [sys.executable, "-m", "fusion_oci.cli.fast", "run", "--", "true"],
        cwd=wt,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert started.returncode == 0, started.stderr
    folder = base / "fusion-oci"
    assert list(folder.glob("*.sock"))
    try:
        yield folder
    finally:
        for sock in folder.glob("*.sock"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                pid = _server_pid(sock, (folder / "token").read_text().strip())
                os.kill(pid, signal.SIGTERM)
        shutil.rmtree(base, ignore_errors=True)


def _server_pid(sock_path: Path, token: str) -> int:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(sock_path))
        body = json.dumps(
            {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"token": token}}
        ).encode()
        s.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        data = b""
        while b"}}" not in data:
            data += s.recv(65536)
        return int(json.loads(data.split(b"\r\n\r\n", 1)[1])["result"]["pid"])


def test_resident_server_is_out_of_reach(
    prober: Prober, resident_dir: Path, tmp_path: Path
) -> None:
    marker = tmp_path / f"resident-pwned-{secrets.token_hex(4)}"
    token = resident_dir / "token"
    sock = next(resident_dir.glob("*.sock"))
    script = (
        f"test -S {sock} && echo SOCKET-VISIBLE; "
        f"cat {token} >/dev/null 2>&1 && echo TOKEN-READABLE; "
        f"if command -v python3 >/dev/null; then python3 -c '{PROBE}' {resident_dir} "
        f"{marker} 2>&1 | tail -3; fi; true"
    )
    result = prober.run(script, timeout_ms=60_000)
    reached = "SOCKET-VISIBLE" in result.stdout and "TOKEN-READABLE" in result.stdout
    check(
        "resident-server",
        prober.backend,
        reached or marker.exists(),
        f"stdout: {result.stdout[-500:]!r}; host file created: {marker.exists()}",
    )
