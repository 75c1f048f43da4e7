"""process.probe, the one helper for short synchronous probes: exit status and output, a
missing program, a timeout that a grandchild holding the pipes cannot stretch."""

from __future__ import annotations

import time

from fusion_oci.host.process import probe


def test_a_probe_gives_status_and_output() -> None:
    done = probe(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (done.returncode, done.stdout, done.stderr, done.error) == (3, b"out\n", b"err\n", None)
    assert not done.ok
    assert probe(["true"]).ok
    assert probe(["printf", "\\377x"]).text() == "\ufffdx"


def test_a_probe_reads_no_stdin_and_takes_the_env_given() -> None:
    assert probe(["cat"]).stdout == b""
    assert (
        probe(["sh", "-c", 'echo "$ONLY"'], env={"ONLY": "this", "PATH": "/usr/bin:/bin"}).stdout
        == b"this\n"
    )


def test_a_missing_program_is_an_outcome_not_an_exception() -> None:
    done = probe(["/nonexistent/tool", "--version"])
    assert done.returncode is None and not done.ok
    assert done.error is not None and "/nonexistent/tool" in done.error


def test_a_timeout_ends_the_group_even_when_a_grandchild_holds_the_pipes() -> None:
    start = time.monotonic()
    done = probe(["sh", "-c", "sleep 30 & echo started; wait"], timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert done.returncode is None and done.error == "timed out after 0.5 s"
    assert done.stdout == b"started\n"


def test_a_signal_is_a_negative_status() -> None:
    done = probe(["sh", "-c", "kill -TERM $$"])
    assert done.returncode == -15 and done.error is None
