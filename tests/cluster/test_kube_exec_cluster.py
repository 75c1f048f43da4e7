"""``pods/exec`` over the API server's WebSocket (:mod:`fusion_oci.runtimes.kubernetes.execstream`)
against the real cluster.

One pod (passing Pod Security Admission's ``restricted`` level, enforced on its namespace) runs
``sleep``; each test opens streams into it: stdin to stdout through ``cat`` (a line, 20 MB both
ways with checksums), exit codes and stderr, stdin's end ending ``cat``, three streams at once,
backpressure (stdout not read: the buffer stays bounded), a 403 for an identity without
``pods/exec``, the ``v4.channel.k8s.io`` fallback, a pod deleted mid-stream, a connection
through a relay that goes silent or is cut (lost, not hung), and the worktree transfer
(``WorktreeSync`` against ``remote.py`` in the pod). ``test_measure`` prints the medians: a
fresh exec of ``true`` (ours and ``kubectl exec``) and a one-frame round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import statistics
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import pytest_asyncio

from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.runtimes.kubernetes import execstream
from fusion_oci.runtimes.kubernetes.client import ApiError
from fusion_oci.runtimes.kubernetes.execstream import (
    V4,
    V5,
    ExecError,
    ExecStream,
    ExecStreamLost,
    PodExec,
)
from fusion_oci.runtimes.kubernetes.kubeconfig import ClusterAccess, find_access
from tests.cluster.kube import Kube

POD = "exec-target"
REPO = "/work/repo"
MB = 1 << 20


@dataclass(frozen=True)
class Target:
    kube: Kube
    ns: str
    access: ClusterAccess
    pod_exec: PodExec
    """Built once: its TLS context (CA, client certificate) costs tens of ms to load."""


def restricted_pod(kube: Kube, name: str) -> dict[str, Any]:
    """A pod of the task image that passes ``restricted``, with a writable /work."""
    pod = kube.pod(name, ["sleep", "3600"])
    spec = pod["spec"]
    spec["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    spec["volumes"] = [{"name": "work", "emptyDir": {}}]
    spec["containers"][0].update(
        securityContext={
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
        volumeMounts=[{"name": "work", "mountPath": "/work"}],
        env=[{"name": "HOME", "value": "/work"}],
    )
    return pod


@pytest.fixture(scope="module")
def target(kube: Kube) -> Iterator[Target]:
    """A namespace of this module's, enforcing ``restricted``, with one running pod."""
    ns = f"t-exec-{uuid.uuid4().hex[:8]}"
    kube.run("create", "namespace", ns)
    try:
        kube.run(
            "label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted",
            "pod-security.kubernetes.io/enforce-version=latest",
        )  # fmt: skip
        kube.run("-n", ns, "wait", "--for=create", "serviceaccount/default", "--timeout=60s")
        kube.apply(restricted_pod(kube, POD), namespace=ns)
        kube.wait_ready(ns, POD)
        access = find_access(KubernetesSettings(), {"KUBECONFIG": str(kube.kubeconfig)})
        assert access is not None
        yield Target(kube, ns, access, PodExec(access))
    finally:
        kube.run("delete", "namespace", ns, "--wait=false", check=False)


@pytest_asyncio.fixture
async def cat(target: Target) -> AsyncIterator[ExecStream]:
    stream = await target.pod_exec.open(target.ns, POD, ["cat"])
    try:
        yield stream
    finally:
        await stream.close()


async def run(target: Target, *argv: str, **kwargs: Any) -> tuple[int, bytes, ExecStream]:
    """``argv`` without stdin: its exit code and stdout."""
    async with await target.pod_exec.open(
        target.ns, POD, list(argv), stdin=False, **kwargs
    ) as stream:
        out = b""
        while chunk := await asyncio.wait_for(stream.read(), 60):
            out += chunk
        return await stream.wait(60), out, stream


async def test_a_line_round_trips_through_cat_and_stdin_end_ends_it(cat: ExecStream) -> None:
    assert cat.protocol == V5
    await cat.write(b"hello\n")
    assert await asyncio.wait_for(cat.readline(100), 20) == b"hello\n"
    await cat.write(b"no newline")
    await cat.close_stdin()
    assert await asyncio.wait_for(cat.read(), 20) == b"no newline"
    assert await asyncio.wait_for(cat.read(), 20) == b""
    assert await cat.wait(20) == 0
    with pytest.raises(ExecError, match="stdin is closed"):
        await cat.write(b"more")


