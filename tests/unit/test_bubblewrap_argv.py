"""bubblewrap translation: golden argv per policy, and the pure helpers around the launch."""

from __future__ import annotations

from typing import Any

import pytest

from fusion_oci.errors import BundleError
from fusion_oci.models import CacheMode, CpuLimit, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.model import Mount
from fusion_oci.policy.layout import CacheMount, GitLayout, TaskLayout
from fusion_oci.runtimes.bubblewrap import (
    BwrapHost,
    LaunchFds,
    agent_rlimits,
    args_launch,
    bwrap_argv,
    bwrap_spawn,
    mount_args,
    needs_launch_hooks,
    plan_notes,
    seccomp_program,
    with_fds,
)
from fusion_oci.runtimes.linux import cgroups, egress, userns
from fusion_oci.runtimes.linux.cgroups import CgroupLimits
from tests.golden import GOLDEN_HOST, assert_golden
from tests.tasks import Case, resolved

HOST = GOLDEN_HOST
CACHES = (
    CacheMount(
        "pnpm-store",
        "/home/u/.cache/fusion-oci/projects/abc/pnpm-store",
        "/var/cache/fusion-oci/pnpm-store",
        (("npm_config_store_dir", "/var/cache/fusion-oci/pnpm-store"),),
    ),
    CacheMount(
        "npm-cache",
        "/home/u/.cache/fusion-oci/projects/abc/npm-cache",
        "/var/cache/fusion-oci/npm-cache",
        (("npm_config_cache", "/var/cache/fusion-oci/npm-cache"),),
    ),
)
PLAIN = TaskLayout(
    "/work/wt/task-1", None, CACHES, "/etc/ssl/certs/ca-certificates.crt", ca_complete=True
)
LINKED = TaskLayout(
    "/work/wt/task-1",
    GitLayout("linked", "/work/repo/.git/worktrees/task-1", "/work/repo/.git"),
    CACHES,
    "/etc/ssl/certs/ca-certificates.crt",
    ca_complete=True,
)
ENV = {
    "PATH": "/home/u/bin:/usr/bin",
    "HOME": "/home/u",
    "LANG": "C.UTF-8",
    "GITHUB_TOKEN": "ghp_secret",
    "CI": "true",
}
BWRAP_HOST = BwrapHost(
    bwrap="/usr/bin/bwrap", cgroup_mode="v1", egress_resolv_conf="/run/fusion/resolv.conf"
)

GRANTS = ("127.0.0.1:5432", "[::1]:6379", "unix:/var/run/postgresql/.s.PGSQL.5432")
SERVICE_ARGS = [
    "--service",
    "127.0.0.1:5432=/run/fusion-oci/services/0.sock",
    "--service",
    "[::1]:6379=/run/fusion-oci/services/1.sock",
]

CASES: dict[str, tuple[SandboxPolicy, TaskLayout]] = {
    "default-egress": (SandboxPolicy(), PLAIN),
    "network-none": (SandboxPolicy(allow_network=False), PLAIN),
    "network-host": (SandboxPolicy(network="host"), PLAIN),
    "network-filtered": (SandboxPolicy(network="filtered", allowed_domains=["example.com"]), PLAIN),
    "locked-down": (
        SandboxPolicy(
            allow_network=False,
            memory_limit_mb=256,
            pids_limit=64,
            cpu_limit=CpuLimit(max_cores=1.5, max_ms=30_000),
            allowed_paths=["/opt/sdk"],
            writable_paths=["/work/out"],
            env_allowlist=["CI"],
        ),
        PLAIN,
    ),
    "linked-worktree": (SandboxPolicy(), LINKED),
    "host-services": (SandboxPolicy(host_services=list(GRANTS)), PLAIN),
}


def spec_for(name: str, command: str = "pnpm test") -> Case:
    policy, layout = CASES[name]
    ctx = PrepareContext(
        task_id="task-1",
        run_id="run-1",
        worktree_path=layout.worktree,
        policy=policy,
        cache_mode=CacheMode.SHARED,
    )
    return Case(resolved(ctx, layout, HOST, ENV), command)


