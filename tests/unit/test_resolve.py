"""The resolve step's choices, and what runtimes read back from the spec instead of the policy
or the context."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fusion_oci.models import (
    CacheMode,
    CpuLimit,
    NetworkMode,
    PrepareContext,
    RunOptions,
    SandboxPolicy,
)
from fusion_oci.oci import spec as spec_module
from fusion_oci.oci.spec import (
    ANN_NETWORK,
    Spec,
    compile_spec,
    spec_cache_mode,
    spec_network,
)
from fusion_oci.policy.layout import TaskLayout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.resolve import resolve_ca_bundle, resolve_image
from fusion_oci.runtimes.base import requirements, spec_requirements
from tests.golden import GOLDEN_HOST

DOCS = Path(__file__).parent.parent.parent / "docs" / "spec-annotations.md"
LAYOUT = TaskLayout("/srv/wt", None, (), None)

POLICIES = {
    "default": SandboxPolicy(),
    "none": SandboxPolicy(allow_network=False),
    "host": SandboxPolicy(network=NetworkMode.HOST),
    "limits": SandboxPolicy(memory_limit_mb=256, pids_limit=64, tmp_size_mb=100,
                            file_size_limit_mb=10,
                            cpu_limit=CpuLimit(max_cores=1.5, max_ms=30_000)),
    "cores-only": SandboxPolicy(cpu_limit=CpuLimit(max_cores=2)),
}


def ctx(policy: SandboxPolicy, **kw: object) -> PrepareContext:
    return PrepareContext(task_id="t", run_id="r", worktree_path="/srv/wt", policy=policy,
                          **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_spec_says_what_the_policy_requires(name: str) -> None:
    policy = POLICIES[name]
    spec = compile_spec(ctx(policy), LAYOUT, GOLDEN_HOST, "true", RunOptions(), {})
    assert spec_requirements(spec) == requirements(policy)
    assert spec_network(spec) is policy.network_mode


def test_network_is_read_from_the_namespaces_first() -> None:
    spec = compile_spec(ctx(SandboxPolicy()), LAYOUT, GOLDEN_HOST, "true", RunOptions(), {})
    assert spec_network(spec) is NetworkMode.EGRESS
    no_ns = {**spec, "linux": {**spec["linux"], "namespaces": [
        n for n in spec["linux"]["namespaces"] if n["type"] != "network"]}}
    assert spec_network(no_ns) is NetworkMode.HOST  # no namespace: the host's network
    claims_host = {**spec, "annotations": {**spec["annotations"], ANN_NETWORK: "host"}}
    assert spec_network(claims_host) is NetworkMode.NONE  # a namespace, an odd claim: closed
    unannotated = {**spec, "annotations": {}}
    assert spec_network(unannotated) is NetworkMode.NONE


def test_cache_mode_travels_in_the_spec() -> None:
    spec = compile_spec(ctx(SandboxPolicy(), cache_mode=CacheMode.ISOLATED), LAYOUT,
                        GOLDEN_HOST, "true", RunOptions(), {})
    assert spec_cache_mode(spec) is CacheMode.ISOLATED
    assert spec_cache_mode({"annotations": {}}) is CacheMode.SHARED
    assert spec_cache_mode({"annotations": {spec_module.ANN_CACHE_MODE: "??"}}) \
        is CacheMode.ISOLATED


def test_image_and_ca_are_chosen_in_one_place() -> None:
    settings = SandboxSettings(image="node:22")
    assert resolve_image(settings, ctx(SandboxPolicy(), image="own"), "node") == "own"
    assert resolve_image(settings, ctx(SandboxPolicy()), "node") == "node:22"
    assert resolve_image(SandboxSettings(), ctx(SandboxPolicy()), "node") == "node"
    assert resolve_image(SandboxSettings(), ctx(SandboxPolicy()), None) is None
    host_ca = GOLDEN_HOST.ca_bundle
    assert resolve_ca_bundle(SandboxSettings(), ctx(SandboxPolicy()), GOLDEN_HOST) == host_ca
    assert resolve_ca_bundle(SandboxSettings(host_ca="off"), ctx(SandboxPolicy()),
                             GOLDEN_HOST) is None
    assert resolve_ca_bundle(SandboxSettings(host_ca="off"),
                             ctx(SandboxPolicy(), host_ca_bundle="/own.pem"),
                             GOLDEN_HOST) == "/own.pem"


def test_every_annotation_is_listed_in_the_docs_table() -> None:
    table = DOCS.read_text(encoding="utf-8")
    names = {value for key, value in vars(spec_module).items()
             if key.startswith("ANN_") and isinstance(value, str)}
    assert names, "no annotation constants found"
    listed = set(re.findall(r"^\| `(io\.fusion-oci\.[a-z-]+)` \|", table, re.M))
    assert names == listed, f"docs/spec-annotations.md table vs oci/spec.py: {names ^ listed}"


def test_the_lifecycle_refuses_a_task_spec_the_runtime_does_not_enforce() -> None:
    """The check against the spec: a memory limit in the task spec that the runtime cannot
    hold is refused (before prepare, and before each command), whatever the policy said."""
    from fusion_oci.errors import PolicyNotEnforceableError
    from fusion_oci.runtimes.base import Requirement, unenforced_in
    from fusion_oci.sandbox import Sandbox

    spec = compile_spec(ctx(SandboxPolicy(allow_network=False, memory_limit_mb=64)), LAYOUT,
                        GOLDEN_HOST, "true", RunOptions(), {})

    class Holds:
        id = "fake"
        isolates = True

        def check(self, spec: Spec) -> list[str]:
            return unenforced_in(spec, frozenset({Requirement.FILESYSTEM, Requirement.PROC_PATHS,
                                                  Requirement.ENV, Requirement.NETWORK_NONE}))

    with pytest.raises(PolicyNotEnforceableError) as refused:
        Sandbox(SandboxSettings())._check_spec(Holds(), spec)  # type: ignore[arg-type]
    assert refused.value.unenforced == ["memoryLimitMb"]
    Sandbox(SandboxSettings())._check_spec(Holds(), compile_spec(  # type: ignore[arg-type]
        ctx(SandboxPolicy(allow_network=False)), LAYOUT, GOLDEN_HOST, "true", RunOptions(), {}))
