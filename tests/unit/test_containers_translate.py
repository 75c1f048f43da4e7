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

from fusion_oci.errors import (
    BundleError,
    EngineError,
    ProvisionError,
    RuntimeUnavailableError,
    SandboxSetupError,
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
from fusion_oci.oci.spec import compile_spec
from fusion_oci.policy.layout import CacheMount, GitLayout, TaskLayout
from fusion_oci.runtimes.containers import (
    AGENT_PATH,
    AGENT_RUN_DIR,
    LIMIT_PROBE,
    AgentMounts,
    Owner,
    Target,
    harden_seccomp,
    limit_reason,
    parse_limit_counters,
    plan_container,
    plan_exec,
    plan_limit_probe,
)
from fusion_oci.runtimes.engine import (
    ContainerGoneError,
    Endpoint,
    Found,
    docker_endpoints,
    engine_errors,
    podman_endpoints,
)

GOLDEN = Path(__file__).parent.parent / "data" / "containers"
OWNER = Owner(pid=4242, start="123456", boot="boot-1", host="build-host")
HOST = HostInfo(
    uid=1000, gid=1000,
    rlimits={"RLIMIT_NOFILE": (1024, 20000), "RLIMIT_CPU": (-1, -1),
             "RLIMIT_NPROC": (96551, 96551)},
    ca_bundle="/etc/ssl/certs/ca-certificates.crt",
)


def layout(isolated: bool = False) -> TaskLayout:
    base = "/home/u/.cache/fusion-oci/projects/abc123def456"
    if isolated:
        base += "/tasks/t1"
    caches = tuple(
        CacheMount(name, f"{base}/{name}", f"/var/cache/fusion-oci/{name}",
                   ((env, f"/var/cache/fusion-oci/{name}"),))
        for name, env in (("pnpm-store", "npm_config_store_dir"), ("npm-cache", "npm_config_cache"))
    )
    git = GitLayout("linked", "/srv/repo/.git/worktrees/wt", "/srv/repo/.git")
    return TaskLayout("/srv/wt", git, caches, "/etc/ssl/certs/ca-certificates.crt")


def spec_for(policy: SandboxPolicy, *, command: str = "pnpm test", isolated: bool = False,
             image: str | None = "localhost/fusion-oci/node:0123456789ab") -> dict[str, Any]:
    ctx = PrepareContext(task_id="t1", run_id="r1", worktree_path="/srv/wt", policy=policy,
                         image=image,
                         cache_mode=CacheMode.ISOLATED if isolated else CacheMode.SHARED)
    return compile_spec(ctx, layout(isolated), HOST, command, RunOptions(cwd="pkg"),
                        {"LANG": "C.UTF-8", "SECRET": "x", "NODE_ENV": "test"})


POLICY = SandboxPolicy(
    memory_limit_mb=512, pids_limit=256, cpu_limit=CpuLimit(max_cores=1.5, max_ms=60_000),
    env_allowlist=["NODE_ENV"], allowed_paths=["/opt/ref"], writable_paths=["/srv/out"],
)

CASES = {
    "docker-egress": (Target("docker", False, (96551, 96551)), POLICY, False),
    "podman-egress": (Target("podman", False, (32768, 32768)), POLICY, False),
    "podman-rootless-egress": (Target("podman", True, (32768, 32768)), POLICY, False),
    "podman-rootless-cgroupv1": (Target("podman", True, (32768, 32768), cgroup_limits=False),
                                 POLICY, False),
    "docker-none-isolated": (Target("docker"), SandboxPolicy(allow_network=False), True),
    "podman-host": (Target("podman"), SandboxPolicy(network=NetworkMode.HOST), False),
}


def golden(name: str, data: Any) -> None:
    path = GOLDEN / f"{name}.json"
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    if os.environ.get("FUSION_OCI_UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert json.loads(path.read_text()) == json.loads(text), f"golden {path} differs"


@pytest.mark.parametrize("case", sorted(CASES))
def test_create_kwargs_golden(case: str, oci_validator: Any) -> None:
    target, policy, isolated = CASES[case]
    spec = spec_for(policy, isolated=isolated)
    oci_validator.validate(spec)
    plan = plan_container(spec, target, name="fusion-oci-t1-abcd", owner=OWNER,
                          isolated_caches=isolated)
    golden(case, {
        "create": plan.create,
        "volumes": [{"name": v.name, "destination": v.destination, "device": v.device,
                     "driver_opts": v.driver_opts, "labels": v.labels, "scope": v.scope}
                    for v in plan.volumes],
        "exec": plan_exec(spec).to_json(),
    })


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
            assert create["security_opt"] == ["no-new-privileges"]
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
    assert env["NODE_EXTRA_CA_CERTS"] == "/etc/fusion-oci/host-ca.pem"


def test_rootless_slirp_keeps_host_loopback_closed() -> None:
    create = plan_container(spec_for(POLICY), Target("podman", True), name="n",
                            owner=OWNER).create
    assert create["network_options"] == {"slirp4netns": ["allow_host_loopback=false"]}


def test_network_none_and_host() -> None:
    none = plan_container(spec_for(SandboxPolicy(allow_network=False)), Target("docker"),
                          name="n", owner=OWNER).create
    assert none["network_mode"] == "none"
    host = plan_container(spec_for(SandboxPolicy(network=NetworkMode.HOST)), Target("podman"),
                          name="n", owner=OWNER).create
    assert host["network_mode"] == "host"


def test_cache_volumes_per_project_and_per_task() -> None:
    shared_a = plan_container(spec_for(POLICY), Target("docker"), name="a", owner=OWNER).volumes
    shared_b = plan_container(spec_for(POLICY, command="true"), Target("docker"), name="b",
                              owner=Owner(1, "1", "b", "h")).volumes
    assert [v.name for v in shared_a] == [v.name for v in shared_b], "same project, same volume"
    assert all(v.scope == "project" and "io.fusion-oci.owner-pid" not in v.labels
               for v in shared_a)
    isolated = plan_container(spec_for(POLICY, isolated=True), Target("docker"), name="c",
                              owner=OWNER, isolated_caches=True).volumes
    assert {v.name for v in isolated}.isdisjoint(v.name for v in shared_a)
    assert all(v.scope == "task" and v.labels["io.fusion-oci.task-id"] == "t1"
               for v in isolated)
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
    probe = plan_limit_probe(spec)
    assert probe.argv == ["/bin/sh", "-c", LIMIT_PROBE] and probe.env.keys() == {"PATH"}


def test_agent_mounts_are_the_given_host_paths() -> None:
    mounts = AgentMounts("/opt/fusion/fusion-oci-agent", "/tmp/fusion-oci-docker-t1-x/agent-1")
    docker = plan_container(spec_for(POLICY), Target("docker"), name="n", owner=OWNER,
                            agent=mounts).create
    binds = {m["Target"]: (m["Source"], m["ReadOnly"]) for m in docker["mounts"]}
    assert binds[AGENT_PATH] == ("/opt/fusion/fusion-oci-agent", True)
    assert binds[AGENT_RUN_DIR] == ("/tmp/fusion-oci-docker-t1-x/agent-1", True)
    podman = plan_container(spec_for(POLICY), Target("podman", True), name="n", owner=OWNER,
                            agent=mounts).create
    assert podman["volumes"]["/opt/fusion/fusion-oci-agent"]["bind"] == AGENT_PATH


def test_endpoint_discovery_order() -> None:
    assert podman_endpoints("unix:///x.sock", {"CONTAINER_HOST": "unix:///y"}, 0)[0].url == \
        "unix:///x.sock"
    env = {"CONTAINER_HOST": "unix:///y"}
    assert podman_endpoints(None, env, 1000)[0].source == "CONTAINER_HOST"
    assert podman_endpoints(None, {}, 0)[0].url == "unix:///run/podman/podman.sock"
    rootless = podman_endpoints(None, {"XDG_RUNTIME_DIR": "/run/user/1001"}, 1001)
    assert rootless[0].url == "unix:///run/user/1001/podman/podman.sock"
    assert not rootless[0].explicit
    assert docker_endpoints(None, {"DOCKER_HOST": "unix:///d"}, 0)[0].explicit
    urls = [e.url for e in docker_endpoints(None, {"XDG_RUNTIME_DIR": "/run/user/7"}, 7)]
    assert urls == ["unix:///var/run/docker.sock", "unix:///run/user/7/docker.sock"]


def test_gc_rule() -> None:
    at = Here("build-host", "boot-1", lambda pid, start: pid == 4242 and start == "123456")
    labels = {"io.fusion-oci.kind": "container", "io.fusion-oci.task-id": "t1", **OWNER.labels()}
    live = Found("1", "c1", labels, "container")
    assert owner_state(labels, at) == "live" and not is_garbage(live, at)
    dead = Found("2", "c2", {**labels, "io.fusion-oci.owner-start": "999"}, "container")
    assert owner_state(dead.labels, at) == "dead" and is_garbage(dead, at)
    rebooted = Found("3", "c3", {**labels, "io.fusion-oci.owner-boot": "boot-0"}, "container")
    assert is_garbage(rebooted, at)
    foreign = Found("4", "c4", {**labels, "io.fusion-oci.owner-host": "other",
                                "io.fusion-oci.owner-start": "1"}, "container")
    assert owner_state(foreign.labels, at) == "foreign" and not is_garbage(foreign, at)
    assert not is_garbage(dead, at, task_id="t2")
    assert not is_garbage(Found("5", "x", {"other": "1"}, "container"), at)
    cache = Found("v", "v", {"io.fusion-oci.kind": "cache",
                             "io.fusion-oci.cache-scope": "project"}, "volume")
    assert not is_garbage(cache, at) and is_garbage(cache, at, include_caches=True)
    bound = Found("v", "v", {**cache.labels, "io.fusion-oci.cache-dir": "/gone",
                             "io.fusion-oci.owner-host": "build-host"}, "volume")
    assert not is_garbage(bound, replace(at, exists=lambda p: True))
    assert is_garbage(bound, replace(at, exists=lambda p: False))
    assert not is_garbage(bound, replace(at, exists=lambda p: False), task_id="t1")
    task_cache = Found("w", "w", {"io.fusion-oci.kind": "cache", "io.fusion-oci.cache-scope":
                                  "task", **dead.labels}, "volume")
    assert is_garbage(task_cache, at)


def test_seccomp_hardening_matches_dockers_namespace_and_keyring_rules() -> None:
    base: dict[str, Any] = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
        {"names": ["read", "unshare", "keyctl", "clone", "clone3"], "action": "SCMP_ACT_ALLOW"},
        {"names": ["setns"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
    ]}
    hardened = harden_seccomp(base)
    allowed = {n for r in hardened["syscalls"] if r["action"] == "SCMP_ACT_ALLOW"
               and not r.get("args") and not r.get("includes") for n in r["names"]}
    assert "read" in allowed and not allowed & {"unshare", "keyctl", "clone", "clone3"}
    clone = next(r for r in hardened["syscalls"] if r["names"] == ["clone"])
    assert clone["args"][0]["value"] == 2114060288
    assert base["syscalls"][0]["names"][1] == "unshare", "the input is not changed"
    spec = spec_for(POLICY)
    create = plan_container(spec, Target("podman", seccomp_profile="/p.json"), name="n",
                            owner=OWNER).create
    assert create["seccomp_profile_path"] == "/p.json"


def test_limit_counters_name_the_limit_that_held() -> None:
    after = parse_limit_counters("pids 3\noom 0\n")
    assert after == {"pids": 3, "oom": 0}
    from fusion_oci.runtimes.base import LimitCounters

    assert limit_reason({}, after).pids_max > 0
    assert limit_reason({"pids": 3}, {"pids": 3, "oom": 1}) == LimitCounters(oom_kills=1)
    assert limit_reason({"pids": 3}, after) == LimitCounters()
    assert "pids.events" in LIMIT_PROBE and "memory.oom_control" in LIMIT_PROBE


ENDPOINT = Endpoint("unix:///run/x.sock", "test")


@pytest.mark.parametrize(("message", "why", "hint"), [
    ("crun: cgroups in hybrid mode not supported, drop all controllers from cgroupv2",
     "crun refuses", 'runtime = "runc"'),
    ("cannot find newuidmap: exec: \"newuidmap\": executable file not found",
     "newuidmap", "apt-get install uidmap"),
    ("cannot set up namespace using \"/usr/bin/newuidmap\": no subuid ranges found for user",
     "subordinate uid", "usermod --add-subuids"),
    ("slirp4netns failed: open(\"/dev/net/tun\"): Permission denied", "/dev/net/tun",
     "chmod 0666 /dev/net/tun"),
])
def test_engine_errors_name_the_fix(message: str, why: str, hint: str) -> None:
    import podman.errors

    with pytest.raises(RuntimeUnavailableError) as caught, \
            engine_errors("podman", "container start", ENDPOINT):
        raise podman.errors.APIError("500 Server Error", explanation=message)
    assert why in caught.value.why and hint in caught.value.hint
    assert isinstance(caught.value.__cause__, podman.errors.APIError)


def test_engine_errors_socket_and_image_and_run_failures() -> None:
    import docker.errors
    import requests

    with pytest.raises(RuntimeUnavailableError, match="permission denied"), \
            engine_errors("docker", "ping", ENDPOINT):
        raise requests.exceptions.ConnectionError(PermissionError(13, "Permission denied"))
    with pytest.raises(RuntimeUnavailableError, match="no docker service answers"), \
            engine_errors("docker", "ping", ENDPOINT):
        raise FileNotFoundError(2, "No such file or directory", "/run/x.sock")
    with pytest.raises(ProvisionError, match="image is missing") as missing, \
            engine_errors("docker", "container create", ENDPOINT):
        raise docker.errors.ImageNotFound("No such image: node")
    assert "fusion-oci images build" in missing.value.hint
    with pytest.raises(ContainerGoneError), engine_errors("docker", "exec", ENDPOINT,
                                                          setup=False):
        raise docker.errors.APIError("409", explanation="Container abc is not running")
    with pytest.raises(EngineError) as run_error, engine_errors("docker", "exec", ENDPOINT,
                                                                setup=False):
        raise docker.errors.APIError("500", explanation="something odd")
    assert not isinstance(run_error.value, SandboxSetupError)
