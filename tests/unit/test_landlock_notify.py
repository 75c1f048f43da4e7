"""The landlock supervisor's notification fd asks for synchronous wake-ups: every open of a
confined command waits for the supervisor's answer, and without the flag each of those round
trips wakes the supervisor's thread on another CPU (issue #23: ~80 µs per open on a 2-core
VM, 20 µs with it; benchmarks/workload_suspects.py landlock)."""

from __future__ import annotations

import _thread
import ctypes
import os
import platform
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fusion_oci.shims import confine, seccomp_notify
from fusion_oci.shims.seccomp_notify import sync_wake_up
from fusion_oci.shims.supervisor import Supervisor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="seccomp is Linux's")


def _kernel_at_least(major: int, minor: int) -> bool:
    parts = platform.release().split(".")
    return (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)) >= (
        major,
        minor,
    )


def test_sync_wake_up_is_refused_quietly_by_what_is_not_a_listener() -> None:
    r, w = os.pipe()
    try:
        assert sync_wake_up(r) is False  # an older kernel answers a listener the same way
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.skipif(
    platform.machine() not in seccomp_notify.OPEN_CALLS or not _kernel_at_least(6, 6),
    reason="SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP is Linux 6.6's",
)
def test_a_listener_takes_sync_wake_up_and_its_opens_are_still_answered() -> None:
    mine, theirs = seccomp_notify.socketpair()
    pid = os.fork()
    if pid == 0:  # the confined side: only syscalls, then _exit
        code = 1
        try:
            mine.close()
            confine.no_new_privs()
            confine.install_chmod_listener(platform.machine(), theirs)
            for _ in range(50):
                os.close(os.open("/dev/null", os.O_RDONLY))
            code = 0
        finally:
            os._exit(code)
    os.close(theirs)
    try:
        listener = _listener_from(mine)
        assert sync_wake_up(listener) is True
        supervisor = Supervisor({"arch": platform.machine()}, listener)
        _thread.start_new_thread(supervisor.serve, ())
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # every open went on (CONTINUE)
    finally:
        mine.close()


def _listener_from(mine: socket.socket) -> int:
    """The seccomp listener the confined child sent over ``mine`` (SCM_RIGHTS)."""
    _msg, ancdata, _flags, _addr = mine.recvmsg(1, socket.CMSG_LEN(4))
    return int(struct.unpack("i", ancdata[0][2][:4])[0])


def _supervised(tmp_path: Path, child: Callable[[], int]) -> int | None:
    """Run ``child()`` in a forked process whose chmods, opens, connects and listens go to a
    :class:`Supervisor` in this process (unix sockets beneath ``tmp_path`` allowed): its exit
    code, or None when it did not end within 10 s (then it is killed)."""
    mine, theirs = seccomp_notify.socketpair()
    pid = os.fork()
    if pid == 0:  # the confined side: no pytest, _exit whatever happens
        code = 1
        try:
            mine.close()
            confine.no_new_privs()
            confine.install_chmod_listener(platform.machine(), theirs, connect=True)
            code = child()
        finally:
            os._exit(code)
    os.close(theirs)
    try:
        listener = _listener_from(mine)
        cfg = {"arch": platform.machine(), "writable": [str(tmp_path)], "connect_port": 0}
        _thread.start_new_thread(Supervisor(cfg, listener).serve, ())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    finally:
        mine.close()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _needs(ok: bool, why: str) -> None:
    """What these landlock tests need of the kernel: a skip here, a failure where the suite
    requires every backend (FUSION_OCI_REQUIRE_BACKENDS=all: CI)."""
    from tests.backends import require

    require("landlock", ok, why)


def _supervised_here() -> None:
    _needs(platform.machine() in seccomp_notify.OPEN_CALLS, "no notify filter here")


def test_a_blocked_unix_connect_stalls_no_open_or_chmod(tmp_path: Path) -> None:
    """The thread that receives a connect answers it, but hands the receiving on first: a
    connect to a unix listener whose backlog is full blocks (here until the child exits),
    and the opens and the chmod of the caller's other thread are answered meanwhile."""
    _supervised_here()
    path, target = str(tmp_path / "full.sock"), tmp_path / "mode"
    target.write_text("")

    def child() -> int:
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        server.listen(0)
        socket.socket(socket.AF_UNIX).connect(path)  # the one the backlog holds
        blocked = socket.socket(socket.AF_UNIX)
        _thread.start_new_thread(blocked.connect, (path,))
        time.sleep(0.2)  # that connect waits in the supervisor now
        for _ in range(20):
            os.close(os.open("/dev/null", os.O_RDONLY))
        os.chmod(target, 0o600)
        return 0

    assert _supervised(tmp_path, child) == 0
    assert target.stat().st_mode & 0o777 == 0o600


def test_connects_answered_one_after_another_leave_no_threads_behind(tmp_path: Path) -> None:
    """Each connect's thread becomes the spare that receives next (or ends): a long run of
    connections starts no thread each, and once the child is gone (the listener hangs up)
    every supervisor thread ends instead of spinning on an empty receive."""
    _supervised_here()
    path = str(tmp_path / "echo.sock")
    before = _threads()

    def child() -> int:
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        server.listen(64)
        for _ in range(50):
            client = socket.socket(socket.AF_UNIX)
            client.connect(path)
            server.accept()[0].close()
            client.close()
        return 0

    assert _supervised(tmp_path, child) == 0
    deadline = time.monotonic() + 5
    while _threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads() == before


def test_a_thread_with_its_own_descriptor_table_connects_its_own_socket(tmp_path: Path) -> None:
    """A thread that unshared its descriptor table: the number it connects names its socket,
    not the one its process's first thread has at that number."""
    _supervised_here()
    _needs(_kernel_at_least(6, 9), "PIDFD_THREAD is Linux 6.9's")
    path = str(tmp_path / "own.sock")

    def child() -> int:
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        server.listen(4)
        leaders = socket.socket(socket.AF_UNIX)
        number = leaders.fileno()
        result: list[int] = []
        done = _thread.allocate_lock()
        done.acquire()

        def thread() -> None:
            try:
                if ctypes.CDLL(None, use_errno=True).unshare(0x400) != 0:  # CLONE_FILES
                    result.append(2)
                    return
                os.close(number)
                own = socket.socket(socket.AF_UNIX)
                assert own.fileno() == number
                own.connect(path)
                result.append(0 if own.getpeername() == path else 3)
            except Exception:
                result.append(4)
            finally:
                done.release()

        _thread.start_new_thread(thread, ())
        done.acquire()
        try:
            leaders.getpeername()
        except OSError:
            return result[0]
        return 5  # the first thread's socket was connected instead

    assert _supervised(tmp_path, child) == 0
