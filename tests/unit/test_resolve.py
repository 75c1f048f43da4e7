"""The resolve step's choices, the two typed forms of the spec (TaskSpec, ProcessSpec), and
what runtimes read back from the spec instead of the policy or the context."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from fusion_oci.models import (
    CacheMode,
    CpuLimit,
    NetworkMode,
    PrepareContext,
    RunOptions,
    SandboxPolicy,
)
from fusion_oci.oci import model as model_module
from fusion_oci.oci.model import ANN_CACHE_MODE, ANN_NETWORK, ProcessSpec, TaskSpec, split
from fusion_oci.policy.layout import TaskLayout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.resolve import ResolvedTask, resolve_ca_bundle, resolve_image
from fusion_oci.runtimes.requirements import Requirement, task_requirements
from tests.golden import GOLDEN_HOST
from tests.tasks import config_for, resolved

DOCS = Path(__file__).parent.parent.parent / "docs" / "spec-annotations.md"
LAYOUT = TaskLayout("/srv/wt", None, (), None)

POLICIES = {
    "default": SandboxPolicy(),
    "none": SandboxPolicy(allow_network=False),
    "host": SandboxPolicy(network=NetworkMode.HOST),
    "limits": SandboxPolicy(
        memory_limit_mb=256,
        pids_limit=64,
        tmp_size_mb=100,
        file_size_limit_mb=10,
        cpu_limit=CpuLimit(max_cores=1.5, max_ms=30_000),
    ),
    "cores-only": SandboxPolicy(cpu_limit=CpuLimit(max_cores=2)),
}


def ctx(policy: SandboxPolicy, **kw: object) -> PrepareContext:
    return PrepareContext(task_id="t", run_id="r", worktree_path="/srv/wt", policy=policy, **kw)  # type: ignore[arg-type]


R = Requirement
BASE = {R.FILESYSTEM, R.PROC_PATHS, R.ENV, R.HOST_PROCESSES}
REQUIRED = {
    "default": BASE | {R.NETWORK_EGRESS},
    "none": BASE | {R.NETWORK_NONE},
    "host": BASE,
    "limits": BASE
    | {R.NETWORK_EGRESS, R.MEMORY, R.PIDS, R.TMP_SIZE, R.FILE_SIZE, R.CPU_QUOTA, R.CPU_TIME},
    "cores-only": BASE | {R.NETWORK_EGRESS, R.CPU_QUOTA},
}


def task(policy: SandboxPolicy, **kw: object) -> ResolvedTask:
    return resolved(ctx(policy, **kw), LAYOUT, GOLDEN_HOST)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_what_a_task_requires_is_read_from_its_spec(name: str) -> None:
    """Once, from the task spec and its commands' rlimits (not from the policy again)."""
    policy = POLICIES[name]
    assert task_requirements(task(policy)) == REQUIRED[name]
    assert task(policy).spec.network is policy.network_mode


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_two_typed_halves_are_the_whole_schema_valid_config(
    name: str, oci_validator: Any
) -> None:
    t = task(POLICIES[name])
    process = t.process(["make", "-j2"], RunOptions(cwd="sub"))
    config = config_for(
        ctx(POLICIES[name]), LAYOUT, GOLDEN_HOST, ["make", "-j2"], RunOptions(cwd="sub"), {}
    )
    oci_validator.validate(config)
    assert t.spec.to_oci() | {"process": process.to_oci()} == config
    back_task, back_process = split(config)
    assert back_task == t.spec and back_process == process
    assert process.cwd == "/srv/wt/sub" and process.rlimit("RLIMIT_NOFILE") is not None


def test_the_env_allowlist_rides_on_the_spec_outside_the_json() -> None:
    """Native narrows the caller's own environment by it, read from the spec (not the
    context); the OCI config has no word for it, and every process's env is narrowed already."""
    spec = task(SandboxPolicy(env_allowlist=["CI", "NODE_*"])).spec
    assert spec.env_allowlist == ("CI", "NODE_*")
    assert task(SandboxPolicy()).spec.env_allowlist == ()
    # The same JSON as without one, but for the policy's digest.
    assert spec.to_oci() == task(SandboxPolicy()).spec.to_oci() | {"annotations": spec.annotations}
    assert "envAllowlist" not in spec.to_oci()


def test_a_misspelt_or_mistyped_field_is_refused() -> None:
    config = config_for(ctx(SandboxPolicy()), LAYOUT, GOLDEN_HOST, "true", RunOptions(), {})
    with pytest.raises(ValidationError, match="noNewPrivilege"):
        ProcessSpec.model_validate({**config["process"], "noNewPrivilege": True})
    with pytest.raises(ValidationError, match="mounts"):
        TaskSpec.model_validate(
            {**{k: v for k, v in config.items() if k != "process"}, "mounts": [{"destination": 1}]}
        )


def test_network_is_read_from_the_namespaces_first() -> None:
    spec = task(SandboxPolicy()).spec
    assert spec.network is NetworkMode.EGRESS
    no_ns = spec.model_copy(
        update={
            "linux": spec.linux.model_copy(
                update={"namespaces": [n for n in spec.linux.namespaces if n.type != "network"]}
            )
        }
    )
    assert no_ns.network is NetworkMode.HOST  # no namespace: the host's network
    claims_host = spec.model_copy(update={"annotations": {**spec.annotations, ANN_NETWORK: "host"}})
    assert claims_host.network is NetworkMode.NONE  # a namespace, an odd claim: closed
    assert spec.model_copy(update={"annotations": {}}).network is NetworkMode.NONE


