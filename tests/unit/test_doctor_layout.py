"""``fusion-oci doctor``'s text: one line per backend with a mark, its details indented and
wrapped at word boundaries, so a 100-column terminal never shows a name cut in two (the old
six-column table broke ``sandbox.ociRuntime`` and ``maskedPaths/readonlyPaths`` mid-word)."""

from __future__ import annotations

import re

from fusion_oci.cli.doctor import backend_lines

ENFORCES = [
    "cpuLimit.maxCores",
    "envAllowlist",
    "host processes (signals, rlimits, priorities)",
    "hostServices (granted host services only, through the task's relays)",
    "maskedPaths/readonlyPaths",
    "network filtered (egress only through the task's proxy)",
]
ROWS = [
    {"backend": "bubblewrap", "available": True, "version": "0.8.0", "rootless": False,
     "enforces": ENFORCES, "reason": None, "hint": None},
    {"backend": "oci", "ociRuntime": "crun", "available": False, "version": None,
     "rootless": None, "enforces": [],
     "reason": "crun refuses cgroup v1/hybrid hosts ('cgroups in hybrid mode not supported')",
     "hint": "set sandbox.oci.runtime: runc, or boot the host with the unified cgroup v2 "
     "hierarchy (systemd.unified_cgroup_hierarchy=1)"},
]  # fmt: skip


def plain(lines: list[str]) -> list[str]:
    return [re.sub(r"\[/?[a-z ]*\]", "", line) for line in lines]


def test_one_marked_line_per_backend_then_its_details_indented() -> None:
    lines = plain(backend_lines(ROWS, "bubblewrap", 100))
    heads = [line for line in lines if not line.startswith("      ")][1:]
    assert heads == ["  ok bubblewrap  0.8.0, rootful, configured", "   x oci (crun)"]
    assert any(line.startswith("      why: crun refuses") for line in lines)
    assert any(line.startswith("      fix: set sandbox.oci.runtime: runc") for line in lines)


def test_details_wrap_at_word_boundaries_within_the_width() -> None:
    for width in (60, 80, 100):
        lines = plain(backend_lines(ROWS, "bubblewrap", width))
        assert max(len(line) for line in lines) <= width, (width, lines)
        text = " ".join(line.strip() for line in lines)
        for word in ("maskedPaths/readonlyPaths", "sandbox.oci.runtime:", "cpuLimit.maxCores"):
            assert word in text, (width, word)
