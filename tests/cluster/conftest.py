"""Fixtures for the tests against the real cluster of scripts/cluster.sh.

The cluster is started by scripts/test.sh (or by hand: ``scripts/cluster.sh start``). Without
it these tests skip, or fail when FUSION_OCI_REQUIRE_BACKENDS asks for ``kubernetes`` (``all``
does). A failing test's components' logs are in ``$FUSION_OCI_CLUSTER_STATE/logs``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from fusion_oci.images.provision import ProvisionedImage
from tests.backends import require
from tests.cluster.kube import Kube, KubectlError, cluster_env, load_image
from tests.integration.images_fixture import node_image  # noqa: F401  (fixture)

NODES = ("fusion-oci-n1", "fusion-oci-n2")


@pytest.fixture(scope="session")
def kube(node_image: Callable[[str], ProvisionedImage]) -> Kube:  # noqa: F811
    """The running cluster, with the suite's node task image (built in podman by the images
    fixture, as every container test has it) imported into both nodes."""
    try:
        env = cluster_env()
    except (OSError, subprocess.SubprocessError) as exc:
        require("kubernetes", False, f"scripts/cluster.sh env failed: {exc}")
        raise
    bin_dir = env.get("FUSION_OCI_K8S_BIN", "")
    if not bin_dir:
        require("kubernetes", False, "the cluster is not running: scripts/cluster.sh start")
    k = Kube.from_env(env)
    try:
        k.run("get", "--raw", "/readyz", timeout=20)
    except (KubectlError, OSError) as exc:
        require(
            "kubernetes", False, f"the cluster does not answer (scripts/cluster.sh start): {exc}"
        )
    ref = node_image("podman").ref
    load_image(ref)
    return dataclasses.replace(k, node_image=ref)


@pytest.fixture
def ns(kube: Kube) -> Iterator[str]:
    """A fresh namespace for one test, deleted (without waiting) afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.run("create", "namespace", name)
    # pods are admitted only once the namespace's default service account exists
    kube.run("-n", name, "wait", "--for=create", "serviceaccount/default", "--timeout=60s")
    yield name
    kube.run("delete", "namespace", name, "--wait=false", check=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed cluster test's report ends with where every component's log is, and the last
    lines of each (the logs themselves stay in the state folder after `stop`)."""
    report: pytest.TestReport = yield
    if report.failed and call.when == "call":
        logs = Path(cluster_env().get("FUSION_OCI_CLUSTER_STATE", "/nonexistent")) / "logs"
        tails = []
        for log in sorted(logs.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-5:]
            tails.append(f"== {log}\n" + "\n".join(line[:300] for line in lines))
        if tails:
            report.sections.append(("cluster logs (last lines)", "\n".join(tails)))
    return report
