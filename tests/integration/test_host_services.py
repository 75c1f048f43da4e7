"""Host services by grant (issue #35) for real: Debian's PostgreSQL started by the test on the
host's loopback (a free port, 127.0.0.1 and ::1) and a unix socket, granted by
``policy.hostServices``, and reached from inside every runtime by real clients: a PostgreSQL
wire-protocol client in Node.js (tests/services_world.py; the task images have node, not psql)
over each grant, and ``psql`` and ``pg_isready`` where the sandbox has the host's /usr.

Every backend of tests/security (rootful and rootless) through its ``prober``: the same
command, the same judge. Native runs it too and lists ``hostServices`` as unenforced;
kubernetes refuses the unix grant and runs the TCP ones, carried back over the agent's stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.runtimes.requirements import Requirement
from fusion_oci.sandbox import SyncSandbox
from tests.backends import backend_settings, require_runtime
from tests.security.conftest import (  # noqa: F401 - the fixtures, shared with the probes
    Prober,
    backend,
    dockerless_user,
    prober,
    rootless_user,
)
from tests.services_world import PG_CLIENT_JS, Postgres, postgres_server

NETWORKS = ["none", "egress", "filtered"]


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server


def grants(pg: Postgres) -> list[str]:
    return [f"127.0.0.1:{pg.port}", f"[::1]:{pg.port}", f"unix:{pg.unix_socket}"]


def client_script(pg: Postgres, unix: bool = True) -> str:
    """Each grant by the node client, then psql and pg_isready where they exist (``unix``:
    the unix grant's clients too; each prints one line)."""
    node = "node pg.js"
    return "; ".join(
        [
            f"{node} 127.0.0.1:{pg.port} 'select 40+2 as v4'",
            f"{node} '[::1]:{pg.port}' 'select 43'",
            *([f"{node} {pg.unix_socket} 'select 44'"] if unix else []),
            f"{node} 127.0.0.1:{pg.port} 'select count(*) from generate_series(1,5000)'",
            "if command -v psql >/dev/null; then "
            f"psql -h 127.0.0.1 -p {pg.port} -U postgres -Atc 'select 45'; "
            + (
                f"psql -h {pg.socket_dir} -p {pg.port} -U postgres -Atc 'select 46'; "
                if unix
                else ""
            )
            + f"pg_isready -h 127.0.0.1 -p {pg.port} -q && echo ready; "
            + f"else echo 45; {'echo 46; ' if unix else ''}echo ready; fi",
        ]
    )


@pytest.mark.parametrize("network", NETWORKS)
def test_a_granted_postgres_answers_real_clients_inside(
    prober: Prober,  # noqa: F811 - the fixture imported above
    pg: Postgres,
    network: str,
) -> None:
    (prober.worktree / "pg.js").write_text(PG_CLIENT_JS)
    policy = SandboxPolicy(network=network, host_services=grants(pg))  # type: ignore[arg-type]
    if prober.backend == "landlock" and network == "egress":
        # landlock has no egress without host loopback (no network namespace): refused as
        # before, grants or not.
        with pytest.raises(PolicyNotEnforceableError):
            prober.run("true", policy)
        return
    # on kubernetes the unix grant's socket is the pod relay's, at the same path in the pod
    result = prober.run(client_script(pg), policy, timeout_ms=90_000)
    assert result.exit_code == 0, (result.stdout, result.stderr[-2000:])
    assert result.stdout.split() == ["42", "43", "44", "5000", "45", "46", "ready"], result
    hosted = Requirement.HOST_SERVICES.value
    assert (hosted in result.unenforced) == (prober.backend == "native")


def test_every_connection_is_an_audit_event_with_its_service(pg: Postgres, tmp_path: Path) -> None:
    """One runtime is enough for what the host side writes (the relay is the same code)."""
    require_runtime("bubblewrap")
    from tests.conftest import git_init

    wt = git_init(tmp_path / "wt")
    (wt / "pg.js").write_text(PG_CLIENT_JS)
    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    policy = SandboxPolicy(allow_network=False, host_services=grants(pg))
    ctx = PrepareContext(task_id="svc", run_id="r1", policy=policy, worktree_path=str(wt))
    with SyncSandbox(
        backend_settings("bubblewrap", policy=policy), audit=audit, cache_root=tmp_path / "c"
    ) as sb:
        sb.prepare(ctx)
        result = sb.run(
            f"node pg.js 127.0.0.1:{pg.port} 'select 1'; node pg.js {pg.unix_socket} 'select 2'",
            RunOptions(timeout_ms=60_000),
        )
    assert result.stdout.split() == ["1", "2"], result
    seen = [e for e in events if e.type == "sandbox:egress" and (e.details or {}).get("service")]
    assert [(e.details or {})["service"] for e in seen] == [
        f"127.0.0.1:{pg.port}",
        f"unix:{pg.unix_socket}",
    ]
    for e in seen:
        assert e.allowed and e.task_id == "svc"
        assert (e.rule or "").startswith("policy.hostServices[")
    # The TCP grant's connection was handed to the command: its connect was answered with a
    # socket of the host connected to the grant (no bytes pass through fusion-oci, so none
    # are counted); the unix grant's, dialled by the command itself, spliced by the relay.
    assert [(e.details or {})["via"] for e in seen] == ["command", "relay"]
    assert seen[0].bytes_up is None and (seen[1].bytes_up or 0) > 0 and seen[1].bytes_down


def test_landlock_connects_the_commands_own_socket_and_audits_it(
    pg: Postgres, tmp_path: Path
) -> None:
    """landlock: the connect supervisor connects the command's own socket to the TCP grant
    (no hop) and reports it to the relay, which audits it (no byte counts: no bytes pass
    through fusion-oci); a report from anyone but the task's supervisor is not taken."""
    import socket

    require_runtime("landlock")
    from tests.conftest import git_init

    wt = git_init(tmp_path / "wt")
    project = tmp_path / "project"
    project.mkdir()
    (wt / "pg.js").write_text(PG_CLIENT_JS)
    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    policy = SandboxPolicy(allow_network=False, host_services=grants(pg))
    ctx = PrepareContext(
        task_id="ll", run_id="r1", policy=policy, worktree_path=str(wt), project_dir=str(project)
    )
    with SyncSandbox(
        backend_settings("landlock", policy=policy), audit=audit, cache_root=tmp_path / "c"
    ) as sb:
        sb.prepare(ctx)
        assert sb.sandbox.services is not None
        report = sb.sandbox.services.relays[0].report
        assert report is not None
        forged = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        forged.sendto(b"O", str(report))  # this process is not the task's supervisor
        forged.close()
        result = sb.run(
            f"node pg.js 127.0.0.1:{pg.port} 'select 1'; node pg.js '[::1]:{pg.port}' 'select 2'",
            RunOptions(timeout_ms=60_000),
        )
    assert result.stdout.split() == ["1", "2"], result
    seen = [e for e in events if e.type == "sandbox:egress" and (e.details or {}).get("service")]
    assert [(e.details or {})["service"] for e in seen] == [
        f"127.0.0.1:{pg.port}",
        f"[::1]:{pg.port}",
    ], seen
    for e in seen:
        assert e.allowed and e.task_id == "ll" and (e.details or {})["via"] == "command"


def test_a_burst_past_the_agents_pool_is_served_whole_and_audited(tmp_path: Path) -> None:
    """40 connections at once: the first take the agent's pool of 8 host sockets (each handed
    to the command in place of its own), the rest reach the agent's listener and dial the
    relay one by one (the socket handed over to the agent, which splices) while the pool
    refills; each one reaches the service and is one audit event."""
    from tests.conftest import git_init
    from tests.services_world import listening

    require_runtime("bubblewrap")
    wt = git_init(tmp_path / "wt")
    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    with listening() as a:
        policy = SandboxPolicy(allow_network=False, host_services=[f"127.0.0.1:{a.port}"])
        ctx = PrepareContext(task_id="burst", run_id="r1", policy=policy, worktree_path=str(wt))
        js = (
            "const net = require('net'); let ok = 0, done = 0;"
            "for (let i = 0; i < 40; i++) {"
            f"  const c = net.connect({a.port}, '127.0.0.1'); let got = '';"
            "  c.on('data', (d) => { got += d; });"
            "  c.on('close', () => { if (got === 'hello\\n') ok++;"
            "    if (++done === 40) console.log(ok); });"
            "  c.on('error', () => {});"
            "}"
        )
        (wt / "burst.js").write_text(js)
        with SyncSandbox(
            backend_settings("bubblewrap", policy=policy), audit=audit, cache_root=tmp_path / "c"
        ) as sb:
            sb.prepare(ctx)
            result = sb.run("node burst.js", RunOptions(timeout_ms=30_000))
        assert result.stdout.split() == ["40"], result
        assert len(a.seen) == 40, a.seen
    seen = [e for e in events if e.type == "sandbox:egress" and (e.details or {}).get("service")]
    assert len(seen) == 40, seen
    vias = [(e.details or {})["via"] for e in seen]
    assert all(e.allowed for e in seen) and set(vias) <= {"command", "agent"}, seen
    assert vias.count("command") >= 8, vias  # at least the pool's first eight
    # the agent's own connections carry its counts; the command's pass through nothing of ours
    assert all(e.bytes_down == len(b"hello\n") for e in seen if e.details["via"] == "agent")


def test_a_grant_whose_service_is_down_is_a_refused_event(tmp_path: Path) -> None:
    """The agent connects its pool socket to the grant itself; a refused connect is reported
    to the relay and audited as refused, with the reason; the command's own connect fails
    with the same error (ECONNREFUSED), as it would against the host."""
    import socket

    require_runtime("bubblewrap")
    from tests.conftest import git_init

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    wt = git_init(tmp_path / "wt")
    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    policy = SandboxPolicy(allow_network=False, host_services=[f"127.0.0.1:{port}"])
    ctx = PrepareContext(task_id="down", run_id="r1", policy=policy, worktree_path=str(wt))
    js = (
        f"const c = require('net').connect({port}, '127.0.0.1');"
        "c.on('data', () => console.log('data'));"
        "c.on('close', () => console.log('closed'));"
        "c.on('error', (e) => console.log(e.code));"
    )
    with SyncSandbox(
        backend_settings("bubblewrap", policy=policy), audit=audit, cache_root=tmp_path / "c"
    ) as sb:
        sb.prepare(ctx)
        result = sb.run(f'node -e "{js}"', RunOptions(timeout_ms=30_000))
    assert result.stdout.split() == ["ECONNREFUSED", "closed"], result
    seen = [e for e in events if e.type == "sandbox:egress" and (e.details or {}).get("service")]
    assert len(seen) == 1 and seen[0].allowed is False, seen
    assert "Connection refused" in (seen[0].reason or ""), seen
    assert (seen[0].details or {})["via"] == "agent"


def test_a_flood_through_a_grant_is_capped_and_audited(tmp_path: Path) -> None:
    """The relay's per-task bound: connections past it are closed at once, each refusal is
    audited (within the task's audit budget), and the ones held keep working."""
    import asyncio
    import socket

    from fusion_oci.models.hostservice import parse_grant
    from fusion_oci.services import Limits, start_relays, stop_relays
    from tests.services_world import listening

    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    with listening() as a:
        relays = asyncio.run(
            start_relays(
                task_id="flood",
                grants=[(parse_grant(f"127.0.0.1:{a.port}"), False)],
                audit=audit,
                tcp=False,
                backend="test",
                policy_hash=None,
                limits=Limits(max_connections=4),
            )
        )
        held: list[socket.socket] = []
        try:
            path = str(relays.relays[0].socket)
            for _ in range(4):
                s = socket.socket(socket.AF_UNIX)
                s.connect(path)
                s.sendall(b"C")  # one connection, as the agent asks when its pool is empty
                # Dialled by a process that is not a sandbox's init (this one): the relay's
                # byte carries no socket (only the agent gets the connected socket), and the
                # dialer asks the relay to splice.
                byte, fds, _, _ = socket.recv_fds(s, 1, 1)
                assert (byte, fds) == (b"\x01", [])
                s.sendall(b"S")
                assert s.recv(6) == b"hello\n"  # through the relay to the service
                held.append(s)
            refused = 0
            for _ in range(20):
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(5)
                s.connect(path)
                s.sendall(b"C")
                refused += s.recv(6) == b""  # closed by the relay, the service never saw it
                s.close()
        finally:
            for s in held:
                s.close()
            asyncio.run(stop_relays(relays))
    assert refused == 20 and len(a.seen) == 4, (refused, a.seen)
    over = [e for e in events if e.allowed is False and "too many connections" in (e.reason or "")]
    assert len(over) == 20 and all((e.details or {}).get("service") for e in over)


def test_a_unix_grant_swapped_for_a_symlink_after_prepare_is_refused(tmp_path: Path) -> None:
    """The path resolved at prepare is walked again, without following a symlink, at every
    connect: a socket replaced by a symlink to another is refused and audited; the other
    socket sees nothing."""
    import asyncio
    import socket

    from fusion_oci.models.hostservice import parse_grant
    from fusion_oci.services import start_relays, stop_relays
    from tests.services_world import listening

    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    granted, other = tmp_path / "db.sock", tmp_path / "other.sock"
    with listening([granted, other]) as a:
        relays = asyncio.run(
            start_relays(
                task_id="swap",
                grants=[(parse_grant(f"unix:{granted}"), False)],
                audit=audit,
                tcp=False,
                backend="test",
                policy_hash=None,
            )
        )
        try:
            path = str(relays.relays[0].socket)

            def through() -> bytes:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(5)
                    s.connect(path)
                    return s.recv(6)

            assert through() == b"hello\n"
            granted.rename(tmp_path / "db-moved.sock")
            granted.symlink_to(other)
            assert through() == b""
        finally:
            asyncio.run(stop_relays(relays))
    assert a.seen == [str(granted)], a.seen  # the first connection only; other.sock: nothing
    refused = [e for e in events if e.allowed is False]
    assert refused and "refused the connection" in (refused[-1].reason or ""), events


@pytest.mark.parametrize(
    "runtime",
    [
        pytest.param("bubblewrap", marks=pytest.mark.bubblewrap),
        pytest.param("landlock", marks=pytest.mark.landlock),
    ],
)
def test_an_unprivileged_caller_gets_its_grants_too(
    runtime: str,
    pg: Postgres,
    rootless_user: Any,  # noqa: F811 - the fixture imported above: the CI user
) -> None:
    """bubblewrap and landlock run by the unprivileged CI user (the relays are that user's):
    the same client, the same answers, under none and filtered."""
    import shutil
    import tempfile

    from tests.conftest import git_init

    require_runtime(runtime)
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-svc-"))
    base.chmod(0o755)
    try:
        prober_ = Prober(
            runtime,
            base,
            git_init(base / "wt"),
            base / "home",
            {"HOME": str(base / "home"), "PATH": "/usr/local/bin:/usr/bin:/bin"},
            rootless_user,
        )
        (base / "home").mkdir()
        (prober_.worktree / "pg.js").write_text(PG_CLIENT_JS)
        for network in ("none", "filtered"):
            policy = SandboxPolicy(network=network, host_services=grants(pg))  # type: ignore[arg-type]
            result = prober_.run(client_script(pg), policy, timeout_ms=90_000)
            assert result.stdout.split() == ["42", "43", "44", "5000", "45", "46", "ready"], (
                network,
                result,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


HANDED_PY = r"""
import fcntl, os, socket, struct, sys
port = int(sys.argv[1])
def cookie(s):  # SO_NETNS_COOKIE (71); 20 below is SO_RCVTIMEO
    return s.getsockopt(socket.SOL_SOCKET, 71, 8)
fresh = socket.socket()
out = []
for blocking, inheritable in ((True, False), (False, True)):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 2, 500000))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 7000)
    s.set_inheritable(inheritable)
    s.setblocking(blocking)
    before = s.fileno()
    err = s.connect_ex(("127.0.0.1", port))
    flags = fcntl.fcntl(s.fileno(), fcntl.F_GETFL)
    out.append({
        "err": err,
        "same_fd": s.fileno() == before,
        "handed": cookie(s) != cookie(fresh),
        "keepalive": s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        "nodelay": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
        "rcvtimeo": list(struct.unpack("ll", s.getsockopt(socket.SOL_SOCKET, 20, 16))),
        "user_timeout": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        "nonblock": bool(flags & os.O_NONBLOCK),
        "inheritable": os.get_inheritable(s.fileno()),
    })
    s.close()
import json; print(json.dumps(out))
"""


@pytest.mark.parametrize("runtime", ["bubblewrap", "oci"])
def test_a_handed_socket_keeps_what_the_command_set_before_its_connect(
    runtime: str, tmp_path: Path
) -> None:
    """The socket put in place of the command's own has its options (keepalive, no delay,
    timeouts), its blocking mode and its close-on-exec flag, at the same descriptor."""
    import json as _json

    from tests.conftest import git_init
    from tests.services_world import listening

    require_runtime(runtime)
    wt = git_init(tmp_path / "wt")
    (wt / "handed.py").write_text(HANDED_PY)
    with listening() as a:
        policy = SandboxPolicy(allow_network=False, host_services=[f"127.0.0.1:{a.port}"])
        ctx = PrepareContext(task_id="handed", run_id="r1", policy=policy, worktree_path=str(wt))
        with SyncSandbox(backend_settings(runtime, policy=policy), cache_root=tmp_path / "c") as sb:
            sb.prepare(ctx)
            result = sb.run(f"python3 handed.py {a.port}", RunOptions(timeout_ms=30_000))
    assert result.exit_code == 0, result
    seen = _json.loads(result.stdout)
    for one, (nonblock, inheritable) in zip(seen, ((False, False), (True, True)), strict=True):
        assert one["err"] == 0 and one["same_fd"] and one["handed"], one
        assert (one["keepalive"], one["nodelay"], one["user_timeout"]) == (1, 1, 7000), one
        assert one["rcvtimeo"] == [2, 500000], one
        assert (one["nonblock"], one["inheritable"]) == (nonblock, inheritable), one
