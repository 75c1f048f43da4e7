"""Which backends the tests may use here, and the rule that a missing one fails in CI.

``FUSION_OCI_REQUIRE_BACKENDS`` (``all`` or a comma list, set by scripts/test.sh and so by CI)
turns "backend missing → skip" into a test error: a runtime test that skips in CI is a
failing test.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.registry import create_runtime


def required_backends() -> set[str]:
    value = os.environ.get("FUSION_OCI_REQUIRE_BACKENDS", "")
    if value.strip() == "all":
        return {
            "native",
            "bubblewrap",
            "oci",
            "oci-runsc",
            "landlock",
            "podman",
            "podman-rootless",
            "docker",
            "docker-rootless",
            "oci-schema",
            "libseccomp",
            "kubernetes",
        }
    return {v.strip() for v in value.split(",") if v.strip()}


def require(backend: str, available: bool, reason: str) -> None:
    """Skip when ``backend`` is missing here, unless it is required (then fail)."""
    if available:
        return
    if backend in required_backends():
        pytest.fail(
            f"backend '{backend}' is required (FUSION_OCI_REQUIRE_BACKENDS) but missing: {reason}",
            pytrace=False,
        )
    pytest.skip(f"backend '{backend}' missing: {reason}")


VARIANTS: dict[str, dict[str, str]] = {"oci-runsc": {"backend": "oci", "oci_runtime": "runsc"}}
"""Test backends that are a backend id plus settings: ``oci-runsc`` is the oci backend with
gVisor's runsc as its OCI runtime."""


def backend_settings(backend: str, **fields: Any) -> SandboxSettings:
    """The settings that select ``backend`` (a backend id or a name in VARIANTS)."""
    if backend == "kubernetes":
        # the test cluster, its namespace and the node image (tests/contract/harness.py)
        from tests.contract.harness import kubernetes_runtime

        return kubernetes_runtime().settings.model_copy(update=fields)
    base: dict[str, Any] = dict(VARIANTS.get(backend, {"backend": backend}))
    return SandboxSettings(**{**base, **fields})


def require_runtime(backend: str, settings: SandboxSettings | None = None) -> None:
    settings = settings or backend_settings(backend)
    runtime = create_runtime(settings.backend, settings, os.environ)
    avail = runtime.availability()
    require(backend, avail.available, f"{avail.reason} {avail.hint}".strip())