def test_cache_mode_travels_in_the_spec() -> None:
    spec = task(SandboxPolicy(), cache_mode=CacheMode.ISOLATED).spec
    assert spec.cache_mode is CacheMode.ISOLATED
    assert spec.model_copy(update={"annotations": {}}).cache_mode is CacheMode.SHARED
    assert (
        spec.model_copy(update={"annotations": {ANN_CACHE_MODE: "??"}}).cache_mode
        is CacheMode.ISOLATED
    )


def test_image_and_ca_are_chosen_in_one_place() -> None:
    settings = SandboxSettings(image="node:22")
    assert resolve_image(settings, ctx(SandboxPolicy(), image="own"), "node") == "own"
    assert resolve_image(settings, ctx(SandboxPolicy()), "node") == "node:22"
    assert resolve_image(SandboxSettings(), ctx(SandboxPolicy()), "node") == "node"
    assert resolve_image(SandboxSettings(), ctx(SandboxPolicy()), None) is None
    host_ca = GOLDEN_HOST.ca_bundle
    assert resolve_ca_bundle(SandboxSettings(), ctx(SandboxPolicy()), GOLDEN_HOST) == host_ca
    assert (
        resolve_ca_bundle(SandboxSettings(host_ca="off"), ctx(SandboxPolicy()), GOLDEN_HOST) is None
    )
    assert (
        resolve_ca_bundle(
            SandboxSettings(host_ca="off"),
            ctx(SandboxPolicy(), host_ca_bundle="/own.pem"),
            GOLDEN_HOST,
        )
        == "/own.pem"
    )


def test_every_annotation_is_listed_in_the_docs_table() -> None:
    table = DOCS.read_text(encoding="utf-8")
    names = {
        value
        for key, value in vars(model_module).items()
        if key.startswith("ANN_") and isinstance(value, str)
    }
    assert names, "no annotation constants found"
    listed = set(re.findall(r"^\| `(io\.fusion-oci\.[a-z-]+)` \|", table, re.M))
    assert names == listed, f"docs/spec-annotations.md table vs oci/model.py: {names ^ listed}"


def test_the_lifecycle_refuses_a_task_spec_the_runtime_does_not_enforce() -> None:
    """The one check, against the task: a memory limit in the task spec that the runtime
    cannot hold is refused before prepare, whatever the policy said."""
    from fusion_oci.errors import PolicyNotEnforceableError
    from fusion_oci.runtimes.protocol import RuntimeDefaults
    from fusion_oci.sandbox import Sandbox

    class Holds(RuntimeDefaults):
        id = "fake"

        def enforces(self) -> frozenset[Requirement]:
            return frozenset({*BASE, R.NETWORK_NONE})

    limited = task(SandboxPolicy(allow_network=False, memory_limit_mb=64))
    with pytest.raises(PolicyNotEnforceableError) as refused:
        Sandbox(SandboxSettings())._check(Holds(), limited)  # type: ignore[arg-type]
    assert refused.value.unenforced == ["memoryLimitMb"]
    Sandbox(SandboxSettings())._check(  # type: ignore[arg-type]
        Holds(), task(SandboxPolicy(allow_network=False))
    )


def test_a_prepare_compiles_the_task_spec_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dry resolve the check reads, the resolve that creates the folders, the copies with
    the proxy, relays, ports and the provisioned image: one compile, and the spec they carry is
    the one a fresh compile gives."""
    from fusion_oci import resolve as resolve_module
    from fusion_oci.oci.spec import compile_task

    calls: list[str] = []

    def counting(*args: Any) -> TaskSpec:
        calls.append("compile")
        return compile_task(*args)

    monkeypatch.setattr(resolve_module, "compile_task", counting)
    wt = tmp_path / "wt"
    (wt / ".fusion").mkdir(parents=True)  # a project that ran before: the layouts are equal
    c = PrepareContext(task_id="t", run_id="r", worktree_path=str(wt), image="localhost/x:1")
    where = {"env": {}, "cache_root": tmp_path / "cache"}
    checked = resolve_module.resolve(SandboxSettings(), c, GOLDEN_HOST, create=False, **where)
    assert checked.spec.image == "localhost/x:1"
    task = resolve_module.resolve(SandboxSettings(), c, GOLDEN_HOST, checked=checked, **where)
    assert (tmp_path / "cache").is_dir()
    task = task.with_egress(None).with_services(None).with_ports(None)
    task = task.with_layout(replace(task.layout)).with_image("localhost/x@sha256:ab")
    assert task.spec == compile_task(task.ctx, task.layout, task.host)
    assert task.spec.image == "localhost/x@sha256:ab"
    assert calls == ["compile"]
    # A layout that changes the mounts is compiled again.
    moved = task.with_layout(replace(task.layout, hosts_file="/h/hosts"))
    assert any(m.destination == "/etc/hosts" for m in moved.spec.mounts)
    assert calls == ["compile", "compile"]