def argv_of(case: Case, host: BwrapHost, fds: LaunchFds | None = None) -> list[str]:
    return bwrap_argv(case.spec, case.task.user, host, fds)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_argv(name: str, oci_validator: Any) -> None:
    spec = spec_for(name)
    oci_validator.validate(spec.config())
    argv = argv_of(spec, BWRAP_HOST)
    spawn = bwrap_spawn(spec.process)
    assert_golden(
        f"bubblewrap/{name}.json",
        {
            "argv": argv,
            "spawn": [f"{k}={v}" for k, v in spawn.fields()],
            "notes": plan_notes(spec.spec, spec.process, BWRAP_HOST),
        },
    )
    assert argv_of(spec, BWRAP_HOST) == argv  # pure: same input, same argv


def _pairs(argv: list[str], flag: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == flag]


def test_isolation_flags_always_present() -> None:
    for name in CASES:
        argv = argv_of(spec_for(name), BWRAP_HOST)
        head = argv[: argv.index("--clearenv")]
        for flag in (
            "--unshare-all",
            "--unshare-user",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
            "--disable-userns",
            "--seccomp",
        ):
            assert flag in head, (name, flag)
        assert head[head.index("--cap-drop") + 1] == "ALL"
        assert tuple(head[head.index("--proc") :][:2]) == ("--proc", "/proc")
        assert "--dev" in head and head[-1] != "/"
        # the sandbox runs the agent; the command is the spawn frame's
        forward = ["--egress", "/run/fusion-oci/egress.sock"] if name == "network-filtered" else []
        forward += SERVICE_ARGS if name == "host-services" else []
        assert argv[-7 - len(forward) :] == [
            "--clearenv",
            "--chdir",
            "/",
            "--",
            "/dev/fusion-oci-agent",
            *forward,
            "--fd",
            "<agent-fd>",
        ]
        assert list(bwrap_spawn(spec_for(name).process).argv) == ["/bin/sh", "-c", "pnpm test"]
        assert ("--share-net" in head) == (name == "network-host")


def test_env_is_exactly_the_spec_env() -> None:
    spec = spec_for("locked-down")
    argv = argv_of(spec, BWRAP_HOST)
    assert "--setenv" not in argv  # the agent starts with none; each command gets its own
    spawn = bwrap_spawn(spec.process)
    env = dict(spawn.env)
    assert env["HOME"] == "/home/sandbox" and env["CI"] == "true"
    assert "GITHUB_TOKEN" not in env
    assert spawn.cwd == "/work/wt/task-1"


def test_nothing_of_the_command_is_in_the_sandbox_argv() -> None:
    """Two commands of one task, with other args, env and cwd, need the same sandbox."""
    policy, layout = CASES["locked-down"]
    ctx = PrepareContext(
        task_id="task-1",
        run_id="run-1",
        worktree_path=layout.worktree,
        policy=policy,
        cache_mode=CacheMode.SHARED,
    )
    one = Case(resolved(ctx, layout, HOST, ENV), "true", RunOptions())
    two = Case(
        resolved(ctx, layout, HOST, {**ENV, "CI": "false"}), ["make", "-j2"], RunOptions(cwd="sub")
    )
    assert argv_of(one, BWRAP_HOST) == argv_of(two, BWRAP_HOST)
    assert bwrap_spawn(one.process) != bwrap_spawn(two.process)


def test_mount_kinds_and_order() -> None:
    argv = argv_of(spec_for("locked-down"), BWRAP_HOST)
    ro, rw = _pairs(argv, "--ro-bind"), _pairs(argv, "--bind")
    assert ("/usr", "/usr") in ro and ("/usr/bin", "/bin") in ro
    assert ("/etc/passwd", "/etc/passwd") in ro
    assert ("/opt/sdk", "/opt/sdk") in ro
    assert ("/work/out", "/work/out") in rw
    assert ("/work/wt/task-1", "/work/wt/task-1") in rw
    assert ("/etc/ssl/certs/ca-certificates.crt", "/etc/fusion-oci/host-ca.pem") in ro
    # tmpfs /tmp (1777) and a private HOME (0700)
    i = argv.index("/home/sandbox")
    assert argv[i - 1] == "--tmpfs" and argv[i - 2] == "0700"
    # nothing of the caller's home unless a policy path names it
    assert not any(a.startswith("/home/u") and "fusion-oci" not in a for a in argv)
    # the root is made read-only after every mount point exists
    assert argv.index("--remount-ro") > max(i for i, a in enumerate(argv) if a == "--bind")


