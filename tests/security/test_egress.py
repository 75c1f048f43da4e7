"""``network: filtered`` (issue #22) under attack, on every backend: one sandboxed program
(egress_world.PROBE_JS) tries each way out, and the host judges by what it observes: the
world's server (in a network namespace this test creates) logs every peer and datagram, a
server on the host's loopback records every connection. The probe logic is egress_world's:
one place, every runtime (a runtime that enforces filtered needs no change here, only its
EXPECT entries dropped in conftest.py).
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fusion_oci.egress.mitm import Exchange, Head, Session
from tests.hostside import tcp_server
from tests.security.conftest import EGRESS_PROBES, Prober, expected
from tests.security.egress_world import (
    EgressWorld,
    allowed_answers,
    egress_world,
    judge,
    parse,
    probe_command,
)
from tests.security.resolver_world import DENIED, DENIED_NAMES, SPELLINGS, run_world
from tests.security.test_probes import assert_unenforced, check

PROBES = EGRESS_PROBES
FILTERED = "network filtered (egress only through the task's proxy)"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EgressWorld]:
    with egress_world(tmp_path_factory.mktemp("egress-world")) as made:
        yield made


def test_filtered_network_reaches_only_what_the_proxy_allows(
    prober: Prober, world: EgressWorld
) -> None:
    policy = world.policy()
    if expected("egress-denied-host", prober.backend) == "unenforced":
        assert_unenforced("egress-denied-host", prober, policy, FILTERED)
        for probe in PROBES[1:]:
            assert expected(probe, prober.backend) == "unenforced", probe
            assert_unenforced(probe, prober, policy, FILTERED)
        return
    prober.egress_names = world.names
    world.log.write_text("")
    with tcp_server() as (port, seen):
        result = prober.run(probe_command(world, port), policy, timeout_ms=90_000)
    assert result.exit_code == 0, result.stderr[-2000:]
    out = parse(result.stdout)
    # What filtered is for: the allowed host answers, through the proxy, by name.
    assert allowed_answers(out, world), out
    for probe, (leaked, detail) in judge(out, world, list(seen)).items():
        check(probe, prober.backend, leaked, detail)


def test_the_egress_probe_program_is_one_file_of_the_world(
    world: EgressWorld, tmp_path: Path
) -> None:
    """The probe sees a leak where there is one: run on the host itself (no sandbox, no
    proxy), the direct connection to the world's server gets through and is judged so."""
    import subprocess

    with tcp_server() as (port, seen):
        done = subprocess.run(
            probe_command(world, port),
            capture_output=True,
            text=True,
            timeout=120,
            env={"PATH": "/usr/bin:/bin"},
            check=True,
        )
    verdicts = judge(parse(done.stdout), world, list(seen))
    assert verdicts["egress-direct-connect"][0], verdicts["egress-direct-connect"][1]
    assert verdicts["egress-raw-udp"][0] and verdicts["egress-host-loopback"][0]


# -- the proxy itself, whatever runs the command (issue #31 items 5, 6 and 7) ----------------
# These attack the proxy every backend shares, with the host's own resolver
# (tests/security/resolver_world.py): once, not per runtime.

FOLDED = "not a plain host name"


@pytest.fixture(scope="module")
def spellings() -> dict[str, Any]:
    return run_world("spellings")


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
@pytest.mark.parametrize("front", ["connect", "plain", "socks"])
def test_a_spelling_the_resolver_folds_into_a_denied_name_is_refused(
    spellings: dict[str, Any], spelling: str, front: str
) -> None:
    """Allowed by ``*.world.test``, denied by name: a soft hyphen, 'º'/'ª' (IDNA nameprep) and
    resolver escapes (``\\100``, ``\\n``) are refused before any decision, on every front; the
    denied server sees nobody."""
    answer = spellings["out"][spelling][front]
    if front == "socks":
        assert answer == "050005020001000000000000", answer  # 0x02: not allowed by ruleset
    else:
        assert answer.startswith("HTTP/1.1 403") and FOLDED in answer, answer
    assert DENIED not in spellings["http"], spellings
    assert not set(DENIED_NAMES) & set(spellings["dns"]), spellings["dns"]


