"""Starting `fusion-oci dashboard` as a user would, and talking to it over loopback only."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Dashboard:
    proc: subprocess.Popen[str]
    url: str
    token: str | None
    output: list[str]

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 0

    def request(
        self, path: str, headers: dict[str, str] | None = None, timeout: float = 30
    ) -> tuple[int, dict[str, str], bytes]:
        # http.client, not urllib: a proxy from the environment must never be used
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("GET", path, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def json(self, path: str) -> Any:
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        status, _, body = self.request(path, headers)
        assert status == 200, body
        return json.loads(body)


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The process's stdout lines, read by a thread (select() on a buffered pipe misses
    lines already in the buffer)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _read_line(lines: queue.Queue[str | None], proc: subprocess.Popen[str], deadline: float) -> str:
    try:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
    except queue.Empty:
        line = None
    if line is None:
        stderr = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
        raise AssertionError(f"dashboard printed no address (exit {proc.poll()}) {stderr}")
    return line


@contextlib.contextmanager
def dashboard(
    audit_log: Path, *args: str, expect_token: bool = False, timeout: float = 30
) -> Iterator[Dashboard]:
    """`fusion-oci dashboard --audit-log FILE ARGS...`, stopped (by its pid) on exit."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fusion_oci.cli.main",
            "dashboard",
            "--audit-log",
            str(audit_log),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + timeout
        lines = _lines(proc)
        output = [_read_line(lines, proc, deadline)]
        url = output[0].split()[2]
        token = None
        if expect_token:
            output += [_read_line(lines, proc, deadline), _read_line(lines, proc, deadline)]
            token = output[1].split()[-1]
        yield Dashboard(proc, url, token, output)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, from /proc (IPv4)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and inode in inodes:  # 0A: LISTEN
            addr_hex, port_hex = local.split(":")
            octets = [str(int(addr_hex[i : i + 2], 16)) for i in (6, 4, 2, 0)]
            found.append((".".join(octets), int(port_hex, 16)))
    return found
