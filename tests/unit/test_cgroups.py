"""The shared cgroup module's host-layout and counter readers (used by oci and bubblewrap)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusion_oci.runtimes.linux.cgroups import (
    CgroupEvents,
    Hierarchy,
    hierarchy_of,
    leaf_name,
    parse_mountinfo,
    read_events,
)

HYBRID = """\
25 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
26 25 0:23 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
27 26 0:24 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
28 26 0:25 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
29 26 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
30 26 0:27 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
31 26 0:28 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
"""
UNIFIED = "26 25 0:23 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"


def test_hierarchy_of_the_mounts() -> None:
    assert hierarchy_of(parse_mountinfo(HYBRID)) == Hierarchy(
        "hybrid", frozenset({"memory", "pids", "cpu", "cpuacct"})
    )
    v1_only = "\n".join(line for line in HYBRID.splitlines() if "cgroup2" not in line)
    assert hierarchy_of(parse_mountinfo(v1_only)).layout == "v1"
    assert hierarchy_of(parse_mountinfo(UNIFIED), "cpuset cpu io memory pids\n") == Hierarchy(
        "v2", frozenset({"cpuset", "cpu", "io", "memory", "pids"})
    )
    assert hierarchy_of([]).layout == "none"


def test_read_events_from_v1_and_v2_directories(tmp_path: Path) -> None:
    mem, pids, unified = tmp_path / "memory", tmp_path / "pids", tmp_path / "unified"
    for d in (mem, pids, unified):
        d.mkdir()
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (pids / "pids.events").write_text("max 5\n")
    (unified / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 1\noom_kill 7\n")
    (unified / "pids.events").write_text("max 9\n")
    # v1 entries first (runc's state.json names them by controller, v2 under "")
    assert read_events({"memory": mem, "pids": pids, "": unified}) == CgroupEvents(2, 5)
    assert read_events({"": str(unified)}) == CgroupEvents(7, 9)
    assert read_events({"unified": unified}) == CgroupEvents(7, 9)
    assert read_events({"memory": tmp_path / "gone"}) == CgroupEvents(0, 0)
    assert read_events({}) == CgroupEvents()


def test_leaf_names_carry_the_creator_pid() -> None:
    assert leaf_name("ab12cd1", 4242) == "fusion-oci.4242.ab12cd1"
    with pytest.raises(ValueError, match="dot"):
        leaf_name("a.b", 1)
