"""The oci runtime against a real runc: bundles, network, runtime state and leftovers,
images. What every runtime must do (statuses, output, timeouts, limits) is tests/contract."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.models import PrepareContext, RunOptions, RunResult, SandboxPolicy
from fusion_oci.oci.bundle import write_bundle
from fusion_oci.oci.host import probe_host
from fusion_oci.policy.layout import resolve_layout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.resolve import compile_spec
from fusion_oci.runtimes.oci import OciRuntime, bundle_spec, gc_oci, list_containers
from fusion_oci.sandbox import Sandbox
from tests.backends import require, require_runtime
from tests.conftest import git
from tests.hostside import pids_with, tcp_server
from tests.integration.container_cases import checked_rootless_user
from tests.integration.runc_user import run_bundle_as
from tests.tasks import resolved

pytestmark = [pytest.mark.oci, pytest.mark.runc]

REPO = Path(__file__).resolve().parents[2]
SETTINGS = SandboxSettings(backend="oci", oci_runtime="runc")
# The system interpreter: it is inside the host-rootfs container (a pyenv shim is not).
PYTHON3 = "/usr/bin/python3"


@pytest.fixture(autouse=True)
def _runc_available() -> None:
    require_runtime("oci", SETTINGS)


def ctx(
    worktree: Path, task: str = "t1", image: str | None = None, **policy: Any
) -> PrepareContext:
    return PrepareContext(
        task_id=task,
        run_id="r1",
        worktree_path=str(worktree),
        policy=SandboxPolicy(**policy),
        image=image,
    )


@contextlib.asynccontextmanager
async def sandbox(
    worktree: Path, cache_root: Path | None = None, **kw: Any
) -> AsyncIterator[Sandbox]:
    async with Sandbox(SETTINGS, env=dict(os.environ), cache_root=cache_root) as sb:
        await sb.prepare(ctx(worktree, **kw))
        yield sb


async def run(
    worktree: Path, command: str | list[str], opts: RunOptions | None = None, **kw: Any
) -> RunResult:
    async with sandbox(worktree, **kw) as sb:
        return await sb.run(command, opts)


def oci(sb: Sandbox) -> OciRuntime:
    assert isinstance(sb.runtime, OciRuntime)
    return sb.runtime


def new_marker() -> str:
    return f"fusion-oci-marker-{uuid.uuid4().hex[:12]}"


# --- bundles ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        {"allow_network": False, "memory_limit_mb": 128, "pids_limit": 64},
        {"network": "host"},
    ],
    ids=["none-limits", "host"],
)
def test_compiled_bundle_runs_unchanged_under_runc(
    worktree: Path, tmp_path: Path, oci_validator: Any, policy: Any
) -> None:
    host = probe_host()
    context = ctx(worktree, **policy)
    layout = resolve_layout(context, cache_root=tmp_path / "cache", ca_bundle=host.ca_bundle)
    spec = compile_spec(
        resolved(context, layout, host, dict(os.environ)),
        "echo hi; id -u; pwd; exit 5",
        RunOptions(),
    )
    oci_validator.validate(spec.to_oci())
    bundle = write_bundle(spec, tmp_path / "bundle")
    oci_validator.validate(json.loads(bundle.config_path.read_text()))
    cid = f"fusion-oci-test-{uuid.uuid4().hex[:8]}"
    root = tmp_path / "runc-state"
    try:
        done = subprocess.run(
            ["runc", "--root", str(root), "run", "--bundle", str(bundle.path), cid],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    finally:
        subprocess.run(
            ["runc", "--root", str(root), "delete", "--force", cid],
            capture_output=True,
            check=False,
        )
    assert done.returncode == 5, done.stderr
    assert done.stdout == f"hi\n{os.getuid()}\n{worktree.resolve()}\n"


def test_rootless_bundle_runs_under_an_unprivileged_runc(oci_validator: Any) -> None:
    """The rootless translation (one mapping: the caller to root inside, no cgroup limits)
    run by runc as an unprivileged user; what it writes is that user's on the host."""
    account, _ = checked_rootless_user(
        "oci", None, "switching to the rootless test user needs root"
    )
    # Not tmp_path: pytest's base directory is 0700 root, which the user cannot traverse.
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-rootless-", dir="/tmp"))
    try:
        wt = base / "wt"
        wt.mkdir()
        host = replace(probe_host(), uid=account.pw_uid, gid=account.pw_gid)
        context = ctx(wt, allow_network=False, memory_limit_mb=64)
        layout = resolve_layout(context, cache_root=base / "cache", ca_bundle=host.ca_bundle)
        spec = compile_spec(
            resolved(context, layout, host), "id -u; echo hi > f; exit 4", RunOptions()
        )
        rootless = bundle_spec(spec, rootless_ids=(account.pw_uid, account.pw_gid))
        oci_validator.validate(rootless.to_oci())
        bundle = write_bundle(rootless, base / "bundle")
        done = run_bundle_as(account, base, bundle.path, "rootless-1")
        assert done.returncode == 4, done.stderr
        assert done.stdout == "0\n"
        st = (wt / "f").stat()
        assert (st.st_uid, st.st_gid) == (account.pw_uid, account.pw_gid)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --- plan == launch ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy",
    [
        {"allow_network": False, "memory_limit_mb": 128, "pids_limit": 64},
        {"network": "egress"},
    ],
    ids=["none-limits", "egress"],
)
async def test_the_plan_is_exactly_what_execute_runs(
    worktree: Path, policy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """plan() of a command == the argv, env, cwd and config.json prepare started the task's
    container with, and the spawn frame execute then sent to its agent."""
    from fusion_oci.agent.client import Agent
    from fusion_oci.runtimes.oci.launch import TaskLaunch

    started: list[dict[str, Any]] = []
    sent: list[dict[str, Any]] = []
    real_cli, real_run = OciRuntime._spawn_cli, Agent.run

    async def spawn_cli(self: OciRuntime, launch: TaskLaunch, stdin: Any) -> Any:
        started.append(
            {
                "argv": launch.argv,
                "env": launch.env,
                "cwd": launch.cwd,
                "bundle": json.loads((Path(launch.cwd) / "config.json").read_text()),
            }
        )
        return await real_cli(self, launch, stdin)

    async def agent_run(self: Agent, argv: Any, **kw: Any) -> Any:
        sent.append(
            {
                "argv": list(argv),
                "env": dict(kw["env"]),
                "cwd": kw["cwd"],
                "rlimits": list(kw["rlimits"]),
            }
        )
        return await real_run(self, argv, **kw)

    monkeypatch.setattr(OciRuntime, "_spawn_cli", spawn_cli)
    monkeypatch.setattr(Agent, "run", agent_run)
    async with sandbox(worktree, **policy) as sb:
        rt = oci(sb)
        assert sb.task is not None
        plan = rt.plan(sb.task.process("echo planned", RunOptions()))
        r = await rt.execute(plan, RunOptions())
    assert (r.exit_code, r.stdout) == (0, "planned\n"), r.stderr
    assert plan.sandbox is not None
    assert started == [
        {
            "argv": plan.sandbox.argv,
            "env": plan.sandbox.env,
            "cwd": plan.sandbox.cwd,
            "bundle": json.loads(json.dumps(plan.bundle.to_oci())),
        }
    ]
    assert sent == [
        {
            "argv": list(plan.spawn.argv),
            "env": dict(plan.spawn.env),
            "cwd": plan.spawn.cwd,
            "rlimits": list(plan.spawn.rlimits),
        }
    ]


async def test_a_command_that_needs_another_container_is_refused(worktree: Path) -> None:
    from fusion_oci.errors import SandboxSetupError
    from fusion_oci.oci.model import User

    async with sandbox(worktree, allow_network=False) as sb:
        rt = oci(sb)
        assert sb.task is not None
        process = sb.task.process("echo no", RunOptions())
        other = process.model_copy(update={"user": User(uid=4242, gid=4242)})
        with pytest.raises(SandboxSetupError, match="container other than the task's"):
            await rt.execute(rt.plan(other), RunOptions())
        assert (await sb.run("echo yes")).stdout == "yes\n"


async def running(rt: OciRuntime) -> list[str]:
    """The ids of the task's running containers (its one, between commands)."""
    assert rt._task is not None
    return [
        c["id"]
        for c in await list_containers("runc", rt._task.root, os.environ)
        if c["status"] == "running"
    ]


# --- statuses ---------------------------------------------------------------------------------


async def test_timeout_leaves_no_process_and_no_runtime_state(worktree: Path) -> None:
    marker = new_marker()
    command = (
        f"sh -c 'sleep 1000' {marker} & "
        f"setsid sh -c 'sleep 1000' {marker}-setsid & "
        f"trap '' TERM; sleep 1000"
    )
    async with sandbox(worktree) as sb:
        runtime = oci(sb)
        start = time.monotonic()
        r = await sb.run(command, RunOptions(timeout_ms=1000))
        elapsed = time.monotonic() - start
        assert r.timed_out and r.reason == "timeout"
        assert r.shell_status == 124
        assert elapsed < 1 + 2 + 3, elapsed  # timeout + grace + slack
        assert pids_with(marker) == []
        assert runtime._task is not None
        task_dir, root = runtime._task.dir, runtime._task.root
        # The task's container stays, usable: the next command runs in it.
        assert len(await running(runtime)) == 1
        assert (await sb.run("echo next")).stdout == "next\n"
    assert not task_dir.exists()
    assert not root.exists()


async def test_max_buffer_ends_the_container(worktree: Path) -> None:
    marker = new_marker()
    async with sandbox(worktree) as sb:
        r = await sb.run(f"sh -c 'sleep 1000' {marker} & yes", RunOptions(max_buffer=10_000))
        assert r.truncated and r.reason == "max-buffer"
        assert len(r.stdout) == 10_000
        assert pids_with(marker) == []
        assert len(await running(oci(sb))) == 1
        assert (await sb.run("echo next")).stdout == "next\n"


async def test_abort_ends_the_container(worktree: Path) -> None:
    marker = new_marker()
    async with sandbox(worktree) as sb:
        task = asyncio.ensure_future(sb.run(f"sh -c 'sleep 1000' {marker}; :"))
        for _ in range(100):
            if pids_with(marker):
                break
            await asyncio.sleep(0.05)
        assert pids_with(marker)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pids_with(marker) == []
        assert len(await running(oci(sb))) == 1
        assert (await sb.run("echo next")).stdout == "next\n"


# --- limits -----------------------------------------------------------------------------------


# --- network ----------------------------------------------------------------------------------


def connect_script(targets: list[tuple[str, int]]) -> list[str]:
    code = (
        "import socket, sys\n"
        "for host, port in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    try:\n"
        "        socket.create_connection((host, int(port)), timeout=3).recv(5)\n"
        "        print(host, 'open')\n"
        "    except OSError as exc:\n"
        "        print(host, 'closed', type(exc).__name__)\n"
    )
    return [PYTHON3, "-c", code, *[str(x) for t in targets for x in t]]


async def test_network_none_has_no_route_to_a_host_loopback_server(worktree: Path) -> None:
    with tcp_server("127.0.0.1", b"hello\n") as (port, seen):
        async with sandbox(worktree, allow_network=False) as sb:
            r = await sb.run(connect_script([("127.0.0.1", port)]))
            assert r.stdout == "127.0.0.1 closed ConnectionRefusedError\n", r.stderr
            routes = await sb.run("cat /proc/net/route")
            assert routes.stdout.strip().count("\n") == 0  # the header line only
    assert seen == []


@pytest.fixture
def test_network() -> Iterator[str]:
    """A veth pair this test creates, with an address on the host side: an "outside" to reach
    over egress without sending a packet off the machine."""
    if os.geteuid() != 0:
        pytest.skip("creating the test network (a veth pair) needs root")
    name = f"fo{uuid.uuid4().hex[:6]}"
    address = "10.213.77.1"
    subprocess.run(
        ["ip", "link", "add", f"{name}h", "type", "veth", "peer", "name", f"{name}p"], check=True
    )
    try:
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", f"{name}h"], check=True)
        for end in ("h", "p"):
            subprocess.run(["ip", "link", "set", f"{name}{end}", "up"], check=True)
        yield address
    finally:
        subprocess.run(["ip", "link", "del", f"{name}h"], check=False)


THREADED_FETCH = (
    "import socket, sys, threading\n"
    "got = []\n"
    "def fetch():\n"
    '    socket.getaddrinfo("localhost", 80)\n'
    "    got.append(socket.create_connection((sys.argv[1], int(sys.argv[2])), 3).recv(6))\n"
    "t = threading.Thread(target=fetch); t.start(); t.join(); print(got)"
)


async def assert_egress_without_host_loopback(
    run_in: Callable[..., Awaitable[RunResult]], worktree: Path, test_network: str
) -> None:
    """Egress reaches a server in a test-made namespace, never the host's loopback (directly
    or through slirp's gateway). Shared by the runc and runsc tests."""
    with (
        tcp_server("127.0.0.1", b"hello\n") as (lo_port, lo_seen),
        tcp_server(test_network, b"hello\n") as (out_port, out_seen),
    ):
        r = await run_in(
            worktree,
            connect_script(
                [
                    ("127.0.0.1", lo_port),
                    ("10.0.2.2", lo_port),
                    (test_network, out_port),
                ]
            ),
            allow_network=True,
        )
        lines = r.stdout.splitlines()
        assert lines[0].startswith("127.0.0.1 closed"), r
        assert lines[1].startswith("10.0.2.2 closed"), r
        assert lines[2] == f"{test_network} open", r
        # Egress as a build uses it: curl, and a fetch on a thread of its own after a name
        # resolution (under runsc no thread could start once, so no resolver either).
        c = await run_in(
            worktree,
            "curl -sS --http0.9 --max-time 5 "
            f"http://{test_network}:{out_port}/ && "
            f"{PYTHON3} -c '{THREADED_FETCH}' {test_network} {out_port}",
            allow_network=True,
        )
        assert c.stdout == "hello\n[b'hello\\n']\n", c
    assert lo_seen == []
    assert len(out_seen) == 3


async def test_egress_reaches_out_but_not_host_loopback(worktree: Path, test_network: str) -> None:
    ok, why = OciRuntime(SETTINGS, dict(os.environ)).egress_status()
    require("oci", ok, f"egress: {why}")
    await assert_egress_without_host_loopback(run, worktree, test_network)


# --- files and git ----------------------------------------------------------------------------


async def test_a_file_written_to_the_worktree_is_the_callers(worktree: Path) -> None:
    r = await run(worktree, "echo made > made.txt && mkdir sub && touch sub/f")
    assert r.exit_code == 0, r.stderr
    for path in (worktree / "made.txt", worktree / "sub", worktree / "sub" / "f"):
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())


