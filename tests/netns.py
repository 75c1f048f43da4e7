"""Network-namespace plumbing the test worlds share (tests/security/*_world.py): ``ip``
itself, removing the namespaces a killed test process left, and choosing a free /24."""

from __future__ import annotations

import subprocess
from pathlib import Path


def ip(*args: str) -> None:
    """Run ``ip`` with these arguments; a failure raises (the world is then half made)."""
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def drop_stale_namespaces(prefix: str) -> None:
    """Delete the namespaces named ``<prefix><pid>`` whose pid is gone: those of a test process
    killed before its clean-up (kill -9). Deleting one drops its veth pair too."""
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name.removeprefix(prefix)
        if name.startswith(prefix) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(
                ["ip", "netns", "del", name], capture_output=True, timeout=30, check=False
            )


def free_subnet(network: str, pid: int) -> str:
    """A ``<network>.N`` /24 no address on this host is in yet (test processes of other
    checkouts run too); the search starts at one derived from ``pid``."""
    used = subprocess.run(
        ["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    tag = next(
        t for t in ((pid + i) % 200 + 20 for i in range(200)) if f" {network}.{t}." not in used
    )
    return f"{network}.{tag}"
