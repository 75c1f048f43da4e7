"""The process that holds a task's secrets never leaves them in a core file (issue #31).

An attack from a landlock command raised the owner's ``RLIMIT_CORE`` (prlimit, same uid),
killed it with SIGXCPU and read the ~70 MB core it dumped into the worktree: the brokered
token, the caller's environment, the per-task CA key. ``fusion_oci.host.hardening.harden_owner``
(applied by ``fusion-oci run``, ``serve`` and a Sandbox that starts a proxy or a broker) makes
the owner non-dumpable with a hard core limit of 0. Each owner here is a fresh interpreter, so
the test process itself is left as it was; the kernel's own word (``WCOREDUMP`` of the wait
status) says whether a core was written, wherever ``core_pattern`` sends it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534

OWNER = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "harden":
    from fusion_oci.host.hardening import harden_owner
    harden_owner()
print("ready", flush=True)
time.sleep(60)
"""

REPORT = r"""
import ctypes, resource, sys
sys.path.insert(0, sys.argv[1])
from fusion_oci.host.hardening import dumpable, harden_owner
harden_owner()
harden_owner()  # idempotent
print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0), *resource.getrlimit(resource.RLIMIT_CORE))
print(int(dumpable()))
"""


@pytest.fixture
def cwd() -> Iterator[Path]:
    """A folder any uid can write a core into (pytest's tmp_path is root's alone)."""
    where = Path(tempfile.mkdtemp(prefix="fusion-oci-core-"))
    where.chmod(0o777)
    try:
        yield where
    finally:
        import shutil

        shutil.rmtree(where, ignore_errors=True)


def _owner(cwd: Path, mode: str, user: int | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(ROOT), mode],
        cwd=cwd,
        stdout=subprocess.PIPE,
        text=True,
        user=user,
        group=user,
        extra_groups=[] if user is not None else None,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def _xcpu(proc: subprocess.Popen[str]) -> int:
    """End ``proc`` as the attack did (SIGXCPU, whose default action dumps core); its raw wait
    status."""
    os.kill(proc.pid, signal.SIGXCPU)
    _, status = os.waitpid(proc.pid, 0)
    proc.returncode = -signal.SIGXCPU  # reaped here: keep Popen from waiting again
    assert proc.stdout is not None
    proc.stdout.close()
    return status


def test_hardening_makes_the_process_non_dumpable_with_a_hard_core_limit_of_0() -> None:
    out = subprocess.run(
        [sys.executable, "-c", REPORT, str(ROOT)], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0].split() == ["0", "0", "0"], out  # PR_GET_DUMPABLE, soft, hard
    assert out[1] == "0"


def test_no_core_of_the_owner_even_with_its_core_limit_raised_from_outside(cwd: Path) -> None:
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    if resource.getrlimit(resource.RLIMIT_CORE)[1] != 0:
        # The control: an owner as before the fix, whose limit a process of its uid raised
        # (what the attack's prlimit did), dumps core when SIGXCPU ends it. Not possible once
        # a Sandbox with a proxy hardened this test process earlier in the session (its hard
        # limit 0 is every child's): the hardened case below holds either way.
        control = _owner(cwd, "plain")
        with _ended(control):
            resource.prlimit(control.pid, resource.RLIMIT_CORE, unlimited)
            status = _xcpu(control)
        assert os.WCOREDUMP(status), "the control dumped no core: the test could not see one"
        for core in cwd.iterdir():
            core.unlink()
    # A hardened owner. With CAP_SYS_RESOURCE the test raises its hard limit and the
    # non-dumpable flag alone holds; without it (a container's root) the hard 0 refuses first.
    owner = _owner(cwd, "harden")
    with _ended(owner):
        with contextlib.suppress(PermissionError):
            resource.prlimit(owner.pid, resource.RLIMIT_CORE, unlimited)
        status = _xcpu(owner)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU
    assert not os.WCOREDUMP(status)
    time.sleep(0.2)  # a piped core_pattern's helper writes after the wait
    assert list(cwd.iterdir()) == []


