"""The oci runtime's pure parts: golden plans (the task container's argv, env, cwd and bundle:
exactly what prepare starts; the command's spawn frame: exactly what execute sends), the
bundle ops it applies, statuses."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.host.process import ProcessOutcome
from fusion_oci.models import CpuLimit, NetworkMode, PrepareContext, SandboxPolicy
from fusion_oci.oci.model import ConfigSpec
from fusion_oci.oci.spec import bind
from fusion_oci.policy.layout import GitLayout, TaskLayout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.resolve import ResolvedTask
from fusion_oci.runtimes.linux.cgroups import CgroupEvents, Hierarchy
from fusion_oci.runtimes.oci import OciRuntime, exit_status, limit_counters
from fusion_oci.runtimes.oci.gvisor import UNKNOWN_FLAGS, GvisorFlags, parse_flags
from fusion_oci.runtimes.oci.launch import (
    AGENT_IN_SANDBOX,
    EgressHook,
    bundle_spec,
    command_spawn,
    egress_launch_argv,
    run_argv,
    runtime_flags,
)
from fusion_oci.runtimes.oci.state import container_id, state_base
from fusion_oci.runtimes.requirements import Requirement
from tests.golden import GOLDEN_HOST, assert_golden
from tests.tasks import Case, plan_for, resolved

HOST = GOLDEN_HOST
LAYOUT = TaskLayout(
    worktree="/work/repo-wt/task-1",
    git=GitLayout("linked", "/work/repo/.git/worktrees/task-1", "/work/repo/.git"),
    caches=(),
    ca_bundle="/etc/ssl/certs/ca-certificates.crt",
    ca_complete=True,  # the host's own bundle, as hostCa: auto resolves
)
POLICIES = {
    "none-limits": SandboxPolicy(
        allow_network=False,
        memory_limit_mb=256,
        pids_limit=64,
        cpu_limit=CpuLimit(max_cores=1.0, max_ms=30_000),
    ),
    "egress": SandboxPolicy(),
    "host": SandboxPolicy(network="host"),
    "services": SandboxPolicy(
        allow_network=False,
        host_services=["127.0.0.1:5432", "[::1]:6379", "unix:/var/run/postgresql/.s.PGSQL.5432"],
    ),
    # the agent's --publish and the relays' sockets bound in; runsc: --host-uds=open (gVisor's
    # agent dials the relay, and back for each client)
    "published": SandboxPolicy(allow_network=False, publish_ports=["3000", "8080:80"]),
}


def task_for(policy: SandboxPolicy, image: str | None = None) -> ResolvedTask:
    ctx = PrepareContext(
        task_id="task-1", run_id="run-1", worktree_path=LAYOUT.worktree, policy=policy, image=image
    )
    return resolved(ctx, LAYOUT, HOST, {"PATH": "/usr/bin"})


def spec_for(policy: SandboxPolicy, image: str | None = None) -> ConfigSpec:
    """The whole config of `pnpm test` in the task, typed (what the bundle ops take)."""
    case = Case(task_for(policy, image))
    return ConfigSpec(case.spec, case.process)


def plan_of(rt: OciRuntime, policy: SandboxPolicy, image: str | None = None) -> Any:
    """The runtime's plan of `pnpm test` in the task (adopted, not prepared)."""
    return plan_for(rt, task_for(policy, image))


def runtime(uid: int = 0, oci_runtime: str = "runc") -> OciRuntime:
    """A runtime with fixed host facts (the tools it would find, its nonce and pid)."""
    rt = OciRuntime(
        SandboxSettings(backend="oci", oci_runtime=oci_runtime),
        {"HOME": "/home/u", "PATH": "/usr/sbin:/usr/bin"},
        cache_root=Path("/home/u/.cache/fusion-oci"),
        host=HOST,
    )
    rt.uid, rt.gid = uid, uid
    rt.state_base = state_base(rt.env, uid)
    rt._binary = f"/usr/sbin/{Path(oci_runtime).name}"
    rt._agent = "/usr/lib/fusion-oci/fusion-oci-agent"
    rt._unshare = "/usr/bin/unshare"
    rt._gvisor_flags = GvisorFlags(directfs=False, platform="ptrace")  # Debian 12's 20221219
    rt.nonce, rt.pid = "ab12cd", 4242
    return rt


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("uid", [0, 1000], ids=["root", "rootless"])
def test_golden_plan(name: str, uid: int) -> None:
    plan = plan_of(runtime(uid), POLICIES[name])
    assert_golden(f"oci/plan-{name}-{'root' if uid == 0 else 'rootless'}.json", plan.to_json())


