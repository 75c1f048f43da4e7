"""Published ports (``policy.publishPorts``, issue #35) for real, on every runtime: a dev server
inside (node's http server: the host has node, the task images too) reached from the host by a
real HTTP client at the published port, the named one and a free one reported at prepare; and
the probes: a port the command listens on but that is not published stays unreachable, nothing
listens on a non-loopback host address, a command that dials the port's relay socket itself
(to be handed the host's connections) is closed, every connection is a ``sandbox:inbound``
audit event, and the host ports are closed once the sandbox is disposed.

native runs it and lists it unenforced. gVisor drops the handed socket: its agent dials
the relay back for each client (services/publish.py). kubernetes carries each
connection over the agent's stream to the pod's own loopback (mux.py ``--publish-port``):
no relay socket is in the pod, so the command that dials one finds none (its verdict comes
back with the worktree, once the command has ended).
landlock has no network namespace: the command's bind to a published port is the reaper's
supervisor's, to host loopback at an ephemeral port, and the host carries each client there
(fusion_oci/runtimes/landlock/published.py); its probes: every other bind is EACCES (another
port, the wildcard on an unpublished port, another loopback address), the ephemeral port of
a wildcard bind is not on a non-loopback host address, and once the server is gone a host
process that takes its ephemeral port is never handed a client (a stale report).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
import urllib.request
from pathlib import Path

import pytest

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.requirements import Requirement
from fusion_oci.sandbox import Sandbox
from tests.backends import backend_settings, require, require_runtime
from tests.security.conftest import (  # noqa: F401 - the fixtures, shared with the probes
    DOCKERLESS,
    ROOTLESS,
    ROOTLESS_BACKENDS,
    RootlessUser,
    dockerless_user,
    engine_env,
    rootless_user,
)

RUNTIMES = [
    "native", "bubblewrap", "landlock", "oci", "oci-runsc", "podman", "docker", "kubernetes"
]  # fmt: skip
REFUSED: set[str] = set()
"""Runtimes that refuse publishPorts at check: none now (landlock and gVisor publish too)."""
INSIDE = (8080, 8081, 8082)
"""The dev server's ports inside: 8080 published on a named host port, 8082 on a free one,
8081 not published."""

HIJACK_JS = (
    "const net=require('net');const said=[];const say=(i,w)=>{if(said[i]!==undefined)return;"
    "said[i]=w;if(said.filter((x)=>x!==undefined).length===2)require('fs')"
    ".writeFileSync('hijack.txt',said[0]===said[1]?said[0]:said.join(' / '))};"
    "['I','A'+'\\0'.repeat(16)].forEach((hello,i)=>{"
    "const c=net.connect('/run/fusion-oci/publish/0.sock');let got=0;"
    "c.on('connect',()=>c.write(hello));c.on('data',(d)=>{got+=d.length});"
    "c.on('error',(e)=>say(i,'error '+e.code));"
    "c.on('close',()=>say(i,got?'GOT '+got:'closed'));"
    "setTimeout(()=>say(i,got?'GOT '+got:'open'),3000)});"
)
"""Run beside the servers (one command: the engines run a task's commands one at a time): the
command dials its published port's relay socket itself, once asking to be the agent (``I``),
once claiming a dialled-back client with a made-up token (``A``, what gVisor's agent says);
the relay closes both (only the sandbox's init is handed host connections; a token is never
seen outside the agent). Its verdict goes to ``hijack.txt`` in the worktree."""

SELF_JS = (
    "setTimeout(()=>require('http').get('http://127.0.0.1:8080/',(r)=>{let b='';"
    "r.on('data',(d)=>{b+=d});r.on('end',()=>require('fs').writeFileSync('self.txt',b))})"
    ".on('error',(e)=>require('fs').writeFileSync('self.txt','error '+e.code)),300);"
)
"""The command's own client of its published server, at the port it asked for (a test that
starts the dev server and talks to it): its answer goes to ``self.txt``."""

SERVER_JS = (
    HIJACK_JS + SELF_JS + "const http=require('http');"
    "for (const p of [8080,8081,8082]) http.createServer((q,r)=>r.end('hello '+p))"
    ".listen(p,'127.0.0.1');"
    "setTimeout(()=>{},600000)"
)

LANDLOCK_SERVER_JS = (
    HIJACK_JS + SELF_JS + "const http=require('http'),fs=require('fs');"
    "const note=(l)=>fs.appendFileSync('binds.txt',l+'\\n');"
    "for (const [p,h] of [[8080,'127.0.0.1'],[8081,'127.0.0.1'],[8082,'0.0.0.0'],"
    "[8083,'0.0.0.0'],[8080,'127.0.0.2']]) {"
    "const s=http.createServer((q,r)=>r.end('hello '+p));"
    "s.on('error',(e)=>note(p+' '+h+' '+e.code));"
    "s.listen(p,h,()=>note(p+' '+h+' at '+s.address().address+' '+s.address().port));}"
    "setTimeout(()=>{},600000)"
)
"""landlock's: each bind's outcome goes to ``binds.txt`` (an EACCES is the server's error
event, which would end node otherwise): what ``server.address()`` shows (loopback at the
ephemeral port), or the error."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(host: str, port: int, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/", timeout=timeout) as r:
        return str(r.read().decode())


