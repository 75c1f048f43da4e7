"""Host services by grant (issue #35): what a grant must not open, on every backend.

Each probe grants one TCP service (127.0.0.1:A) and one unix socket of servers the test owns,
and beside them runs servers that are *not* granted (the same ports on ::1, port B on
127.0.0.1 and ::1, a sibling unix socket; another task's relay to B). The sandboxed command
(tests/services_world.py's PROBE_JS: plain Node.js) tries every way to them; the host's
servers say what got through. The granted ones must answer (or the probe fails: a sandbox
that closes everything proves nothing), the others must see nothing. Native isolates
nothing: there each probe leaks, which shows it can see a leak (and that the same program
gets through without the grant machinery in the way). On kubernetes the pod's relay listens
at the unix grant's own path in the pod and carries its connections back as for TCP.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import time
from pathlib import Path

from fusion_oci.models import SandboxPolicy
from fusion_oci.models.hostservice import parse_grant
from fusion_oci.runtimes.requirements import Requirement
from fusion_oci.services import start_relays, stop_relays
from tests.security.conftest import Prober, expected
from tests.security.test_probes import assert_unenforced, check
from tests.services_world import PROBE_JS, Listening, listening


def _run(
    prober: Prober, targets: list[dict[str, object]], policy: SandboxPolicy, send: str = ""
) -> str:
    (prober.worktree / "probe.js").write_text(PROBE_JS)
    cfg = json.dumps({"targets": targets, "send": send})
    result = prober.run(f"node probe.js {shlex.quote(cfg)}", policy, timeout_ms=90_000)
    time.sleep(0.3)  # a late accept is still recorded
    return result.stdout + result.stderr[-500:]


def _grants(granted: Listening, prober: Prober) -> SandboxPolicy:
    unix = f"unix:{granted.sockets[0]}"
    return SandboxPolicy(allow_network=False, host_services=[f"127.0.0.1:{granted.port}", unix])


def _refused(prober: Prober, probe: str) -> bool:
    """A backend that cannot carry grants refuses them, and the probe is recorded as
    unenforced there."""
    if expected(probe, prober.backend) != "unenforced" or prober.backend == "native":
        return False
    assert_unenforced(probe, prober, _grants_to(1), Requirement.HOST_SERVICES.value)
    return True


def _grants_to(port: int) -> SandboxPolicy:
    return SandboxPolicy(allow_network=False, host_services=[f"127.0.0.1:{port}"])


def _svc_dir(prober: Prober) -> Path:
    d = prober.tmp / "svc"
    d.mkdir(exist_ok=True)
    d.chmod(0o755)
    return d


def test_an_ungranted_port_or_address_form_stays_closed(prober: Prober) -> None:
    """Port B (127.0.0.1 and ::1), the granted port on ::1, by name, v4-mapped, slirp's
    gateway and 4040: nothing but 127.0.0.1:A."""
    if _refused(prober, "service-ungranted-port"):
        return
    d = _svc_dir(prober)
    with listening([d / "granted.sock"]) as a, listening() as b:
        out = _run(
            prober,
            [
                {"host": "127.0.0.1", "port": a.port},  # granted: must answer
                {"host": "127.0.0.1", "port": b.port},
                {"host": "localhost", "port": b.port},
                {"host": "::1", "port": b.port},
                {"host": "::ffff:127.0.0.1", "port": b.port},
                {"host": "::1", "port": a.port},  # the granted port, in another family
                {"host": "10.0.2.2", "port": b.port},
                {"host": "127.0.0.1", "port": 4040},
                {"host": "localhost", "port": 4040},
            ],
            _grants(a, prober),
        )
    assert "tcp4" in a.seen, f"the granted service did not answer: {out}"
    leaked = bool(b.seen) or "tcp6" in a.seen or "4040 connected" in out
    check(
        "service-ungranted-port", prober.backend, leaked, f"A saw {a.seen}, B saw {b.seen}; {out}"
    )


def test_the_relay_connects_only_to_its_grant(prober: Prober) -> None:
    """The relay's own socket inside (and the agent's listener) asked, in HTTP CONNECT and
    SOCKS5, for port B; another task's relay (to B) looked for under /tmp: B sees nothing."""
    if _refused(prober, "service-through-relay"):
        return
    d = _svc_dir(prober)
    with listening([d / "granted.sock"]) as a, listening() as b:
        other = asyncio.run(
            start_relays(
                task_id="other-task",
                grants=[(parse_grant(f"127.0.0.1:{b.port}"), False)],
                audit=None,
                tcp=False,
                backend="probe",
                policy_hash=None,
            )
        )
        try:
            other.state_dir.chmod(0o755)  # reachable to the caller on the host (native)
            ask = f"CONNECT 127.0.0.1:{b.port} HTTP/1.1\r\nHost: 127.0.0.1:{b.port}\r\n\r\n"
            socks = (
                "\x05\x01\x00\x05\x01\x00\x01\x7f\x00\x00\x01"
                + chr(b.port >> 8)
                + chr(b.port & 0xFF)
            )
            targets: list[dict[str, object]] = [
                {"host": "127.0.0.1", "port": a.port},
                {"path": "/run/fusion-oci/services/0.sock"},
                {"path": a.sockets[0]},
                {"path": str(other.relays[0].socket)},  # another task's relay, by its host path
            ]
            out = _run(prober, targets, _grants(a, prober), send=ask)
            out += _run(prober, targets, _grants(a, prober), send=socks)
        finally:
            asyncio.run(stop_relays(other))
    assert "tcp4" in a.seen, f"the granted service did not answer: {out}"
    check("service-through-relay", prober.backend, bool(b.seen), f"B saw {b.seen}; {out}")


