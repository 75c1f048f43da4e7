"""The oci runtime's ``network: filtered`` (runc and runsc): golden launches and the bundle op
that binds the proxy socket and starts the agent's forwarder (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from fusion_oci.agent.protocol import EGRESS_AGENT, EGRESS_SOCKET
from fusion_oci.errors import BundleError
from fusion_oci.models import NetworkMode, SandboxPolicy
from fusion_oci.oci.spec import bind
from fusion_oci.runtimes.oci.filtered import SOCKET_PLACEHOLDER, with_egress_forwarder
from fusion_oci.runtimes.oci.launch import AGENT_IN_SANDBOX, runtime_flags
from fusion_oci.runtimes.requirements import Requirement
from tests.golden import assert_golden
from tests.unit.test_oci_plan import plan_of, runtime, spec_for, task_for

FILTERED = SandboxPolicy(network="filtered", allowed_domains=["registry.npmjs.org"])


@pytest.mark.parametrize("uid", [0, 1000], ids=["root", "rootless"])
def test_golden_plan(uid: int) -> None:
    plan = plan_of(runtime(uid), FILTERED)
    assert_golden(f"oci/plan-filtered-{'root' if uid == 0 else 'rootless'}.json", plan.to_json())


def test_golden_plan_runsc() -> None:
    plan = plan_of(runtime(oci_runtime="runsc"), FILTERED)
    assert_golden("oci/plan-runsc-filtered.json", plan.to_json())


def test_the_bundle_keeps_its_empty_netns_and_runs_the_forwarder(oci_validator: Any) -> None:
    rt = runtime()
    rt._egress_socket = "/run/scratch/egress-1/egress.sock"
    plan = plan_of(rt, FILTERED)
    bundle = plan.to_json()["bundle"]
    oci_validator.validate(bundle)
    assert task_for(FILTERED).spec.network is NetworkMode.FILTERED
    assert {"type": "network"} in bundle["linux"]["namespaces"]  # runc brings lo up, no more
    assert "hooks" not in bundle  # no slirp4netns
    assert (
        bind(EGRESS_SOCKET, "/run/scratch/egress-1/egress.sock", writable=False)
        in plan.bundle.task.mounts
    )
    assert (
        bind(EGRESS_AGENT, "/usr/lib/fusion-oci/fusion-oci-agent", writable=False)
        in plan.bundle.task.mounts
    )
    # The init is the agent with its forwarder, for the task's life.
    assert bundle["process"]["args"] == [AGENT_IN_SANDBOX, "--egress", EGRESS_SOCKET, "--fd", "0"]
    env = dict(plan.spawn.env)  # the command's, in its frame
    assert env["HTTPS_PROXY"] == "http://127.0.0.1:3128"
    # The mount points are made in a /run of the container's own, never in an image rootfs.
    run = [m for m in bundle["mounts"] if m["destination"] == "/run"]
    assert run and run[0]["type"] == "tmpfs"
    assert bundle["mounts"].index(run[0]) < [m["destination"] for m in bundle["mounts"]].index(
        EGRESS_SOCKET
    )


def test_the_forwarder_needs_the_agent_around_the_command() -> None:
    spec = spec_for(FILTERED)
    with pytest.raises(BundleError, match="exec agent"):
        with_egress_forwarder(spec, SOCKET_PLACEHOLDER, "/agent")


def test_runsc_uses_its_closed_netstack_and_may_connect_the_host_socket() -> None:
    assert runtime_flags("runsc", NetworkMode.FILTERED) == [
        "--oci-seccomp",
        "--network=none",
        "--host-uds=open",
    ]
    assert runtime_flags("runc", NetworkMode.FILTERED) == []


@pytest.mark.parametrize("oci_runtime", ["runc", "runsc"])
def test_filtered_is_enforced_and_fine(oci_runtime: str) -> None:
    from fusion_oci.runtimes.linux.cgroups import Hierarchy

    rt = runtime(oci_runtime=oci_runtime)
    rt._cgroups = Hierarchy("v1", frozenset())
    rt._egress = (False, "no slirp4netns")  # filtered needs none of egress's parts
    assert Requirement.NETWORK_FILTERED in rt.enforces()
    assert rt.capabilities().network_policy == "fine"
