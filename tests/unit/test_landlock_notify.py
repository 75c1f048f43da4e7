"""The landlock supervisor's notification fd asks for synchronous wake-ups: every open of a
confined command waits for the supervisor's answer, and without the flag each of those round
trips wakes the supervisor's thread on another CPU (issue #23: ~80 µs per open on a 2-core
VM, 20 µs with it; benchmarks/workload_suspects.py landlock)."""

from __future__ import annotations

import _thread
import os
import platform
import socket
import struct
import sys

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
        _msg, ancdata, _flags, _addr = mine.recvmsg(1, socket.CMSG_LEN(4))
        listener = struct.unpack("i", ancdata[0][2][:4])[0]
        assert sync_wake_up(listener) is True
        supervisor = Supervisor({"arch": platform.machine()}, listener)
        _thread.start_new_thread(supervisor.serve, ())
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # every open went on (CONTINUE)
    finally:
        mine.close()