def test_golden_plan_image() -> None:
    plan = plan_of(runtime(), POLICIES["none-limits"], image="localhost/fusion-base:1")
    assert_golden("oci/plan-image.json", plan.to_json())


def test_run_argv_is_exact() -> None:
    assert run_argv("runc", "/run/s", "/run/t/bundle", "t-r-ab12cd", "/run/t/init.pid") == [
        "runc",
        "--root",
        "/run/s",
        "run",
        "--detach",
        "--pid-file",
        "/run/t/init.pid",
        "--bundle",
        "/run/t/bundle",
        "t-r-ab12cd",
    ]


def test_the_tasks_init_is_the_agent_on_its_stdin(oci_validator: Any) -> None:
    """The task container's process is the agent on fd 0 (the socketpair runc hands through),
    PATH only, cwd /, the spec's user and rlimits but RLIMIT_CPU (which would charge the
    agent's own time over the whole task; the agent sets it per command)."""
    spec = spec_for(POLICIES["none-limits"]).to_oci()
    bundle = plan_of(runtime(), POLICIES["none-limits"]).bundle.to_oci()
    oci_validator.validate(bundle)
    proc = bundle["process"]
    assert proc["args"] == [AGENT_IN_SANDBOX, "--fd", "0"]
    assert proc["env"] == ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    assert proc["cwd"] == "/"
    assert proc["user"] == spec["process"]["user"]
    assert proc["capabilities"] == spec["process"]["capabilities"]
    assert proc["noNewPrivileges"] is True
    assert [r["type"] for r in proc["rlimits"]] == ["RLIMIT_NOFILE"]
    agent = next(m for m in bundle["mounts"] if m["destination"] == AGENT_IN_SANDBOX)
    assert agent["source"] == "/usr/lib/fusion-oci/fusion-oci-agent" and "ro" in agent["options"]
    assert {k: v for k, v in bundle.items() if k not in ("process", "mounts")} == {
        k: v for k, v in spec.items() if k not in ("process", "mounts")
    }


def test_each_command_is_a_spawn_frame_of_its_own_process() -> None:
    process = Case(task_for(POLICIES["none-limits"])).process
    spawn = command_spawn(process)
    assert list(spawn.argv) == ["/bin/sh", "-c", "pnpm test"]
    assert spawn.cwd == "/work/repo-wt/task-1"
    assert dict(spawn.env) == process.env_map()
    assert list(spawn.rlimits) == [("RLIMIT_NOFILE", 20000, 20000), ("RLIMIT_CPU", 30, 31)]
    assert spawn.uid is None  # the agent runs as the task's user already
    plan = plan_of(runtime(), POLICIES["none-limits"])
    assert plan.to_json()["spawn"] == {
        "fields": [f"{k}={v}" for k, v in spawn.fields()],
        "fds": ["stdin", "stdout", "stderr"],
    }


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_root_bundle_is_the_compiled_spec(name: str, oci_validator: Any) -> None:
    spec = spec_for(POLICIES[name])
    out = bundle_spec(spec)
    oci_validator.validate(out.to_oci())
    assert out.to_oci() == spec.to_oci()


