"""StdinStream: stdin fed to a command as it comes, with backpressure (models/stdin.py)."""

from __future__ import annotations

import asyncio
import hashlib

from fusion_oci.host.process import run_process
from fusion_oci.models.stdin import StdinStream


async def test_chunks_in_order_then_the_end() -> None:
    stream = StdinStream(max_chunks=2)
    taken: list[int] = []
    stream.on_take = lambda: taken.append(1)

    async def feed() -> None:
        for part in (b"a", b"b", b"c"):
            await stream.put(part)  # waits while two are queued
        stream.close()

    feeder = asyncio.ensure_future(feed())
    assert await stream.read_all() == b"abc"
    await feeder
    assert len(taken) == 3
    assert stream.sha256() == "sha256:" + hashlib.sha256(b"abc").hexdigest()


async def test_a_full_stream_refuses_without_waiting() -> None:
    stream = StdinStream(max_chunks=1)
    assert stream.put_nowait(b"x")
    assert not stream.put_nowait(b"y")


async def test_the_command_reads_each_chunk_as_it_comes() -> None:
    """`cat` echoes the first line while the second has not been fed yet."""
    stream = StdinStream()
    seen: list[bytes] = []
    first = asyncio.Event()

    def on_output(name: str, chunk: bytes) -> None:
        seen.append(chunk)
        first.set()

    run = asyncio.ensure_future(
        run_process(["cat"], stdin=stream, on_output=on_output, timeout_s=30)
    )
    await stream.put(b"one\n")
    await asyncio.wait_for(first.wait(), 20)
    assert b"".join(seen) == b"one\n"
    await stream.put(b"two\n")
    stream.close()
    outcome = await run
    assert outcome.returncode == 0 and outcome.stdout == b"one\ntwo\n"