def test_linked_worktree_git_order_keeps_hooks_and_config_read_only_last() -> None:
    argv = argv_of(spec_for("linked-worktree"), BWRAP_HOST)
    binds = [(argv[i], argv[i + 2]) for i, a in enumerate(argv) if a in ("--bind", "--ro-bind")]
    where = {dest: n for n, (_, dest) in enumerate(binds)}
    common = "/work/repo/.git"
    assert binds[where[common]][0] == "--ro-bind"
    for sub in ("objects", "refs", "logs", "worktrees/task-1"):
        assert binds[where[f"{common}/{sub}"]][0] == "--bind"
        assert where[f"{common}/{sub}"] > where[common]
    last_rw = max(n for n, (flag, _) in enumerate(binds) if flag == "--bind")
    for sub in ("hooks", "config"):
        assert binds[where[f"{common}/{sub}"]][0] == "--ro-bind"
        assert where[f"{common}/{sub}"] > last_rw  # read-only has the last word


def test_egress_gets_hooks_and_slirp_dns() -> None:
    spec = spec_for("default-egress")
    argv = argv_of(spec, BWRAP_HOST, LaunchFds(info=7, block=8, seccomp=9))
    assert argv[argv.index("--info-fd") + 1] == "7"
    assert argv[argv.index("--block-fd") + 1] == "8"
    assert argv[argv.index("--seccomp") + 1] == "9"
    assert _pairs(argv, "--ro-bind")[-1] == ("/run/fusion/resolv.conf", "/etc/resolv.conf")
    assert "--share-net" not in argv
    none = argv_of(spec_for("network-none"), BWRAP_HOST)
    assert "--info-fd" not in none and "/run/fusion/resolv.conf" not in none


def test_filtered_is_an_empty_netns_with_the_proxy_socket_and_the_forwarder() -> None:
    spec = spec_for("network-filtered")
    host = BwrapHost(
        bwrap="/usr/bin/bwrap",
        cgroup_mode="v1",
        agent="/opt/agent",
        egress_socket="/tmp/fusion-oci-egress-x/egress.sock",
    )
    argv = argv_of(spec, host, LaunchFds(info=7, block=8, seccomp=9, agent=6))
    assert "--share-net" not in argv and "--unshare-all" in argv
    assert "--info-fd" not in argv  # no slirp4netns, nothing to attach
    assert "/run/fusion/resolv.conf" not in argv
    binds = _pairs(argv, "--ro-bind")
    assert ("/tmp/fusion-oci-egress-x/egress.sock", "/run/fusion-oci/egress.sock") in binds
    assert ("/opt/agent", "/run/fusion-oci/agent") in binds
    assert argv[-5:] == [
        "/dev/fusion-oci-agent",
        "--egress",
        "/run/fusion-oci/egress.sock",
        "--fd",
        "6",
    ]
    env = dict(bwrap_spawn(spec.process).env)
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://127.0.0.1:3128"
    assert env["NO_PROXY"] == ""
    assert "/run/fusion-oci/agent connect %h %p" in env["GIT_SSH_COMMAND"]
    launch, _ = args_launch(argv, host, 5)
    assert launch[-5:] == [
        "/dev/fusion-oci-agent",
        "--egress",
        "/run/fusion-oci/egress.sock",
        "--fd",
        "6",
    ]
    # the proxy env is the filtered policy's only: none elsewhere
    assert "HTTPS_PROXY" not in dict(bwrap_spawn(spec_for("default-egress").process).env)