def test_image_bundle_points_at_the_shared_rootfs(oci_validator: Any) -> None:
    spec = spec_for(POLICIES["egress"], image="localhost/x:1")
    out = bundle_spec(spec, rootfs="/cache/oci-rootfs/abc/rootfs").to_oci()
    oci_validator.validate(out)
    assert out["root"] == {"path": "/cache/oci-rootfs/abc/rootfs", "readonly": True}
    assert spec.task.root.path == "rootfs"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_rootless_bundle_maps_only_the_caller_and_drops_cgroup_limits(
    name: str, oci_validator: Any
) -> None:
    out = bundle_spec(spec_for(POLICIES[name]), rootless_ids=(1000, 1001)).to_oci()
    oci_validator.validate(out)
    linux = out["linux"]
    assert {"type": "user"} in linux["namespaces"]
    assert linux["uidMappings"] == [{"containerID": 0, "hostID": 1000, "size": 1}]
    assert linux["gidMappings"] == [{"containerID": 0, "hostID": 1001, "size": 1}]
    assert out["process"]["user"] == {"uid": 0, "gid": 0}
    home = next(m for m in out["mounts"] if m["destination"] == "/home/sandbox")
    assert "uid=0" in home["options"] and "uid=1000" not in home["options"]
    assert not {"memory", "pids", "cpu"} & set(linux["resources"])
    sys_mount = next(m for m in out["mounts"] if m["destination"] == "/sys")
    # Without its own network namespace a user namespace may not mount sysfs: bind it.
    assert sys_mount["type"] == ("bind" if name == "host" else "sysfs")


def test_egress_bundle_has_the_hook_and_slirp_dns(oci_validator: Any) -> None:
    hook = EgressHook("/s/1.egress-request", "/s/1.egress-reply", "/s/resolv.conf")
    out = bundle_spec(spec_for(POLICIES["egress"]), egress=hook).to_oci()
    oci_validator.validate(out)
    assert_golden("oci/egress-hooks.json", out["hooks"])
    assert out["mounts"][-1] == {
        "destination": "/etc/resolv.conf",
        "type": "bind",
        "source": "/s/resolv.conf",
        "options": ["rbind", "ro", "nosuid", "nodev"],
    }
    # The network namespace stays: slirp4netns is the only way out of it.
    assert {"type": "network"} in out["linux"]["namespaces"]


def test_container_ids_are_unique_per_task_and_name_safe() -> None:
    assert container_id("t", "r", "ab12cd") == "t-r-ab12cd"
    long = container_id("a" * 128, "b" * 128, "ab12cd")
    assert len(long) < 200
    assert long.endswith("-ab12cd")


def test_state_base() -> None:
    assert state_base({}, 0) == Path("/run/fusion-oci/oci")
    assert state_base({"XDG_RUNTIME_DIR": "/run/user/1000"}, 1000) == Path(
        "/run/user/1000/fusion-oci/oci"
    )
    assert state_base({}, 1000) == Path("/tmp/fusion-oci-1000/oci")


@pytest.mark.parametrize(
    ("rc", "expected"),
    [
        (0, (0, None)),
        (3, (3, None)),
        (128, (128, None)),
        (137, (None, "SIGKILL")),
        (143, (None, "SIGTERM")),
        (200, (200, None)),
    ],
)
def test_exit_status(rc: int, expected: tuple[int | None, str | None]) -> None:
    assert exit_status(rc, None) == expected


def test_exit_status_passes_a_signal_of_the_cli_itself() -> None:
    assert exit_status(None, "SIGKILL") == (None, "SIGKILL")


def outcome(
    rc: int | None = 0, sig: str | None = None, *, timed_out: bool = False, truncated: bool = False
) -> ProcessOutcome:
    return ProcessOutcome(b"", b"", rc, sig, timed_out, truncated, 1)


def test_cgroup_counters_feed_the_one_classifier() -> None:
    from fusion_oci.runtimes.outcome import classify

    spec = Case(task_for(POLICIES["none-limits"])).process
    oom = limit_counters(CgroupEvents(oom_kills=1, pids_max=0))
    pids = limit_counters(CgroupEvents(oom_kills=0, pids_max=3))
    # One precedence for every runtime (outcome.classify): a limit that fired wins over the
    # timeout that followed it, and over maxBuffer.
    assert classify(outcome(None, "SIGKILL", timed_out=True), spec, pids) == "pids"
    assert classify(outcome(None, "SIGTERM", truncated=True), spec, oom) == "oom"
    assert classify(outcome(None, "SIGKILL"), spec, oom) == "oom"
    assert classify(outcome(2), spec, pids) == "pids"
    # A command that survived the limit and succeeded ended by its own exit.
    assert classify(outcome(0), spec, oom) == "exit"
    assert classify(outcome(0), spec, pids) == "exit"
    # Counters unknown: no claim; RLIMIT_CPU in the spec makes a SIGKILL cpu-time.
    unknown = limit_counters(CgroupEvents())
    assert classify(outcome(None, "SIGKILL"), spec, unknown) == "cpu-time"
    assert (
        classify(outcome(None, "SIGKILL"), Case(task_for(POLICIES["egress"])).process, unknown)
        == "signal"
    )


