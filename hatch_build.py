"""Build hook: compile the exec agent (fusion_oci/agent/agent.c) into a static binary.

Hatchling runs it for wheels and editable installs (registered in pyproject.toml); the wheel
then ships fusion_oci/agent/fusion-oci-agent and is platform-tagged. By hand, in a checkout:
``python hatch_build.py`` (rebuilds only when agent.c is newer than the binary).
Needs a C compiler and a static libc (Debian: gcc, libc6-dev; scripts/install.sh).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
SOURCE = ROOT / "fusion_oci" / "agent" / "agent.c"
BINARY = ROOT / "fusion_oci" / "agent" / "fusion-oci-agent"
CFLAGS = ["-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror"]


def build_agent(force: bool = False) -> Path:
    """Compile agent.c when the binary is missing or older; return the binary's path."""
    if not force and BINARY.exists() and BINARY.stat().st_mtime >= SOURCE.stat().st_mtime:
        return BINARY
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit(
            "fusion-oci: building the exec agent needs a C compiler "
            "(Debian: apt-get install gcc libc6-dev; see scripts/install.sh)"
        )
    tmp = BINARY.with_name(BINARY.name + ".tmp")
    # Written beside and renamed: a running agent's binary is never rewritten in place.
    subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(SOURCE)], check=True)
    tmp.chmod(0o755)
    tmp.replace(BINARY)
    return BINARY


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # by hand without hatchling: only build_agent() is needed
    BuildHookInterface = object  # type: ignore[assignment,misc]


class AgentBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if not sys.platform.startswith("linux"):
            return  # the agent is Linux C; elsewhere native keeps its reaper shim (pure wheel)
        binary = build_agent()
        if self.target_name != "wheel":
            return
        # A native binary inside: the wheel is for this platform (any Python 3), not any.
        build_data["pure_python"] = False
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["tag"] = f"py3-none-{platform}"
        # The binary is git-ignored, so it is listed explicitly.
        build_data["force_include"][str(binary)] = "fusion_oci/agent/fusion-oci-agent"


if __name__ == "__main__":
    print(build_agent(force="--force" in sys.argv[1:]))
