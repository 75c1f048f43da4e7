"""No command changes the rlimits, priority, I/O priority, affinity or scheduling of a host
process (issue #31).

The kernel lets a process do all of that to any other process of its uid (``prlimit64``,
``setpriority``, ``ioprio_set``, ``sched_setaffinity``, ``sched_setscheduler``), and to every
one of them at once with ``PRIO_USER``/``IOPRIO_WHO_USER``. The attack raised the owner's
``RLIMIT_CORE``, set its ``RLIMIT_CPU`` to 1 s and had it dump its secrets. Each probe aims
the util-linux tools at (a) a host process of the command's uid, (b) one that leads its own
process group (``renice -g``, ``ionice -P``) and (c) the task's owner, this very test process
(SyncSandbox runs in it), and then reads every value back from the host side. The changes
are harmless ones the test undoes (soft limits raised, nice +7, idle I/O class, one CPU,
SCHED_IDLE): native, which isolates nothing, must show them. ``PRIO_USER`` and
``IOPRIO_WHO_USER`` are tried apart, by a uid of their own: from a prober they would reach the
CI user's rootless engines.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import git_init
from tests.security.conftest import Prober, RootlessUser
from tests.security.test_probes import check

LIMITS = (resource.RLIMIT_CORE, resource.RLIMIT_CPU, resource.RLIMIT_NOFILE)
LIMIT_ROWS = ("Max core file size", "Max cpu time", "Max open files")
SYS_IOPRIO_SET, SYS_IOPRIO_GET, IOPRIO_WHO_PROCESS = 251, 252, 1
ROOT = Path(__file__).resolve().parents[2]


def _lonely_uid() -> int:
    """A uid no account names and no process runs as: ``PRIO_USER``/``IOPRIO_WHO_USER`` from
    it reach only the probe's own victim (``nobody`` may run a container's processes)."""
    import pwd

    taken = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if line.startswith("Uid:"):
                    taken.update(int(u) for u in line.split()[1:])
    for uid in range(61_184, 61_284):
        with contextlib.suppress(KeyError):
            pwd.getpwuid(uid)
            continue
        if uid not in taken:
            return uid
    raise RuntimeError("no unused uid in 61184-61283")


IDLE_CPU_SECONDS = 10_000_000
"""The RLIMIT_CPU the probe sets: visible, and harmless to the test process it may reach."""


def _ioprio(pid: int, value: int | None = None) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if value is None:
        return int(libc.syscall(SYS_IOPRIO_GET, IOPRIO_WHO_PROCESS, pid))
    return int(libc.syscall(SYS_IOPRIO_SET, IOPRIO_WHO_PROCESS, pid, value))


def _limits(pid: int) -> list[list[str]]:
    """The soft and hard limits of LIMITS, from /proc/PID/limits: prlimit() cannot read
    another uid's without CAP_SYS_RESOURCE, which a container's root may lack."""
    rows = Path(f"/proc/{pid}/limits").read_text().splitlines()
    return [next(r for r in rows if r.startswith(name)).split()[-3:-1] for name in LIMIT_ROWS]


def state(pid: int) -> dict[str, Any]:
    """What the probe tries to change, read from the host (as root: any pid)."""
    return {
        "limits": _limits(pid),
        "nice": os.getpriority(os.PRIO_PROCESS, pid),
        "ioprio": _ioprio(pid),
        "affinity": sorted(os.sched_getaffinity(pid)),
        "policy": os.sched_getscheduler(pid),
    }


def restore(pid: int, before: dict[str, Any], limits: list[tuple[int, int]]) -> None:
    """Undo a leak: priorities as root (CAP_SYS_NICE), the limits of this process (the
    owner) itself; the victims' limits go with them. Each step on its own: a limit that
    cannot be set back (a hard core limit of 0 since a Sandbox hardened this process) must
    not leave the owner at nice 7, idle I/O and one CPU for the rest of the session."""
    steps: list[Callable[[], object]] = []
    if pid == os.getpid():
        steps += [
            partial(resource.setrlimit, r, value) for r, value in zip(LIMITS, limits, strict=True)
        ]
    steps += [
        partial(os.setpriority, os.PRIO_PROCESS, pid, before["nice"]),
        partial(_ioprio, pid, before["ioprio"]),
        partial(os.sched_setaffinity, pid, before["affinity"]),
        partial(os.sched_setscheduler, pid, before["policy"], os.sched_param(0)),
    ]
    for step in steps:
        with contextlib.suppress(OSError, ValueError):
            step()


OWN_LIMITS = [resource.getrlimit(r) for r in LIMITS]
"""This process's limits at import: what a leak onto the owner is undone to."""


def attack(targets: list[int], group: int) -> str:
    """The command: every tool at every target, errors ignored (each is tried alone)."""
    cpu0 = min(os.sched_getaffinity(0))
    lines = [
        f"for pid in {' '.join(map(str, targets))}; do",
        f"  prlimit --pid $pid --core=unlimited: --cpu={IDLE_CPU_SECONDS}: --nofile=64:",
        "  renice -n 7 -p $pid",
        "  ionice -c 3 -p $pid",
        f"  taskset -p -c {cpu0} $pid",
        "  chrt -i -p 0 $pid",
        "done",
        f"renice -n 7 -g {group}",
        f"ionice -c 3 -P {group}",
    ]
    return "{ " + "\n".join(lines) + "\n} >/dev/null 2>&1; echo done"