def test_enforces_follows_controllers_and_rootless() -> None:
    rt = runtime()
    rt._cgroups = Hierarchy("hybrid", frozenset({"memory", "pids", "cpu"}))
    rt._egress = (False, "no slirp4netns")
    assert rt.enforces() == {
        Requirement.FILESYSTEM,
        Requirement.PROC_PATHS,
        Requirement.ENV,
        Requirement.HOST_PROCESSES,
        Requirement.NETWORK_NONE,
        Requirement.NETWORK_FILTERED,
        Requirement.HOST_SERVICES,
        Requirement.PUBLISHED_PORTS,
        Requirement.CPU_TIME,
        Requirement.MEMORY,
        Requirement.PIDS,
        Requirement.CPU_QUOTA,
        Requirement.TMP_SIZE,
        Requirement.FILE_SIZE,
    }
    rt._egress = (True, "/usr/bin/slirp4netns")
    assert Requirement.NETWORK_EGRESS in rt.enforces()
    rootless = runtime(uid=1000)
    rootless._cgroups = rt._cgroups
    rootless._egress = (False, "x")
    assert not {Requirement.MEMORY, Requirement.PIDS, Requirement.CPU_QUOTA} & rootless.enforces()
    # publishPorts: handed to the agent, rootless too; dialled back under gVisor.
    assert Requirement.PUBLISHED_PORTS in rootless.enforces()
    gvisor = runtime(oci_runtime="runsc")
    gvisor._cgroups = rt._cgroups
    gvisor._egress = (False, "x")
    assert Requirement.PUBLISHED_PORTS in gvisor.enforces()
    assert rootless.capabilities().resource_limits == "basic"


def test_crun_on_a_hybrid_host_is_unavailable_with_the_fix() -> None:
    rt = runtime(oci_runtime="crun")
    rt._binary = "/usr/bin/crun"
    rt._cgroups = Hierarchy("hybrid", frozenset({"memory"}))
    avail = rt.availability()
    assert not avail.available
    assert "hybrid" in avail.reason
    assert "sandbox.oci.runtime: runc" in avail.hint  # the current key, not the deprecated one


def test_missing_runtime_is_unavailable() -> None:
    rt = OciRuntime(
        SandboxSettings(backend="oci", oci_runtime="no-such-runtime-xyz"),
        {"PATH": "/nonexistent"},
        host=HOST,
    )
    avail = rt.availability()
    assert not avail.available
    assert "no-such-runtime-xyz" in avail.reason


def test_signal_names_cover_the_common_deaths() -> None:
    assert exit_status(128 + signal.SIGXCPU, None) == (None, "SIGXCPU")


# --- gVisor (runsc) ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_golden_plan_runsc(name: str) -> None:
    plan = plan_of(runtime(oci_runtime="runsc"), POLICIES[name])
    assert_golden(f"oci/plan-runsc-{name}.json", plan.to_json())


DATA = Path(__file__).resolve().parents[1] / "data" / "oci"


@pytest.mark.parametrize(
    ("release", "facts"),
    [
        ("20221219", GvisorFlags(directfs=False, platform="ptrace")),
        ("20240729", GvisorFlags(directfs=True, platform="systrap")),
    ],
)
def test_runsc_flags_listing_says_directfs_and_the_default_platform(
    release: str, facts: GvisorFlags
) -> None:
    """``runsc flags`` of Debian 12's release and of trixie's, as they print it."""
    listing = (DATA / f"runsc-flags-{release}.txt").read_text(encoding="utf-8")
    assert parse_flags(listing) == facts