def test_limits_are_the_agents_setrlimit_and_launch_hooks() -> None:
    spec = spec_for("locked-down")
    argv = argv_of(spec, BWRAP_HOST)
    # rlimits: the agent's setrlimit(2) per command, not a prlimit exec in front
    assert argv[0] == "/usr/bin/bwrap"
    assert [(n, s, h) for n, _, s, h in agent_rlimits(spec.process.rlimits)] == [
        ("RLIMIT_NOFILE", 20000, 20000),
        ("RLIMIT_CPU", 30, 31),
    ]
    assert list(bwrap_spawn(spec.process).rlimits) == [
        ("RLIMIT_NOFILE", 20000, 20000),
        ("RLIMIT_CPU", 30, 31),
    ]
    assert needs_launch_hooks(spec.spec, BWRAP_HOST)
    # no usable cgroup: the limits are not the launcher's business (enforces() says so)
    assert not needs_launch_hooks(spec.spec, BwrapHost(cgroup_mode="none"))
    systemd = BwrapHost(cgroup_mode="systemd-run", systemd_run="/usr/bin/systemd-run")
    sd = argv_of(spec, systemd)
    assert sd[:6] == [
        "/usr/bin/systemd-run",
        "--user",
        "--scope",
        "--quiet",
        "--collect",
        "--unit=fusion-oci-run-1",
    ]
    assert "MemoryMax=268435456" in sd and "TasksMax=64" in sd and "CPUQuota=150%" in sd


def test_mount_args_edge_cases() -> None:
    assert mount_args(Mount(destination="/sys", type="sysfs", source="sysfs"))[1]
    assert mount_args(Mount(destination="/dev/pts", type="devpts", source="devpts")) == ([], None)
    assert mount_args(
        Mount(destination="/s", type="tmpfs", source="tmpfs", options=["mode=755", "size=64k"])
    )[0] == ["--perms", "0755", "--size", "65536", "--tmpfs", "/s"]
    with pytest.raises(BundleError):
        mount_args(Mount(destination="/x", type="overlay", source="overlay"))


def test_image_reference_is_refused_but_rootfs_dir_is_bound() -> None:
    policy, layout = CASES["network-none"]
    ctx = PrepareContext(
        task_id="t",
        run_id="r",
        worktree_path=layout.worktree,
        policy=policy,
        image="localhost/node:20",
    )
    spec = Case(resolved(ctx, layout, HOST, ENV), "true", RunOptions())
    with pytest.raises(BundleError, match="cannot use image"):
        argv_of(spec, BWRAP_HOST)
    ctx = ctx.model_copy(update={"image": "/srv/rootfs"})
    spec = Case(resolved(ctx, layout, HOST, ENV), "true", RunOptions())
    argv = argv_of(spec, BWRAP_HOST)
    assert _pairs(argv, "--ro-bind")[0] == ("/srv/rootfs", "/")


def test_seccomp_program_compiles_from_the_spec() -> None:
    program = seccomp_program(spec_for("default-egress").spec)
    assert program and len(program) % 8 == 0


# ---------------------------------------------------------------- linux helpers (pure parts)


def test_cgroup_limits_and_writes() -> None:
    limits = CgroupLimits.from_task(spec_for("locked-down").spec)
    assert limits.controllers() == {"memory", "pids", "cpu"}
    assert cgroups.v1_writes(limits, has_memsw=True) == [
        ("memory", "memory.limit_in_bytes", str(256 << 20)),
        ("memory", "memory.memsw.limit_in_bytes", str(256 << 20)),
        ("pids", "pids.max", "64"),
        ("cpu", "cpu.cfs_period_us", "100000"),
        ("cpu", "cpu.cfs_quota_us", "150000"),
    ]
    assert cgroups.v2_writes(limits) == [
        ("memory.max", str(256 << 20)),
        ("memory.swap.max", "0"),
        ("pids.max", "64"),
        ("cpu.max", "150000 100000"),
    ]
    assert CgroupLimits.from_task(spec_for("default-egress").spec).controllers() == frozenset()