async def test_git_commit_in_a_linked_worktree(linked_worktree: tuple[Path, Path]) -> None:
    repo, wt = linked_worktree
    common = repo / ".git"
    command = (
        "echo change >> README && git add README && "
        "git -c user.name=sandbox -c user.email=s@example.invalid commit -qm 'from sandbox' && "
        f"if touch {common}/hooks/post-commit 2>/dev/null; then echo HOOKS-WRITABLE; fi; "
        f"if echo x >> {common}/config 2>/dev/null; then echo CONFIG-WRITABLE; fi; "
        "git status --porcelain"
    )
    r = await run(wt, command)
    assert r.exit_code == 0, r.stderr
    assert "WRITABLE" not in r.stdout
    assert git(wt, "log", "-1", "--format=%s").strip() == "from sandbox"
    assert not (common / "hooks" / "post-commit").exists()
    for obj in (common / "objects").rglob("*"):
        assert obj.stat().st_uid == os.getuid()


# --- leftovers --------------------------------------------------------------------------------


CRASHER = """
import asyncio, os, sys
from pathlib import Path
from fusion_oci.models import PrepareContext, RunOptions
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.resolve import compile_spec
from fusion_oci.runtimes.oci import runtime as oci
from fusion_oci.sandbox import Sandbox

async def main():
    oci.state_base = lambda env, uid: Path(sys.argv[1])
    sb = Sandbox(SandboxSettings(backend="oci"))
    await sb.prepare(PrepareContext(task_id="crash", run_id="r1", worktree_path=sys.argv[2]))
    await sb.run(f"sh -c 'sleep 1000' {os.environ['MARKER']}; :", RunOptions())

asyncio.run(main())
"""


