"""`fusion-oci dashboard` as a server: where it binds, what it refuses, who it lets in, and
its JSON API and event stream on a real uvicorn over loopback."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusion_oci.audit import DisposeEvent, RunEvent
from fusion_oci.dashboard import server
from fusion_oci.errors import FlagError
from tests.auditgen import append_raw, task_events, write_log
from tests.integration.dashboard_fixture import dashboard, listening_addresses


@pytest.fixture(autouse=True)
def _audit_key_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit key the writers make (and the dashboard checks MACs with) lives in the
    test's own state folder, not the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture
def audit_log(tmp_path: Path) -> Path:
    path = tmp_path / "audit.jsonl"
    write_log(path, task_events(12), malformed_at={5})
    return path


def test_port_4040_is_refused_before_any_socket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def no_socket(*args: object, **kwargs: object) -> None:
        raise AssertionError("a socket was made for a refused port")

    monkeypatch.setattr(socket, "socket", no_socket)
    monkeypatch.setattr(socket, "getaddrinfo", no_socket)
    for host in ("127.0.0.1", "0.0.0.0", "::1"):  # never bound: refused first
        with pytest.raises(FlagError, match="4040"):
            server.serve(tmp_path / "audit.jsonl", host=host, port=4040)
        with pytest.raises(FlagError, match="4040"):
            server.bind(host, 4040)


@pytest.mark.parametrize("args", [["--port", "4040"], ["--host", "127.0.0.2", "--port", "4040"]])
def test_cli_refuses_4040_with_exit_2(args: list[str], audit_log: Path) -> None:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "fusion_oci.cli.main",
            "dashboard",
            "--audit-log",
            str(audit_log),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 2
    assert "--port 4040 is refused" in p.stderr and "hint:" in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


def test_a_busy_port_is_a_clear_error(audit_log: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "fusion_oci.cli.main",
                "dashboard",
                "--audit-log",
                str(audit_log),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    assert p.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in p.stderr


def test_binds_loopback_and_a_free_port_by_default(audit_log: Path) -> None:
    with dashboard(audit_log) as d:
        assert d.host == "127.0.0.1" and d.port not in (0, 4040)
        assert listening_addresses(d.proc.pid) == [("127.0.0.1", d.port)]
        assert d.token is None and "token" not in " ".join(d.output)
        status, headers, _ = d.request("/api/summary")
        assert status == 200
        assert headers["content-type"] == "application/json"
        assert "default-src 'self'" in headers["content-security-policy"]
        # DNS rebinding: a page from elsewhere that resolves its name to 127.0.0.1 is refused
        status, _, _ = d.request("/api/summary", {"host": "attacker.example"})
        assert status == 400


@pytest.mark.parametrize("host", ["::1", "localhost"])
def test_other_loopback_names_need_no_token_but_the_right_host(host: str, audit_log: Path) -> None:
    with dashboard(audit_log, "--host", host) as d:
        assert d.token is None and d.port not in (0, 4040)
        name = "[::1]" if host == "::1" else "127.0.0.1"
        assert d.url == f"http://{name}:{d.port}/"
        for good in (f"{name}:{d.port}", f"localhost:{d.port}"):
            assert d.request("/api/summary", {"host": good})[0] == 200, good
        for bad in ("attacker.example", f"attacker.example:{d.port}", "[::2]"):
            assert d.request("/api/summary", {"host": bad})[0] == 400, bad


def test_non_loopback_bind_needs_the_token(audit_log: Path) -> None:
    """127.0.0.2 is not one of the no-token hosts, so it stands in for a LAN address here
    (and keeps every byte of the test on loopback)."""
    with dashboard(audit_log, "--host", "127.0.0.2", expect_token=True) as d:
        assert d.host == "127.0.0.2"
        assert listening_addresses(d.proc.pid) == [("127.0.0.2", d.port)]
        assert d.token and len(d.token) >= 24
        for path in (
            "/",
            "/api/summary",
            "/api/events",
            "/api/stream",
            "/task/x",
            "/static/dashboard.js",
        ):
            assert d.request(path)[0] == 401, path
            assert d.request(path, {"authorization": "Bearer wrong"})[0] == 401, path
            assert d.request(f"{path}?token=wrong")[0] == 401, path
        assert d.request("/api/summary", {"authorization": f"Bearer {d.token}"})[0] == 200
        status, headers, _ = d.request(f"/?token={d.token}")
        assert status == 200
        cookie = headers["set-cookie"].split(";")[0]
        assert "HttpOnly" in headers["set-cookie"] and "SameSite=Strict" in headers["set-cookie"]
        assert d.request("/api/summary", {"cookie": cookie})[0] == 200
        assert d.request("/api/summary", {"cookie": cookie + "x"})[0] == 401


def test_api_summary_and_events(audit_log: Path) -> None:
    events = task_events(12)
    with dashboard(audit_log) as d:
        s = d.json("/api/summary")
        assert s["log"]["events"] == len(events)
        assert s["log"]["malformed"] == 1
        assert s["runs"]["total"] == sum(1 for e in events if e.type == "sandbox:run")
        assert s["chain"]["status"] in {"ok", "broken", "unsupported", "pending", "error"}
        assert s["source"]["path"] == str(audit_log)
        mine = d.json("/api/events?task=task-00004")
        assert [e["type"] for e in mine["events"]] == [
            e.type for e in events if e.task_id == "task-00004"
        ]
        page = d.json("/api/events?limit=5")
        assert [e["line"] for e in page["events"]] == [1, 2, 3, 4, 5]
        rest = d.json(f"/api/events?since={page['next']}&limit=10000")
        assert len(page["events"]) + len(rest["events"]) == len(events)
        by_time = d.json("/api/events?since=2026-12-01T09:00:00%2B00:00&limit=10000")
        assert all(e["ts"] > "2026-12-01T09:00:00" for e in by_time["events"])
        assert 0 < len(by_time["events"]) < len(events)
        status, _, body = d.request("/api/events?since=yesterday")
        assert status == 400 and b"since=" in body
        assert d.request("/task/no-such-task")[0] == 404
        status, _, html = d.request("/task/task-00004")
        assert status == 200 and b"task-00004" in html


def test_stream_sends_appended_events_and_summaries(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = write_log(path, task_events(2))
    with dashboard(path) as d:
        conn = http.client.HTTPConnection(d.host, d.port, timeout=20)
        conn.request("GET", "/api/stream")
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("content-type", "").startswith("text/event-stream")

        def next_event() -> tuple[str, dict[str, object]]:
            name = ""
            while True:
                line = resp.readline().decode().rstrip("\n")
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    return name, json.loads(line[6:])

        name, ready = next_event()
        assert (name, ready) == ("ready", {"cursor": len(task_events(2))})
        name, first = next_event()
        assert name == "summary"
        assert first["log"]["events"] == len(task_events(2))  # type: ignore[index]
        log.emit(
            RunEvent(
                task_id="late",
                run_id="r",
                backend="oci",
                duration_ms=5,
                exit_code=0,
                end_reason="exit",
                command="true",
            )
        )
        append_raw(path, b"garbage\n")
        got: dict[str, dict[str, object]] = {}
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and "summary" not in got:
            name, data = next_event()
            got[name] = data
        assert got["audit"]["taskId"] == "late"
        summary = got["summary"]
        assert summary["log"]["malformed"] == 1  # type: ignore[index]
        assert summary["runs"]["total"] == first["runs"]["total"] + 1  # type: ignore[index]
        conn.close()


def test_an_empty_or_missing_log_is_served(tmp_path: Path) -> None:
    with dashboard(tmp_path / "missing.jsonl") as d:
        s = d.json("/api/summary")
        assert s["log"]["events"] == 0 and s["runs"]["total"] == 0
        assert d.json("/api/events") == {"events": [], "next": 0}
        assert d.request("/")[0] == 200


def test_audit_summary_is_the_api_summary(audit_log: Path, tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fusion_oci.cli.main", "audit", "--summary", *args],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )

    p = cli("--json", "--audit-log", str(audit_log))
    assert p.returncode == 0, p.stderr
    terminal = json.loads(p.stdout)
    with dashboard(audit_log) as d:
        api = d.json("/api/summary")
    for doc in (terminal, api):
        doc.pop("source")
        doc.pop("chain")
    assert terminal == api
    p = cli("--audit-log", str(audit_log))
    assert p.returncode == 0
    words = " ".join(p.stdout.split())  # rich wraps at the terminal's width
    assert "runs and durations per backend" in words and "1 malformed" in words
    p = cli("--audit-log", str(tmp_path / "none.jsonl"))
    assert p.returncode == 0 and "0 events in 0 lines" in " ".join(p.stdout.split())


def test_chain_status_follows_the_log(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    write_log(path, task_events(3))

    def chain_when(d: object, predicate: object, timeout: float = 20) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chain = d.json("/api/summary")["chain"]  # type: ignore[attr-defined]
            if predicate(chain):  # type: ignore[operator]
                return chain  # type: ignore[no-any-return]
            time.sleep(0.2)
        raise AssertionError(f"chain status stayed {chain}")

    with dashboard(path) as d:
        ok = chain_when(d, lambda c: c["status"] != "pending")
        assert ok == {
            "status": "ok",
            "lines": len(task_events(3)),
            "firstBadLine": None,
            "reason": None,
            "keyed": True,
        }
        append_raw(path, b'{"type": "sandbox:run", "forged": true}\n')
        broken = chain_when(d, lambda c: c["status"] == "broken")
        assert broken["firstBadLine"] == len(task_events(3)) + 1


def test_stream_without_events_sends_only_summaries(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = write_log(path, task_events(1))
    with dashboard(path) as d:
        conn = http.client.HTTPConnection(d.host, d.port, timeout=20)
        conn.request("GET", "/api/stream?events=0", headers={"last-event-id": "0"})
        resp = conn.getresponse()
        names: list[str] = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and names.count("summary") < 2:
            line = resp.readline().decode()
            if line.startswith("event: "):
                names.append(line[7:].strip())
                if names.count("summary") == 1 and names[-1] == "summary":
                    log.emit(DisposeEvent(task_id="t", run_id="r", backend="oci"))
        conn.close()
    assert names == ["ready", "summary", "summary"]
