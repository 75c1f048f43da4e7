"""The scale benchmark's small version (benchmarks/bench_scale.py, 5 sandboxes): correctness
only. Warm sandboxes of one runtime at once in one process, each running a command every
second: every command succeeds with its own sandbox's output, nothing is crossed between
sandboxes, and every sandbox disposes clean. Timings belong to the benchmark, not here."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmarks.bench_scale import scale, settings_for
from tests.backends import require_runtime

N = 5
SECONDS = 3.0

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "runtime",
    [
        pytest.param("bubblewrap", marks=pytest.mark.bubblewrap),
        pytest.param("podman", marks=pytest.mark.podman),
        pytest.param("docker", marks=pytest.mark.docker),
    ],
)
async def test_five_warm_sandboxes_at_once_each_running_a_command_a_second(
    runtime: str, tmp_path: Path
) -> None:
    require_runtime(runtime, settings_for(runtime))

    # Each command writes a file of its own sandbox and reads back what that sandbox wrote so
    # far: a command run in the wrong sandbox, or state crossed between them, shows.
    def command(i: int, k: int) -> str:
        return f"echo {i}-{k} >> mine; tr '\\n' ' ' < mine"

    def expect(i: int, k: int) -> str:
        return "".join(f"{i}-{j} " for j in range(k + 1))

    result = await asyncio.wait_for(
        scale(runtime, N, SECONDS, tmp_path, command=command, expect=expect), 240
    )
    assert result.failures == [], result.failures
    assert result.outputs_ok
    assert result.commands == N * int(SECONDS)
    assert len(result.prepare_ms) == N
    for i in range(N):
        assert (tmp_path / f"wt{i}" / "mine").read_text().split() == [
            f"{i}-{k}" for k in range(int(SECONDS))
        ]
