"""The far end of the exec agent over a byte stream (PROTOCOL.md, "Over a byte stream").

Run by path, standard library only, no fusion_oci import: it is copied into a pod and started
there as ``python3 -S -E -s mux.py --agent PATH [agent args]`` on the stdin/stdout of one exec.
It starts the agent as its child on a socketpair (``--fd N --parent PID``, as
``Agent.start_local`` does), makes each command's pipes itself and hands their ends to the agent
with the local protocol (``SCM_RIGHTS``), and relays: the pipes' output as ``D`` frames, the
host's ``D`` frames into the command's stdin, the agent's frames both ways. Both directions are
windowed (``A`` frames give credit back), so neither side buffers without bound.

With ``--egress-listen PORT`` (``network: filtered`` in a pod) it also listens on
127.0.0.1:PORT before the agent says hello and carries each accepted connection over the same
stream to the host, which dials the task's egress proxy there (``O``/``B``/``W``/``C`` frames,
windowed per connection like the runs).

With ``--service-listen ADDR:PORT`` (repeatable; ``policy.hostServices``, TCP grants) it also
listens on that address of the pod's own loopback (an IPv6 one only where the pod has ``::1``)
and carries each connection the same way; its ``O`` names the listener by its place among
these options (``listener=N``), never an address: the host dials the grant it put there.
``--service-listen unix:/PATH`` (a unix grant) listens on a unix socket at PATH in the pod,
making its folder when missing (the pod gives it a writable one: runtimes/kubernetes/pod.py).

With ``--publish-port PORT`` (repeatable; ``policy.publishPorts``) the host may ask for a
connection to the pod's own 127.0.0.1:PORT (``N`` with ``ref=R port=PORT``: a client of the
host's published port): only a port of these options, connected from here, then carried as
any connection (its ``O`` says ``inbound=R``; a refused connect: ``O`` with ``error=ERRNO``
and nothing more).

One thread, one ``poll`` loop: a run's pipes are read only while the host has given credit
and the bytes waiting for the stream are under ``HIGH_WATER``. The frame layout is written
again here (fusion_oci/agent/protocol.py is the host's) because this file travels alone.
"""

from __future__ import annotations

import array
import collections
import contextlib
import errno
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
(fusion_oci.host.process.DRAIN_LIMIT_S)."""
TAIL = 1 << 20
"""After the agent's X the tree is gone; what is left in the pipes is read past the window, up
to this much, so a host that stopped consuming still gets its X."""
CLOSE_WAIT_S = 15.0
EGRESS_WINDOW = 256 << 10
"""Per egress connection and direction: bytes sent and not yet written by the other side.
Smaller than a run's: up to MAX_CONNS of them may be open."""
MAX_CONNS = 512
"""Connections carried at once (egress and services); more wait in the listeners' backlogs."""
BACKLOG = 128
MAX_FRAME = 64 << 20
HEADER = struct.Struct(">I")
IN, OUT = select.POLLIN, select.POLLOUT
READABLE = IN | select.POLLHUP | select.POLLERR


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


class Conn:
    """One egress connection of the pod: the command's socket, what the host sent for it and
    the credit each side has left."""

    def __init__(self, conn_id: int, sock: socket.socket) -> None:
        self.id = conn_id
        self.tag = str(conn_id).encode() + b"\0"
        self.sock = sock
        self.credit = EGRESS_WINDOW
        """Bytes of the command's this side may still send before the host's W."""
        self.inbound: collections.deque[bytes] = collections.deque()
        self.inbound_size = 0
        self.read_done = False
        """The command's side ended its writing (its EOF went to the host as an empty B)."""
        self.write_done = False
        """The host's side ended (its empty B came): shut our writing once inbound is out."""
        self.shut = False


UNIX_PORT = -1
"""The port :func:`listen_address` gives a unix socket's path (``unix:/PATH``)."""


