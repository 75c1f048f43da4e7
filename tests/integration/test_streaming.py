"""Output streams through RunOptions.on_output while the command runs, on the host runtimes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import pytest

from fusion_oci.models import OutputStream, PrepareContext, RunOptions
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import Sandbox
from tests.backends import require_runtime

BACKENDS = [
    pytest.param("native", marks=pytest.mark.native),
    pytest.param("bubblewrap", marks=pytest.mark.bubblewrap),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_arrive_before_the_command_ends_and_bytes_are_kept(
    backend: str, worktree: Path
) -> None:
    require_runtime(backend)
    seen: list[tuple[OutputStream, bytes, float]] = []

    def on_output(stream: OutputStream, chunk: bytes) -> None:
        seen.append((stream, chunk, time.monotonic()))

    async def go() -> tuple[float, float]:
        settings = SandboxSettings(backend=backend)  # type: ignore[arg-type]
        async with Sandbox(settings, env=dict(os.environ)) as sb:
            await sb.prepare(PrepareContext(task_id="t1", run_id="r1", worktree_path=str(worktree)))
            start = time.monotonic()
            result = await sb.run(
                "printf 'a\\377\\n'; sleep 1; echo b >&2", RunOptions(on_output=on_output)
            )
            assert result.exit_code == 0
            return start, start + result.duration_ms / 1000

    start, end = asyncio.run(go())
    assert seen[0][:2] == ("stdout", b"a\xff\n")  # bytes as written, not decoded
    assert seen[0][2] < end - 0.5
    assert [(s, c) for s, c, _ in seen[1:]] == [("stderr", b"b\n")]
    assert start < seen[0][2]


@pytest.mark.native
def test_stream_run_yields_chunks_then_the_result_and_leaving_aborts(worktree: Path) -> None:
    from fusion_oci import OutputChunk, stream_run
    from tests.hostside import pids_with

    marker = f"fusion-oci-stream-{os.getpid()}-{time.monotonic_ns()}"

    async def go() -> list[object]:
        items: list[object] = []
        async with Sandbox(SandboxSettings(), env=dict(os.environ)) as sb:
            await sb.prepare(PrepareContext(task_id="t1", run_id="r1", worktree_path=str(worktree)))
            async for item in stream_run(sb, "echo a; echo b >&2"):
                items.append(item)
            run = stream_run(sb, f"echo up; sh -c 'sleep 100; :' {marker}")
            async with contextlib.aclosing(run) as chunks:
                async for item in chunks:
                    assert isinstance(item, OutputChunk)
                    break  # leaving the loop (closing the iterator) aborts the command
            assert pids_with(marker) == []
        return items

    items = asyncio.run(go())
    chunks = [i for i in items if isinstance(i, OutputChunk)]
    assert sorted((c.stream, c.data) for c in chunks) == [("stderr", b"b\n"), ("stdout", b"a\n")]
    result = items[-1]
    assert getattr(result, "exit_code", None) == 0
    deadline = time.monotonic() + 5
    while pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids_with(marker) == []
