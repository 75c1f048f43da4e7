"""landlock translation: the golden ruleset per policy, and the pure ABI arithmetic."""

from __future__ import annotations

import struct

import pytest

from fusion_oci.models import CacheMode, CpuLimit, PrepareContext, SandboxPolicy
from fusion_oci.oci.model import TaskSpec
from fusion_oci.policy.layout import GitLayout, TaskLayout
from fusion_oci.resolve import ResolvedTask
from fusion_oci.runtimes.landlock import (
    FS_RIGHTS,
    enforced_requirements,
    landlock_rules,
    launch_config,
)
from fusion_oci.runtimes.requirements import Requirement
from tests.bpf import run_bpf
from tests.golden import GOLDEN_HOST, assert_golden
from tests.tasks import plan_for, resolved

HOST = GOLDEN_HOST
PLAIN_DIR = TaskLayout(
    "/work/wt/task-1", None, (), "/etc/ssl/certs/ca-certificates.crt", ca_complete=True
)
LINKED = TaskLayout(
    "/work/wt/task-1",
    GitLayout("linked", "/work/repo/.git/worktrees/task-1", "/work/repo/.git"),
    (),
    "/etc/ssl/certs/ca-certificates.crt",
    ca_complete=True,
)
MAIN_REPO = TaskLayout(
    "/work/wt/task-1", GitLayout("main", "/work/wt/task-1/.git", "/work/wt/task-1/.git"), (), None
)
HOME, TMP = "/run/scratch/home", "/run/scratch/tmp"

CASES: dict[str, tuple[SandboxPolicy, TaskLayout]] = {
    "network-none": (SandboxPolicy(allow_network=False), PLAIN_DIR),
    "network-host": (SandboxPolicy(network="host"), PLAIN_DIR),
    "locked-down": (
        SandboxPolicy(
            allow_network=False,
            cpu_limit=CpuLimit(max_ms=30_000),
            file_size_limit_mb=64,
            allowed_paths=["/opt/sdk"],
            writable_paths=["/work/out"],
            env_allowlist=["CI"],
        ),
        PLAIN_DIR,
    ),
    "linked-worktree": (SandboxPolicy(allow_network=False), LINKED),
    "main-repository": (SandboxPolicy(allow_network=False), MAIN_REPO),
    "host-services": (
        SandboxPolicy(
            allow_network=False,
            host_services=[
                "127.0.0.1:5432",
                "[::1]:6379",
                "unix:/var/run/postgresql/.s.PGSQL.5432",
            ],
        ),
        LINKED,
    ),
}


def spec_for(name: str) -> TaskSpec:
    policy, layout = CASES[name]
    ctx = PrepareContext(
        task_id="task-1",
        run_id="run-1",
        worktree_path=layout.worktree,
        policy=policy,
        cache_mode=CacheMode.OFF,
    )
    return resolved(ctx, layout, HOST, {"LANG": "C.UTF-8"}).spec


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_ruleset(name: str) -> None:
    rules = landlock_rules(spec_for(name), HOME, TMP)
    data = rules.to_json()
    data["seccomp"] = data["seccomp"]["syscalls"][-2:]  # the bundle's own rules are golden
    assert_golden(f"landlock/{name}.json", data)  # elsewhere (tests/data/bundles)
    assert landlock_rules(spec_for(name), HOME, TMP) == rules  # pure


def _grants(name: str) -> dict[str, tuple[str, ...]]:
    return dict(landlock_rules(spec_for(name), HOME, TMP).paths)


def test_only_the_worktree_scratch_and_writable_paths_are_writable() -> None:
    writable = {
        p
        for p, a in _grants("locked-down").items()
        if "write_file" in a and not p.startswith("/dev/")
    }
    assert writable == {"/work/wt/task-1", "/work/out", HOME, TMP}
    assert "write_file" not in _grants("locked-down")["/opt/sdk"]


def test_linked_worktree_common_dir_hooks_and_config_stay_read_only() -> None:
    rules = landlock_rules(spec_for("linked-worktree"), HOME, TMP)
    grants = dict(rules.paths)
    assert rules.restored == ["/work/wt/task-1/.git"]  # the .git file: kept and put back
    for path in ("/work/repo/.git", "/work/repo/.git/hooks", "/work/repo/.git/config"):
        assert "write_file" not in grants[path] and "make_reg" not in grants[path], path
    for path in (
        "/work/repo/.git/objects",
        "/work/repo/.git/refs",
        "/work/repo/.git/worktrees/task-1",
    ):
        assert "write_file" in grants[path], path


def test_main_repository_hooks_inside_the_worktree_are_kept_and_restored() -> None:
    rules = landlock_rules(spec_for("main-repository"), HOME, TMP)
    assert rules.restored == ["/work/wt/task-1/.git/hooks", "/work/wt/task-1/.git/config"]


def test_nothing_else_of_the_host_is_granted() -> None:
    for name in CASES:
        for path in _grants(name):
            assert not path.startswith(
                ("/home", "/root", "/run/", "/var", "/tmp")
            ) or path.startswith("/run/scratch/"), (name, path)
            assert path != "/proc" and not path.startswith("/proc/self"), (name, path)