def _refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            s.settimeout(2)
            # A listener that accepts and closes (nothing inside at that port) counts too.
            return s.recv(1) == b""
    except OSError:
        return True


def _outside_address() -> str | None:
    """A non-loopback address of this host (None: there is none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: a route lookup
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def _stale_report_delivers(binds: list[str], named: int) -> tuple[bool, bool]:
    """With the command's server gone, a host process takes its ephemeral port (the last
    report of 8080 names it): (whether the host's client of the published port was refused,
    whether that process was handed a connection)."""
    bound = next(int(b.split()[-1]) for b in binds if b.startswith("8080 127.0.0.1 at "))
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        other.bind(("127.0.0.1", bound))
        other.listen(8)
        other.settimeout(1.0)
        refused = _refused("127.0.0.1", named)
        try:
            conn, _ = other.accept()
        except TimeoutError:
            return refused, False
        conn.close()
        return refused, True


async def _serve_and_probe(
    backend: str, wt: Path, cache: Path, network: str
) -> tuple[list[dict[str, object]], dict[str, object], list[AuditEvent], list[str]]:
    named = _free_port()
    policy = SandboxPolicy(
        network=network,  # type: ignore[arg-type]
        publish_ports=[f"{named}:8080", "8082"],
    )
    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    # landlock: the project outside the worktree (its .fusion/ the command cannot write).
    project = None
    if backend == "landlock":
        project = wt.parent / "project"
        project.mkdir(exist_ok=True)
    ctx = PrepareContext(
        task_id="pub",
        run_id="r1",
        policy=policy,
        worktree_path=str(wt),
        project_dir=str(project) if project is not None else None,
    )
    env = engine_env(backend)
    seen: dict[str, object] = {}
    sb = Sandbox(backend_settings(backend, policy=policy), audit=audit, env=None, cache_root=cache)
    if env:
        sb.env.update(env)
    try:
        await sb.prepare(ctx)
        published = sb.published()
        seen["unenforced"] = list(sb.unenforced)
        if not published:  # native: nothing published, listed unenforced
            return published, seen, events, list(sb.unenforced)
        js = LANDLOCK_SERVER_JS if backend == "landlock" else SERVER_JS
        run = asyncio.ensure_future(sb.run(["node", "-e", js], RunOptions(timeout_ms=120_000)))
        try:
            loop = asyncio.get_running_loop()
            for _ in range(200):
                with contextlib.suppress(OSError):
                    seen["named"] = await loop.run_in_executor(None, _get, "127.0.0.1", named)
                    break
                if run.done():
                    break
                await asyncio.sleep(0.1)
            free = next(int(str(p["hostPort"])) for p in published if p["port"] == 8082)
            seen["free"] = await loop.run_in_executor(None, _get, "127.0.0.1", free)
            seen["other_ports"] = [
                await loop.run_in_executor(None, _refused, "127.0.0.1", p) for p in INSIDE
            ]
            outside = _outside_address()
            seen["outside"] = (
                None
                if outside is None
                else await loop.run_in_executor(None, _refused, outside, named)
            )
            seen["ports"] = (named, free)
            verdict = wt / "hijack.txt"
            for _ in range(50):
                if verdict.exists():
                    break
                await asyncio.sleep(0.1)
            seen["hijack"] = verdict.read_text() if verdict.exists() else None
            for _ in range(50 if backend != "kubernetes" else 0):  # a pod's: once it ended
                if (wt / "self.txt").exists():
                    break
                await asyncio.sleep(0.1)
            seen["after"] = await loop.run_in_executor(None, _get, "127.0.0.1", named)
            if backend == "landlock":
                binds = wt / "binds.txt"
                seen["binds"] = sorted(binds.read_text().splitlines()) if binds.exists() else []
                seen["bound_outside"] = [
                    await loop.run_in_executor(None, _refused, outside, int(b.split()[-1]))
                    for b in seen["binds"]  # type: ignore[attr-defined]
                    if outside is not None and " at " in b
                ]
        finally:
            sb.abort()
            with contextlib.suppress(BaseException):
                await run
        if backend == "kubernetes":
            # a pod's files come back when its command ends (an abort too)
            verdict = wt / "hijack.txt"
            seen["hijack"] = verdict.read_text() if verdict.exists() else None
        own = wt / "self.txt"
        seen["self"] = own.read_text() if own.exists() else None
        # The sandbox is still there, its servers are not: the host's client is closed.
        if "ports" in seen:
            seen["no_server"] = await asyncio.get_running_loop().run_in_executor(
                None, _refused, "127.0.0.1", seen["ports"][0]
            )
        if backend == "landlock" and "binds" in seen:
            seen["stale"] = await asyncio.get_running_loop().run_in_executor(
                None, _stale_report_delivers, seen["binds"], seen["ports"][0]
            )
    finally:
        await sb.dispose()
    return published, seen, events, list(sb.unenforced)


@pytest.mark.parametrize("network", ["none", "egress", "filtered"])
@pytest.mark.parametrize("backend", RUNTIMES)
def test_a_dev_server_inside_is_reached_on_the_published_ports_only(
    backend: str, network: str, tmp_path: Path
) -> None:
    require_runtime(backend, backend_settings(backend))
    if backend in ("podman", "docker"):
        from tests.integration.images_fixture import ensure_node_image

        ensure_node_image(backend)
    from tests.conftest import git_init

    wt = git_init(tmp_path / "wt")
    coro = _serve_and_probe(backend, wt, tmp_path / "c", network)
    if backend == "landlock":
        from fusion_oci.runtimes.landlock import host_abi

        require("landlock", host_abi() >= 4, "publishPorts needs Landlock ABI 4 (Linux 6.7+)")
    if backend == "landlock" and network == "egress":
        # No network namespace: egress is not enforceable; the ports would be.
        with pytest.raises(PolicyNotEnforceableError) as info:
            asyncio.run(coro)
        assert Requirement.PUBLISHED_PORTS.value not in info.value.unenforced
        assert Requirement.NETWORK_EGRESS.value in info.value.unenforced
        return
    if backend in REFUSED:
        with pytest.raises(PolicyNotEnforceableError) as info:
            asyncio.run(coro)
        assert Requirement.PUBLISHED_PORTS.value in info.value.unenforced
        return
    published, seen, events, _ = asyncio.run(coro)
    if backend == "native":
        assert Requirement.PUBLISHED_PORTS.value in seen["unenforced"]  # type: ignore[operator]
        assert published == []
        return
    named, free = seen["ports"]  # type: ignore[misc]
    # The named host port and a free one, reported.
    assert [(p["port"], p["hostPort"], p["address"]) for p in published] == [
        (8080, named, "127.0.0.1"),
        (8082, free, "127.0.0.1"),
    ]
    assert free not in (0, 4040)
    assert seen["named"] == "hello 8080" and seen["free"] == "hello 8082", seen
    # The sandbox's own ports are not the host's: 8080-8082 on the host's loopback are
    # nothing of the sandbox's (the unpublished 8081 above all).
    assert seen["other_ports"] == [True, True, True], seen
    # A command that dials the port's relay itself gets nothing of the host's, and the
    # published port still goes to the server.
    # No relay in a pod, nor on landlock's host (the ports are carried, not handed over).
    hijacked = "error ENOENT" if backend in ("kubernetes", "landlock") else "closed"
    assert seen["hijack"] == hijacked and seen["after"] == "hello 8080", seen
    # The command reaches its own server at the port it asked for (landlock: the supervisor
    # sends it to the ephemeral port).
    assert seen["self"] == "hello 8080", seen
    # Nothing on another address of the host.
    assert seen["outside"] in (None, True), seen
    # One sandbox:inbound event per connection, each naming its published port.
    inbound = [e for e in events if e.type == "sandbox:inbound"]
    assert {e.port for e in inbound} >= {8080, 8082}, inbound
    ok = [e for e in inbound if e.allowed and e.reason is None]  # ended on their own
    assert ok and all((e.bytes_down or 0) > 0 and (e.bytes_up or 0) > 0 for e in ok), ok
    prepare = next(e for e in events if e.type == "sandbox:prepare")
    assert (prepare.details or {})["published"] == published
    # With nothing listening inside any more: closed, and audited as refused with the reason.
    assert seen["no_server"] is True
    refused = [e for e in inbound if not e.allowed]
    assert any("nothing accepted the connection" in (e.reason or "") for e in refused), inbound
    # Closed at dispose.
    assert _refused("127.0.0.1", named) and _refused("127.0.0.1", free)
    if backend == "landlock":
        _landlock_probes(seen, inbound)


def _landlock_probes(seen: dict[str, object], inbound: list[AuditEvent]) -> None:
    binds = seen["binds"]
    assert isinstance(binds, list)
    # Every bind but the published ports' on loopback or the wildcard: EACCES.
    assert [b for b in binds if " at " not in b] == [
        "8080 127.0.0.2 EACCES",
        "8081 127.0.0.1 EACCES",
        "8083 0.0.0.0 EACCES",
    ], binds
    # The published ones: host loopback at an ephemeral port (what getsockname shows), the
    # wildcard's too, so it is not on a non-loopback address of the host.
    bound = {b.split()[0]: b.split()[3:] for b in binds if " at " in b}
    assert sorted(bound) == ["8080", "8082"], binds
    assert all(a == "127.0.0.1" and int(p) not in (8080, 8082) for a, p in bound.values())
    assert seen["bound_outside"] in ([], [True, True]), seen
    # A stale report (the server gone, its port another host process's): refused, and that
    # process is handed nothing.
    assert seen["stale"] == (True, False), seen
    assert sum(1 for e in inbound if not e.allowed) >= 2, inbound  # no_server and stale


UNPRIVILEGED = {
    "bubblewrap-unprivileged": "bubblewrap",
    "landlock-unprivileged": "landlock",
    ROOTLESS: "podman",
    DOCKERLESS: "docker",
}
"""Driven as the unprivileged CI user (tests/integration/rootless_driver.py ``publish``): no
root needed, the agent is handed the connections (landlock: the user's own supervisor binds
and the user's own process carries)."""
NO_ENGINE = {"bubblewrap-unprivileged", "landlock-unprivileged"}


@pytest.mark.parametrize("backend", list(UNPRIVILEGED))
def test_published_ports_work_without_root(backend: str, request: pytest.FixtureRequest) -> None:
    from tests.conftest import git_init

    # The same unprivileged user for all; bubblewrap and landlock need no engine of it.
    user: RootlessUser = request.getfixturevalue(ROOTLESS_BACKENDS.get(backend, "rootless_user"))
    # A folder the user can reach (pytest's tmp_path is under root's private one).
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-test-publish-"))
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    wt = git_init(base / "wt")
    user.hand_over(base)
    policy = SandboxPolicy(network="none", publish_ports=["8080", "8082"])  # type: ignore[arg-type]
    settings = SandboxSettings(
        backend=UNPRIVILEGED[backend],  # type: ignore[arg-type]
        policy=policy,
        **(user.settings if backend not in NO_ENGINE else {}),
    )
    project = base / "project"  # outside the worktree: landlock cannot keep .fusion/ in it
    project.mkdir()
    user.hand_over(project)
    ctx = PrepareContext(
        task_id="pub",
        run_id="r1",
        policy=policy,
        worktree_path=str(wt),
        project_dir=str(project),
    )
    answer = user.drive(
        "publish",
        {
            "settings": settings.model_dump(mode="json", by_alias=True),
            "ctx": ctx.model_dump(mode="json", by_alias=True),
            "env": {},
            "cacheRoot": str(base / "cache"),
            "command": ["node", "-e", LANDLOCK_SERVER_JS if "landlock" in backend else SERVER_JS],
        },
        timeout=300,
    )
    assert "refused" not in answer, answer
    assert answer.get("answers") == ["hello 8080", "hello 8082"], answer
    # landlock has no relay socket to dial: the command finds none.
    hijacked = "error ENOENT" if backend == "landlock-unprivileged" else "closed"
    assert answer["hijack"] == hijacked, answer
    assert answer["closedAfter"] == [True, True], answer


CRASHING = """
import json, os, signal, sys
from pathlib import Path
from fusion_oci.models import PrepareContext, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox
cfg = json.loads(sys.argv[1])
policy = SandboxPolicy.model_validate(cfg["policy"])
sb = SyncSandbox(SandboxSettings(backend="bubblewrap", policy=policy),
                 cache_root=Path(cfg["cache"]))
sb.prepare(PrepareContext(task_id="pub-crash", run_id="r1", policy=policy,
                          worktree_path=cfg["wt"]))
ports = sb.sandbox.ports
print(json.dumps({"port": sb.sandbox.published()[0]["hostPort"],
                  "dir": str(ports.state_dir)}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_crashed_owner_leaves_no_port_and_gc_takes_its_folder(tmp_path: Path) -> None:
    """kill -9 of the task's owner: the kernel closes its listeners (nothing answers at the
    published port), and the relay sockets' folder, stamped with the dead owner, goes at the
    next gc (every prepare runs it)."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from fusion_oci.host.scratch import gc_scratch
    from tests.conftest import git_init

    require_runtime("bubblewrap")
    wt = git_init(tmp_path / "wt")
    policy = SandboxPolicy(network="none", publish_ports=["3000"])  # type: ignore[arg-type]
    cfg = {
        "policy": policy.model_dump(mode="json", by_alias=True),
        "cache": str(tmp_path / "cache"),
        "wt": str(wt),
    }
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING, json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    left = json.loads(proc.stdout.strip().splitlines()[-1])
    assert _refused("127.0.0.1", int(left["port"]))
    assert Path(left["dir"]).is_dir()  # what the crash left
    gc_scratch()
    assert not Path(left["dir"]).exists()


