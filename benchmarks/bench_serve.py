"""Per-command overhead through `fusion-oci serve` from Node, per runtime, beside the Python API
and the runtime's own tool.

    .venv/bin/python benchmarks/bench_serve.py [--runs N] [--backends native,bubblewrap,...]

For each runtime, a prepared sandbox runs ``true`` N times: through the Python API
(``SyncSandbox.run``), and from Node through ``@fusion-oci/client`` (``fusion-oci serve``);
the floor is the runtime's own tool started from Node with ``execFile`` (``sh -c true``, raw
``bwrap``, ``podman|docker exec C true`` on a container of the same image). Needs
``npm run build`` in clients/typescript (scripts/test.sh and bench.sh do it). Prints medians,
ratios to the floor, and what serve adds over the Python API; quote the ratios. The three
columns are sampled in turn (API and serve alternating which goes first, then the tool) so a
busy moment of the shared machine falls on all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_containers import LIMITS, cli
from benchmarks.common import markdown_table, write_markdown
from fusion_oci.audit import AuditLog, default_audit_path
from fusion_oci.models import CacheMode, PrepareContext, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox

BWRAP = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--", "true"]
NODE_BENCH = ROOT / "clients" / "typescript" / "dist" / "bench" / "serve.js"


def engine_settings(backend: str) -> dict[str, Any]:
    """camelCase settings (as a settings file) that reach the engines the tests use."""
    if backend in ("podman", "docker"):
        from tests.integration.images_fixture import ensure_node_image

        key, env = (
            ("podmanUrl", "FUSION_OCI_PODMAN_URL")
            if backend == "podman"
            else ("dockerUrl", "DOCKER_HOST")
        )
        return {key: os.environ.get(env), "image": ensure_node_image(backend).ref}
    return {}


def python_sandbox(backend: str, wt: str) -> SyncSandbox:
    subprocess.run(["git", "init", "-q", wt], check=True)  # a worktree is a git work tree
    settings = SandboxSettings.model_validate({"backend": backend, **engine_settings(backend)})
    # The audit file the server writes too (PROJECT/.fusion/sandbox-audit.jsonl), for a fair sum.
    sb = SyncSandbox(settings, env=dict(os.environ), audit=AuditLog(default_audit_path(Path(wt))))
    sb.prepare(
        PrepareContext(
            task_id=f"bench-py-{backend}",
            run_id="r",
            worktree_path=wt,
            policy=SandboxPolicy(allow_network=False),
            image=settings.image,
            cache_mode=CacheMode.OFF,
        )
    )
    return sb


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--backends", default="native,bubblewrap,podman,docker")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    cases: list[dict[str, Any]] = []
    samples: dict[str, dict[str, list[float]]] = {
        b: {"api": [], "serve": [], "raw": [], "ping": []} for b in backends
    }
    with contextlib.ExitStack() as stack:
        for backend in backends:
            settings = engine_settings(backend)
            if backend == "native":
                raw = ["sh", "-c", "true"]
            elif backend == "bubblewrap":
                raw = BWRAP
            else:
                base = cli(backend)
                name = f"fusion-oci-bench-serve-{backend}-{os.getpid()}"
                subprocess.run(
                    [
                        *base,
                        "run",
                        "-d",
                        "--rm",
                        "--name",
                        name,
                        "--network",
                        "none",
                        *LIMITS,
                        settings["image"],
                        "sleep",
                        "infinity",
                    ],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                stack.callback(
                    subprocess.run,
                    [*base, "rm", "-f", name],
                    stdout=subprocess.DEVNULL,
                    check=False,
                )
                raw = [*base, "exec", name, "true"]
            # The same task settings as the Python side (no package-cache mount).
            cases.append(
                {"backend": backend, "settings": {**settings, "cacheMode": "off"}, "raw": raw}
            )
        config = {
            "cases": cases,
            "serverCommand": [sys.executable, "-m", "fusion_oci.cli.main", "serve"],
        }
        node = subprocess.Popen(
            ["node", str(NODE_BENCH), json.dumps(config)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        stack.callback(node.wait, 60)
        assert node.stdin is not None and node.stdout is not None
        stack.callback(node.stdin.close)
        if node.stdout.readline().strip() != "ready":
            sys.exit("the Node side did not start (see its stderr above)")

        def ask(kind: str, backend: str) -> float:
            assert node.stdin is not None and node.stdout is not None
            node.stdin.write(f"{kind} {backend}\n")
            node.stdin.flush()
            answer = node.stdout.readline().strip()
            if answer.startswith("error"):
                print(f"  {kind} {backend}: {answer} (sample dropped)", file=sys.stderr)
                return float("nan")
            return float(answer)

        api: dict[str, SyncSandbox] = {}
        for backend in backends:
            wt = stack.enter_context(tempfile.TemporaryDirectory())
            api[backend] = stack.enter_context(python_sandbox(backend, wt))
        for i in range(args.runs + 3):  # 3 warm-up rounds, then samples interleaved
            for backend in backends:
                # API and serve take turns going first: an engine answers a command that
                # follows another one more slowly, which would otherwise count against one.
                got: dict[str, float] = {}
                for kind in ("api", "serve") if i % 2 else ("serve", "api"):
                    got[kind] = (
                        timed(lambda b=backend: api[b].run("true"))  # type: ignore[misc]
                        if kind == "api"
                        else ask("serve", backend)
                    )
                got["raw"] = ask("raw", backend)
                got["ping"] = ask("ping", backend)
                if i >= 3:
                    for key, value in got.items():
                        samples[backend][key].append(value)
    print(
        "\nper-command overhead from Node through `fusion-oci serve` (`true`, medians of "
        f"{args.runs} interleaved samples)"
    )
    print(
        f"{'runtime':<11} {'floor: own tool from Node':<26} {'Python API':>11} {'serve/Node':>11}"
        f" {'serve - API':>12} {'round trip':>11}"
    )
    for backend in backends:
        med = {
            k: statistics.median([x for x in v if x == x])  # NaN: a dropped sample
            for k, v in samples[backend].items()
        }
        tool = {"native": "sh -c true", "bubblewrap": "raw bwrap ... true"}.get(
            backend, f"{backend} exec C true"
        )
        print(
            f"{backend:<11} {tool:<26} {med['api'] / med['raw']:>10.2f}x"
            f" {med['serve'] / med['raw']:>10.2f}x {med['serve'] - med['api']:>+10.1f}ms"
            f" {med['ping']:>9.2f}ms"
        )
    print(
        "(ratios: median / the floor's median; serve - API: what the server and the Node "
        "client add per command; round trip: one request that runs nothing)"
    )
    table = []
    for backend in backends:
        med = {k: statistics.median([x for x in v if x == x]) for k, v in samples[backend].items()}
        tool = {"native": "`sh -c true`", "bubblewrap": "raw `bwrap ... true`"}.get(
            backend, f"`{backend} exec C true`"
        )
        table.append(
            (
                backend,
                tool,
                f"{med['api'] / med['raw']:.2f}x",
                f"{med['serve'] / med['raw']:.2f}x",
                f"{med['serve'] - med['api']:+.1f} ms",
                f"{med['ping']:.2f} ms",
            )
        )
    write_markdown(
        args.markdown,
        "Executor integration: `fusion-oci serve` from Node",
        "`benchmarks/bench_serve.py`: `true` through the Python API and through "
        "`fusion-oci serve` from Node, beside each runtime's own tool started from "
        f"Node (the floor); medians of {args.runs} interleaved samples.",
        markdown_table(
            [
                "runtime",
                "floor (own tool, from Node)",
                "Python API / floor",
                "serve / floor",
                "serve - API",
                "one request, no command",
            ],
            table,
        ),
    )


if __name__ == "__main__":
    main()
