"""Transient vs permanent engine failures, and the tenacity loop that retries only the first."""

from __future__ import annotations

import pytest

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.engines import EngineOpError
from fusion_oci.engines.errors import classify
from fusion_oci.images.gates import AuditContext
from fusion_oci.images.retry import (
    RetryPolicy,
    audit_attempt,
    classify_build,
    is_transient_error,
    run_attempts,
)

# Messages as podman 4.3 and docker 20.10 word them (seen in tests/integration).
TRANSIENT = [
    "initializing source docker://127.0.0.1:41234/tiny:1: pinging container registry "
    '127.0.0.1:41234: Get "http://127.0.0.1:41234/v2/": read tcp 127.0.0.1:50612->'
    "127.0.0.1:41234: read: connection reset by peer",
    "reading manifest 1 in 127.0.0.1:41234/tiny: received unexpected HTTP status: "
    "503 Service Unavailable",
    'Get "http://127.0.0.1:41234/v2/": EOF',
    "initializing source docker://127.0.0.1:38095/tiny:1: pinging container registry "
    "127.0.0.1:38095: invalid status code from registry 503 (Service Unavailable)",
    "received unexpected HTTP status: 502 Bad Gateway",
    "toomanyrequests: You have reached your pull rate limit.",
    'Get "https://registry-1.docker.io/v2/": net/http: TLS handshake timeout',
    "dial tcp 127.0.0.1:5000: connect: connection refused",
    "Temporary failure in name resolution",
    "error parsing HTTP 429 response body: unexpected end of JSON input",
]
PERMANENT = [
    "reading manifest nope in 127.0.0.1:41234/tiny: manifest unknown: manifest unknown",
    "manifest for 127.0.0.1:41234/tiny:nope not found: manifest unknown: manifest unknown",
    "initializing source docker://127.0.0.1:41234/tiny:1: reading manifest 1 in "
    "127.0.0.1:41234/tiny: unauthorized: authentication required",
    "pull access denied for nope, repository does not exist or may require 'docker login'",
    "invalid reference format",
    "dial tcp: lookup registry-1.docker.io on 10.0.0.2:53: no such host",
    "x509: certificate signed by unknown authority",
    'Head "http://127.0.0.1:58597/v2/tiny/manifests/1": no basic auth credentials',
    "initializing source docker://127.0.0.1:42879/tiny:1: reading manifest 1 in "
    "127.0.0.1:42879/tiny: unauthorized",
    "something nobody has seen before",
]


@pytest.mark.parametrize("message", TRANSIENT)
def test_transient(message: str) -> None:
    assert classify(message)


@pytest.mark.parametrize("message", PERMANENT)
def test_permanent(message: str) -> None:
    assert not classify(message)


def test_status_code_counts_unless_the_text_says_permanent() -> None:
    assert classify("boom", 503)
    assert classify("slow down", 429)
    assert not classify("boom", 400)
    assert not classify("manifest unknown", 503)
    # docker reports every registry failure as a 500: only the words decide
    assert not classify("no basic auth credentials", 500)
    assert not classify("something new", 500)
    assert classify("read: connection reset by peer", 500)


def test_build_failures_are_transient_only_for_network_blips() -> None:
    step = 'building at STEP "RUN apt-get update": while running runtime: exit status 100'
    assert classify_build(
        step,
        "Err:1 http://deb.debian.org/debian bookworm InRelease\n"
        "  Temporary failure resolving 'deb.debian.org'",
    )
    assert classify_build(step, "npm ERR! code ECONNRESET")
    assert not classify_build(step, "E: Unable to locate package nodejs-nope")
    assert not classify_build("dockerfile parse error line 3: unknown instruction: RUNN", "503")


def err(transient: bool, text: str = "connection reset by peer") -> EngineOpError:
    return EngineOpError("pull x", text, transient=transient)


def recorder() -> tuple[AuditContext, list[AuditEvent]]:
    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    return AuditContext(audit, "t", "r", "podman"), events


def run(fn, policy: RetryPolicy, ctx: AuditContext, sleeps: list[float]):  # type: ignore[no-untyped-def]
    def on_attempt(n, outcome, exc, seconds, wait):  # type: ignore[no-untyped-def]
        audit_attempt(ctx, "pull", "x", "podman", n, policy.attempts, outcome, exc, seconds, wait)

    return run_attempts(
        fn,
        action="pull",
        target="x",
        policy=policy,
        is_transient=is_transient_error,
        on_attempt=on_attempt,
        sleep=sleeps.append,
    )


def test_transient_failures_are_retried_with_capped_jittered_backoff() -> None:
    ctx, events = recorder()
    calls: list[int] = []

    def fn(n: int) -> str:
        calls.append(n)
        if n < 4:
            raise err(True)
        return "sha256:ok"

    sleeps: list[float] = []
    policy = RetryPolicy(attempts=5, initial_s=1.0, max_s=3.0, jitter_s=0.5)
    assert run(fn, policy, ctx, sleeps) == "sha256:ok"
    assert calls == [1, 2, 3, 4]
    assert len(sleeps) == 3
    assert 1.0 <= sleeps[0] <= 1.5 and 2.0 <= sleeps[1] <= 2.5
    assert all(s <= 3.0 for s in sleeps)  # the cap holds, jitter included
    details = [e.details for e in events]
    assert [d["attempt"] for d in details if d] == [1, 2, 3, 4]
    assert [d["outcome"] for d in details if d] == ["retry", "retry", "retry", "ok"]
    assert "attempt 1/5 failed (transient): connection reset by peer; retrying in" in (
        events[0].reason or ""
    )
    assert all(e.type == "sandbox:provision" for e in events)


def test_permanent_failure_stops_at_the_first_attempt() -> None:
    ctx, events = recorder()
    sleeps: list[float] = []

    def fn(n: int) -> str:
        raise err(False, "manifest unknown")

    with pytest.raises(EngineOpError, match="manifest unknown"):
        run(fn, RetryPolicy.immediate(), ctx, sleeps)
    assert sleeps == []
    assert len(events) == 1 and events[0].details is not None
    assert events[0].details["outcome"] == "failed" and events[0].details["transient"] is False
    assert "(permanent)" in (events[0].reason or "")


def test_attempts_run_out() -> None:
    ctx, events = recorder()

    def fn(n: int) -> str:
        raise err(True)

    with pytest.raises(EngineOpError):
        run(fn, RetryPolicy.immediate(attempts=3), ctx, [])
    assert [e.details["outcome"] for e in events if e.details] == ["retry", "retry", "failed"]
    assert "attempts exhausted" in (events[-1].reason or "")


def test_other_exceptions_are_not_retried() -> None:
    ctx, events = recorder()

    def fn(n: int) -> str:
        raise ValueError("bug")

    with pytest.raises(ValueError, match="bug"):
        run(fn, RetryPolicy.immediate(), ctx, [])
    assert len(events) == 1


def test_backoff_is_exponential_jittered_and_capped() -> None:
    p = RetryPolicy(attempts=8, initial_s=2.0, max_s=30.0, jitter_s=1.0, multiplier=2.0)
    assert [p.delay(n, 0.0) for n in range(1, 7)] == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert p.delay(1, 0.5) == 2.5
    assert p.delay(4, 0.99) <= 30.0 and p.delay(5, 0.99) == 30.0
    assert RetryPolicy.immediate().max_s == 0
