"""Fixtures for the tests against the real cluster of scripts/cluster.sh.

The cluster is started by scripts/test.sh (or by hand: ``scripts/cluster.sh start``). Without
it these tests skip, or fail when FUSION_OCI_REQUIRE_BACKENDS asks for ``kubernetes`` (``all``
does). A failing test's components' logs are in ``$FUSION_OCI_CLUSTER_STATE/logs``.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest

from tests.backends import require
from tests.cluster.kube import Kube, KubectlError, cluster_env

NODES = ("fusion-oci-n1", "fusion-oci-n2")


@pytest.fixture(scope="session")
def kube() -> Kube:
    try:
        env = cluster_env()
    except (OSError, subprocess.SubprocessError) as exc:
        require("kubernetes", False, f"scripts/cluster.sh env failed: {exc}")
        raise
    bin_dir = env.get("FUSION_OCI_K8S_BIN", "")
    if not bin_dir or not env.get("FUSION_OCI_K8S_NODE_IMAGE"):
        require("kubernetes", False, "the cluster is not running: scripts/cluster.sh start")
    k = Kube.from_env(env)
    try:
        k.run("get", "--raw", "/readyz", timeout=20)
    except KubectlError as exc:
        require("kubernetes", False, f"the cluster's API server does not answer: {exc}")
    return k


@pytest.fixture
def ns(kube: Kube) -> Iterator[str]:
    """A fresh namespace for one test, deleted (without waiting) afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.run("create", "namespace", name)
    # pods are admitted only once the namespace's default service account exists
    kube.run("-n", name, "wait", "--for=create", "serviceaccount/default", "--timeout=60s")
    yield name
    kube.run("delete", "namespace", name, "--wait=false", check=False)
