"""Start-up of the CLI beside `python3 -c pass` (the issue's yardstick: within 4x).

    .venv/bin/python benchmarks/bench_startup.py [--runs N] [--markdown PATH]

Times, as a user starts them (a console script like the installed one, on this checkout's
code): `fusion-oci --help`; a one-off `fusion-oci run -- true` (native, in a fresh git work
tree) the first time, when it starts the resident server (cold), and the typical repeated call
(warm); and the same run in-process (FUSION_OCI_NO_SERVER=1, the full typer CLI). Beside
`python3 -c pass` with the system interpreter. Medians; quote the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median_ms, report

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """#!{python}
import sys
from fusion_oci.cli.fast import main
if __name__ == "__main__":
    sys.exit(main())
"""


def _server_pid(folder: Path) -> int | None:
    for sock in folder.glob("*.sock"):
        with contextlib.suppress(OSError, ValueError, KeyError), \
                socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(sock))
            token = (folder / "token").read_text().strip()
            body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                               "params": {"token": token}}).encode()
            s.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
            data = b""
            while b"}}" not in data:
                data += s.recv(65536)
            return int(json.loads(data.split(b"\r\n\r\n", 1)[1])["result"]["pid"])
    return None


def _stop_server(folder: Path) -> None:
    pid = _server_pid(folder)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    for _ in range(200):
        if not any(folder.glob("*.sock")):
            break
        time.sleep(0.05)
    time.sleep(0.2)  # its interpreter's exit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--markdown", type=Path, help="write the docs/performance.md section")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        xdg = Path(tmp) / "xdg"
        xdg.mkdir(mode=0o700)
        script = Path(tmp) / "fusion-oci"
        script.write_text(SCRIPT.format(python=sys.executable))
        script.chmod(0o755)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_RUNTIME_DIR": str(xdg),
               "FUSION_OCI_SERVER_IDLE": "300"}
        env.pop("FUSION_OCI_NO_SERVER", None)
        wt = Path(tmp) / "wt"
        subprocess.run(["git", "init", "-q", str(wt)], check=True)

        def timed(argv: list[str], runs: int = args.runs, extra: dict[str, str] | None = None,
                  before: object = None) -> float:
            def go() -> object:
                return subprocess.run(argv, cwd=wt, env={**env, **(extra or {})}, check=True,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            return median_ms(go, runs)

        system = timed(["/usr/bin/python3", "-c", "pass"])
        on_path = shutil.which("python3") or "/usr/bin/python3"
        folder = xdg / "fusion-oci"
        cold: list[float] = []
        for _ in range(max(3, args.runs // 4)):
            _stop_server(folder)
            start = time.perf_counter()
            subprocess.run([str(script), "run", "--", "true"], cwd=wt, env=env, check=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            cold.append((time.perf_counter() - start) * 1000)
        cold.sort()
        rows = [
            (f"python3 -c pass ({on_path})", timed([on_path, "-c", "pass"])),
            ("fusion-oci --help", timed([str(script), "--help"])),
            ("fusion-oci --version", timed([str(script), "--version"])),
            ("fusion-oci run -- true (first: starts server)", cold[len(cold) // 2]),
            ("fusion-oci run -- true (warm server)", timed([str(script), "run", "--", "true"])),
            ("fusion-oci run -- true (in-process)",
             timed([str(script), "run", "--", "true"], max(3, args.runs // 4),
                   {"FUSION_OCI_NO_SERVER": "1"})),
            ("fusion-oci plan -- true (full CLI)",
             timed([str(script), "plan", "--", "true"], max(3, args.runs // 4))),
        ]
        _stop_server(folder)
    report("CLI start-up beside python3 -c pass", ("/usr/bin/python3 -c pass", system), rows)
    if args.markdown:
        args.markdown.write_text(markdown(system, rows))


def markdown(system: float, rows: list[tuple[str, float]]) -> str:
    lines = [
        "## CLI start-up",
        "",
        "`benchmarks/bench_startup.py`: the console script as a user starts it, beside "
        "`/usr/bin/python3 -c pass` measured in the same run (the target: `--help` and a "
        "one-off `run` within 4x). Native backend, in a fresh git work tree; medians.",
        "",
        "| case | median ms | ratio |",
        "|---|---:|---:|",
        f"| `/usr/bin/python3 -c pass` | {system:.1f} | 1.0x |",
    ]
    lines += [f"| `{label}` | {value:.1f} | {value / system:.1f}x |" for label, value in rows]
    lines += [
        "",
        "Reading it: `--help` and `--version` are answered by the stdlib-only front end "
        "(`fusion_oci/cli/fast.py`) from texts generated from the typer app. `run` goes to "
        "the per-user resident server (`fusion-oci serve --socket`, started on first use, "
        "exits after 60 s idle): the warm row is the typical repeated call, and what is left "
        "there is the server's own work for the run (settings, spec, audit, the native "
        "reaper shim's interpreter) rather than imports. The first call pays the server's "
        "start once. In-process is the full typer CLI (`FUSION_OCI_NO_SERVER=1`, and every "
        "command other than `run`). Timings come from a shared, busy 2-core machine: quote "
        "the ratios of one run.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