def test_no_command_takes_a_descriptor_from_another_process() -> None:
    """The task's agent is dumpable and shares the commands' uid and domain: pidfd_getfd is
    refused (its connection stays its own), as ptrace and process_vm_* are by the profile."""
    for name in CASES:
        refused = {
            n
            for r in landlock_rules(spec_for(name), HOME, TMP).seccomp["syscalls"]
            if r["action"] == "SCMP_ACT_ERRNO" and not r.get("args")
            for n in r["names"]
        }
        assert {"pidfd_getfd", "ptrace", "process_vm_readv", "process_vm_writev"} <= refused


def test_network_none_refuses_every_socket_host_refuses_unix() -> None:
    none = landlock_rules(spec_for("network-none"), HOME, TMP).seccomp["syscalls"][-1]
    host = landlock_rules(spec_for("network-host"), HOME, TMP).seccomp["syscalls"][-1]
    assert none == {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}
    assert host["args"] == [{"index": 0, "value": 1, "op": "SCMP_CMP_EQ"}]


@pytest.mark.parametrize("abi", [1, 3, 4, 6, 7])
def test_launch_config_handles_exactly_what_the_abi_knows(abi: int) -> None:
    rules = landlock_rules(spec_for("network-none"), HOME, TMP)
    cfg = launch_config(rules, abi, "x86_64")
    known = sum(bit for bit, since in FS_RIGHTS.values() if since <= abi)
    assert cfg["handled_fs"] == known
    assert cfg["handled_net"] == (3 if abi >= 4 else 0)
    assert cfg["scoped"] == (3 if abi >= 6 else 0)
    assert all(mask & ~known == 0 for _, mask in cfg["paths"])
    program = bytes.fromhex(cfg["seccomp"])
    assert len(program) % 8 == 0 and struct.unpack_from("<HBBI", program)[0] == 0x20
    assert launch_config(rules, abi, "x86_64") == cfg


def test_enforced_requirements_per_abi() -> None:
    assert enforced_requirements(0) == frozenset()
    assert Requirement.FILESYSTEM not in enforced_requirements(2)
    seven = enforced_requirements(7)
    assert {Requirement.FILESYSTEM, Requirement.NETWORK_NONE, Requirement.ENV} <= seven
    # Below ABI 6 nothing scopes signals: the caller's other processes can be killed.
    assert Requirement.HOST_PROCESSES not in enforced_requirements(5)
    assert Requirement.HOST_PROCESSES in enforced_requirements(6)
    for never in (
        Requirement.NETWORK_EGRESS,
        Requirement.MEMORY,
        Requirement.PIDS,
        Requirement.CPU_QUOTA,
        Requirement.TMP_SIZE,
    ):
        assert never not in seven


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_every_chmod_and_open_call_and_only_those_go_to_the_supervisor(arch: str) -> None:
    """chmod (Landlock does not govern metadata) and open/openat (the caller's own /proc
    entries, which no rule can grant a process tree)."""
    from fusion_oci.shims.confine import AUDIT_ARCH, RET_ALLOW, RET_USER_NOTIF, notify_program
    from fusion_oci.shims.seccomp_notify import CHMOD_CALLS, OPEN_CALLS

    program = notify_program(arch)
    calls = {nr for nr in (*CHMOD_CALLS[arch], *OPEN_CALLS[arch]) if nr >= 0}
    assert len(calls) == {"x86_64": 6, "aarch64": 4}[arch]
    for nr in range(0, 460):
        want = RET_USER_NOTIF if nr in calls else RET_ALLOW
        assert run_bpf(program, nr, AUDIT_ARCH[arch]) == want, nr
    assert run_bpf(program, 90, 0x40000003) == RET_ALLOW  # foreign arch: the main filter's


def test_chmod_is_supervised_only_beneath_writable_directories() -> None:
    rules = landlock_rules(spec_for("locked-down"), HOME, TMP)
    writable = launch_config(rules, 7, "x86_64")["writable"]
    assert set(writable) == {"/work/wt/task-1", "/work/out", HOME, TMP}
    assert not any(p.startswith("/dev/") for p in writable)  # never chmod /dev/null


def test_the_launch_file_reads_back_as_it_was_written() -> None:
    from fusion_oci.runtimes.landlock import launch_text
    from fusion_oci.shims.confine import parse

    rules = landlock_rules(spec_for("linked-worktree"), HOME, "/run/scratch/a dir with spaces")
    cfg = launch_config(rules, 7, "x86_64")
    back = parse(launch_text(cfg))
    assert back == {**cfg, "drop_capabilities": 1}


def test_a_path_with_a_newline_is_refused_not_misread() -> None:
    from fusion_oci.errors import SandboxSetupError
    from fusion_oci.runtimes.landlock import launch_text

    rules = landlock_rules(spec_for("network-none"), HOME, "/run/scratch/evil\npath 65535 /")
    with pytest.raises(SandboxSetupError, match="newline"):
        launch_text(launch_config(rules, 7, "x86_64"))


