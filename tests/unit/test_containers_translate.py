"""The spec → SDK create kwargs translation for podman and docker, against golden files.

Regenerate after an intended change: ``FUSION_OCI_UPDATE_GOLDEN=1 pytest tests/unit/...``
and review the diff of tests/data/containers/.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.agent.protocol import Spawn
from fusion_oci.engines import Found
from fusion_oci.engines.labels import Owner
from fusion_oci.errors import (
    BundleError,
)
from fusion_oci.gc import Here, is_garbage, owner_state
from fusion_oci.models import (
    CacheMode,
    CpuLimit,
    NetworkMode,
    PrepareContext,
    RunOptions,
    SandboxPolicy,
)
from fusion_oci.oci.host import HostInfo
from fusion_oci.oci.model import split
from fusion_oci.policy.layout import CacheMount, GitLayout, TaskLayout
from fusion_oci.resolve import ResolvedTask
from fusion_oci.runtimes.engine.containers import (
    AGENT_PATH,
    AGENT_RUN_DIR,
    LIMIT_PROBE,
    AgentMounts,
    Target,
    limit_reason,
    parse_limit_counters,
    plan_limit_probe,
    seccomp_file,
    seccomp_json,
)
from fusion_oci.runtimes.engine.containers import (
    plan_container as _plan_container,
)
from fusion_oci.runtimes.plans import spawn_of
from tests.tasks import Case, plan_for, resolved

GOLDEN = Path(__file__).parent.parent / "data" / "containers"
OWNER = Owner(pid=4242, start="123456", boot="boot-1", host="build-host")
HOST = HostInfo(
    uid=1000,
    gid=1000,
    rlimits={
        "RLIMIT_NOFILE": (1024, 20000),
        "RLIMIT_CPU": (-1, -1),
        "RLIMIT_NPROC": (96551, 96551),
    },
    ca_bundle="/etc/ssl/certs/ca-certificates.crt",
)


def layout(isolated: bool = False) -> TaskLayout:
    base = "/home/u/.cache/fusion-oci/projects/abc123def456"
    if isolated:
        base += "/tasks/t1"
    caches = tuple(
        CacheMount(
            name,
            f"{base}/{name}",
            f"/var/cache/fusion-oci/{name}",
            ((env, f"/var/cache/fusion-oci/{name}"),),
        )
        for name, env in (("pnpm-store", "npm_config_store_dir"), ("npm-cache", "npm_config_cache"))
    )
    git = GitLayout("linked", "/srv/repo/.git/worktrees/wt", "/srv/repo/.git")
    return TaskLayout(
        "/srv/wt", git, caches, "/etc/ssl/certs/ca-certificates.crt", ca_complete=True
    )


def task_for(
    policy: SandboxPolicy,
    *,
    isolated: bool = False,
    image: str | None = "localhost/fusion-oci/node:0123456789ab",
) -> ResolvedTask:
    ctx = PrepareContext(
        task_id="t1",
        run_id="r1",
        worktree_path="/srv/wt",
        policy=policy,
        image=image,
        cache_mode=CacheMode.ISOLATED if isolated else CacheMode.SHARED,
    )
    return resolved(
        ctx, layout(isolated), HOST, {"LANG": "C.UTF-8", "SECRET": "x", "NODE_ENV": "test"}
    )


def spec_for(
    policy: SandboxPolicy,
    *,
    command: str = "pnpm test",
    isolated: bool = False,
    image: str | None = "localhost/fusion-oci/node:0123456789ab",
) -> dict[str, Any]:
    """The whole config.json of one command (its process is the container's, here)."""
    return Case(
        task_for(policy, isolated=isolated, image=image), command, RunOptions(cwd="pkg")
    ).config()


def plan_container(spec: dict[str, Any], target: Target, **kwargs: Any) -> Any:
    return _plan_container(*split(spec), target, **kwargs)


def plan_exec(spec: dict[str, Any]) -> Spawn:
    return spawn_of(split(spec)[1])


def exec_json(spawn: Spawn) -> dict[str, Any]:
    return {
        "argv": list(spawn.argv),
        "env": dict(spawn.env),
        "cwd": spawn.cwd,
        "rlimits": [list(r) for r in spawn.rlimits],
    }


POLICY = SandboxPolicy(
    memory_limit_mb=512,
    pids_limit=256,
    cpu_limit=CpuLimit(max_cores=1.5, max_ms=60_000),
    env_allowlist=["NODE_ENV"],
    allowed_paths=["/opt/ref"],
    writable_paths=["/srv/out"],
)

FILTERED = SandboxPolicy(network=NetworkMode.FILTERED, allowed_domains=["example.com"])
SERVICES = SandboxPolicy(
    host_services=["127.0.0.1:5432", "[::1]:6379", "unix:/var/run/postgresql/.s.PGSQL.5432"]
)

CASES = {
    "docker-egress": (Target("docker", False, (96551, 96551)), POLICY, False),
    "podman-egress": (Target("podman", False, (32768, 32768)), POLICY, False),
    "podman-rootless-egress": (Target("podman", True, (32768, 32768)), POLICY, False),
    "podman-rootless-cgroupv1": (
        Target("podman", True, (32768, 32768), cgroup_limits=False),
        POLICY,
        False,
    ),
    "docker-none-isolated": (Target("docker"), SandboxPolicy(allow_network=False), True),
    "docker-rootless-cgroupv1": (
        Target("docker", True, (96551, 96551), cgroup_limits=False),
        POLICY,
        False,
    ),
    "podman-host": (Target("podman"), SandboxPolicy(network=NetworkMode.HOST), False),
    "podman-filtered": (Target("podman", False, (32768, 32768)), FILTERED, False),
    "podman-rootless-filtered": (Target("podman", True, (32768, 32768)), FILTERED, False),
    "docker-filtered": (Target("docker", False, (96551, 96551)), FILTERED, False),
    "docker-rootless-filtered": (Target("docker", True, (96551, 96551)), FILTERED, False),
    "podman-services": (Target("podman", False, (32768, 32768)), SERVICES, False),
    "docker-services": (Target("docker", False, (96551, 96551)), SERVICES, False),
}


def golden(name: str, data: Any) -> None:
    path = GOLDEN / f"{name}.json"
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    if os.environ.get("FUSION_OCI_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"golden {path} is missing (FUSION_OCI_UPDATE_GOLDEN=1 writes it)"
    assert json.loads(path.read_text()) == json.loads(text), f"golden {path} differs"


@pytest.mark.parametrize("case", sorted(CASES))
def test_create_kwargs_golden(case: str, oci_validator: Any) -> None:
    target, policy, isolated = CASES[case]
    spec = spec_for(policy, isolated=isolated)
    oci_validator.validate(spec)
    plan = plan_container(
        spec, target, name="fusion-oci-t1-abcd", owner=OWNER, isolated_caches=isolated
    )
    golden(
        case,
        {
            "create": plan.create,
            "volumes": [
                {
                    "name": v.name,
                    "destination": v.destination,
                    "device": v.device,
                    "driver_opts": v.driver_opts,
                    "labels": v.labels,
                    "scope": v.scope,
                }
                for v in plan.volumes
            ],
            "exec": exec_json(plan_exec(spec)),
        },
    )


def test_translation_essentials() -> None:
    spec = spec_for(POLICY)
    for engine, rootless in (("docker", False), ("podman", False), ("podman", True)):
        create = plan_container(spec, Target(engine, rootless), name="n", owner=OWNER).create  # type: ignore[arg-type]
        assert create["cap_drop"] == ["ALL"]
        assert create["read_only"] is True
        assert create["user"] == "1000:1000"
        assert create["init"] is False, "the exec agent is the init"
        assert create["entrypoint"] == [AGENT_PATH]
        assert create["command"] == ["--connect", f"{AGENT_RUN_DIR}/agent.sock"]
        assert create["environment"].keys() == {"PATH"}, "the container env carries no secrets"
        assert create["labels"]["io.fusion-oci.task-id"] == "t1"
        assert create["labels"]["io.fusion-oci.owner-pid"] == "4242"
        assert create["labels"]["io.fusion-oci.image"] == "localhost/fusion-oci/node:0123456789ab"
        assert {"Name": "nofile", "Soft": 20000, "Hard": 20000} in create["ulimits"]
        assert all(u["Name"] != "cpu" for u in create["ulimits"]), "per command, not the agent"
        assert create["mem_limit"] == 512 * 1024 * 1024 == create["memswap_limit"]
        assert create["pids_limit"] == 256
        assert create["cpu_quota"] == 150_000 and create["cpu_period"] == 100_000
        if engine == "docker":
            assert create["security_opt"][0] == "no-new-privileges"
            assert create["security_opt"][1].startswith("seccomp={")
            ro = {m["Target"]: m["ReadOnly"] for m in create["mounts"]}
            assert ro["/srv/repo/.git/hooks"] is True and ro["/srv/repo/.git/config"] is True
            assert ro[AGENT_PATH] is True and ro[AGENT_RUN_DIR] is True
            assert ro["/srv/wt"] is False and ro["/opt/ref"] is True
        else:
            assert create["no_new_privileges"] is True
            assert "/proc/kcore" in create["masked_paths"]
            vols = create["volumes"]
            assert "ro" in vols["/srv/repo/.git/hooks"]["extended_mode"]
            assert "rw" in vols["/srv/wt"]["extended_mode"]
            agent = {v["bind"]: v["extended_mode"] for v in vols.values()}
            assert "ro" in agent[AGENT_PATH] and "ro" in agent[AGENT_RUN_DIR]
        assert create["network_mode"] == ("slirp4netns" if rootless else "bridge")
        assert (create.get("userns_mode") == "keep-id") is rootless
    env = plan_exec(spec).env
    assert "SECRET" not in env and env["NODE_ENV"] == "test"
    assert env["GIT_CONFIG_VALUE_0"] == "*"
    assert env["SSL_CERT_FILE"] == "/etc/fusion-oci/host-ca.pem"
    assert env["NODE_OPTIONS"] == "--use-openssl-ca"


def test_rootless_dockerd_runs_the_caller_as_its_user_namespace_root() -> None:
    """A rootless dockerd maps the container's root to the caller (uids above it to the
    caller's subordinate ids): the sandbox user is 0:0 inside, without capabilities, and the
    private HOME is that user's, so the worktree's files stay the caller's; the rootful
    translation keeps the caller's uid, and nothing else of the spec changes."""
    spec = spec_for(POLICY)
    rootless = plan_container(spec, Target("docker", True), name="n", owner=OWNER)
    rootful = plan_container(spec, Target("docker"), name="n", owner=OWNER)
    assert rootless.create["user"] == "0:0" and rootful.create["user"] == "1000:1000"
    assert rootless.create["cap_drop"] == ["ALL"] and rootless.create["cap_add"] == []
    assert rootless.create["security_opt"][0] == "no-new-privileges"
    home = "/home/sandbox"
    assert "uid=0" in rootless.create["tmpfs"][home].split(",")
    assert "uid=1000" in rootful.create["tmpfs"][home].split(",")
    assert "userns_mode" not in rootless.create, "docker has no keep-id"
    assert rootless.create["network_mode"] == "bridge", "rootlesskit's slirp4netns is outside"
    assert spec["process"]["user"] == {"uid": 1000, "gid": 1000}, "the spec is not changed"
    same = {k: v for k, v in rootful.create.items() if k not in ("user", "tmpfs")}
    assert {k: v for k, v in rootless.create.items() if k not in ("user", "tmpfs")} == same
    assert any("rootless dockerd" in n for n in rootless.notes)


def test_rootless_slirp_keeps_host_loopback_closed() -> None:
    create = plan_container(spec_for(POLICY), Target("podman", True), name="n", owner=OWNER).create
    assert create["network_options"] == {"slirp4netns": ["allow_host_loopback=false"]}


def test_network_none_and_host() -> None:
    none = plan_container(
        spec_for(SandboxPolicy(allow_network=False)), Target("docker"), name="n", owner=OWNER
    ).create
    assert none["network_mode"] == "none"
    host = plan_container(
        spec_for(SandboxPolicy(network=NetworkMode.HOST)), Target("podman"), name="n", owner=OWNER
    ).create
    assert host["network_mode"] == "host"


def test_filtered_is_network_none_with_the_proxy_socket_and_the_forwarder() -> None:
    mounts = AgentMounts("/opt/agent", "/tmp/run-1", "/tmp/fusion-oci-egress-t1/egress.sock")
    spec = spec_for(FILTERED)
    for target in (
        Target("docker"),
        Target("docker", True),
        Target("podman"),
        Target("podman", True),
    ):
        create = plan_container(spec, target, name="n", owner=OWNER, agent=mounts).create
        assert create["network_mode"] == "none", target
        assert "network_options" not in create
        assert create["command"] == [
            "--egress",
            "/run/fusion-oci/egress.sock",
            "--connect",
            f"{AGENT_RUN_DIR}/agent.sock",
        ]
        if target.engine == "docker":
            binds = {m["Target"]: (m["Source"], m["ReadOnly"]) for m in create["mounts"]}
        else:
            binds = {
                m["target"]: (m["source"], m["read_only"])
                for m in create["mounts"]
                if m["type"] == "bind"
            }
        assert binds["/run/fusion-oci/egress.sock"] == (
            "/tmp/fusion-oci-egress-t1/egress.sock",
            True,
        )
        assert binds["/run/fusion-oci/agent"] == ("/opt/agent", True)
    env = plan_exec(spec).env
    assert env["HTTPS_PROXY"] == "http://127.0.0.1:3128" and env["no_proxy"] == ""
    # other modes: no forwarder, no socket
    create = plan_container(
        spec_for(POLICY), Target("docker"), name="n", owner=OWNER, agent=mounts
    ).create
    assert "--egress" not in create["command"]
    assert all(m["Target"] != "/run/fusion-oci/egress.sock" for m in create["mounts"])
    assert "HTTPS_PROXY" not in plan_exec(spec_for(POLICY)).env


def test_cache_volumes_per_project_and_per_task() -> None:
    shared_a = plan_container(spec_for(POLICY), Target("docker"), name="a", owner=OWNER).volumes
    shared_b = plan_container(
        spec_for(POLICY, command="true"), Target("docker"), name="b", owner=Owner(1, "1", "b", "h")
    ).volumes
    assert [v.name for v in shared_a] == [v.name for v in shared_b], "same project, same volume"
    assert all(v.scope == "project" and "io.fusion-oci.owner-pid" not in v.labels for v in shared_a)
    isolated = plan_container(
        spec_for(POLICY, isolated=True),
        Target("docker"),
        name="c",
        owner=OWNER,
        isolated_caches=True,
    ).volumes
    assert {v.name for v in isolated}.isdisjoint(v.name for v in shared_a)
    assert all(v.scope == "task" and v.labels["io.fusion-oci.task-id"] == "t1" for v in isolated)
    assert all(v.driver_opts["o"] == "bind" for v in isolated)


def test_no_image_is_refused() -> None:
    with pytest.raises(BundleError, match="need an image"):
        plan_container(spec_for(POLICY, image=None), Target("docker"), name="n", owner=OWNER)


def test_exec_is_the_command_itself_with_its_env_cwd_and_rlimits() -> None:
    spec = spec_for(POLICY, command="echo hi")
    command = plan_exec(spec)
    assert command.argv == ["/bin/sh", "-c", "echo hi"], "no wrapper: the agent ends the tree"
    assert command.cwd == "/srv/wt/pkg"
    assert ("RLIMIT_CPU", 60, 61) in command.rlimits
    assert "SECRET" not in command.env and command.env["NODE_ENV"] == "test"
    probe = plan_limit_probe(split(spec)[1])
    assert probe.argv == ["/bin/sh", "-c", LIMIT_PROBE] and probe.env.keys() == {"PATH"}


def test_agent_mounts_are_the_given_host_paths() -> None:
    mounts = AgentMounts("/opt/fusion/fusion-oci-agent", "/tmp/fusion-oci-docker-t1-x/agent-1")
    docker = plan_container(
        spec_for(POLICY), Target("docker"), name="n", owner=OWNER, agent=mounts
    ).create
    binds = {m["Target"]: (m["Source"], m["ReadOnly"]) for m in docker["mounts"]}
    assert binds[AGENT_PATH] == ("/opt/fusion/fusion-oci-agent", True)
    assert binds[AGENT_RUN_DIR] == ("/tmp/fusion-oci-docker-t1-x/agent-1", True)
    podman = plan_container(
        spec_for(POLICY), Target("podman", True), name="n", owner=OWNER, agent=mounts
    ).create
    assert podman["volumes"]["/opt/fusion/fusion-oci-agent"]["bind"] == AGENT_PATH


def test_gc_rule() -> None:
    at = Here("build-host", "boot-1", lambda pid, start: pid == 4242 and start == "123456")
    labels = {"io.fusion-oci.kind": "container", "io.fusion-oci.task-id": "t1", **OWNER.labels()}
    live = Found("1", "c1", labels, "container")
    assert owner_state(labels, at) == "live" and not is_garbage(live, at)
    dead = Found("2", "c2", {**labels, "io.fusion-oci.owner-start": "999"}, "container")
    assert owner_state(dead.labels, at) == "dead" and is_garbage(dead, at)
    rebooted = Found("3", "c3", {**labels, "io.fusion-oci.owner-boot": "boot-0"}, "container")
    assert is_garbage(rebooted, at)
    foreign = Found(
        "4",
        "c4",
        {**labels, "io.fusion-oci.owner-host": "other", "io.fusion-oci.owner-start": "1"},
        "container",
    )
    assert owner_state(foreign.labels, at) == "foreign" and not is_garbage(foreign, at)
    assert not is_garbage(dead, at, task_id="t2")
    assert not is_garbage(Found("5", "x", {"other": "1"}, "container"), at)
    cache = Found(
        "v", "v", {"io.fusion-oci.kind": "cache", "io.fusion-oci.cache-scope": "project"}, "volume"
    )
    assert not is_garbage(cache, at) and is_garbage(cache, at, include_caches=True)
    bound = Found(
        "v",
        "v",
        {
            **cache.labels,
            "io.fusion-oci.cache-dir": "/gone",
            "io.fusion-oci.owner-host": "build-host",
        },
        "volume",
    )
    assert not is_garbage(bound, replace(at, exists=lambda p: True))
    assert is_garbage(bound, replace(at, exists=lambda p: False))
    assert not is_garbage(bound, replace(at, exists=lambda p: False), task_id="t1")
    task_cache = Found(
        "w",
        "w",
        {"io.fusion-oci.kind": "cache", "io.fusion-oci.cache-scope": "task", **dead.labels},
        "volume",
    )
    assert is_garbage(task_cache, at)


def test_both_engines_get_the_bundles_own_seccomp_profile_caps_and_nnp() -> None:
    spec = spec_for(POLICY)
    profile = spec["linux"]["seccomp"]
    docker = plan_container(spec, Target("docker"), name="n", owner=OWNER).create
    assert docker["security_opt"] == ["no-new-privileges", "seccomp=" + seccomp_json(profile)]
    assert json.loads(docker["security_opt"][1].removeprefix("seccomp=")) == profile
    podman = plan_container(
        spec, Target("podman", seccomp_dir="/c/seccomp"), name="n", owner=OWNER
    ).create
    path, text = seccomp_file(profile, "/c/seccomp")
    assert podman["seccomp_profile_path"] == path and json.loads(text) == profile
    for create in (docker, podman):
        assert create["cap_drop"] == ["ALL"] and create["cap_add"] == []
    # What the bundle says is what the engines get: a changed profile, a kept capability,
    # no no_new_privs.
    changed = json.loads(json.dumps(spec))
    changed["linux"]["seccomp"]["syscalls"][0]["names"].append("io_uring_setup")
    changed["process"]["capabilities"]["bounding"] = ["CAP_NET_BIND_SERVICE"]
    changed["process"]["noNewPrivileges"] = False
    docker2 = plan_container(changed, Target("docker"), name="n", owner=OWNER).create
    podman2 = plan_container(
        changed, Target("podman", seccomp_dir="/c/seccomp"), name="n", owner=OWNER
    ).create
    assert docker2["security_opt"] == ["seccomp=" + seccomp_json(changed["linux"]["seccomp"])]
    assert podman2["seccomp_profile_path"] != path
    assert podman2["no_new_privileges"] is False
    for create in (docker2, podman2):
        assert create["cap_add"] == ["NET_BIND_SERVICE"]


def test_limit_counters_name_the_limit_that_held() -> None:
    after = parse_limit_counters("pids 3\noom 0\n")
    assert after == {"pids": 3, "oom": 0}
    from fusion_oci.runtimes.outcome import LimitCounters

    assert limit_reason({}, after).pids_max > 0
    assert limit_reason({"pids": 3}, {"pids": 3, "oom": 1}) == LimitCounters(oom_kills=1)
    assert limit_reason({"pids": 3}, after) == LimitCounters()
    assert "pids.events" in LIMIT_PROBE and "memory.oom_control" in LIMIT_PROBE


def test_the_runtime_takes_the_cache_scope_from_the_spec_not_the_context() -> None:
    """A runtime never prepared (no context at all) plans task-scoped volumes for a spec
    whose cache mode is isolated: the scope travels in the spec."""
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.runtimes.engine.docker import DockerRuntime

    runtime = DockerRuntime(SandboxSettings(backend="docker"), {}, host=HOST)
    assert not hasattr(runtime, "ctx")  # a runtime holds no caller context at all
    notes = plan_for(runtime, task_for(POLICY, isolated=True)).notes
    assert any(n.endswith("(task)") for n in notes if n.startswith("volume ")), notes
    notes = plan_for(runtime, task_for(POLICY)).notes
    assert any(n.endswith("(project)") for n in notes if n.startswith("volume ")), notes