def test_a_unix_grant_is_that_socket_only(prober: Prober) -> None:
    """A sibling socket beside the granted one, the granted path with `..`, and a symlink the
    command makes to the sibling: only the granted socket answers."""
    if _refused(prober, "service-unix-path"):
        return
    d = _svc_dir(prober)
    granted, sibling = d / "granted.sock", d / "sibling.sock"
    with listening([granted, sibling]) as a:
        link = prober.worktree / "link.sock"
        (prober.worktree / "mklink.js").write_text(
            f"require('fs').symlinkSync({json.dumps(str(sibling))}, {json.dumps(str(link))})"
        )
        policy = _grants(a, prober)
        out = prober.run("node mklink.js", policy).stderr[-300:]
        out += _run(
            prober,
            [
                {"path": str(granted)},  # granted: must answer
                {"path": str(sibling)},
                {"path": f"{granted}/../sibling.sock"},
                {"path": f"{d}/./sibling.sock"},
                {"path": str(link)},
            ],
            policy,
        )
    assert str(granted) in a.seen, f"the granted socket did not answer: {out}"
    leaked = str(sibling) in a.seen
    check("service-unix-path", prober.backend, leaked, f"seen {a.seen}; {out}")


HANDOVER_PY = r"""
import array, socket, sys
b = int(sys.argv[1])
def ask(first):  # the relay's socket of the TCP grant, dialled by the command itself
    u = socket.socket(socket.AF_UNIX)
    u.settimeout(3)
    u.connect("/run/fusion-oci/services/0.sock")
    u.sendall(first)  # C: one connection; P: the agent's pool of host sockets
    fds = array.array("i")
    try:
        while True:
            msg, anc, _, _ = u.recvmsg(1, socket.CMSG_SPACE(4 * fds.itemsize))
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            if not msg or first == b"C":
                break
    except OSError:
        pass
    print("asked", first, "fds", len(fds))
    return fds
try:
    fds = ask(b"C") + ask(b"P")
    for fd in fds:  # a host socket: disconnect it, then aim it at port B
        s = socket.socket(fileno=fd)
        s.setblocking(True)
        s.settimeout(3)
        try:
            import ctypes
            unspec = (ctypes.c_ushort * 8)(0)
            ctypes.CDLL(None, use_errno=True).connect(fd, unspec, 16)
            s.connect(("127.0.0.1", b))
            s.sendall(b"probe\n")
            print("reconnected to B")
        except OSError as e:
            print("reconnect", e)
except OSError as e:
    print("relay", e)
try:  # the baseline: B directly (what native shows)
    socket.create_connection(("127.0.0.1", b), timeout=3).sendall(b"probe\n")
    print("direct B connected")
except OSError as e:
    print("direct B", e)
"""