def test_plan_is_what_execute_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan is the spawn frame execute sends to the task's confined agent, beside the
    launch prepare makes (the shim with the launch file and the agent on its connection; the
    fd and the scratch as placeholders before prepare); golden without this host's facts."""
    from pathlib import Path

    import fusion_oci.runtimes.landlock.host as mod
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.runtimes.landlock import LandlockRuntime
    from tests.golden import host_neutral

    monkeypatch.setattr(mod, "_ABI", 7)  # the notes name it: not this host's
    runtime = LandlockRuntime(
        SandboxSettings(backend="landlock"),
        {"PATH": "/usr/bin"},
        cache_root=Path("/nonexistent-cache"),
        host=HOST,
    )
    policy, layout = CASES["locked-down"]
    ctx = PrepareContext(
        task_id="task-1",
        run_id="run-1",
        worktree_path=layout.worktree,
        policy=policy,
        cache_mode=CacheMode.OFF,
    )
    task: ResolvedTask = resolved(ctx, layout, HOST, {"LANG": "C.UTF-8"})
    plan = plan_for(runtime, task, "pnpm test")
    assert plan.sandbox is not None and plan.sandbox.argv is not None
    launch = plan.sandbox.argv
    assert launch == runtime.launch_command("<task scratch>/launch", "N")
    assert "<reaper>" not in launch
    # The agent's own environment is not the caller's; the command's is in the frame.
    assert plan.sandbox.env == {} and plan.spawn.rlimits == plan.process.limits()
    agent = runtime._agent()
    data = plan.to_json()
    data["sandbox"]["argv"] = [
        "<agent>" if a == agent else a for a in host_neutral(data["sandbox"]["argv"])
    ]
    assert_golden("landlock/plan-locked-down.json", data)


@pytest.mark.parametrize(
    ("path", "want"),
    [
        ("/proc/self/status", (40, "status")),
        ("/proc/self", (40, ".")),
        ("/proc/self/", (40, ".")),
        ("/proc/40/limits", (40, "limits")),
        ("/proc/self/fd", (40, "fd")),
        ("/proc/self/fdinfo/3", (40, "fdinfo/3")),
        ("/proc/self/./maps", (40, "maps")),
        ("/proc/thread-self/status", (40, "task/41/status")),
        ("/proc/self/task/41/stat", (40, "task/41/stat")),
        ("/proc/self/task", (40, "task")),
        ("/proc/39/status", (39, "status")),  # another process: the supervisor asks whose
        ("/proc/39/cmdline", (39, "cmdline")),
        ("/proc/39/task/39/stat", (39, "task/39/stat")),
        ("/proc/1/environ", None),  # ptrace-guarded entries: the caller's own only
        ("/proc/39/maps", None),
        ("/proc/39/fd", None),
        ("/proc/39/task/39/environ", None),
        ("/proc", (0, ".")),  # the listing
        ("/proc/", (0, ".")),
        ("/proc/self/pagemap", None),  # content depends on the opener's capabilities
        ("/proc/self/stack", None),
        ("/proc/self/mem", None),
        ("/proc/self/net/tcp", None),  # the host's sockets
        ("/proc/self/root", None),
        ("/proc/self/task/41/pagemap", None),
        ("/proc/self/../1/environ", None),
        ("/proc/040/status", None),  # not how the kernel names a pid
        ("/proc/0/status", None),
        ("/proc/sys/kernel/hostname", None),
        ("/proc/keys", None),
        ("/proc/cpuinfo", None),  # granted by a Landlock rule, not by the supervisor
        ("/etc/passwd", None),
    ],
)
def test_which_proc_entries_the_supervisor_may_open(
    path: str, want: tuple[int, str] | None
) -> None:
    from fusion_oci.shims.supervisor import proc_entry

    assert proc_entry(path, tid=41, tgid=40) == want


def test_no_command_changes_another_process_s_limits_or_priorities() -> None:
    """Issue #31: no pid namespace, and Landlock does not govern these calls, so the profile
    allows each on the caller only; setpriority/ioprio_set on a group or a user never."""
    ne = "SCMP_CMP_NE"
    for name in CASES:
        rules = landlock_rules(spec_for(name), HOME, TMP).seccomp["syscalls"]
        denied: dict[str, list[list[tuple[int, int]]]] = {}
        for r in rules:
            if r["action"] == "SCMP_ACT_ERRNO" and r.get("args"):
                for n in r["names"]:
                    denied.setdefault(n, []).append(
                        [(a["index"], a["value"]) for a in r["args"] if a["op"] == ne]
                    )
        for call in ("prlimit64", "sched_setaffinity", "sched_setscheduler", "sched_setparam"):
            assert [(0, 0)] in denied[call], (name, call)
        assert [(0, 0)] in denied["sched_setattr"] and [(0, 0)] in denied["move_pages"]
        assert {(0, 0), (1, 0)} <= {c for g in denied["setpriority"] for c in g}  # PRIO_PROCESS
        assert {(0, 1), (1, 0)} <= {c for g in denied["ioprio_set"] for c in g}  # WHO_PROCESS
