"""``network: filtered`` (issue #22) under attack, on every backend: one sandboxed program
(egress_world.PROBE_JS) tries each way out, and the host judges by what it observes: the
world's server (in a network namespace this test creates) logs every peer and datagram, a
server on the host's loopback records every connection. The probe logic is egress_world's:
one place, every runtime (a runtime that enforces filtered needs no change here, only its
EXPECT entries dropped in conftest.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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