@contextlib.contextmanager
def _ended(proc: subprocess.Popen[str]) -> Iterator[None]:
    """``proc`` killed and reaped if the block did not end it."""
    try:
        yield
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.communicate()


def test_an_unprivileged_process_of_the_owner_s_uid_cannot_raise_its_core_limit(
    cwd: Path,
) -> None:
    """The attack's first step as the sandboxed command's uid would take it (no capability)."""
    user = NOBODY if os.geteuid() == 0 else None
    owner = _owner(cwd, "harden", user)
    try:
        attack = (
            "import resource, sys\n"
            "inf = resource.RLIM_INFINITY\n"
            "try:\n"
            "    resource.prlimit(int(sys.argv[1]), resource.RLIMIT_CORE, (inf, inf))\n"
            "except PermissionError:\n"
            "    print('refused')\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", attack, str(owner.pid)],
            capture_output=True,
            text=True,
            user=user,
            group=user,
            extra_groups=[] if user is not None else None,
            cwd=cwd,
            check=True,
        )
        assert done.stdout == "refused\n", done
        limits = Path(f"/proc/{owner.pid}/limits").read_text()
        core = next(line for line in limits.splitlines() if line.startswith("Max core"))
        assert core.split()[4:6] == ["0", "0"], core
        # Non-dumpable: its /proc entries are root's, so its uid cannot read its memory.
        assert os.stat(f"/proc/{owner.pid}/environ").st_uid == 0
    finally:
        owner.kill()
        owner.communicate()


def _core_limit(pid: int) -> list[str]:
    limits = Path(f"/proc/{pid}/limits").read_text()
    return next(line for line in limits.splitlines() if line.startswith("Max core")).split()[4:6]


def test_cli_run_and_serve_harden_themselves(tmp_path: Path) -> None:
    """The entry points that hold a task's secrets: the in-process ``run`` (its command
    inherits the hard limit, which shows it) and ``serve`` (the protocol and resident
    server), before they serve anything."""
    worktree = tmp_path / "wt"
    worktree.mkdir()
    subprocess.run(["git", "init", "-q", str(worktree)], check=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    cli = [sys.executable, "-m", "fusion_oci.cli.main"]
    run = subprocess.run(
        [*cli, "run", "--backend", "native", "--", "sh", "-c", "ulimit -Hc"],
        cwd=worktree,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (run.returncode, run.stdout) == (0, "0\n"), run.stderr
    serve = subprocess.Popen(
        [*cli, "serve"], env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 30
        while _core_limit(serve.pid) != ["0", "0"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _core_limit(serve.pid) == ["0", "0"]
    finally:
        serve.kill()
        serve.communicate()


SANDBOX = r"""
import sys
sys.path.insert(0, sys.argv[1])
from fusion_oci.host.hardening import dumpable
from fusion_oci.models import PrepareContext, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox
print(int(dumpable()), flush=True)
policy = SandboxPolicy(network=sys.argv[3])
with SyncSandbox(SandboxSettings(backend="native", policy=policy)) as sb:
    sb.prepare(PrepareContext(task_id="t", run_id="r", policy=policy, worktree_path=sys.argv[2]))
    print(int(dumpable()), flush=True)
"""


@pytest.mark.parametrize(("network", "after"), [("none", "1"), ("filtered", "0")])
def test_a_sandbox_hardens_its_caller_when_it_starts_a_proxy(
    tmp_path: Path, network: str, after: str
) -> None:
    """The Python API changes its caller's process only where the task's proxy (and any
    brokered token, and the task's CA key) will live in it."""
    worktree = tmp_path / "wt"
    worktree.mkdir()
    subprocess.run(["git", "init", "-q", str(worktree)], check=True)
    done = subprocess.run(
        [sys.executable, "-c", SANDBOX, str(ROOT), str(worktree), network],
        env={**os.environ, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split() == ["1", after], done.stderr[-2000:]