async def test_gc_removes_what_a_kill_9_left(worktree: Path, tmp_path: Path) -> None:
    base = tmp_path / "state"
    marker = new_marker()
    # The marker goes by env: in the crasher's argv its forks would show it before exec.
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CRASHER,
        str(base),
        str(worktree),
        cwd=REPO,
        env={**os.environ, "MARKER": marker},
    )
    try:
        for _ in range(200):
            if pids_with(marker):
                break
            await asyncio.sleep(0.05)
        assert pids_with(marker), "the container never started"
        # A live owner's state is never collected.
        assert await gc_oci("runc", base) == []
        child.kill()
        await child.wait()
        # The agent lost its connection: it ends the command's tree (TERM, 1 s, KILL) and
        # exits, which stops the container; its state is what gc finds.
        for _ in range(100):
            if not pids_with(marker):
                break
            await asyncio.sleep(0.05)
        assert pids_with(marker) == []
        removed = await gc_oci("runc", base)
        assert len(removed) == 1 and removed[0].startswith("crash-r1-")
        assert pids_with(marker) == []
        assert list(base.iterdir()) == []
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        await gc_oci("runc", base)


async def test_parallel_tasks_neither_hang_nor_leak(tmp_path: Path) -> None:
    from tests.conftest import git_init

    async def one(i: int) -> tuple[RunResult, Path]:
        wt = git_init(tmp_path / f"task-{i}")
        async with sandbox(wt, task=f"par{i}") as sb:
            r = await sb.run(f"echo {i} > out && cat out")
            assert oci(sb)._task is not None
            return r, oci(sb)._task.dir  # type: ignore[union-attr]

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(8))), 120)
    for i, (r, task_dir) in enumerate(results):
        assert (r.exit_code, r.stdout) == (0, f"{i}\n")
        assert not task_dir.exists()


