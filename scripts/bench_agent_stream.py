"""The exec agent's two transports side by side: the local socket (the pipes passed) and a byte
stream (mux.py on a subprocess's stdin/stdout, what a pod's exec gives).

    python scripts/bench_agent_stream.py [--runs 200] [--megabytes 200]

Prints, per transport, the median and p90 round trip of ``true`` and the throughput of
``head -c NM /dev/zero`` read to the end (nothing kept).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from fusion_oci.agent.client import Agent
from fusion_oci.agent.outcome import AgentLike
from fusion_oci.agent.streamed import StreamedAgent, mux_argv

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}


async def measure(name: str, agent: AgentLike, runs: int, megabytes: int) -> None:
    for _ in range(10):  # warm: the first runs pay for page faults and caches
        await agent.run(["true"], env=ENV)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        await agent.run(["true"], env=ENV)
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    got = 0

    def count(stream: str, chunk: bytes) -> None:
        nonlocal got
        got += len(chunk)

    start = time.perf_counter()
    r = await agent.run(
        ["head", "-c", f"{megabytes}M", "/dev/zero"], env=ENV, keep_output=False, on_output=count
    )
    seconds = time.perf_counter() - start
    assert r.returncode == 0 and got == megabytes << 20, (r, got)
    print(
        f"{name:9} true: median {statistics.median(times):.3f} ms, "
        f"p90 {times[int(len(times) * 0.9)]:.3f} ms ({runs} runs); "
        f"head -c {megabytes}M: {seconds:.3f} s, {megabytes / seconds:.0f} MB/s"
    )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--megabytes", type=int, default=200)
    args = parser.parse_args()
    local = await Agent.start_local()
    try:
        await measure("local", local, args.runs, args.megabytes)
    finally:
        await local.close()
    streamed = await StreamedAgent.start(mux_argv())  # the system's python3, as in a pod
    try:
        await measure("streamed", streamed, args.runs, args.megabytes)
    finally:
        await streamed.close()


if __name__ == "__main__":
    asyncio.run(main())
