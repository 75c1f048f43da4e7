"""The far end of the exec agent over a byte stream (PROTOCOL.md, "Over a byte stream").

Run by path, standard library only, no fusion_oci import: it is copied into a pod and started
there as ``python3 -S -E -s mux.py --agent PATH [agent args]`` on the stdin/stdout of one exec.
It starts the agent as its child on a socketpair (``--fd N --parent PID``, as
``Agent.start_local`` does), makes each command's pipes itself and hands their ends to the agent
with the local protocol (``SCM_RIGHTS``), and relays: the pipes' output as ``D`` frames, the
host's ``D`` frames into the command's stdin, the agent's frames both ways. Both directions are
windowed (``A`` frames give credit back), so neither side buffers without bound.

One thread, one ``poll`` loop: a run's pipes are read only while the host has given credit
and the bytes waiting for the stream are under ``HIGH_WATER``. The frame layout is written
again here (fusion_oci/agent/protocol.py is the host's) because this file travels alone.
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import itertools
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

WINDOW = 1 << 20
"""Per run and direction: output bytes sent and not yet acknowledged by the host, stdin bytes
the host may send before this side has written them into the command's pipe."""
CHUNK = 1 << 16
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, named only from Python 3.10
HIGH_WATER = 4 << 20
"""Bytes waiting for the stream past which no pipe is read (the stream is backed up)."""
DRAIN_S = 2.0
"""After the agent's X: how long a pipe held open by something outside the tree is waited for
(fusion_oci.process.DRAIN_LIMIT_S)."""
TAIL = 1 << 20
"""After the agent's X the tree is gone; what is left in the pipes is read past the window, up
to this much, so a host that stopped consuming still gets its X."""
CLOSE_WAIT_S = 15.0
MAX_FRAME = 64 << 20
HEADER = struct.Struct(">I")
IN, OUT = select.POLLIN, select.POLLOUT


def frame(kind: bytes, body: bytes) -> bytes:
    return HEADER.pack(len(body) + 1) + kind + body


def undumpable() -> bool:
    """PR_SET_DUMPABLE 0, as the agent does: a command of the same uid cannot ptrace the mux
    nor open its stream through /proc/PID/fd (and so cannot forge another run's frames).
    False where this Python has no ctypes (a minimal image): said, not hidden."""
    try:
        import ctypes  # optional: not every python3 in an image has it

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(4, 0, 0, 0, 0) == 0)  # PR_SET_DUMPABLE
    except (ImportError, OSError, AttributeError):
        return False


def split(buf: bytearray) -> list[tuple[bytes, bytes]] | None:
    """The whole frames at the front of ``buf`` as (type, body), taken off it; None for a
    length no peer of ours sends (the stream cannot be trusted any more)."""
    frames: list[tuple[bytes, bytes]] = []
    at = 0
    while len(buf) - at >= 4:
        (size,) = HEADER.unpack_from(buf, at)
        if size == 0 or size > MAX_FRAME:
            return None
        if len(buf) - at < 4 + size:
            break
        frames.append((bytes(buf[at + 4 : at + 5]), bytes(buf[at + 5 : at + 4 + size])))
        at += 4 + size
    del buf[:at]
    return frames


def first_field(body: bytes, key: bytes) -> bytes:
    """The value of ``key`` in a fields body (``key=value`` NUL ...), or b""."""
    for item in body.split(b"\0"):
        name, _, value = item.partition(b"=")
        if name == key:
            return value
    return b""


class Run:
    """One command: its output pipes (fd -> stream byte), its stdin pipe and what waits for it,
    the host's credit, and the agent's X held until the output is all sent."""

    def __init__(self, run_id: bytes) -> None:
        self.id = run_id
        self.outs: dict[int, bytes] = {}
        self.stdin = -1
        self.stdin_buf: collections.deque[bytes] = collections.deque()
        self.stdin_eof = False
        self.credit = WINDOW
        self.exit_frame = b""
        self.deadline = 0.0
        self.tail = TAIL