# --- image mode -------------------------------------------------------------------------------


def _layer(files: dict[str, bytes | None], modes: dict[str, int] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted({str(Path(n).parent) for n in files} - {"."}):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            raw = data or b""
            info.size, info.mode = len(raw), (modes or {}).get(name, 0o644)
            tar.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def docker_archive(tag: str) -> bytes:
    """A two-layer image with dash and its libraries; the second layer whites out a file."""
    sh = Path("/usr/bin/dash").read_bytes()
    libs = {}
    for line in subprocess.run(
        ["ldd", "/usr/bin/dash"], capture_output=True, text=True, check=True
    ).stdout.splitlines():
        path = next((p for p in line.split() if p.startswith("/")), None)
        if path:
            libs[path.lstrip("/")] = Path(path).read_bytes()
    base = _layer(
        {"bin/sh": sh, **libs, "etc/hello": b"hello from the image\n", "etc/gone": b"whited out\n"},
        {name: 0o755 for name in ["bin/sh", *libs]},
    )
    top = _layer({"etc/.wh.gone": None})
    layers = [base, top]
    diff_ids = ["sha256:" + hashlib.sha256(layer).hexdigest() for layer in layers]
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created_by": "fusion-oci test"}, {"created_by": "fusion-oci test"}],
        }
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    names = [f"{d.removeprefix('sha256:')}/layer.tar" for d in diff_ids]
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": names}]).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [
            ("manifest.json", manifest),
            (config_name, config),
            *zip(names, layers, strict=True),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def podman_image() -> Iterator[str]:
    url = os.environ.get("FUSION_OCI_PODMAN_URL", "unix:///run/podman/podman.sock")
    from podman import PodmanClient

    client = PodmanClient(base_url=url)
    try:
        client.version()
    except Exception as exc:  # any failure means: no podman service here
        client.close()
        require("podman", False, f"no podman API service at {url}: {exc}")
    tag = f"localhost/fusion-oci-test/oci-image:{uuid.uuid4().hex[:8]}"
    list(client.images.load(docker_archive(tag)))
    try:
        yield tag
    finally:
        with contextlib.suppress(Exception):
            client.images.remove(tag, force=True)
        client.close()