def listen_address(text: str) -> tuple[str, int] | None:
    """``127.0.0.1:5432`` or ``[::1]:6379`` as (address, port), ``unix:/PATH`` as (PATH,
    :data:`UNIX_PORT`); None for anything else."""
    if text.startswith("unix:"):
        where = text[len("unix:") :]
        ok = where.startswith("/") and "\0" not in where and len(where.encode()) < 108
        return (where, UNIX_PORT) if ok and "/../" not in where + "/" else None
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.inet_pton(family, host)
    except OSError:
        return None
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def listen(host: str, port: int) -> socket.socket | None:
    """A listening socket on ``host:port``; None for an IPv6 address where the pod has none
    (IPv6 off): that grant is not there, said on stderr. Anything else raises (exit 125).
    A unix socket (port :data:`UNIX_PORT`) at the path ``host``, its folder made if missing;
    a file already there is an error, never replaced."""
    if port == UNIX_PORT:
        return listen_unix(host)
    v6 = ":" in host
    sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        if v6:  # ::1 only, never the v4 side of the port
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        # No SO_REUSEADDR/SO_REUSEPORT: no command can share the port.
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if v6 and exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            sys.stderr.write(f"mux.py: no [{host}]:{port} here (no IPv6 loopback): {exc}\n")
            return None
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.setblocking(False)
    return sock


def listen_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        folder = os.path.dirname(path)  # noqa: PTH120 - no pathlib: start-up
        os.makedirs(folder, mode=0o755, exist_ok=True)  # noqa: PTH103
        sock.bind(path)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on unix:{path}: {exc.strerror}") from exc
    return sock