async def test_a_quiet_stream_stays_open_on_pings(target: Target) -> None:
    # nothing but pings for 6 intervals: the API server's pongs keep it from being lost
    async with await target.pod_exec.open(target.ns, POD, ["cat"], ping_interval_s=0.5) as stream:
        await asyncio.sleep(3)
        await stream.write(b"still here\n")
        assert await asyncio.wait_for(stream.readline(100), 20) == b"still here\n"
        assert "running" in stream.describe()


async def test_twenty_megabytes_both_ways(cat: ExecStream) -> None:
    data = os.urandom(20 * MB)

    async def feed() -> None:
        for i in range(0, len(data), 3 * MB):  # pieces unaligned with frames and reads
            await cat.write(data[i : i + 3 * MB])
        await cat.close_stdin()

    writer = asyncio.ensure_future(feed())
    got = hashlib.sha256()
    size = 0
    while chunk := await asyncio.wait_for(cat.read(1 << 18), 60):
        got.update(chunk)
        size += len(chunk)
    await writer
    assert size == len(data)
    assert got.hexdigest() == hashlib.sha256(data).hexdigest()
    assert await cat.wait(20) == 0


async def test_stdout_is_not_buffered_without_bound(target: Target) -> None:
    total = 24 * MB
    async with await target.pod_exec.open(
        target.ns, POD, ["head", "-c", str(total), "/dev/zero"], stdin=False,
        buffer_limit=MB,
    ) as stream:  # fmt: skip
        await asyncio.sleep(3)  # not reading: the command must be held back, not buffered
        held = len(stream._stdout)
        assert MB <= held <= MB + execstream.MAX_MESSAGE, held
        assert stream.describe().split(" (")[1].startswith("running")
        size = 0
        while chunk := await asyncio.wait_for(stream.read(), 60):
            size += len(chunk)
        assert size == total and await stream.wait(20) == 0
    # readexactly may ask for more than the limit: the buffer grows to that, no further
    async with await target.pod_exec.open(
        target.ns, POD, ["head", "-c", str(4 * MB), "/dev/zero"], stdin=False,
        buffer_limit=MB,
    ) as stream:  # fmt: skip
        assert await asyncio.wait_for(stream.readexactly(3 * MB), 60) == bytes(3 * MB)
        with pytest.raises(asyncio.IncompleteReadError) as info:
            await asyncio.wait_for(stream.readexactly(2 * MB), 60)
        assert len(info.value.partial) == MB


@pytest.mark.parametrize(
    ("script", "code"),
    [("true", 0), ("exit 3", 3), ("kill -9 $$", 137), ("kill -TERM $$", 143)],
)
async def test_exit_codes(target: Target, script: str, code: int) -> None:
    status, out, _ = await run(target, "sh", "-c", script)
    assert (status, out) == (code, b"")


async def test_stderr_is_kept_or_handed_on(target: Target) -> None:
    status, out, stream = await run(target, "sh", "-c", "echo out; echo err >&2; exit 2")
    assert (status, out, stream.stderr) == (2, b"out\n", b"err\n")
    assert "(exit 2); stderr: err" in stream.describe()
    # bounded: the last stderr_limit bytes
    _, _, stream = await run(
        target, "sh", "-c", "head -c 100000 /dev/zero | tr '\\0' a >&2; echo END >&2",
        stderr_limit=1000,
    )  # fmt: skip
    assert len(stream.stderr) == 1000 and stream.stderr.endswith(b"aEND\n")
    pieces: list[bytes] = []
    _, _, stream = await run(target, "sh", "-c", "echo one >&2", on_stderr=pieces.append)
    assert b"".join(pieces) == b"one\n" and stream.stderr == b""


async def test_a_command_that_cannot_start_is_an_error(target: Target) -> None:
    with pytest.raises(ExecError, match="could not run") as info:
        await run(target, "no-such-program")
    assert "executable file not found" in info.value.why