def test_host_port_4040_is_refused_by_the_settings_with_the_field_and_the_fix(
    tmp_path: Path,
) -> None:
    """The dashboard's port is never published: a project's settings that ask for it fail at
    load, naming the field and what to write instead (the CLI as a user runs it)."""
    import os
    import subprocess
    import sys

    from tests.conftest import git_init

    wt = git_init(tmp_path / "wt")
    (wt / ".fusion").mkdir()
    (wt / ".fusion" / "settings.yaml").write_text(
        'sandbox:\n  backend: bubblewrap\n  policy:\n    publishPorts: ["4040:3000"]\n'
    )
    out = subprocess.run(
        [sys.executable, "-m", "fusion_oci.cli.main", "run", "--", "true"],
        cwd=wt,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "FUSION_OCI_NO_SERVER": "1",
            "PYTHONPATH": str(Path(__file__).parents[2]),
        },
    )
    assert out.returncode != 0
    assert "sandbox.policy.publishPorts" in out.stderr, out.stderr
    assert "4040 is fusion-oci's dashboard" in out.stderr
    assert "('8080:3000') or a free one ('3000')" in out.stderr


@pytest.mark.parametrize("network", ["none", "filtered"])
def test_on_landlock_a_published_port_nothing_listens_on_is_refused(
    network: str, tmp_path: Path
) -> None:
    """Before its dev server binds, a client inside sees ECONNREFUSED at the published port
    (and retries, as test runners waiting for their server do), as on a loopback of its own;
    an unpublished port stays EACCES (Landlock's and the supervisor's denial)."""
    from fusion_oci.sandbox import SyncSandbox
    from tests.conftest import git_init

    require_runtime("landlock", backend_settings("landlock"))
    wt = git_init(tmp_path / "wt")
    project = tmp_path / "project"
    project.mkdir()
    policy = SandboxPolicy(network=network, publish_ports=["8080"])  # type: ignore[arg-type]
    js = (
        "const net=require('net');const out=[];"
        "for (const p of [8080,8081]) net.connect(p,'127.0.0.1')"
        ".on('connect',()=>out.push(p+' open')).on('error',(e)=>{out.push(p+' '+e.code);"
        "if(out.length===2)console.log(out.sort().join(' | '))});"
    )
    with SyncSandbox(backend_settings("landlock", policy=policy), cache_root=tmp_path / "c") as sb:
        sb.prepare(
            PrepareContext(
                task_id="pub-early",
                run_id="r1",
                policy=policy,
                worktree_path=str(wt),
                project_dir=str(project),
            )
        )
        result = sb.run(["node", "-e", js], RunOptions(timeout_ms=30_000))
    assert result.stdout.strip() == "8080 ECONNREFUSED | 8081 EACCES", result