MOUNTINFO_V1 = """\
30 23 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
33 30 0:29 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
35 30 0:31 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
36 30 0:32 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
37 30 0:33 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
"""
MOUNTINFO_V2 = "33 30 0:29 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def _support(
    mountinfo: str,
    proc_cgroup: str,
    *,
    uid: int,
    files: dict[str, str],
    writable: set[str],
    user_manager: bool = False,
) -> cgroups.CgroupSupport:
    return cgroups.plan_support(
        cgroups.parse_mountinfo(mountinfo),
        cgroups.parse_proc_cgroup(proc_cgroup),
        uid=uid,
        writable=lambda p: p in writable,
        read=files.get,
        systemd_run="/usr/bin/systemd-run",
        user_manager=user_manager,
    )


def test_cgroup_detection_v1_nests_inside_our_own_cgroup() -> None:
    own = "4:memory:/ci/job-7\n8:pids:/\n2:cpu,cpuacct:/\n0::/\n"
    s = _support(
        MOUNTINFO_V1,
        own,
        uid=0,
        files={},
        writable={
            "/sys/fs/cgroup/memory/ci/job-7",
            "/sys/fs/cgroup/pids",
            "/sys/fs/cgroup/cpu,cpuacct",
        },
    )
    assert s.mode == "v1" and s.controllers == {"memory", "pids", "cpu"}
    assert s.parents["memory"] == "/sys/fs/cgroup/memory/ci/job-7"
    none = _support(MOUNTINFO_V1, own, uid=1000, files={}, writable=set())
    assert none.mode == "none" and not none.controllers


def test_cgroup_detection_v2_root_and_delegated_and_systemd() -> None:
    root = _support(
        MOUNTINFO_V2,
        "0::/\n",
        uid=0,
        files={"/sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids"},
        writable={"/sys/fs/cgroup"},
    )
    assert root.mode == "v2" and root.parents["unified"] == "/sys/fs/cgroup"
    own = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/term.scope\n"
    parent = "/sys/fs/cgroup/user.slice/user-1000.slice/user@1000.service/app.slice"
    delegated = _support(
        MOUNTINFO_V2,
        own,
        uid=1000,
        files={parent + "/cgroup.subtree_control": "memory pids"},
        writable={parent},
    )
    assert delegated.mode == "v2" and delegated.controllers == {"memory", "pids"}
    assert delegated.parents["unified"] == parent  # beside our cgroup, never inside it
    svc = "/sys/fs/cgroup/user.slice/user-1000.slice/user@1000.service/cgroup.subtree_control"
    sd = _support(
        MOUNTINFO_V2,
        own,
        uid=1000,
        files={svc: "cpu memory pids"},
        writable=set(),
        user_manager=True,
    )
    assert sd.mode == "systemd-run" and sd.controllers == {"cpu", "memory", "pids"}


def test_cgroup_event_parsing() -> None:
    assert (
        cgroups.parse_flat_keyed("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")["oom_kill"] == 2
    )
    assert cgroups.parse_flat_keyed("max 17\n") == {"max": 17}


def test_slirp_argv_closes_host_loopback() -> None:
    argv = egress.slirp_argv(
        "/usr/bin/slirp4netns",
        netns="/proc/self/fd/5",
        userns="/proc/self/fd/6",
        ready_fd=7,
        exit_fd=8,
        as_root=True,
    )
    assert "--disable-host-loopback" in argv and "--configure" in argv
    assert "--enable-sandbox" in argv
    assert "--enable-sandbox" not in egress.slirp_argv(
        "s", netns="n", userns="u", ready_fd=1, exit_fd=2, as_root=False
    )
    assert argv[-2:] == ["/proc/self/fd/5", "tap0"]
    assert "--netns-type=path" in argv and "--userns-path=/proc/self/fd/6" in argv


@pytest.mark.parametrize(
    ("sysctls", "uid", "needle"),
    [
        ({"user.max_user_namespaces": 0}, 0, "user.max_user_namespaces=15000"),
        ({"kernel.unprivileged_userns_clone": 0}, 1000, "unprivileged_userns_clone=1"),
        ({"kernel.apparmor_restrict_unprivileged_userns": 1}, 1000, "apparmor"),
    ],
)
def test_userns_diagnosis_names_the_minimal_fix(
    sysctls: dict[str, int], uid: int, needle: str
) -> None:
    problem = userns.diagnose_sysctls(sysctls, uid=uid)
    assert problem is not None and needle in problem.hint.lower()


