"""Start-up of the CLI beside `python3 -c pass` (the issue's yardstick: within 4x).

    .venv/bin/python benchmarks/bench_startup.py [--runs N]

Times `fusion-oci --help` and a one-off `fusion-oci run -- true` (native, in a fresh git work
tree) as a user starts them (the venv's console script), beside `python3 -c pass` with the
system interpreter and with the `python3` first on PATH. Medians; quote the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_ms, report, write_markdown

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", help="write this section of docs/performance.md here")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "fusion_oci.cli.main"]

    def timed(argv: list[str], cwd: str | None = None) -> float:
        def go() -> object:
            return subprocess.run(argv, cwd=cwd, env=env, check=True, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return median_ms(go, args.runs)

    with tempfile.TemporaryDirectory() as wt:
        subprocess.run(["git", "init", "-q", wt], check=True)
        system = timed(["/usr/bin/python3", "-c", "pass"])
        on_path = shutil.which("python3") or "/usr/bin/python3"
        rows = [
            (f"python3 -c pass ({on_path})", timed([on_path, "-c", "pass"])),
            ("fusion-oci --help", timed([*cli, "--help"])),
            ("fusion-oci run -- true (native, one-off)", timed([*cli, "run", "--", "true"], wt)),
        ]
    report("CLI start-up beside python3 -c pass", ("/usr/bin/python3 -c pass", system), rows)
    write_markdown(args.markdown, "CLI start-up",
                   "`benchmarks/bench_startup.py`: `fusion-oci --help` "
                   "and `fusion-oci run -- true` "
                   "beside `python3 -c pass`.")

if __name__ == "__main__":
    main()