def test_the_resolver_world_resolves_and_denies_by_name(spellings: dict[str, Any]) -> None:
    """The world works: the allowed name answers through the real resolver, the denied one
    written plainly gets the deny rule."""
    assert "world-ok 127.0.0.2" in spellings["out"]["control-allowed"]["connect"]
    denied = spellings["out"]["control-denied"]
    assert denied["connect"].startswith("HTTP/1.1 403") and "deniedDomains" in denied["connect"]


def test_port_4040_is_refused_on_the_hosts_own_non_loopback_addresses() -> None:
    """192.0.2.10 and 2001:db8::10 are the namespace's own (a veth end), in ranges the policy
    allows: 4040 there (by address, v4-mapped, by name, plain HTTP, SOCKS5) is refused before
    any connect (nothing listens there: a 502 would mean the proxy tried)."""
    world = run_world("dashboard")
    for what, answer in world["out"].items():
        if what == "socks":
            assert answer == "050005020001000000000000", answer
        else:
            assert answer.startswith("HTTP/1.1 403") and "4040" in answer, (what, answer)


def test_an_idle_connection_flood_to_one_task_leaves_another_tasks_proxy_working() -> None:
    """Task A's 400 idle connections (no byte sent) in a process of 256 descriptors: A keeps
    ``max_connections`` of them (the rest are closed at accept) and task B's proxy, on the same
    loop, still opens B's tunnel."""
    world = run_world("flood-400")
    assert world["out"]["held"] == "400", world
    assert "world-ok 127.0.0.2" in world["out"]["b"], world["out"]["b"][:500]


def _pkt(line: str) -> bytes:
    return b"%04x%s" % (len(line) + 4, line.encode())


async def _push(
    body: list[bytes], allowed_refs: list[str], *, gzipped: bool = True
) -> tuple[bytes | None, Exchange, float]:
    """``Session._check_push`` on ``body`` for a credential allowing ``allowed_refs``: git's
    refusal (None: let through), the exchange, the CPU seconds it took."""
    import time

    session = Session.__new__(Session)
    session.host = "git.example"
    session.cred = SimpleNamespace(  # type: ignore[assignment]
        spec=SimpleNamespace(name="gh", allowed_repos=None, allowed_refs=allowed_refs)
    )

    async def chunks() -> AsyncIterator[bytes]:
        for chunk in body:
            yield chunk

    encoding = [("Content-Encoding", "gzip")] if gzipped else []
    head = Head("POST /a/b.git/git-receive-pack HTTP/1.1", encoding)
    ex = Exchange(method="POST", path="/a/b.git/git-receive-pack")
    started = time.process_time()
    answer, _ = await session._check_push(head, ex, chunks())
    return answer, ex, time.process_time() - started


async def test_a_gzip_push_bomb_is_refused_with_bounded_work() -> None:
    """16 KB of gzip inflating to 16 MB of ref updates: the proxy inflates at most its cap
    (1 MiB), refuses the push (commands longer than the cap) and spends a bounded moment
    of the shared loop on it (the old code: every byte inflated, parsed and reported)."""
    line = _pkt(f"{'0' * 40} {'1' * 40} refs/heads/{'x' * 40}\n")
    plain = line * (16 * 1024 * 1024 // len(line))
    bomb = gzip.compress(plain, 9)
    assert len(bomb) < 64 * 1024
    answer, ex, cpu = await _push([bomb, b"PACK"], ["refs/heads/*"])
    assert answer is not None and b"did not end within 1024 KiB" in answer
    assert len(ex.refs) < 1024 * 1024 // len(line) + 1
    assert cpu < 0.25, cpu  # ~0.013 s here: 1 MiB inflated, framed, parsed, refused once


async def test_a_forbidden_ref_past_the_command_cap_is_not_let_through() -> None:
    """Allowed ref updates filling the cap, then a forbidden one, sent in 64 KB pieces: the
    old code stopped reading at the cap, checked the refs it had and let the push through;
    now a push whose commands do not end within the cap is refused whole."""
    line = _pkt(f"{'0' * 40} {'1' * 40} refs/heads/{'x' * 40}\n")
    plain = line * (1100 * 1024 // len(line)) + _pkt(f"{'0' * 40} {'1' * 40} refs/tags/v1\n")
    plain += b"0000PACK"
    pieces = [plain[i : i + 65536] for i in range(0, len(plain), 65536)]
    answer, ex, _ = await _push(pieces, ["refs/heads/*"], gzipped=False)
    assert answer is not None and ex.refused is not None and "1024 KiB" in ex.refused
