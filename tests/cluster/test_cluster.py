"""The cluster is real: two Ready nodes that run pods, routed pod networking between them,
streaming exec, and memory limits the kernel enforces."""

from __future__ import annotations

from typing import Any

from tests.cluster.conftest import NODES
from tests.cluster.kube import HTTP_SERVER, TCP_PROBE, Kube, wait_for


def _ready(node: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])


def test_both_nodes_ready(kube: Kube) -> None:
    nodes = {n["metadata"]["name"]: n for n in kube.get("nodes")["items"]}
    assert sorted(nodes) == sorted(NODES)
    assert all(_ready(n) for n in nodes.values())
    for node in nodes.values():
        info = node["status"]["nodeInfo"]
        assert info["kubeletVersion"].startswith("v1.") and info["kubeletVersion"] != "v0.0.0"
        assert info["containerRuntimeVersion"].startswith("containerd://")
        # node addresses are ours (the cluster's own network), never the machine's
        (ip,) = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
        assert ip.startswith("10.231.0.")


def test_versions_are_real(kube: Kube) -> None:
    out = kube.run("version", "-o", "json").stdout
    assert '"gitVersion": "v0.0.0' not in out
    assert '"gitVersion": "v1.' in out


def test_pods_on_each_node_reach_each_other(kube: Kube, ns: str) -> None:
    server, client = (
        kube.pod("b", ["node", "-e", HTTP_SERVER], node=NODES[1]),
        kube.pod("a", ["sleep", "infinity"], node=NODES[0]),
    )
    kube.apply(server, client, namespace=ns)
    kube.wait_ready(ns, "a", "b")
    pods = {p["metadata"]["name"]: p for p in kube.get("pods", namespace=ns)["items"]}
    assert pods["a"]["spec"]["nodeName"] == NODES[0]
    assert pods["b"]["spec"]["nodeName"] == NODES[1]
    b_ip = pods["b"]["status"]["podIP"]
    assert pods["a"]["status"]["podIP"].startswith("10.232.1.")
    assert b_ip.startswith("10.232.2.")
    wait_for(
        "b's server",
        lambda: kube.exec(ns, "a", "node", "-e", TCP_PROBE, b_ip, "8080").returncode == 0,
        30,
    )
    res = kube.exec(
        ns, "a", "node", "-e",
        f"fetch('http://{b_ip}:8080').then(r => r.text()).then(t => console.log(t))",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "pong from b"


def test_exec_streams_stdin_and_returns_the_exit_code(kube: Kube, ns: str) -> None:
    kube.apply(kube.pod("e", ["sleep", "infinity"]), namespace=ns)
    kube.wait_ready(ns, "e")
    payload = "".join(f"line {i}\n" for i in range(2000))
    res = kube.exec(ns, "e", "sh", "-c", "wc -l; tr a-z A-Z | tail -n 1; exit 7", input=payload)
    assert res.returncode == 7
    lines = res.stdout.splitlines()
    # `wc -l` read all of stdin; `tr` then found it at its end: only wc's count is printed
    assert lines == ["2000"]
    res = kube.exec(ns, "e", "sh", "-c", "tr a-z A-Z; echo err >&2", input="hello\n")
    assert (res.returncode, res.stdout, res.stderr.strip()) == (0, "HELLO\n", "err")


def test_memory_limit_oom_kills(kube: Kube, ns: str) -> None:
    # `tail /dev/zero` keeps one ever-growing "line" in memory
    kube.apply(kube.pod("oom", ["tail", "/dev/zero"], memory="48Mi"), namespace=ns)

    def terminated() -> dict[str, Any] | None:
        pod = kube.get("pod", "oom", namespace=ns)
        for st in pod.get("status", {}).get("containerStatuses", []):
            term = st.get("state", {}).get("terminated")
            if term:
                return dict(term)
        return None

    term = wait_for("the container to be OOM-killed", terminated, 120)
    assert term["reason"] == "OOMKilled", term
    assert term["exitCode"] == 137


def test_pnpm_install_in_a_pod(kube: Kube, ns: str) -> None:
    """Pods reach the npm registry through the machine's outbound path (the host's CA bundle
    mounted, as the engines' containers get it: the machine may sit behind a TLS proxy)."""
    ca = "/etc/ssl/certs/ca-certificates.crt"
    pod = kube.pod("pnpm", ["sleep", "infinity"])
    pod["spec"]["volumes"] = [{"name": "ca", "hostPath": {"path": ca, "type": "File"}}]
    main = pod["spec"]["containers"][0]
    main["volumeMounts"] = [{"name": "ca", "mountPath": "/run/host-ca.crt", "readOnly": True}]
    main["env"] = [
        {"name": name, "value": "/run/host-ca.crt"}
        for name in ("NODE_EXTRA_CA_CERTS", "npm_config_cafile", "SSL_CERT_FILE")
    ]
    kube.apply(pod, namespace=ns)
    kube.wait_ready(ns, "pnpm")
    script = (
        "set -e; mkdir -p /tmp/p && cd /tmp/p; "
        'echo \'{"name": "p", "version": "1.0.0", "dependencies": {"is-number": "7.0.0"}}\' '
        "> package.json; pnpm install --reporter=silent; "
        "node -e \"console.log(require('is-number')(5))\""
    )
    res = kube.exec(ns, "pnpm", "sh", "-c", script, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == "true"
