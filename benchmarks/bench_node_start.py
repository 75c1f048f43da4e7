"""What one Node.js start costs inside a sandbox, with the CA trust the sandbox sets (the host's
store through OpenSSL: ``NODE_OPTIONS=--use-openssl-ca``) against ``NODE_EXTRA_CA_CERTS`` on
the same bundle (what it set before), interleaved, in one prepared sandbox per runtime.

    .venv/bin/python -m benchmarks.bench_node_start [--rounds 5] [--runtimes bubblewrap,oci]

A task's commands start Node.js many times (pnpm, the tool it runs, that tool's children):
whatever each start costs, every step pays it several times over.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import markdown_table, write_markdown
from fusion_oci.models import NetworkMode, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.spec import CA_IN_SANDBOX
from fusion_oci.sandbox import Sandbox
from tests.backends import backend_settings
from tests.conftest import git_init

STARTS = 10
LOOP = "for i in $(seq " + str(STARTS) + "); do node -e 0; done"
CASES = {
    "OpenSSL's store (now)": f"sh -c '{LOOP}'",
    "NODE_EXTRA_CA_CERTS (before)": (
        f"env -u NODE_OPTIONS NODE_EXTRA_CA_CERTS={CA_IN_SANDBOX} sh -c '{LOOP}'"
    ),
}


async def measure(runtime: str, base: Path, rounds: int) -> dict[str, float]:
    wt = base / f"wt-{runtime}"
    wt.mkdir()
    git_init(wt)
    chosen = backend_settings(runtime, policy=SandboxPolicy(network=NetworkMode.NONE))
    out: dict[str, list[float]] = {case: [] for case in CASES}
    async with Sandbox(chosen, env=dict(os.environ), cache_root=base / "cache") as sb:
        await sb.prepare(
            PrepareContext(
                task_id=f"node-{runtime}",
                run_id="r",
                worktree_path=str(wt),
                policy=chosen.policy,
                project_dir=str(base / "project"),
            )
        )
        for i in range(rounds):
            order = list(CASES) if i % 2 == 0 else list(reversed(CASES))
            for case in order:
                start = time.perf_counter()
                done = await sb.run(CASES[case], RunOptions(timeout_ms=120_000))
                assert done.exit_code == 0, done.stderr
                out[case].append((time.perf_counter() - start) / STARTS)
    return {case: statistics.median(v) for case, v in out.items()}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runtimes", default="bubblewrap,landlock,oci")
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    args, _ = parser.parse_known_args()  # scripts/bench.sh passes --runs to every benchmark
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-bench-node-"))
    (base / "project").mkdir()
    try:
        rows: list[list[object]] = []
        for runtime in args.runtimes.split(","):
            got = await measure(runtime, base, args.rounds)
            now, before = got["OpenSSL's store (now)"], got["NODE_EXTRA_CA_CERTS (before)"]
            rows.append(
                [runtime, f"{now * 1000:.1f} ms", f"{before * 1000:.1f} ms", f"{now / before:.2f}x"]
            )
        body = markdown_table(
            ["runtime", "Node.js start, OpenSSL's store", "with NODE_EXTRA_CA_CERTS", "ratio"],
            rows,
        )
        print(body)
        write_markdown(
            args.markdown,
            "Node.js start-up and the CA bundle",
            f"`benchmarks/bench_node_start.py --rounds {args.rounds}`: `node -e 0` {STARTS} "
            "times per command in one prepared sandbox (`network: none`), the two ways of "
            "trusting the shared bundle interleaved; medians per start.",
            body,
            "",
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