async def test_image_mode_runs_on_the_unpacked_image(
    worktree: Path, tmp_path: Path, podman_image: str
) -> None:
    cache = tmp_path / "cache"
    async with sandbox(worktree, cache_root=cache, image=podman_image, allow_network=False) as sb:
        r = await sb.run(
            'while read -r l; do echo "$l"; done < /etc/hello; echo /etc/*; echo made > in-worktree'
        )
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == "hello from the image"
        assert "/etc/gone" not in lines[1] and "/etc/hello" in lines[1]
        again = await sb.run("echo /usr/*")  # no host system directories in image mode
        assert again.stdout.strip() == "/usr/*"
    assert (worktree / "in-worktree").read_text() == "made\n"
    assert len(list((cache / "oci-rootfs").iterdir())) == 1
    # The engine flattened the image from a created container; that container is gone.
    from podman import PodmanClient

    from fusion_oci.images.rootfs import EXPORT_COMMAND

    url = os.environ.get("FUSION_OCI_PODMAN_URL", "unix:///run/podman/podman.sock")
    with PodmanClient(base_url=url) as client:
        left = [
            c.name
            for c in client.containers.list(all=True)
            if (c.attrs.get("Command") or [])[:1] == EXPORT_COMMAND[:1]
        ]
    assert left == []