async def test_three_streams_at_once(target: Target) -> None:
    pod_exec = target.pod_exec

    async def echo(n: int) -> bytes:
        async with await pod_exec.open(target.ns, POD, ["cat"]) as stream:
            payload = f"stream {n}\n".encode() * 1000
            await stream.write(payload)
            got = await asyncio.wait_for(stream.readexactly(len(payload)), 30)
            await stream.close_stdin()
            assert await stream.wait(20) == 0
            return got

    results = await asyncio.gather(*(echo(n) for n in range(3)))
    assert results == [f"stream {n}\n".encode() * 1000 for n in range(3)]


async def test_an_identity_without_pods_exec_gets_the_api_error(target: Target) -> None:
    kube, ns = target.kube, target.ns
    kube.run("-n", ns, "create", "serviceaccount", "noexec")
    token = kube.run("-n", ns, "create", "token", "noexec", "--duration=10m").stdout.strip()
    access = ClusterAccess(
        server=target.access.server, namespace=ns, source="test",
        ca_file=target.access.ca_file, ca_data=target.access.ca_data, token=token,
    )  # fmt: skip
    with pytest.raises(ApiError) as info:
        await PodExec(access).open(ns, POD, ["true"])
    err = info.value
    assert (err.status, err.reason, err.kind) == (403, "Forbidden", "engine-error")
    assert "pods/exec" in err.why and "docs/kubernetes.md" in err.hint
    # and no answer at all is the same transient error a JSON call gives
    with pytest.raises(ApiError) as info:
        dead = ClusterAccess(server="https://127.0.0.1:9", namespace=ns, source="test")
        await PodExec(dead, timeout_s=5).open(ns, POD, ["true"])
    assert info.value.status == 0 and info.value.transient