def test_a_runsc_with_directfs_runs_with_it_off() -> None:
    """With directfs, runsc 20240729 truncates files under read-only binds on O_TRUNC: the
    gofer must serve them (--directfs=false); a runsc whose flags cannot be read gets it too
    (an old one then refuses to start: fail closed)."""
    assert runtime_flags("runsc", NetworkMode.NONE, directfs=True) == [
        "--oci-seccomp",
        "--directfs=false",
        "--network=none",
    ]
    assert runtime_flags("runc", NetworkMode.NONE, directfs=True) == []
    assert UNKNOWN_FLAGS.directfs
    rt = runtime(oci_runtime="runsc")
    rt._gvisor_flags = GvisorFlags(directfs=True, platform="systrap")
    argv = plan_of(rt, POLICIES["none-limits"]).launch.argv
    assert argv[argv.index("--oci-seccomp") + 1] == "--directfs=false"
    assert argv.index("--directfs=false") < argv.index("run")
    old = plan_of(runtime(oci_runtime="runsc"), POLICIES["none-limits"]).launch.argv
    assert "--directfs=false" not in old
    runc = runtime()
    runc._gvisor_flags = GvisorFlags(directfs=True, platform="systrap")
    assert "--directfs=false" not in plan_of(runc, POLICIES["none-limits"]).launch.argv


def test_runsc_network_flags_come_before_the_subcommand() -> None:
    assert runtime_flags("runsc", NetworkMode.NONE) == ["--oci-seccomp", "--network=none"]
    assert runtime_flags("/usr/bin/runsc", NetworkMode.HOST)[-1] == "--network=host"
    # egress: host networking of the namespace the launch script prepared, never the host's
    assert runtime_flags("runsc", NetworkMode.EGRESS)[-1] == "--network=host"
    assert runtime_flags("runc", NetworkMode.NONE) == []
    argv = run_argv("runsc", "/s", "/b", "id", "/p", flags=["--network=none"])
    assert argv[:5] == ["runsc", "--root", "/s", "--network=none", "run"]


def test_runsc_egress_launch_holds_the_runtime_until_slirp_is_attached() -> None:
    hook = EgressHook("/t/1.egress-request", "/t/1.egress-reply", "/t/resolv.conf", hook=False)
    argv = egress_launch_argv("/usr/bin/unshare", hook, ["runsc", "run", "x"])
    assert argv[:3] == ["/usr/bin/unshare", "--net", "--"]
    assert argv[-5:] == ["/t/1.egress-request", "/t/1.egress-reply", "runsc", "run", "x"]
    script = argv[5]
    assert script.index('read -r answer <"$2"') < script.index('exec "$@"')
    assert '[ "$answer" = go ]' in script


def test_runsc_egress_bundle_has_no_hook_and_no_second_netns(oci_validator: Any) -> None:
    spec = spec_for(POLICIES["egress"])
    hook = EgressHook("/t/1.egress-request", "/t/1.egress-reply", "/t/resolv.conf", hook=False)
    typed = bundle_spec(spec, egress=hook)
    out = typed.to_oci()
    oci_validator.validate(out)
    assert "hooks" not in out
    assert all(ns["type"] != "network" for ns in out["linux"]["namespaces"])
    assert bind("/etc/resolv.conf", "/t/resolv.conf", writable=False) in typed.task.mounts
    runc = bundle_spec(spec, egress=EgressHook("/a", "/b", "/t/resolv.conf")).to_oci()
    assert runc["hooks"]["createRuntime"] and {"type": "network"} in runc["linux"]["namespaces"]


def test_runsc_never_claims_pids_and_is_unavailable_rootless() -> None:
    rt = runtime(oci_runtime="runsc")
    rt._cgroups = Hierarchy("v1", frozenset({"memory", "pids", "cpu"}))
    assert Requirement.PIDS not in rt.enforces()
    # gVisor fires RLIMIT_CPU only when set inside: the agent's setrlimit per command does.
    assert Requirement.CPU_TIME in rt.enforces()
    assert Requirement.MEMORY in rt.enforces()
    rootless = runtime(uid=1000, oci_runtime="runsc")
    rootless._binary = "/usr/bin/runsc"
    avail = rootless.availability()
    assert not avail.available and "unprivileged" in avail.reason