class Mux:
    def __init__(
        self,
        agent_argv: list[str],
        egress_port: int | None = None,
        services: list[tuple[str, int]] | None = None,
        published: list[int] | None = None,
    ) -> None:
        self.listeners: dict[int, tuple[socket.socket, bytes]] = {}
        self.published = frozenset(published or ())
        """The ports of the pod's loopback the host may connect to (``N``)."""
        self.connecting: dict[int, tuple[socket.socket, bytes]] = {}
        """fd -> (a connect to a published port still in progress, the host's ref)."""
        """fd -> (the listening socket, what its O frames add: ``listener=N`` for a service)."""
        self.services = len(services or ())
        # Before the agent starts, so before hello and any command: none can take a port first.
        try:
            if egress_port is not None:
                self.add_listener("127.0.0.1", egress_port, b"")
            for index, (host, port) in enumerate(services or ()):
                self.add_listener(host, port, b"listener=%d\0" % index)
        except OSError:
            for sock, _extra in self.listeners.values():
                sock.close()
            raise
        self.conns: dict[int, Conn] = {}
        self.conn_fds: dict[int, Conn] = {}
        self.next_conn = 1
        self.greeted = False
        """The hello went out: only then are connections accepted (the host learns from it
        that O frames may come)."""
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

    def add_listener(self, host: str, port: int, extra: bytes) -> None:
        sock = listen(host, port)
        if sock is not None:
            self.listeners[sock.fileno()] = (sock, extra)

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
        for fd, conn in self.conn_fds.items():
            read = room and conn.credit > 0 and not conn.read_done
            self.want(fd, (IN if read else 0) | (OUT if conn.inbound else 0))
        accepting = self.greeted and len(self.conns) < MAX_CONNS
        for fd in self.listeners:
            self.want(fd, IN if accepting else 0)
        for fd in self.connecting:
            self.want(fd, OUT)
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
        # A frame no host of ours sends: the stream is not trusted (end everything).
        return all(self.host_frame(kind, body) for kind, body in frames)

    def host_frame(self, kind: bytes, body: bytes) -> bool:
        if kind in (b"B", b"W", b"C"):
            return self.egress_frame(kind, body)
        if kind == b"N":
            return self.inbound(body)
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
        return True

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
            body += b"window=" + str(WINDOW).encode() + b"\0"
            if self.listeners or self.services or self.published:
                # the host is ready for O before it runs anything
                body += b"egress_window=" + str(EGRESS_WINDOW).encode() + b"\0"
            if self.services:  # how many it was asked for (one without ::1 is not listening)
                body += b"services=%d\0" % self.services
            if self.published:
                body += b"publish=%d\0" % len(self.published)
            self.send(frame(b"H", body))
            self.greeted = True
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

    # --- connections (--egress-listen, --service-listen) ----------------------------------

    def accept(self, fd: int) -> None:
        listener, extra = self.listeners[fd]
        while len(self.conns) < MAX_CONNS:
            try:
                sock, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ECONNABORTED, EMFILE: the next one may do
                return
            sock.setblocking(False)
            conn = Conn(self.next_conn, sock)
            self.next_conn += 1
            self.conns[conn.id] = conn
            self.conn_fds[sock.fileno()] = conn
            self.send(frame(b"O", b"id=" + str(conn.id).encode() + b"\0" + extra))

    def inbound(self, body: bytes) -> bool:
        """The host's ``N``: connect to a published port of the pod's loopback for a client of
        the host's. A ref that is not a number is not our host's (False); a port not
        published, or too many connections, is an ``O`` with its error."""
        ref, port = first_field(body, b"ref"), first_field(body, b"port")
        if not ref.isdigit() or not port.isdigit():
            return False
        if int(port) not in self.published:
            self.inbound_refused(ref, errno.EPERM)
            return True
        if len(self.conns) + len(self.connecting) >= MAX_CONNS:
            self.inbound_refused(ref, errno.EMFILE)
            return True
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        err = sock.connect_ex(("127.0.0.1", int(port)))
        if err == errno.EINPROGRESS:
            self.connecting[sock.fileno()] = (sock, ref)
        else:
            self.inbound_done(sock, ref, err)
        return True

    def connected(self, fd: int) -> None:
        sock, ref = self.connecting.pop(fd)
        self.want(fd, 0)
        self.inbound_done(sock, ref, sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))

    def inbound_done(self, sock: socket.socket, ref: bytes, err: int) -> None:
        """An ``O`` for the host's ref: the connection carried from now on, or its error.
        Ids are taken here, when the O goes out, so that they reach the host in order."""
        if err:
            sock.close()
            self.inbound_refused(ref, err)
            return
        conn = Conn(self.next_conn, sock)
        self.next_conn += 1
        self.conns[conn.id] = conn
        self.conn_fds[sock.fileno()] = conn
        self.send(frame(b"O", b"id=%d\0inbound=%s\0" % (conn.id, ref)))

    def inbound_refused(self, ref: bytes, err: int) -> None:
        conn_id = self.next_conn
        self.next_conn += 1  # an id the host counts too: never used again
        self.send(frame(b"O", b"id=%d\0inbound=%s\0error=%d\0" % (conn_id, ref, err)))

    def egress_frame(self, kind: bytes, body: bytes) -> bool:
        """The host's word on a connection. An id never opened, or bytes past the window the
        host was given, is not our host's (False); one we closed already is a race: ignored."""
        if kind == b"B":
            tag, sep, data = body.partition(b"\0")
            raw = tag
        else:
            raw, sep, data = first_field(body, b"id"), b"\0", b""
        if not sep or not raw.isdigit() or not 0 < int(raw) < self.next_conn:
            return False
        conn = self.conns.get(int(raw))
        if conn is None:
            return True
        if kind == b"C":
            self.close_conn(conn, tell=False)
        elif kind == b"W":
            conn.credit += int(first_field(body, b"bytes") or b"0")
        elif data:
            if conn.write_done:
                return False
            conn.inbound_size += len(data)
            if conn.inbound_size > EGRESS_WINDOW:
                return False
            conn.inbound.append(data)
        else:
            conn.write_done = True
            self.conn_settle(conn)
        return True

    def conn_read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(min(CHUNK, conn.credit))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by the command: the host drops its end too
            self.close_conn(conn, tell=True)
            return
        if not data:
            conn.read_done = True
            self.send(frame(b"B", conn.tag))  # half-close: the host shuts its writing
            self.conn_settle(conn)
            return
        conn.credit -= len(data)
        self.send(HEADER.pack(1 + len(conn.tag) + len(data)) + b"B" + conn.tag)
        self.send(data)

    def conn_write(self, conn: Conn) -> None:
        written = 0
        try:
            while conn.inbound:
                head = conn.inbound[0]
                n = conn.sock.send(head)
                written += n
                if n < len(head):
                    conn.inbound[0] = head[n:]
                    break
                conn.inbound.popleft()
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # the command closed its socket
            self.close_conn(conn, tell=True)
            return
        if written:
            conn.inbound_size -= written
            self.send(frame(b"W", b"id=%d\0bytes=%d\0" % (conn.id, written)))
        self.conn_settle(conn)

    def conn_settle(self, conn: Conn) -> None:
        """Pass the host's half-close on once its bytes are out; forget a connection both
        sides have ended (each side does so on its own: no frame for it)."""
        if conn.write_done and not conn.inbound and not conn.shut:
            conn.shut = True
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_WR)
        if conn.shut and conn.read_done:
            self.close_conn(conn, tell=False)

    def close_conn(self, conn: Conn, tell: bool) -> None:
        if self.conns.pop(conn.id, None) is None:
            return
        fd = conn.sock.fileno()
        self.want(fd, 0)
        self.conn_fds.pop(fd, None)
        conn.sock.close()
        if tell:
            self.send(frame(b"C", b"id=%d\0" % conn.id))

    # --- the loop --------------------------------------------------------------------------

    def serve(self) -> int:
        agent_fd = self.agent.fileno()
        while True:
            self.refresh()
            timeout = self.overdue()
            for fd, events in self.poll.poll(timeout):
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
                elif fd in self.listeners:
                    self.accept(fd)
                elif fd in self.connecting:
                    self.connected(fd)
                elif (conn := self.conn_fds.get(fd)) is not None:
                    if conn.inbound:
                        self.conn_write(conn)  # POLLERR too: the send's error closes it
                    if conn.id in self.conns and not conn.read_done and events & READABLE:
                        self.conn_read(conn)
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
    egress_port: int | None = None
    services: list[tuple[str, int]] = []
    published: list[int] = []
    while len(argv) >= 2 and argv[0] in ("--egress-listen", "--service-listen", "--publish-port"):
        option, value, argv = argv[0], argv[1], argv[2:]
        if option == "--publish-port":
            if not value.isdigit() or not 0 < int(value) < 65536:
                sys.stderr.write(f"mux.py: --publish-port needs a port, not {value!r}\n")
                return 2
            published.append(int(value))
            continue
        where = listen_address(value if option != "--egress-listen" else "127.0.0.1:" + value)
        if where is None:
            sys.stderr.write(
                f"mux.py: {option} needs a port, ADDR:PORT or unix:/PATH, not {value!r}\n"
            )
            return 2
        if option == "--egress-listen":
            egress_port = where[1]
        else:
            services.append(where)
    if len(argv) < 2 or argv[0] != "--agent":
        sys.stderr.write(
            "usage: mux.py [--egress-listen PORT] [--service-listen ADDR:PORT|unix:/PATH]... "
            "[--publish-port PORT]... --agent PATH [agent args]\n"
        )
        return 2
    if not undumpable():
        sys.stderr.write("mux.py: cannot set PR_SET_DUMPABLE 0 (no ctypes); going on\n")
    try:
        mux = Mux(argv[1:], egress_port, services, published)
    except OSError as exc:
        # Closed, as the agent's own forwarder: no hello, the sandbox does not start.
        sys.stderr.write(f"mux.py: {exc}\n")
        return 125
    return mux.serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