def test_userns_root_is_not_stopped_by_unprivileged_switches() -> None:
    assert (
        userns.diagnose_sysctls(
            {
                "kernel.unprivileged_userns_clone": 0,
                "kernel.apparmor_restrict_unprivileged_userns": 1,
            },
            uid=0,
        )
        is None
    )


def test_seccomp_filtered_container_is_recognised() -> None:
    problem = userns.classify_probe_failure(
        "bwrap: Creating new namespace failed: Operation not permitted\n", {}, uid=1000
    )
    assert "seccomp" in problem.reason and "seccomp=unconfined" in problem.hint
    uidmap = userns.classify_probe_failure(
        "bwrap: setting up uid map: Permission denied", {}, uid=1000
    )
    assert "userns" in uidmap.hint


def test_missing_bwrap_is_unavailable_with_the_install_hint() -> None:
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.runtimes.bubblewrap import BubblewrapRuntime

    runtime = BubblewrapRuntime(
        SandboxSettings(backend="bubblewrap"), {"PATH": "/nonexistent-fusion-oci"}
    )
    avail = runtime.availability()
    assert not avail.available and "not installed" in avail.reason
    assert "apt-get install bubblewrap" in avail.hint
    assert runtime.enforces() == frozenset()


def test_args_launch_moves_the_options_to_the_args_fd() -> None:
    from fusion_oci.runtimes.bubblewrap import args_launch

    spec = spec_for("locked-down", command="echo --; true")
    argv = argv_of(spec, BWRAP_HOST, LaunchFds(info=7, block=8, seccomp=9, agent=6))
    launch, payload = args_launch(argv, BWRAP_HOST, 5)
    assert launch == ["/usr/bin/bwrap", "--args", "5", "--", "/dev/fusion-oci-agent", "--fd", "6"]
    options = payload.split(b"\0")
    assert options[-1] == b"" and [o.decode() for o in options[:-1]] == argv[1:-4]
    systemd = BwrapHost(
        bwrap="/usr/bin/bwrap", cgroup_mode="systemd-run", systemd_run="/usr/bin/systemd-run"
    )
    launch, _ = args_launch(argv_of(spec, systemd), systemd, 5)
    assert launch[0] == "/usr/bin/systemd-run" and launch[-7:-4] == [
        "/usr/bin/bwrap",
        "--args",
        "5",
    ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_execute_fills_the_planned_argv_with_its_fds(name: str) -> None:
    """What runs is the plan with the launch's fds in the placeholders' places: equal to the
    translation made with those fds, whatever the policy (hooks, seccomp or not)."""
    spec = spec_for(name)
    fds = LaunchFds(info=11, block=12, seccomp=13, agent=14)
    assert with_fds(argv_of(spec, BWRAP_HOST), fds) == argv_of(spec, BWRAP_HOST, fds)


def test_fds_are_filled_by_position_never_in_paths() -> None:
    policy, layout = CASES["locked-down"]
    policy = policy.model_copy(update={"allowed_paths": ["/opt/<seccomp-fd>", "/opt/<agent-fd>"]})
    ctx = PrepareContext(
        task_id="task-1",
        run_id="run-1",
        worktree_path=layout.worktree,
        policy=policy,
        cache_mode=CacheMode.SHARED,
    )
    spec = Case(resolved(ctx, layout, HOST, ENV), "true", RunOptions())
    argv = with_fds(argv_of(spec, BWRAP_HOST), LaunchFds(info=7, block=8, seccomp=9, agent=6))
    assert argv[argv.index("--seccomp") + 1] == "9"
    assert argv[argv.index("--info-fd") + 1] == "7"
    assert argv[-1] == "6"
    assert ("/opt/<seccomp-fd>", "/opt/<seccomp-fd>") in _pairs(argv, "--ro-bind")
    assert ("/opt/<agent-fd>", "/opt/<agent-fd>") in _pairs(argv, "--ro-bind")
    with pytest.raises(ValueError):
        with_fds(argv_of(spec, BWRAP_HOST)[:-1], LaunchFds())
