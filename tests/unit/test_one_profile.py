"""One seccomp profile and one capability set, enforced by every runtime: each translation
takes them from the spec, so a change to the spec's profile changes what every runtime is
given (docker's security_opt, podman's profile file, bubblewrap's BPF, runc's config.json,
landlock's filter). Pure."""

from __future__ import annotations

import json
from typing import Any

from fusion_oci.engines.labels import Owner
from fusion_oci.errors import BundleError
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.model import ConfigSpec, split
from fusion_oci.oci.seccomp import compile_bpf
from fusion_oci.policy.layout import TaskLayout
from fusion_oci.runtimes.bubblewrap import BwrapHost, bwrap_spawn, seccomp_program
from fusion_oci.runtimes.engine.containers import Target, plan_container, seccomp_file
from fusion_oci.runtimes.landlock import landlock_rules
from fusion_oci.runtimes.oci import bundle_spec
from tests.golden import GOLDEN_HOST
from tests.tasks import config_for

Spec = dict[str, Any]

LAYOUT = TaskLayout("/srv/wt", None, (), None)
OWNER = Owner(pid=1, start="1", boot="b", host="h")
BWRAP = BwrapHost(bwrap="/usr/bin/bwrap", cgroup_mode="none", egress_resolv_conf="/r")


def spec(image: str | None = None) -> Spec:
    ctx = PrepareContext(
        task_id="t",
        run_id="r",
        worktree_path="/srv/wt",
        policy=SandboxPolicy(allow_network=False),
        image=image,
    )
    return config_for(ctx, LAYOUT, GOLDEN_HOST, "true", RunOptions(), {})


def given(s: Spec) -> dict[str, object]:
    """What each runtime is handed of the spec's profile and capabilities."""
    task, process = split(s)
    docker = plan_container(task, process, Target("docker"), name="n", owner=OWNER).create
    podman = plan_container(
        task, process, Target("podman", seccomp_dir="/c"), name="n", owner=OWNER
    ).create
    try:
        bwrap_spawn(process)
        caps: list[str] | str = []
    except BundleError:
        caps = "refused"  # bwrap drops every capability: a process keeping one is refused
    return {
        "docker": (
            [o for o in docker["security_opt"] if o.startswith("seccomp=")],
            docker["cap_add"],
        ),
        "podman": (podman["seccomp_profile_path"], podman["cap_add"]),
        "bubblewrap": (seccomp_program(task), caps),
        "oci": (
            bundle_spec(ConfigSpec(task, process)).to_oci()["linux"]["seccomp"],
            bundle_spec(ConfigSpec(task, process)).process.kept_capabilities(),
        ),
        "landlock": (landlock_rules(task, "/h", "/t").seccomp["syscalls"],),
    }


def changed(s: Spec) -> Spec:
    out: Spec = json.loads(json.dumps(s))
    out["linux"]["seccomp"]["syscalls"][0]["names"].append("io_uring_setup")
    for key in ("bounding", "effective", "permitted"):
        out["process"]["capabilities"][key] = ["CAP_NET_BIND_SERVICE"]
    return out


def test_each_runtime_is_given_the_specs_profile() -> None:
    s = spec("/srv/rootfs")
    profile = s["linux"]["seccomp"]
    got = given(s)
    assert got["docker"][0] == [
        "seccomp=" + json.dumps(profile, sort_keys=True, separators=(",", ":"))
    ]
    assert got["podman"][0] == seccomp_file(profile, "/c")[0]
    assert got["bubblewrap"][0] == compile_bpf(profile, "x86_64")
    assert got["oci"][0] == profile
    for name in ("docker", "podman", "bubblewrap", "oci"):
        assert not got[name][1], f"{name} keeps a capability the spec does not list"


def test_a_change_to_the_profile_or_caps_shows_in_every_runtime() -> None:
    s = spec("/srv/rootfs")
    before, after = given(s), given(changed(s))
    for name in before:
        assert before[name][0] != after[name][0], f"{name} ignores the spec's seccomp profile"
    for name in ("docker", "podman"):
        assert after[name][1] == ["NET_BIND_SERVICE"]
    assert after["bubblewrap"][1] == "refused"
    assert after["oci"][1] == ["CAP_NET_BIND_SERVICE"]