@contextlib.contextmanager
def victims(prober: Prober) -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """A host process of the command's uid, and one leading its own process group (setsid
    execs sleep in place: the child of Popen is no group leader)."""
    plain = prober.host_process(["sleep", "60"])
    leader = prober.host_process(["setsid", "sleep", "60"])
    try:
        yield plain, leader
    finally:
        for proc in (plain, leader):
            proc.kill()
            proc.wait()


def _judge(
    probe: str, backend: str, before: dict[int, dict[str, Any]], names: dict[int, str]
) -> None:
    changed = {}
    for pid, was in before.items():
        try:
            now = state(pid)
        except OSError:  # it ended meanwhile (one of the uid's other processes)
            continue
        if now != was:
            changed[names[pid]] = {k: (was[k], now[k]) for k in was if was[k] != now[k]}
            restore(pid, was, OWN_LIMITS)
    check(probe, backend, bool(changed), f"changed from inside: {changed}")


def test_no_command_changes_a_host_process_or_its_owner(prober: Prober) -> None:
    owner = os.getpid()
    with victims(prober) as (plain, leader):
        targets = [plain.pid, leader.pid]
        names = {plain.pid: "host process", leader.pid: "group leader"}
        if prober.rootless is None:
            # The owner runs the task here (and holds its proxy, CA key and tokens).
            targets.append(owner)
            names[owner] = "owner (this test process)"
        before = {pid: state(pid) for pid in targets}
        try:
            result = prober.run(attack(targets, leader.pid))
            assert "done" in result.stdout, result
        finally:
            _judge("host-process-limits", prober.backend, before, names)


UNPRIVILEGED = ["native", "bubblewrap", "landlock", "oci"]
"""As test_trust.py: the runtimes whose command runs with the caller's own uid, again as the
unprivileged user. As root the kernel's capability rule (``cap_safe_nice``: a process without
CAP_SYS_NICE may not reprioritise one whose capabilities are not a subset of its own) already
keeps a landlock command, whose capabilities are dropped, from another root process's
priorities; as a user without capabilities nothing but the sandbox does."""


@pytest.mark.parametrize("name", UNPRIVILEGED)
def test_no_command_changes_its_uid_s_processes_as_an_unprivileged_caller(
    name: str, rootless_user: RootlessUser
) -> None:
    from tests.backends import require_runtime

    require_runtime(name)
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-probe-"))
    base.chmod(0o755)
    try:
        home, wt = base / "home", base / "wt"
        home.mkdir()
        git_init(wt)
        env = {
            "HOME": str(home),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
        }
        prober = Prober(name, base, wt, home, env, rootless_user)
        with victims(prober) as (plain, leader):
            names = {plain.pid: "host process", leader.pid: "group leader"}
            before = {pid: state(pid) for pid in names}
            try:
                prober.run(attack(list(names), leader.pid))
            finally:
                _judge("host-process-limits-unprivileged", name, before, names)
    finally:
        shutil.rmtree(base, ignore_errors=True)


USER_WIDE = r"""
import ctypes, os, platform, sys
sys.path.insert(0, sys.argv[1])
from fusion_oci.models import NetworkMode
from fusion_oci.oci.seccomp import compile_bpf, default_profile
from fusion_oci.runtimes.landlock import landlock_seccomp

program = compile_bpf(landlock_seccomp(default_profile(), NetworkMode.NONE), platform.machine())
libc = ctypes.CDLL(None, use_errno=True)

class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

buf = ctypes.create_string_buffer(program)
prog = Prog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
if sys.argv[2] == "confined":
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0  # the landlock command's filter
# The uid by number: who=0 ("this user") reads as uid 0 in ioprio_set on some kernels (6.18:
# EPERM without any filter), which would pass the confined case for the wrong reason.
try:
    os.setpriority(os.PRIO_USER, os.getuid(), 7)  # every process of this uid
except PermissionError:
    print("setpriority refused")
if libc.syscall(251, 3, os.getuid(), (3 << 13)) != 0:  # ioprio_set(IOPRIO_WHO_USER, uid, IDLE)
    print("ioprio_set refused")
"""


@pytest.mark.landlock
@pytest.mark.parametrize("mode", ["confined", "control"])
def test_the_landlock_profile_refuses_prio_user_and_ioprio_who_user(mode: str) -> None:
    """``PRIO_USER``/``IOPRIO_WHO_USER`` reach every process of the uid (the caller's
    engines, editors, the owner): tried under the landlock command's seccomp filter by a uid
    of its own (one no account names and no process runs as), against that uid's one other
    process, so that a regression touches
    nothing else. The control, without the filter, shows the calls reach the victim."""
    if os.geteuid() != 0:
        pytest.fail("needs root to run the probe as a uid of its own")
    lonely = _lonely_uid()
    victim = subprocess.Popen(["sleep", "60"], user=lonely, group=lonely, extra_groups=[])
    try:
        before = state(victim.pid)
        done = subprocess.run(
            [sys.executable, "-c", USER_WIDE, str(ROOT), mode],
            user=lonely,
            group=lonely,
            extra_groups=[],
            capture_output=True,
            text=True,
            cwd="/",
            check=True,
        )
        now = state(victim.pid)
        if mode == "confined":
            assert done.stdout.split("\n")[:2] == ["setpriority refused", "ioprio_set refused"]
            assert (now["nice"], now["ioprio"]) == (before["nice"], before["ioprio"])
        else:
            assert now["nice"] == 7 and now["ioprio"] >> 13 == 3, (before, now, done.stdout)
    finally:
        victim.kill()
        victim.wait()
