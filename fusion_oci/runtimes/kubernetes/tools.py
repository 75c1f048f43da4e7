"""The runtime's own programs in a task's pod, shipped as one immutable ConfigMap.

A pod needs three programs of ours: the exec agent (a static binary), its stream relay
(``agent/mux.py``: the agent's frames over a ``pods/exec`` stream, which cannot pass file
descriptors) and the worktree transfer's remote side (``sync/remote.py``). Baking them into
the task image would tie every image to a fusion-oci version and need a registry; copying
them in through an exec would put them where the command (same uid) can rewrite them. A
ConfigMap named by the hash of its contents is made once per fusion-oci build, mounted
read-only at :data:`~.pod.TOOLS_DIR` with mode 0555, shared by every task of that build and
marked ``immutable`` (the kubelet does not watch it). 1.1 MB of JSON for a 0.8 MB binary: under
the API's 1 MiB ConfigMap limit, which counts the decoded bytes.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusion_oci.runtimes.kubernetes.pod import MANAGED_BY, TOOLS_AGENT, TOOLS_DIR

AGENT = TOOLS_AGENT
MUX = "mux.py"
REMOTE = "remote.py"
LABEL_TOOLS = "io.fusion-oci/kind"
"""``tools``: gc removes a tools ConfigMap no pod of ours mounts."""


@dataclass(frozen=True)
class Tools:
    """Files for the pod in one immutable ConfigMap named by their content."""

    files: tuple[tuple[str, bytes], ...]
    prefix: str = "fusion-oci-tools"

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for name, data in self.files:
            h.update(b"%s\0%d\0" % (name.encode(), len(data)))
            h.update(data)
        return h.hexdigest()

    @property
    def name(self) -> str:
        return f"{self.prefix}-{self.digest[:16]}"

    def manifest(self) -> dict[str, Any]:
        """The ConfigMap. Pure."""
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": self.name, "labels": {**MANAGED_BY, LABEL_TOOLS: "tools"}},
            "immutable": True,
            "binaryData": {n: base64.b64encode(d).decode("ascii") for n, d in self.files},
        }


def host_ca(path: Path, limit: int = 900 << 10) -> Tools:
    """The host's CA bundle (what the spec binds at ``CA_IN_SANDBOX``) for the pod: the pod's
    TLS clients must trust what the host's do (an intercepting proxy's CA, a company's)."""
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        from fusion_oci.errors import SandboxSetupError

        raise SandboxSetupError(
            "the host's CA bundle is too large to carry to the pod",
            f"{path} is over {limit >> 10} KiB (a ConfigMap holds at most 1 MiB)",
            "set sandbox.caBundle to a bundle with only the certificates the tasks need",
        )
    return Tools((("host-ca.pem", data),), prefix="fusion-oci-ca")


def path(name: str) -> str:
    """Where a tool is in the pod."""
    return f"{TOOLS_DIR}/{name}"


def load_tools() -> Tools:
    """This build's tools, read from the package (a setup error when the agent is missing)."""
    from fusion_oci.agent.client import agent_binary
    from fusion_oci.runtimes.kubernetes.sync.stream import REMOTE_SCRIPT

    mux = Path(agent_binary()).with_name(MUX)
    return Tools(
        (
            (AGENT, agent_binary().read_bytes()),
            (MUX, mux.read_bytes()),
            (REMOTE, REMOTE_SCRIPT.read_bytes()),
        )
    )
