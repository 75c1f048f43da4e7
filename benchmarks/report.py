"""Assembles docs/performance.md from the benchmarks' markdown fragments.

    .venv/bin/python benchmarks/report.py FRAGMENT_DIR [--out docs/performance.md]
        [--failed NAME ...]

``scripts/bench.sh`` runs every ``benchmarks/bench_*.py --markdown FRAGMENT_DIR/NAME.md`` and
then this: a header describing the machine (cores, memory, kernel, cgroup mode, engine
versions, date), then every fragment in :data:`ORDER` (the others after them, by name). A
benchmark that failed or wrote nothing gets a line saying so, never a stale section.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import subprocess
from pathlib import Path

ORDER = (
    "native",
    "bubblewrap",
    "oci",
    "tiers",
    "containers",
    "scale",
    "serve",
    "startup",
    "dashboard",
)
"""Sections in the order a reader wants them: the cheapest tier first, then scale, then the
front ends."""

INTRO = """\
# Performance

Written by one command, `bash scripts/bench.sh`: every `benchmarks/bench_*.py`
writes its section with `--markdown`, and `benchmarks/report.py` puts them together under this
header. Each table compares fusion-oci with the raw tool measured **in the same run**: the
machine is small and shared, so **quote the ratios, not the milliseconds**.
"""


def _first_line(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "not installed"
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0].strip() if text and out.returncode == 0 else "not available"


def cgroup_mode() -> str:
    """``v2`` (unified), ``v1`` or ``hybrid`` (v1 controllers with a v2 hierarchy beside)."""
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():
        return "v2 (unified)"
    if (root / "unified" / "cgroup.controllers").exists():
        return "hybrid (v1 controllers, v2 at /sys/fs/cgroup/unified)"
    return "v1"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def memory_gib() -> str:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    return "unknown"


def engine_versions() -> dict[str, str]:
    """Engine versions through their SDKs (the sockets of scripts/services.sh env)."""
    out: dict[str, str] = {}
    try:
        import docker

        client = docker.DockerClient(base_url=os.environ.get("DOCKER_HOST"), timeout=10)
        try:
            out["docker"] = str(client.version().get("Version", "?"))
        finally:
            client.close()
    except Exception:  # a header line never fails the report
        out["docker"] = "not reachable"
    for name, url in (
        ("podman", os.environ.get("FUSION_OCI_PODMAN_URL")),
        ("podman (rootless)", os.environ.get("FUSION_OCI_ROOTLESS_PODMAN_URL")),
    ):
        if not url:
            continue
        try:
            import podman

            with podman.PodmanClient(base_url=url, timeout=10) as client:
                out[name] = str(client.version().get("Version", "?"))
        except Exception:  # ditto
            out[name] = "not reachable"
    return out


def header(now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.UTC)
    engines = engine_versions()
    tools = {
        "bubblewrap": _first_line(["bwrap", "--version"]),
        "runc": _first_line(["runc", "--version"]),
        "runsc": _first_line(["runsc", "--version"]),
    }
    rows = [
        ("date", now.strftime("%Y-%m-%d %H:%M UTC")),
        ("CPU", f"{os.cpu_count()} cores, {cpu_model()}"),
        ("memory", memory_gib()),
        ("kernel", platform.release()),
        ("cgroups", cgroup_mode()),
        ("Python", platform.python_version()),
        *((name, version) for name, version in engines.items()),
        *((name, version) for name, version in tools.items()),
    ]
    table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    return (
        INTRO
        + "\n## The machine of this run\n\n"
        + table
        + "\nOne run on a shared, busy machine (other jobs ran beside it): absolute times "
        "move between runs, the ratios much less. Quote ratios.\n"
    )


def section_names(found: set[str], failed: list[str]) -> list[str]:
    """ORDER first, then any other fragment (or failure) by name."""
    extra = sorted((found | set(failed)) - set(ORDER))
    return [n for n in ORDER if n in found or n in failed] + extra


def assemble(fragment_dir: Path, failed: list[str], now: datetime.datetime | None = None) -> str:
    found = {p.stem: p for p in fragment_dir.glob("*.md")}
    parts = [header(now)]
    for name in section_names(set(found), failed):
        if name in found:
            text = found[name].read_text(encoding="utf-8").strip()
            if not text.startswith("## "):
                text = f"## {name}\n\n{text}"
            parts.append(text + "\n")
        else:
            parts.append(
                f"## {name}\n\n`benchmarks/bench_{name}.py` failed in this run: no "
                "figures (its output is in the log of `scripts/bench.sh`).\n"
            )
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("fragments", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/performance.md"))
    parser.add_argument("--failed", nargs="*", default=[])
    args = parser.parse_args()
    args.out.write_text(assemble(args.fragments, args.failed), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