def test_only_the_agent_is_handed_a_service_socket(prober: Prober) -> None:
    """The relay hands its connected host socket (SCM_RIGHTS) to the sandbox's agent only: a
    command that dials the relay's socket itself gets the byte alone. Were it handed the
    socket, ``connect(AF_UNSPEC)`` would disconnect it and it could connect anywhere on the
    host's loopback (here port B). Python where the sandbox has it (host-process runtimes,
    oci); the task images have none, and their command is no sandbox's init either."""
    if _refused(prober, "service-socket-handover"):
        return
    d = _svc_dir(prober)
    with listening([d / "granted.sock"]) as a, listening() as b:
        (prober.worktree / "handover.py").write_text(HANDOVER_PY)
        (prober.worktree / "probe.js").write_text(PROBE_JS)
        granted = json.dumps({"targets": [{"host": "127.0.0.1", "port": a.port}]})
        by_node = json.dumps(
            {
                "targets": [
                    {"path": "/run/fusion-oci/services/0.sock"},
                    {"host": "127.0.0.1", "port": b.port},
                ],
                "send": "C",
            }
        )
        result = prober.run(
            f"node probe.js {shlex.quote(granted)}; "
            f"if command -v python3 >/dev/null; then python3 handover.py {b.port}; "
            f"else node probe.js {shlex.quote(by_node)}; fi",
            _grants(a, prober),
            timeout_ms=90_000,
        )
        time.sleep(0.3)  # a late accept is still recorded
        out = result.stdout + result.stderr[-500:]
    assert "tcp4" in a.seen, f"the granted service did not answer: {out}"
    assert re.search(r"fds [1-9]", out) is None, out  # no host socket reached the command
    check("service-socket-handover", prober.backend, bool(b.seen), f"B saw {b.seen}; {out}")


REAIM_C = r"""
/* A granted connection, then every way to aim that socket elsewhere: connect(AF_UNSPEC) and
 * connect to port B, the same through the 32-bit syscall table (x86_64), and io_uring. */
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
static struct sockaddr_in to_b, unspec; /* static: below 4 GiB for the 32-bit calls */
static unsigned long long cookie(int s) {
    unsigned long long c = 0;
    socklen_t l = sizeof c;
    getsockopt(s, SOL_SOCKET, 71 /* SO_NETNS_COOKIE */, &c, &l);
    return c;
}
int main(int argc, char **argv) {
    if (argc < 3) return 2;
    struct sockaddr_in to_a = {0};
    to_a.sin_family = AF_INET;
    to_a.sin_port = htons((unsigned short)atoi(argv[1]));
    to_a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    to_b = to_a;
    to_b.sin_port = htons((unsigned short)atoi(argv[2]));
    unspec.sin_family = AF_UNSPEC;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (struct sockaddr *)&to_a, sizeof to_a) != 0) {
        printf("granted connect %s\n", strerror(errno));
        return 1;
    }
    char buf[16] = {0};
    read(s, buf, sizeof buf - 1);
    int fresh = socket(AF_INET, SOCK_STREAM, 0);
    printf("granted %s handed %d\n", buf[0] ? "answered" : "silent", cookie(s) != cookie(fresh));
    int r = connect(s, (struct sockaddr *)&unspec, sizeof unspec);
    printf("unspec %d %s\n", r, r ? strerror(errno) : "ok");
    r = connect(s, (struct sockaddr *)&to_b, sizeof to_b);
    printf("to B %d %s\n", r, r ? strerror(errno) : "ok");
    long ring = syscall(425 /* io_uring_setup */, 8, (char[120]){0});
    printf("io_uring %ld %s\n", ring, ring < 0 ? strerror(errno) : "open");
#if defined(__x86_64__)
    pid_t pid = fork();
    if (pid == 0) { /* i386 connect (362) on a fresh host socket, if one comes: AF_UNSPEC, B */
        int t = socket(AF_INET, SOCK_STREAM, 0);
        connect(t, (struct sockaddr *)&to_a, sizeof to_a);
        long a, b;
        __asm__ volatile("int $0x80" : "=a"(a) : "a"(362), "b"(t), "c"(&unspec), "d"(16)
                         : "memory");
        __asm__ volatile("int $0x80" : "=a"(b) : "a"(362), "b"(t), "c"(&to_b), "d"(16)
                         : "memory");
        printf("i386 unspec %ld to B %ld\n", a, b);
        fflush(stdout);
        _exit(0);
    }
    int st;
    waitpid(pid, &st, 0);
    printf("i386 child %d\n", WIFSIGNALED(st) ? WTERMSIG(st) : 0);
#endif
    fflush(stdout);
    if (fork() == 0) { /* a process the agent cannot look into holds a handed socket */
        int t = socket(AF_INET, SOCK_STREAM, 0);
        connect(t, (struct sockaddr *)&to_a, sizeof to_a);
        prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
        int u = connect(t, (struct sockaddr *)&unspec, sizeof unspec);
        int ue = errno;
        int v = connect(t, (struct sockaddr *)&to_b, sizeof to_b);
        printf("undumpable unspec %d %s to B %d %s\n", u, u ? strerror(ue) : "ok", v,
               v ? strerror(errno) : "ok");
        fflush(stdout);
        _exit(0);
    }
    wait(NULL);
    return 0;
}
"""


