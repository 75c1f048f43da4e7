"""Golden files: compare with tests/data/...; FUSION_OCI_UPDATE_GOLDEN=1 (re)writes them.

A missing golden fails: a test that writes its own expectation proves nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fusion_oci.oci.host import HostInfo

DATA = Path(__file__).parent / "data"


def assert_golden(name: str, value: Any) -> None:
    path = DATA / name
    text = (
        (json.dumps(value, indent=2, sort_keys=True) + "\n")
        if not isinstance(value, str)
        else value
    )
    if os.environ.get("FUSION_OCI_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"golden {path} is missing (FUSION_OCI_UPDATE_GOLDEN=1 writes it)"
    assert path.read_text() == text, f"{path} differs (FUSION_OCI_UPDATE_GOLDEN=1 to accept)"


def host_neutral(argv: list[str]) -> list[str]:
    """A launch argv with this process's facts (the interpreter, the shim's path, our pid)
    as placeholders, so that a golden of what really runs is the same on every machine."""
    import sys

    from fusion_oci.shims import REAPER

    facts = {sys.executable: "<python>", str(REAPER): "<reaper.py>", str(os.getpid()): "<pid>"}
    return [facts.get(a, a) for a in argv]


GOLDEN_HOST = HostInfo(
    uid=1000,
    gid=1000,
    rlimits={"RLIMIT_NOFILE": (1024, 20000), "RLIMIT_CPU": (-1, -1)},
    system_mounts=(("/usr", "/usr"), ("/bin", "/usr/bin"), ("/lib", "/usr/lib")),
    etc_entries=("passwd", "ssl", "resolv.conf"),
    ca_bundle="/etc/ssl/certs/ca-certificates.crt",
)
"""The fixed host facts every golden translation is compiled against (no real host reads)."""
