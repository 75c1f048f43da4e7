"""The dashboard's summary and its incremental tail of the log: pure, no server."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from fusion_oci.audit import AuditEvent, AuditLog, RunEvent
from fusion_oci.dashboard import chain
from fusion_oci.dashboard.summary import SummaryBuilder, percentile
from fusion_oci.dashboard.tail import MAX_LINE, LogTail, summarize_file
from tests.auditgen import append_raw, task_events, write_log

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _audit_key_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit key the writers make (and the dashboard checks MACs with) lives in the
    test's own state folder, not the user's."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def run(
    task: str,
    backend: str,
    ms: int,
    *,
    exit_code: int | None = 0,
    reason: str = "exit",
    command: str = "pnpm test",
    ts: str = "2026-12-01T08:00:00.000+00:00",
) -> AuditEvent:
    return RunEvent(
        ts=ts,
        task_id=task,
        run_id="r",
        backend=backend,
        duration_ms=ms,
        exit_code=exit_code,
        end_reason=reason,
        command=command,
    )


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([7], 95) == 7
    values = list(range(1, 101))
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 100)) == (
        50,
        95,
        100,
    )
    assert percentile([10, 20, 30, 40], 50) == 20


def test_an_empty_summary_is_complete() -> None:
    s = SummaryBuilder().result()
    assert s["log"] == {
        "lines": 0,
        "events": 0,
        "malformed": 0,
        "malformedLines": [],
        "firstTs": None,
        "lastTs": None,
    }
    assert s["runs"] == {"total": 0, "failing": 0, "byBackend": {}}
    assert s["timeline"]["times"] == []
    assert s["durations"] == {"byBackend": [], "byCommand": [], "prepareByBackend": []}


def test_durations_end_reasons_and_failing_exits() -> None:
    b = SummaryBuilder()
    for i, ms in enumerate([100, 200, 300, 400]):
        b.add(i + 1, run("t1", "bubblewrap", ms))
    b.add(5, run("t1", "podman", 1000, exit_code=2))
    b.add(6, run("t2", "podman", 3000, exit_code=None, reason="timeout", command="pnpm build"))
    b.add_malformed(7)
    s = b.result()
    assert s["log"]["lines"] == 7
    assert (s["log"]["events"], s["log"]["malformed"], s["log"]["malformedLines"]) == (6, 1, [7])
    assert s["runs"] == {"total": 6, "failing": 2, "byBackend": {"bubblewrap": 4, "podman": 2}}
    assert s["durations"]["byBackend"] == [
        {"backend": "bubblewrap", "runs": 4, "p50": 200, "p95": 400, "max": 400},
        {"backend": "podman", "runs": 2, "p50": 1000, "p95": 3000, "max": 3000},
    ]
    by_command = {(r["command"], r["backend"]): r["runs"] for r in s["durations"]["byCommand"]}
    assert by_command == {
        ("pnpm test", "bubblewrap"): 4,
        ("pnpm test", "podman"): 1,
        ("pnpm build", "podman"): 1,
    }
    assert s["endReasons"] == {
        "exit": 5,
        "timeout": 1,
        "signal": 0,
        "max-buffer": 0,
        "oom": 0,
        "pids": 0,
        "cpu-time": 0,
        "aborted": 0,
    }
    assert s["limits"]["byTask"] == [{"taskId": "t2", "endReason": "timeout", "runs": 1}]
    assert s["failingExits"]["byCode"] == {"2": 1}
    assert [r["endReason"] for r in s["failingExits"]["recent"]] == ["timeout", "exit"]
    assert s["tasks"]["total"] == 2


def test_fallbacks_failures_gates_provisioning_and_unenforced() -> None:
    b = SummaryBuilder()
    for i, e in enumerate(task_events(24)):
        b.add(i + 1, e)
    s = b.result()
    assert s["fallbacks"]["total"] == s["counts"]["sandbox:fallback"] > 0
    assert s["fallbacks"]["byReason"][0]["reason"] == "bubblewrap not found"
    # only the first line of a multi-line reason is the key
    assert s["failures"]["byReason"][0]["reason"] == "bubblewrap not found"
    assert {"gate": "image-pull", "decision": "allow", "decidedBy": "settings"}.items() <= s[
        "gates"
    ]["byDecision"][0].items()
    assert s["provisioning"]["retries"] == s["provisioning"]["byOutcome"]["retry"] > 0
    assert any(r["digest"] for r in s["provisioning"]["recent"])
    assert set(s["unenforced"]) == {"cpu", "memory", "network", "pids"}
    prepares = {r["backend"]: r["runs"] for r in s["durations"]["prepareByBackend"]}
    assert sum(prepares.values()) == s["counts"]["sandbox:prepare"]
    tl = s["timeline"]
    assert sum(sum(v) for v in tl["series"].values()) == s["runs"]["total"]
    assert len(tl["times"]) <= 60


def test_distinct_commands_are_capped() -> None:
    import fusion_oci.dashboard.summary as summary

    b = SummaryBuilder()
    for i in range(summary.MAX_KEYS + 50):
        b.add(i + 1, run("t", "oci", 1, command=f"echo {i}"))
    assert len(b.command_keys) == summary.MAX_KEYS + 1
    assert b.command_keys[summary.OTHER] == 50


def test_tail_reads_only_what_was_appended(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    tail = LogTail(path)
    assert tail.poll() is False  # no file yet: an empty log, not an error
    log = AuditLog(path)
    log.emit(run("t1", "oci", 10))
    assert tail.poll() is True
    assert tail.summary.events == 1
    assert tail.poll() is False
    line = run("t1", "oci", 20).model_dump_json(by_alias=True, exclude_none=True).encode()
    append_raw(path, line[:30])  # a writer caught mid-line: nothing yet
    tail.poll()
    assert tail.summary.events == 1
    append_raw(path, line[30:] + b"\n")
    tail.poll()
    assert tail.summary.events == 2
    assert tail.summary.result()["durations"]["byBackend"][0]["p95"] == 20


def test_malformed_and_blank_lines_are_counted_never_fatal(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    AuditLog(path).emit(run("t1", "oci", 10))
    append_raw(path, b"not json\n\n[1, 2]\n" + b'{"type": "sandbox:nope"}\n' + b"\xff\xfe\n")
    AuditLog(path).emit(run("t1", "oci", 10))
    append_raw(path, b"x" * (MAX_LINE + 10))  # an endless line: dropped, not buffered
    append_raw(path, b"y" * (MAX_LINE + 10) + b"\n")
    AuditLog(path).emit(run("t1", "oci", 10))
    s = summarize_file(path)
    assert s["log"]["events"] == 3
    assert s["log"]["malformedLines"] == [2, 4, 5, 6, 8]
    assert s["log"]["malformed"] == 5
    assert s["log"]["lines"] == 9


def test_a_replaced_or_truncated_log_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    write_log(path, task_events(3))
    tail = LogTail(path)
    tail.poll()
    before = tail.summary.events
    path.unlink()
    assert tail.poll() is True
    assert (tail.summary.events, tail.generation) == (0, 1)
    write_log(path, task_events(1))
    tail.poll()
    assert 0 < tail.summary.events < before
    os.truncate(path, 0)
    tail.poll()
    assert tail.summary.events == 0


def test_events_by_task_and_cursor(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    events = task_events(5)
    write_log(path, events, malformed_at={4})
    tail = LogTail(path)
    tail.poll()
    mine, cursor = tail.events(task="task-00002")
    expected = [e for e in events if e.task_id == "task-00002"]
    assert [e["type"] for e in mine] == [e.type for e in expected]
    assert [e["line"] for e in mine] == sorted(e["line"] for e in mine)
    assert cursor == tail.cursor
    first, cursor = tail.events(limit=3)
    assert [e["line"] for e in first] == [1, 2, 3]
    assert cursor == 3
    rest, cursor = tail.events(since=cursor, limit=10_000)
    assert [e["line"] for e in rest[:2]] == [4, 6]  # line 5 is the malformed one
    assert len(first) + len(rest) == len(events)
    assert cursor == tail.cursor
    since = tail.epochs[10] - 0.0005  # an ISO time: events after it
    later, _ = tail.events(since=since, limit=10_000)
    assert events[10].ts in {e["ts"] for e in later}
    assert all(e["ts"] >= events[10].ts for e in later)


def test_summary_of_one_task(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    events = task_events(5)
    write_log(path, events)
    s = summarize_file(path, task="task-00001")
    assert s["log"]["events"] == sum(1 for e in events if e.task_id == "task-00001")
    assert s["tasks"]["total"] == 1


def test_chain_status_from_verify_chain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "audit.jsonl"
    write_log(path, task_events(2))
    key = chain.host_key({"XDG_STATE_HOME": str(tmp_path / "state")})
    assert key
    assert chain.chain_status(path, key) == {
        "status": "ok",
        "lines": len(task_events(2)),
        "firstBadLine": None,
        "reason": None,
        "keyed": True,
    }
    assert chain.chain_status(path)["keyed"] is False  # no key: the prev hashes only
    lines = path.read_bytes().splitlines(keepends=True)
    lines[3] = lines[3].replace(b'"durationMs":', b'"durationMs":1')  # an edited line
    path.write_bytes(b"".join(lines))
    status = chain.chain_status(path, key)
    assert (status["status"], status["firstBadLine"]) == ("broken", 4)
    assert chain.chain_status(tmp_path / "none.jsonl")["status"] == "empty"

    def boom(p: Path, key: bytes | None = None) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(chain, "verify_chain", boom)
    assert chain.chain_status(path)["status"] == "error"


def test_the_page_files_are_package_data() -> None:
    """A wheel install serves the page: the wheel ships the whole fusion_oci package (hatch),
    and no static file or template is git-ignored (hatch leaves ignored files out)."""
    import subprocess

    wheel = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"][
        "targets"
    ]["wheel"]
    assert wheel["packages"] == ["fusion_oci"]
    pkg = ROOT / "fusion_oci"
    files = [str(p) for sub in ("static", "templates") for p in (pkg / "dashboard" / sub).iterdir()]
    assert files
    ignored = subprocess.run(
        ["git", "check-ignore", *files], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    assert ignored == []


def test_the_cli_imports_no_web_stack_or_otel() -> None:
    """`fusion-oci run` start-up stays fast: the web stack and OpenTelemetry load only in the
    commands that use them."""
    import subprocess
    import sys

    code = (
        "import sys, fusion_oci.cli.main, fusion_oci.otel, fusion_oci.dashboard; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'starlette', 'uvicorn', "
        "'jinja2', 'opentelemetry', 'anyio'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "[]"


def test_host_header_names() -> None:
    from fusion_oci.dashboard.app import host_name

    assert host_name(b"127.0.0.1:8080") == "127.0.0.1"
    assert host_name(b"LocalHost") == "localhost"
    assert host_name(b"[::1]:8080") == "::1"
    assert host_name(b"[::1]") == "::1"
    assert host_name(b"") == ""
    assert host_name(b"evil.example:80") == "evil.example"


def test_an_unreadable_log_is_an_error_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.mkdir()  # a directory where the log should be: open() fails as it would for EACCES
    tail = LogTail(path)
    assert tail.poll() is True
    assert tail.error and "directory" in tail.error.lower()
    assert tail.poll() is False  # the same error: nothing changed
    assert tail.summary.result()["log"]["events"] == 0
