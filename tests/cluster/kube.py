"""A thin kubectl driver for the cluster tests: the cluster scripts/cluster.sh runs, talked to
with the kubectl built beside it (no Kubernetes client library in the test dependencies).

Every call has a timeout; a failed call raises :class:`KubectlError` with the argv, the exit
status and the tail of stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = ROOT / "scripts" / "cluster.sh"
T = TypeVar("T")


class KubectlError(RuntimeError):
    def __init__(self, argv: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(
            f"{' '.join(argv)} exited {returncode}: {stderr.strip()[-2000:]}"
            "\nhint: the components' logs are in $FUSION_OCI_CLUSTER_STATE/logs"
        )


def cluster_env() -> dict[str, str]:
    """The `export` lines of `scripts/cluster.sh env`, as a dict (the process env wins)."""
    out = subprocess.run(
        ["bash", str(CLUSTER_SH), "env"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    env: dict[str, str] = {}
    for line in out.splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export ") :].partition("=")
            env[key] = os.environ.get(key) or value
    return env


def load_image(ref: str) -> None:
    """``scripts/cluster.sh load-image REF``: the image in both nodes; a failure says the
    script's own words (a bare CalledProcessError hid them once, in CI)."""
    p = subprocess.run(
        ["bash", str(CLUSTER_SH), "load-image", ref],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if p.returncode != 0:
        raise RuntimeError(
            f"scripts/cluster.sh load-image {ref} exited {p.returncode}:\n"
            f"{p.stdout[-4000:]}{p.stderr[-4000:]}"
        )


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Kube:
    """kubectl against the test cluster."""

    kubectl: Path
    kubeconfig: Path
    state: Path
    node_image: str
    hub_netns: str
    hub_ip: str
    host_ip: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Kube:
        return cls(
            kubectl=Path(env["FUSION_OCI_K8S_BIN"]) / "kubectl",
            kubeconfig=Path(env["KUBECONFIG"]),
            state=Path(env["FUSION_OCI_CLUSTER_STATE"]),
            node_image=env.get("FUSION_OCI_K8S_NODE_IMAGE", ""),
            hub_netns=env["FUSION_OCI_K8S_HUB_NETNS"],
            hub_ip=env["FUSION_OCI_K8S_HUB_IP"],
            host_ip=env["FUSION_OCI_K8S_HOST_IP"],
        )

    def run(
        self, *args: str, input: str | None = None, timeout: float = 120, check: bool = True
    ) -> Completed:
        argv = [str(self.kubectl), "--kubeconfig", str(self.kubeconfig), *args]
        try:
            proc = subprocess.run(
                argv,
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise KubectlError(argv, -1, "", f"timed out after {timeout} s") from exc
        if check and proc.returncode != 0:
            raise KubectlError(argv, proc.returncode, proc.stdout, proc.stderr)
        return Completed(proc.returncode, proc.stdout, proc.stderr)

    def apply(self, *objects: Mapping[str, Any], namespace: str | None = None) -> None:
        doc = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
        ns = ["-n", namespace] if namespace else []
        self.run(*ns, "apply", "-f", "-", input=json.dumps(doc))

    def get(self, kind: str, name: str = "", namespace: str | None = None) -> Any:
        ns = ["-n", namespace] if namespace else []
        args = [kind, name] if name else [kind]
        return json.loads(self.run(*ns, "get", *args, "-o", "json").stdout)

    def exists(self, kind: str, name: str, namespace: str) -> bool:
        res = self.run("-n", namespace, "get", kind, name, "-o", "name", check=False)
        if res.returncode == 0:
            return True
        if "NotFound" in res.stderr:
            return False
        raise KubectlError([kind, name], res.returncode, res.stdout, res.stderr)

    def wait_ready(self, namespace: str, *pods: str, timeout: float = 180) -> None:
        self.run(
            "-n",
            namespace,
            "wait",
            "--for=condition=Ready",
            f"--timeout={int(timeout)}s",
            *(f"pod/{p}" for p in pods),
            timeout=timeout + 30,
        )

    def exec(
        self, namespace: str, pod: str, *command: str, input: str | None = None, timeout: float = 60
    ) -> Completed:
        stdin = ["-i"] if input is not None else []
        return self.run(
            "-n", namespace, "exec", *stdin, pod, "--", *command,
            input=input, timeout=timeout, check=False,
        )  # fmt: skip

    def pod(
        self,
        name: str,
        command: Sequence[str],
        *,
        node: str | None = None,
        labels: Mapping[str, str] | None = None,
        memory: str | None = None,
        restart: str = "Never",
    ) -> dict[str, Any]:
        """A pod of the task image running ``command``, optionally pinned to a node."""
        container: dict[str, Any] = {
            "name": "main",
            "image": self.node_image,
            "imagePullPolicy": "Never",
            "command": list(command),
        }
        if memory:
            container["resources"] = {"limits": {"memory": memory}, "requests": {"memory": memory}}
        spec: dict[str, Any] = {
            "containers": [container],
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
        }
        if node:
            spec["nodeSelector"] = {"kubernetes.io/hostname": node}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": spec,
        }


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, every: float = 0.5) -> T:
    """Poll ``probe`` until it returns something other than None/False; fail after timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last is not None and last is not False:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


HTTP_SERVER = (
    "require('http').createServer((q, s) => s.end('pong from ' + require('os').hostname()))"
    ".listen(8080, () => console.log('listening'))"
)
"""A pod's HTTP server (node from the task image) on port 8080, answering its hostname."""

TCP_PROBE = """
const [host, port] = process.argv.slice(1);
const s = require('net').connect({host, port: Number(port), timeout: 3000});
s.on('connect', () => { console.log('open'); s.destroy(); process.exit(0); });
s.on('timeout', () => { console.log('timeout'); process.exit(2); });
s.on('error', (e) => { console.log(e.code); process.exit(3); });
"""
"""A TCP connect probe: prints open / timeout / the error code; exit 0 only when open."""
