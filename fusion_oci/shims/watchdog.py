"""Run a helper service for exactly as long as its owner lives:
``python -S -E watchdog.py OWNER_PID OWNER_START FOLDER -- ARGV...``.

fusion-oci starts engine services of its own (``podman system service`` when no socket
answers). Such a service must end when the process that needed it ends, ``kill -9`` included,
and its socket folder must go with it; a ``__del__`` or an ``atexit`` does neither after a
SIGKILL. This shim starts ARGV in its own session, watches the owner through a pidfd (no
polling of pids that could be reused, and independent of which thread of the owner started
it), and when the owner is gone, when it gets SIGTERM/SIGINT/SIGHUP, or when the service exits,
it ends the service's whole group (SIGTERM, then SIGKILL after a grace period), removes
FOLDER and exits. Standard library only, started with ``-S -E``.
"""

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time

GRACE_S = 5.0


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[-1].split()
    except OSError:
        return None
    return fields[19].decode() if len(fields) > 19 else None


def _stop(child: "subprocess.Popen[bytes]") -> None:
    if child.poll() is not None:
        return
    try:
        os.killpg(child.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + GRACE_S
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if child.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def main(argv: list[str]) -> int:
    if len(argv) < 6 or argv[4] != "--":
        sys.stderr.write("usage: watchdog.py OWNER_PID OWNER_START FOLDER -- ARGV...\n")
        return 2
    owner, start, folder, cmd = int(argv[1]), argv[2], argv[3], argv[5:]
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    try:
        pidfd = os.pidfd_open(owner)
    except OSError:
        pidfd = None
    if pidfd is None or _start_time(owner) != start:
        shutil.rmtree(folder, ignore_errors=True)
        return 1  # the owner is already gone: start nothing
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    try:
        while not stopping and child.poll() is None:
            if poller.poll(250):
                break  # the owner exited
    finally:
        _stop(child)
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
