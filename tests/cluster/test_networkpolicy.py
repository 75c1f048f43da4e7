"""NetworkPolicy is enforced (kube-network-policies on each node), not just stored: a
default-deny egress policy stops a pod's direct TCP connections to another pod and to the
host, while the one peer it allows still answers."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.cluster.conftest import NODES
from tests.cluster.kube import HTTP_SERVER, TCP_PROBE, Kube, wait_for

HOST_PORT = 18631
"""A port the test's own server listens on at the host side of the cluster's network (the
hub's address, the gateway every node routes through)."""


@pytest.fixture
def host_server(kube: Kube) -> Iterator[str]:
    """An HTTP server of the host's, reachable from the pods (in the hub's namespace)."""
    proc = subprocess.Popen(
        ["nsenter", f"--net={kube.hub_netns}", "--", "python3", "-m", "http.server",
         "--bind", kube.hub_ip, str(HOST_PORT)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd="/",
    )  # fmt: skip
    try:
        yield kube.hub_ip
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _probe(kube: Kube, ns: str, pod: str, ip: str, port: int) -> str:
    return kube.exec(ns, pod, "node", "-e", TCP_PROBE, ip, str(port)).stdout.strip()


def _wait_open(kube: Kube, ns: str, ip: str, port: int) -> None:
    wait_for(f"{ip}:{port} open", lambda: _probe(kube, ns, "client", ip, port) == "open", 30)


def test_default_deny_egress_is_enforced(kube: Kube, ns: str, host_server: str) -> None:
    kube.apply(
        kube.pod("client", ["sleep", "infinity"], node=NODES[0], labels={"role": "client"}),
        # the allowed peer on the other node, the denied one on the client's own node (bridged)
        kube.pod("allowed", ["node", "-e", HTTP_SERVER], node=NODES[1], labels={"role": "allowed"}),
        kube.pod("other", ["node", "-e", HTTP_SERVER], node=NODES[0], labels={"role": "other"}),
        namespace=ns,
    )
    kube.wait_ready(ns, "client", "allowed", "other")
    ips = {
        p["metadata"]["name"]: p["status"]["podIP"] for p in kube.get("pods", namespace=ns)["items"]
    }

    # without a policy, everything answers
    for target in ("allowed", "other"):
        _wait_open(kube, ns, ips[target], 8080)
    wait_for("host open", lambda: _probe(kube, ns, "client", host_server, HOST_PORT) == "open", 30)

    kube.apply(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "default-deny-egress"},
            "spec": {"podSelector": {}, "policyTypes": ["Egress"]},
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "client-to-allowed"},
            "spec": {
                "podSelector": {"matchLabels": {"role": "client"}},
                "policyTypes": ["Egress"],
                "egress": [
                    {
                        "to": [{"podSelector": {"matchLabels": {"role": "allowed"}}}],
                        "ports": [{"protocol": "TCP", "port": 8080}],
                    }
                ],
            },
        },
        namespace=ns,
    )
    wait_for("other blocked", lambda: _probe(kube, ns, "client", ips["other"], 8080) != "open", 30)
    assert _probe(kube, ns, "client", host_server, HOST_PORT) != "open"
    assert _probe(kube, ns, "client", ips["other"], 8080) != "open"
    assert _probe(kube, ns, "client", ips["allowed"], 8080) == "open"

    # and it is the policy that did it: deleting it opens the way again
    kube.run("-n", ns, "delete", "networkpolicy", "default-deny-egress", "client-to-allowed")
    wait_for(
        "other open again", lambda: _probe(kube, ns, "client", ips["other"], 8080) == "open", 30
    )


def test_pods_do_not_reach_the_machine_itself(kube: Kube, ns: str) -> None:
    kube.apply(kube.pod("p", ["sleep", "infinity"]), namespace=ns)
    kube.wait_ready(ns, "p")
    # the host's end of the cluster's uplink: the machine's firewall drops what pods send it
    assert _probe(kube, ns, "p", kube.host_ip, 22) == "timeout"