class Mux:
    def __init__(self, agent_argv: list[str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            # The agent's own options (--egress, --service) come before --fd (PROTOCOL.md).
            [*agent_argv, "--fd", str(theirs.fileno()), "--parent", str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
        )
        theirs.close()
        self.agent = ours
        self.null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.poll = select.poll()
        self.masks: dict[int, int] = {}
        self.runs: dict[bytes, Run] = {}
        self.pipe_runs: dict[int, Run] = {}
        self.stdin_runs: dict[int, Run] = {}
        self.out: collections.deque[bytes] = collections.deque()
        self.out_size = 0
        self.host_buf = bytearray()
        self.agent_buf = bytearray()
        self.host_open = True
        os.set_blocking(0, False)
        os.set_blocking(1, False)
        for fd in (0, 1):  # a pipe (kubectl, a container's exec): fewer, larger writes
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, F_SETPIPE_SZ, WINDOW)

    # --- the poll set ----------------------------------------------------------------------

    def want(self, fd: int, events: int) -> None:
        # A fd registered for nothing would still report POLLHUP and spin: unregister it.
        old = self.masks.get(fd, 0)
        if events == old:
            return
        if not events:
            self.poll.unregister(fd)
            del self.masks[fd]
        elif old:
            self.poll.modify(fd, events)
            self.masks[fd] = events
        else:
            self.poll.register(fd, events)
            self.masks[fd] = events

    def refresh(self) -> None:
        room = self.out_size < HIGH_WATER
        for fd, run in self.pipe_runs.items():
            budget = run.tail if run.exit_frame else run.credit
            self.want(fd, IN if room and budget > 0 else 0)
        for fd, run in self.stdin_runs.items():
            self.want(fd, OUT if run.stdin_buf else 0)
        self.want(1, OUT if self.out else 0)
        self.want(0, IN if self.host_open else 0)
        self.want(self.agent.fileno(), IN)

    # --- to the host -----------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        self.out.append(data)
        self.out_size += len(data)

    def flush(self) -> bool:
        """Write what the stream takes now; False when the host is gone."""
        try:
            while self.out:
                batch = list(itertools.islice(self.out, 64))
                sent = os.writev(1, batch)
                self.out_size -= sent
                while sent:
                    head = self.out[0]
                    if sent >= len(head):
                        self.out.popleft()
                        sent -= len(head)
                    else:
                        self.out[0] = head[sent:]
                        sent = 0
        except BlockingIOError:
            pass
        except OSError:
            return False
        return True

    # --- from the host ---------------------------------------------------------------------

    def from_host(self) -> bool:
        try:
            data = os.read(0, 1 << 18)
        except BlockingIOError:
            return True
        if not data:
            return False
        self.host_buf += data
        frames = split(self.host_buf)
        if frames is None:
            return False  # not our host: end everything, as a closed stream does
        for kind, body in frames:
            self.host_frame(kind, body)
        return True

    def host_frame(self, kind: bytes, body: bytes) -> None:
        if kind in (b"S", b"P"):
            self.spawn(body, piped=kind == b"P")
        elif kind == b"K":
            self.agent.sendall(frame(kind, body))
        elif kind == b"A":
            run = self.runs.get(first_field(body, b"id"))
            if run is not None:
                run.credit += int(first_field(body, b"bytes") or b"0")
        elif kind == b"D":
            run_id, _, rest = body.partition(b"\0")
            run = self.runs.get(run_id)
            data = rest[1:]
            if run is None or run.stdin < 0:
                if run is not None and data:
                    self.ack_stdin(run, len(data), closed=True)
            elif data:
                run.stdin_buf.append(data)
            else:
                run.stdin_eof = True
                if not run.stdin_buf:
                    self.close_stdin(run)

    def spawn(self, body: bytes, piped: bool) -> None:
        run = Run(first_field(body, b"id"))
        # Only our ends are non-blocking: the command's ends are as a shell would give them.
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(out_r, False)
        os.set_blocking(err_r, False)
        if piped:
            in_r, run.stdin = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(run.stdin, False)
        else:
            in_r = self.null
        try:
            # The fds ride on the frame's first bytes, as client.py sends them (PROTOCOL.md).
            data = memoryview(frame(b"S", body))
            fds = array.array("i", [in_r, out_w, err_w])
            sent = self.agent.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            self.agent.sendall(data[sent:])
        finally:
            for fd in (in_r, out_w, err_w):
                if fd != self.null:
                    os.close(fd)
        self.runs[run.id] = run
        run.outs = {out_r: b"1", err_r: b"2"}
        self.pipe_runs[out_r] = run
        self.pipe_runs[err_r] = run
        if run.stdin >= 0:
            self.stdin_runs[run.stdin] = run

    def ack_stdin(self, run: Run, n: int, closed: bool = False) -> None:
        body = b"id=" + run.id + b"\0bytes=" + str(n).encode() + b"\0"
        self.send(frame(b"A", body + (b"closed=1\0" if closed else b"")))

    def to_stdin(self, run: Run) -> None:
        written = 0
        try:
            while run.stdin_buf:
                head = run.stdin_buf[0]
                n = os.write(run.stdin, head)
                written += n
                if n < len(head):
                    run.stdin_buf[0] = head[n:]
                    break
                run.stdin_buf.popleft()
        except BlockingIOError:
            pass
        except OSError:  # the command closed its stdin: nothing more goes in
            left = sum(len(b) for b in run.stdin_buf)
            run.stdin_buf.clear()
            self.close_stdin(run)
            self.ack_stdin(run, written + left, closed=True)
            return
        if written:
            self.ack_stdin(run, written)
        if run.stdin_eof and not run.stdin_buf:
            self.close_stdin(run)

    def close_stdin(self, run: Run) -> None:
        if run.stdin >= 0:
            self.want(run.stdin, 0)
            self.stdin_runs.pop(run.stdin, None)
            os.close(run.stdin)
            run.stdin = -1

    # --- from the agent and the pipes ------------------------------------------------------

    def from_agent(self) -> bool:
        try:
            data = self.agent.recv(1 << 16)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        self.agent_buf += data
        frames = split(self.agent_buf)
        if frames is None:
            return False
        for kind, body in frames:
            self.agent_frame(kind, body)
        return True

    def agent_frame(self, kind: bytes, body: bytes) -> None:
        raw = frame(kind, body)
        if kind == b"H":
            self.send(frame(b"H", body + b"window=" + str(WINDOW).encode() + b"\0"))
            return
        run = self.runs.get(first_field(body, b"id"))
        if kind == b"X" and run is not None:
            # Output first: X goes out after the run's last data frame.
            run.exit_frame = raw
            run.deadline = time.monotonic() + DRAIN_S
            self.finish(run)
            return
        if kind == b"F" and run is not None:
            self.drop(run)
        self.send(raw)

    def read_pipe(self, fd: int) -> None:
        run = self.pipe_runs[fd]
        budget = run.tail if run.exit_frame else run.credit
        try:
            data = os.read(fd, min(CHUNK, budget))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close_pipe(run, fd)
            self.finish(run)
            return
        if run.exit_frame:
            run.tail -= len(data)
        run.credit -= len(data)
        # Header and bytes apart (writev joins them): the chunk is never copied here.
        head = b"D" + run.id + b"\0" + run.outs[fd]
        self.send(HEADER.pack(len(head) + len(data)) + head)
        self.send(data)

    def close_pipe(self, run: Run, fd: int) -> None:
        self.want(fd, 0)
        self.pipe_runs.pop(fd, None)
        if run.outs.pop(fd, None) is not None:
            os.close(fd)

    def finish(self, run: Run, force: bool = False) -> None:
        if run.exit_frame and (force or not run.outs):
            self.send(run.exit_frame)
            self.drop(run)

    def drop(self, run: Run) -> None:
        for fd in list(run.outs):
            self.close_pipe(run, fd)
        self.close_stdin(run)
        self.runs.pop(run.id, None)

    def overdue(self) -> float | None:
        """Send the X of runs whose pipes outlived the drain; the next deadline's wait (ms)."""
        now = time.monotonic()
        nearest: float | None = None
        for run in list(self.runs.values()):
            if not run.exit_frame:
                continue
            if run.deadline <= now:
                self.finish(run, force=True)
            else:
                wait = (run.deadline - now) * 1000
                nearest = wait if nearest is None else min(nearest, wait)
        return nearest

    # --- the loop --------------------------------------------------------------------------

    def serve(self) -> int:
        agent_fd = self.agent.fileno()
        while True:
            self.refresh()
            timeout = self.overdue()
            for fd, _events in self.poll.poll(timeout):
                if fd == 0:
                    if not self.from_host():
                        return self.shutdown()
                elif fd == 1:
                    if not self.flush():
                        return self.shutdown()
                elif fd == agent_fd:
                    if not self.from_agent():
                        return self.agent_gone()
                elif fd in self.pipe_runs:
                    self.read_pipe(fd)
                elif fd in self.stdin_runs:
                    self.to_stdin(self.stdin_runs[fd])  # POLLERR too: the write's EPIPE closes it
            if self.out and not self.flush():
                return self.shutdown()

    def shutdown(self) -> int:
        """The host is gone: close the agent's socket (it ends every tree and exits)."""
        self.agent.close()
        try:
            self.proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return 0

    def agent_gone(self) -> int:
        """The agent died: say what is left, then close the stream (the host sees it lost)."""
        os.set_blocking(1, True)
        try:
            while self.out:
                os.write(1, self.out.popleft())
        except OSError:
            pass
        self.agent.close()
        self.proc.wait()
        return 1


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--agent":
        sys.stderr.write("usage: mux.py --agent PATH [agent args]\n")
        return 2
    if not undumpable():
        sys.stderr.write("mux.py: cannot set PR_SET_DUMPABLE 0 (no ctypes); going on\n")
    return Mux(argv[1:]).serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
