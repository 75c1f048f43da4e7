"""Render the probe x backend matrix of docs/security.md from a security run's JSON report.

    FUSION_OCI_SECURITY_REPORT=/tmp/report.json bash scripts/test.sh tests/security
    python3 scripts/security_matrix.py /tmp/report.json docs/security.md

Rewrites the table under "| probe |" in place; every other line of the file stays as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WORKLOAD_NETWORK = {"native": "egress (unenforced)", "landlock": "**filtered** (host below ABI 4)"}
"""The network each backend runs a real project in (tests/contract/test_workload.py: a registry
install, tests, build, commit) where it is not ``egress``: landlock has no egress without the
host's loopback, so it goes through the task's proxy, or (no Landlock TCP rules) the host's
network (its doctor details say which)."""

ORDER = [
    "native",
    "bubblewrap",
    "landlock",
    "oci",
    "oci-runsc",
    "podman",
    "podman-rootless",
    "docker",
    "docker-rootless",
]


def table(rows: list[dict[str, str]]) -> list[str]:
    seen = {r["backend"] for r in rows}
    backends = [b for b in ORDER if b in seen] + sorted(seen - set(ORDER))
    cells = {(r["probe"], r["backend"]): r["outcome"] for r in rows}
    out = ["| probe | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    for probe in sorted({r["probe"] for r in rows}):
        shown = [cells.get((probe, b), "-") for b in backends]
        shown = [f"**{c}**" if c == "leaks" else c for c in shown]
        out.append(f"| `{probe}` | " + " | ".join(shown) + " |")
    out.append(
        "| real project: network it needs | "
        + " | ".join(WORKLOAD_NETWORK.get(b, "egress") for b in backends)
        + " |"
    )
    return out


def main() -> None:
    report, doc = Path(sys.argv[1]), Path(sys.argv[2])
    lines = doc.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| probe |"))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines[start:end] = table(json.loads(report.read_text()))
    doc.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