async def test_v4_works_but_cannot_end_stdin_alone(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(execstream, "PROTOCOLS", (V4,))
    async with await target.pod_exec.open(target.ns, POD, ["cat"]) as stream:
        assert stream.protocol == V4
        await stream.write(b"four\n")
        assert await asyncio.wait_for(stream.readline(100), 20) == b"four\n"
        with pytest.raises(ExecError, match="cannot end the stdin") as info:
            await stream.close_stdin()
        assert V4 in info.value.why and "1.30" in info.value.hint
    status, out, _ = await run(target, "sh", "-c", "echo v4; exit 4")
    assert (status, out) == (4, b"v4\n")


async def test_the_pod_deleted_mid_stream_ends_it(target: Target) -> None:
    kube, ns = target.kube, target.ns
    kube.apply(restricted_pod(kube, "doomed"), namespace=ns)
    kube.wait_ready(ns, "doomed")
    pod_exec = target.pod_exec
    async with await pod_exec.open(ns, "doomed", ["cat"]) as stream:
        await stream.write(b"alive\n")
        assert await asyncio.wait_for(stream.readline(100), 20) == b"alive\n"
        started = time.monotonic()
        await asyncio.to_thread(
            kube.run, "-n", ns, "delete", "pod", "doomed", "--grace-period=0", "--force",
            "--wait=false",
        )  # fmt: skip
        # the stream ends (stdout's end, then the command's fate), in seconds, not never
        assert await asyncio.wait_for(stream.read(), 60) == b""
        try:
            code: int | None = await stream.wait(5)
        except ExecStreamLost:
            code = None
        assert code in (None, 137), code  # killed with the pod, or the stream cut
        assert time.monotonic() - started < 60
        with pytest.raises(ExecStreamLost) as lost:
            await stream.write(b"more\n")
        assert isinstance(lost.value, ConnectionError)
    with pytest.raises(ApiError) as info:
        await pod_exec.open(ns, "doomed", ["true"])
    assert info.value.status == 404


class Relay:
    """A TCP relay on loopback to the API server that can freeze (hold both sockets, pass
    nothing: a node or network gone silent) or cut (drop every connection)."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.frozen = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self.writers += [writer, up_writer]
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pipe(src, dst))
            self.tasks.add(task)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                if self.frozen.is_set():
                    await asyncio.Event().wait()  # hold on, pass nothing, until cancelled
                dst.write(data)
                await dst.drain()
        dst.close()

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()

    async def close(self) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        self.cut()
        await self.server.wait_closed()


async def test_a_connection_gone_silent_or_cut_is_lost_not_hung(target: Target) -> None:
    server = urlsplit(target.access.server)
    assert server.hostname and server.port
    relay = Relay(server.hostname, server.port)
    port = await relay.start()
    pod_exec = PodExec(target.access)
    # through the relay, TLS still checks the API server's own name
    pod_exec._target = dataclasses.replace(
        pod_exec._target, host="127.0.0.1", port=port, server_name=server.hostname
    )
    try:
        for fault in ("freeze", "cut"):
            stream = await pod_exec.open(target.ns, POD, ["cat"], ping_interval_s=0.5)
            await stream.write(b"before\n")
            assert await asyncio.wait_for(stream.readline(100), 20) == b"before\n"
            started = time.monotonic()
            if fault == "freeze":
                relay.frozen.set()
            else:
                relay.cut()
            with pytest.raises(ExecStreamLost) as lost:
                await asyncio.wait_for(stream.read(), 20)
            assert time.monotonic() - started < 5
            if fault == "freeze":
                assert "nothing heard from the API server" in lost.value.why
            else:
                assert "closed without a WebSocket close" in lost.value.why
            assert "lost:" in stream.describe()
            with pytest.raises(ExecStreamLost):
                await stream.wait(5)
            await stream.close()
            relay.frozen.clear()
    finally:
        await relay.close()


async def test_the_worktree_transfer_runs_over_an_exec_stream(
    target: Target, tmp_path: Path
) -> None:
    from fusion_oci.runtimes.kubernetes.sync import WorktreeSync, remote_argv
    from tests.sync_world import GIT_ENV, git, make_host

    host = tmp_path / "host"
    make_host(host)
    pod_exec = target.pod_exec
    await run(target, "rm", "-rf", REPO)
    stream = await pod_exec.open(target.ns, POD, remote_argv(REPO))
    sync = WorktreeSync(host, stream, tmp_path / "state", env=GIT_ENV)
    try:
        await sync.open()
        (host / "src" / "b.ts").write_text("export const b = 2;\n")  # untracked, pushed too
        assert await sync.push()
        # a command, in another exec: edit, add a file, commit on the task branch
        change = (
            f"cd {REPO} && cat src/b.ts > copied.ts && echo changed >> README.md && "
            "git -c user.name=pod -c user.email=pod@example.invalid add -A && "
            "git -c user.name=pod -c user.email=pod@example.invalid commit -qm 'in the pod'"
        )
        status, _, done = await run(target, "sh", "-ec", change)
        assert status == 0, done.stderr
        report = await sync.pull()
        assert sorted(report.written) == ["README.md", "copied.ts"], report
        assert report.branch.startswith("updated"), report
        assert (host / "copied.ts").read_text() == "export const b = 2;\n"
        assert (host / "README.md").read_text() == "hello\nchanged\n"
        assert git(host, "log", "-1", "--format=%s") == "in the pod\n"
        assert not await sync.push()  # nothing changed since: nothing crosses
    finally:
        await sync.close()


async def test_measure(target: Target, capsys: pytest.CaptureFixture[str]) -> None:
    """Medians: a fresh exec of ``true`` (ours, ``kubectl exec``; 20 each) and one small
    frame through an open ``cat`` (200)."""
    pod_exec = target.pod_exec
    ours = []
    for _ in range(20):
        started = time.perf_counter()
        status, _, _ = await run(target, "true")
        ours.append(time.perf_counter() - started)
        assert status == 0
    kube = target.kube
    argv = [str(kube.kubectl), "--kubeconfig", str(kube.kubeconfig), "-n", target.ns]
    kubectl = []
    for _ in range(20):
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *argv, "exec", POD, "--", "true", stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        kubectl.append(time.perf_counter() - started)
    trips = []
    async with await pod_exec.open(target.ns, POD, ["cat"]) as stream:
        for _ in range(200):
            started = time.perf_counter()
            await stream.write(b"x\n")
            assert await asyncio.wait_for(stream.readexactly(2), 20) == b"x\n"
            trips.append(time.perf_counter() - started)
    ms = {
        "exec true, ours": statistics.median(ours) * 1000,
        "exec true, kubectl exec": statistics.median(kubectl) * 1000,
        "one frame round trip": statistics.median(trips) * 1000,
    }
    with capsys.disabled():
        print("\n" + "\n".join(f"  {k}: median {v:.1f} ms" for k, v in ms.items()))
    assert ms["exec true, ours"] < ms["exec true, kubectl exec"]
    assert ms["one frame round trip"] < ms["exec true, ours"]