def test_a_socket_handed_to_the_command_cannot_be_aimed_elsewhere(
    prober: Prober, tmp_path: Path
) -> None:
    """Where the agent answers the command's connect to a grant with a connected socket of
    the host (its fastest path), that socket must never reach anything else: disconnecting it
    (connect AF_UNSPEC) and connecting it to port B, the same through the 32-bit syscalls,
    from a process that made itself non-dumpable (the agent cannot look into it), and
    io_uring (which connects without the syscall) all fail. A static C program, so that every
    image runs it; native shows the leak (its socket is the host's anyway)."""
    if _refused(prober, "service-handed-socket"):
        return
    import subprocess

    source = tmp_path / "reaim.c"
    source.write_text(REAIM_C)
    binary = prober.worktree / "reaim"
    subprocess.run(["gcc", "-static", "-O1", "-o", str(binary), str(source)], check=True)
    with listening() as a, listening() as b:
        result = prober.run(f"./reaim {a.port} {b.port}", _grants_to(a.port), timeout_ms=60_000)
        time.sleep(0.3)  # a late accept is still recorded
        out = result.stdout + result.stderr[-500:]
    assert "granted answered" in out and "tcp4" in a.seen, f"the grant did not answer: {out}"
    handed = "handed 1" in out
    uring_open = re.search(r"io_uring [0-9]", out) is not None
    assert "undumpable unspec" in out, out  # the last attempt ran
    leaked = bool(b.seen) or (handed and uring_open)
    check("service-handed-socket", prober.backend, leaked, f"B saw {b.seen}; {out}")


FLOOD_JS = r"""
// Silent connections to the relay sockets bound into the sandbox (a host service's and a
// published port's): how many the owner still holds open after a moment.
const net = require('net');
const paths = process.argv.slice(2);
const seen = {opened: 0, open: 0, failed: 0};
for (const p of paths) {
  for (let i = 0; i < 400; i++) {
    const c = net.connect(p);
    let up = false;
    c.on('connect', () => { up = true; seen.opened++; seen.open++; });
    c.on('close', () => { if (up) seen.open--; });
    c.on('error', () => { seen.failed++; });
  }
}
setTimeout(() => { console.log('FLOOD ' + JSON.stringify(seen)); process.exit(0); }, 2500);
"""


def test_silent_connections_to_the_relays_do_not_pile_up_in_the_owner(prober: Prober) -> None:
    """A command that dials its relay sockets (a host service's, a published port's) 400
    times each and says nothing: the owner answers a handful and closes the rest at once
    (services/relay.py and publish.py ``GREETING_MAX``), rather than hold a descriptor and a
    task for each (6000 of them before, in one owner serving every task); the grant still
    answers afterwards. Where no relay socket is in the sandbox (native, landlock, a pod)
    there is nothing to dial."""
    if _refused(prober, "service-relay-flood"):
        return
    d = _svc_dir(prober)
    with listening([d / "granted.sock"]) as a:
        (prober.worktree / "flood.js").write_text(FLOOD_JS)
        (prober.worktree / "probe.js").write_text(PROBE_JS)
        granted = json.dumps({"targets": [{"host": "127.0.0.1", "port": a.port}]})
        policy = _grants(a, prober).model_copy(update={"publish_ports": ["3000"]})
        result = prober.run(
            "node flood.js /run/fusion-oci/services/0.sock /run/fusion-oci/publish/0.sock; "
            f"node probe.js {shlex.quote(granted)}",
            policy,
            timeout_ms=90_000,
        )
        time.sleep(0.3)
        out = result.stdout + result.stderr[-500:]
    found = re.search(r"FLOOD (\{.*\})", out)
    assert found is not None, out
    seen = json.loads(found.group(1))
    assert "tcp4" in a.seen, f"the granted service did not answer after the flood: {out}"
    # 64 a task's relays may wait on, 16 a published port's: not 800
    check("service-relay-flood", prober.backend, seen["open"] > 100, f"{seen}; {out}")