# --- plan is the launch -----------------------------------------------------------------------


def test_plan_is_the_launch_prepare_starts_and_the_frame_execute_sends() -> None:
    """The plan carries the one TaskLaunch prepare writes and runs, and the command's Spawn;
    every command of the task has the same container."""
    rt = runtime()
    plan = plan_of(rt, POLICIES["none-limits"])
    launch = plan.launch
    assert plan.sandbox is not None
    assert (plan.sandbox.argv, plan.sandbox.env, plan.sandbox.cwd, plan.bundle) == (
        launch.argv,
        launch.env,
        launch.cwd,
        launch.bundle,
    )
    assert launch == rt._task_launch()  # the builder is pure
    assert launch.cid == "task-1-run-1-ab12cd"
    assert launch.cwd == "/run/fusion-oci/oci/task-1-run-1-ab12cd/bundle"
    # the CLI's own environment; the command's is in its frame
    assert plan.sandbox.env == {"PATH": "/usr/sbin:/usr/bin"}
    other = rt.plan(Case(task_for(POLICIES["none-limits"]), "echo other").process)
    assert other.launch == launch
    assert plan.spawn == command_spawn(plan.process)
    assert {"launch", "process"}.isdisjoint(plan.to_json())


def test_the_bundle_in_the_plan_is_what_the_runtime_validates(oci_validator: Any) -> None:
    for name in sorted(POLICIES):
        for rt in (runtime(), runtime(uid=1000), runtime(oci_runtime="runsc")):
            oci_validator.validate(plan_of(rt, POLICIES[name]).bundle.to_oci())


def test_runsc_limits_go_to_a_cgroup_of_ours_that_runsc_joins() -> None:
    launch = plan_of(runtime(oci_runtime="runsc"), POLICIES["none-limits"]).launch
    assert launch.cgroup is not None and launch.cgroup.pids is None
    assert launch.cgroup.memory_bytes == 256 * 1024 * 1024
    assert launch.cgroup_leaf == "fusion-oci.4242.ab12cd"
    assert launch.bundle.task.linux.cgroups_path == launch.cgroup_leaf
    assert not {"memory", "cpu", "pids"} & set(launch.bundle.to_oci()["linux"]["resources"])
    # runc makes its own cgroup from linux.resources
    runc = plan_of(runtime(), POLICIES["none-limits"]).launch
    assert runc.cgroup is None and runc.bundle.task.resources.memory is not None


def test_network_is_read_from_the_namespaces_then_the_annotation() -> None:
    assert task_for(POLICIES["host"]).spec.network is NetworkMode.HOST
    assert task_for(POLICIES["egress"]).spec.network is NetworkMode.EGRESS
    assert task_for(POLICIES["none-limits"]).spec.network is NetworkMode.NONE


def test_check_names_egress_where_slirp_is_unusable() -> None:
    rt = runtime()
    rt._egress = (False, "no slirp4netns")
    egress = Requirement.NETWORK_EGRESS.value
    assert egress in rt.check(task_for(POLICIES["egress"]))
    assert egress not in rt.check(task_for(POLICIES["none-limits"]))
    rt._egress = (True, "/usr/bin/slirp4netns")
    assert egress not in rt.check(task_for(POLICIES["egress"]))


def test_doctor_says_whether_a_cluster_here_could_run_gvisor_pods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """#33: gVisor as a RuntimeClass needs runsc's containerd shim, which sets its OOM score
    (CAP_SYS_RESOURCE): doctor's runsc row says which of the two is missing."""
    import shutil

    from fusion_oci.runtimes.oci import gvisor

    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    assert gvisor.kubernetes_runtime_class().startswith("no RuntimeClass: this runsc comes")
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}")
    monkeypatch.setattr(gvisor, "_has_sys_resource", lambda: False)
    assert "CAP_SYS_RESOURCE" in gvisor.kubernetes_runtime_class()
    monkeypatch.setattr(gvisor, "_has_sys_resource", lambda: True)
    assert gvisor.kubernetes_runtime_class().startswith("a RuntimeClass can use")
