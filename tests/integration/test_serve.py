"""`fusion-oci serve`, spoken to as a client would: bad messages get JSON-RPC errors and the
server keeps serving; cancel aborts; a client that goes away leaves nothing running."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests.hostside import pids_with

pytestmark = pytest.mark.native
ROOT = Path(__file__).resolve().parents[2]


class Client:
    def __init__(self, rfile: IO[bytes], wfile: IO[bytes]) -> None:
        self.rfile, self.wfile = rfile, wfile
        self.ids = iter(range(1, 1 << 30))
        self.notes: list[dict[str, Any]] = []

    def raw(self, body: bytes) -> None:
        self.wfile.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.wfile.flush()

    def send(self, method: str, params: Any = None, rid: int | None = None) -> int:
        rid = next(self.ids) if rid is None else rid
        self.raw(
            json.dumps(
                {"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}}
            ).encode()
        )
        return rid

    def recv(self) -> dict[str, Any]:
        header = b""
        while not header.endswith(b"\r\n\r\n"):
            byte = self.rfile.read(1)
            assert byte, "the server closed the stream"
            header += byte
        length = int(header.split(b":")[1].split(b"\r")[0])
        message: dict[str, Any] = json.loads(self.rfile.read(length))
        return message

    def reply(self, rid: int | None = None) -> dict[str, Any]:
        while True:
            message = self.recv()
            if "method" in message and "id" not in message:
                self.notes.append(message)
                continue
            if rid is None or message.get("id") in (rid, None):
                return message

    def call(self, method: str, params: Any = None) -> dict[str, Any]:
        return self.reply(self.send(method, params))

    def prepare(self, worktree: Path, **extra: Any) -> str:
        answer = self.call(
            "prepare",
            {"context": {"taskId": "t1", "runId": "r1", "worktreePath": str(worktree)}, **extra},
        )
        sandbox_id: str = answer["result"]["sandboxId"]
        return sandbox_id


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[bytes], Client]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusion_oci.cli.main", "serve", "--max-message-bytes", "4096"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_env(),
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        yield proc, Client(proc.stdout, proc.stdin)
    finally:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _alive(client: Client) -> None:
    assert client.call("initialize")["result"]["protocolVersion"] == "1.0"


def test_malformed_json_is_a_parse_error_and_serving_goes_on(server: Any) -> None:
    _, client = server
    client.raw(b'{"jsonrpc": "2.0", "id": 1, "method": ')
    answer = client.reply()
    assert answer["error"]["code"] == -32700
    assert answer["id"] is None
    _alive(client)


def test_a_stream_without_framing_gets_a_parse_error_then_is_closed(server: Any) -> None:
    proc, client = server
    client.wfile.write(b'{"jsonrpc": "2.0", "id": 1, "method": "initialize"}\r\n\r\n')
    client.wfile.flush()
    answer = client.reply()
    assert answer["error"]["code"] == -32700
    assert answer["error"]["message"].startswith("unreadable message")
    assert proc.wait(15) == 0  # no way to find the next message: the session ends cleanly


def test_unknown_method_lists_the_real_ones(server: Any) -> None:
    _, client = server
    answer = client.call("nosuch")
    assert answer["error"]["code"] == -32601
    assert "prepare" in answer["error"]["data"]["hint"]
    _alive(client)


def test_oversized_message_is_refused_unread_and_serving_goes_on(server: Any) -> None:
    _, client = server
    client.send("run", {"sandboxId": "x", "command": "x" * 10_000})
    answer = client.reply()
    assert answer["error"]["code"] == -32600
    assert "over the limit of 4096" in answer["error"]["message"]
    _alive(client)


def test_not_jsonrpc_and_bad_params_are_errors(server: Any, worktree: Path) -> None:
    _, client = server
    client.raw(b'{"id": 7, "method": "initialize"}')
    assert client.reply()["error"]["code"] == -32600
    client.raw(b'[{"jsonrpc": "2.0", "id": 8, "method": "initialize"}]')
    assert client.reply()["error"]["code"] == -32600
    answer = client.call("prepare", {"context": {"taskId": "t1"}})
    assert answer["error"]["code"] == -32602
    assert answer["error"]["data"]["kind"] == "bad-flags"
    answer = client.call(
        "prepare",
        {
            "context": {"taskId": "t", "runId": "r", "worktreePath": str(worktree)},
            "settings": {"backend": "bubblewarp"},
        },
    )
    assert answer["error"]["code"] == -32000
    assert answer["error"]["data"]["kind"] == "bad-settings"
    _alive(client)


def test_run_on_a_disposed_sandbox_is_an_error(server: Any, worktree: Path) -> None:
    _, client = server
    sandbox = client.prepare(worktree)
    assert client.call("dispose", {"sandboxId": sandbox})["result"] == {"disposed": True}
    answer = client.call("run", {"sandboxId": sandbox, "command": "true"})
    assert answer["error"]["code"] == -32602
    assert answer["error"]["data"]["kind"] == "bad-flags"
    assert "disposed" in answer["error"]["data"]["why"]
    _alive(client)


def test_output_streams_as_notifications_with_bytes_kept(server: Any, worktree: Path) -> None:
    _, client = server
    sandbox = client.prepare(worktree)
    rid = client.send(
        "run",
        {
            "sandboxId": sandbox,
            "execId": "e1",
            "command": "printf 'a\\377'; cat >&2",
            "options": {"stdin": base64.b64encode(b"in\n").decode()},
        },
    )
    result = client.reply(rid)["result"]
    assert result["exitCode"] == 0
    assert result["stderr"] == "in\n"
    chunks = [
        (n["params"]["stream"], base64.b64decode(n["params"]["data"]))
        for n in client.notes
        if n["params"]["execId"] == "e1"
    ]
    assert b"".join(c for s, c in chunks if s == "stdout") == b"a\xff"


def _responses(client: Client, *rids: int) -> dict[int, dict[str, Any]]:
    got: dict[int, dict[str, Any]] = {}
    while len(got) < len(rids):
        message = client.reply()
        got[message["id"]] = message
    return got


def _wait_output(client: Client) -> None:
    while not client.notes:
        message = client.recv()
        assert "id" not in message, message
        client.notes.append(message)


def test_cancel_aborts_the_run_and_ends_its_tree(server: Any, worktree: Path) -> None:
    _, client = server
    marker = f"fusion-oci-serve-cancel-{os.getpid()}-{time.monotonic_ns()}"
    sandbox = client.prepare(worktree)
    rid = client.send(
        "run",
        {
            "sandboxId": sandbox,
            "execId": "e1",
            "command": f"echo started; sh -c 'sleep 100; :' {marker}",
        },
    )
    _wait_output(client)
    cancel = client.send("cancel", {"execId": "e1"})
    got = _responses(client, rid, cancel)
    assert got[cancel]["result"] == {"cancelled": True}
    result = got[rid]["result"]
    assert (result["reason"], result["exitCode"], result["signal"]) == ("aborted", None, "SIGTERM")
    assert result["stdout"] == "started\n"
    _assert_gone(marker)
    _alive(client)


def test_cancel_request_of_a_run_aborts_it(server: Any, worktree: Path) -> None:
    _, client = server
    sandbox = client.prepare(worktree)
    rid = client.send(
        "run", {"sandboxId": sandbox, "execId": "named", "command": "echo started; sleep 100"}
    )
    _wait_output(client)
    client.raw(
        json.dumps({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": rid}}).encode()
    )
    result = client.reply(rid)["result"]
    assert (result["reason"], result["stdout"]) == ("aborted", "started\n")
    _alive(client)


def test_client_gone_ends_every_tree_and_the_server(server: Any, worktree: Path) -> None:
    proc, client = server
    marker = f"fusion-oci-serve-eof-{os.getpid()}-{time.monotonic_ns()}"
    sandbox = client.prepare(worktree)
    for n in range(3):
        client.send(
            "run",
            {
                "sandboxId": sandbox,
                "execId": f"e{n}",
                "command": f"echo up; setsid sh -c 'sleep 100; :' {marker} & "
                f"sh -c 'sleep 100; :' {marker}",
            },
        )
    while len({m["params"]["execId"] for m in client.notes}) < 3:
        client.notes.append(client.recv())
    assert len(pids_with(marker)) >= 3
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(15) == 0
    _assert_gone(marker)


def test_concurrent_runs_on_one_sandbox(server: Any, worktree: Path) -> None:
    _, client = server
    sandbox = client.prepare(worktree)
    rids = [
        client.send(
            "run",
            {"sandboxId": sandbox, "command": f"sleep 0.3; echo {n}", "options": {"stream": False}},
        )
        for n in range(8)
    ]
    got = _responses(client, *rids)
    assert [got[r]["result"]["stdout"] for r in rids] == [f"{n}\n" for n in range(8)]
    assert client.notes == []


def test_socket_is_0600_and_an_existing_path_is_refused(tmp_path: Path) -> None:
    taken = tmp_path / "file"
    taken.write_text("x")
    refused = subprocess.run(
        [sys.executable, "-m", "fusion_oci.cli.main", "serve", "--socket", str(taken)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert refused.returncode == 2
    assert "not a socket" in refused.stderr
    path = tmp_path / "s.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # a socket file nobody listens on: replaced
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusion_oci.cli.main", "serve", "--socket", str(path)],
        env=_env(),
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        assert b"listening" in proc.stderr.readline()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(str(path))
        with conn, conn.makefile("rb") as rfile, conn.makefile("wb") as wfile:
            _alive(Client(rfile, wfile))
        again = subprocess.run(
            [sys.executable, "-m", "fusion_oci.cli.main", "serve", "--socket", str(path)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert again.returncode == 2
        assert "already listening" in again.stderr
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
        assert proc.stderr is not None
        proc.stderr.close()
    assert not path.exists()


def _assert_gone(marker: str) -> None:
    deadline = time.monotonic() + 10
    while pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_with(marker) == []


@pytest.mark.podman
def test_ask_gates_are_requests_to_the_client(server: Any, worktree: Path) -> None:
    from tests.backends import require_runtime
    from tests.integration.container_cases import engine_settings

    require_runtime("podman", engine_settings("podman"))
    _, client = server
    rid = client.send(
        "prepare",
        {
            "context": {"taskId": "t1", "runId": "r1", "worktreePath": str(worktree)},
            "sandboxId": "mine",
            "ask": True,
            "backend": "podman",
            "settings": {
                "podmanUrl": os.environ.get("FUSION_OCI_PODMAN_URL"),
                "image": "localhost/fusion-oci-test/absent:1",
            },
        },
    )
    asked: list[dict[str, Any]] = []
    while True:
        message = client.recv()
        if message.get("method") == "ask":
            asked.append(message["params"])
            allow = message["params"]["gate"] == "sandbox_provision"
            client.raw(
                json.dumps(
                    {"jsonrpc": "2.0", "id": message["id"], "result": {"allow": allow}}
                ).encode()
            )
        elif message.get("id") == rid:
            break
    assert message["error"]["data"]["kind"] == "gate-denied"
    assert [(a["sandboxId"], a["gate"]) for a in asked] == [
        ("mine", "sandbox_provision"),
        ("mine", "network_api"),
    ]
    assert asked[0]["target"] == "localhost/fusion-oci-test/absent:1"
    _alive(client)


def test_a_client_that_reads_slowly_holds_the_command_not_the_servers_memory(
    server: Any, worktree: Path
) -> None:
    """Output notifications are bounded: past ~1 MiB unsent the server stops reading the
    command's pipes (so the command waits on its writes) until the client reads again."""
    proc, client = server
    sandbox = client.prepare(worktree)
    counter = worktree / "written"
    # 120 x 64 KiB: under the run's maxBuffer (10 MiB kept), far over what may wait unsent.
    script = (
        f"i=0; while [ $i -lt 120 ]; do head -c 65536 /dev/zero; i=$((i+1)); "
        f"echo $i > {counter}; done"
    )

    def count() -> int:  # the shell rewrites the file: retry a half-written read
        for _ in range(50):
            text = counter.read_text().strip() if counter.exists() else "0"
            if text:
                return int(text)
            time.sleep(0.01)
        return 0

    def rss_kib() -> int:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1])

    before = rss_kib()
    rid = client.send("run", {"sandboxId": sandbox, "command": script})
    time.sleep(6)  # we read nothing meanwhile
    held = count()
    assert held < 60, f"the command wrote {held} x 64 KiB to a client not reading"
    assert rss_kib() - before < 32 * 1024
    answer = client.reply(rid)  # reading resumes the command, to its end
    assert answer["result"]["exitCode"] == 0, answer
    assert count() == 120


@pytest.mark.parametrize("backend", ["bubblewrap", "landlock"])
def test_prepare_reports_the_published_ports(server: Any, worktree: Path, backend: str) -> None:
    """policy.publishPorts: the host port chosen for an entry that named none is in
    prepare's answer (the backend by the task prompt's line), listening until dispose."""
    import socket

    from tests.backends import require_runtime

    require_runtime(backend)
    # landlock: the project outside the worktree (its .fusion/ the command cannot write).
    project = worktree.parent / "project"
    project.mkdir(exist_ok=True)
    _, client = server
    answer = client.call(
        "prepare",
        {
            "context": {
                "taskId": "t-pub",
                "runId": "r1",
                "worktreePath": str(worktree),
                "policy": {"network": "none", "publishPorts": ["3000"]},
            },
            "taskPrompt": f"**Sandbox:** {backend}",
            **({"projectDir": str(project)} if backend == "landlock" else {}),
        },
    )
    result = answer["result"]
    assert result["backend"] == backend, answer
    [published] = result["published"]
    assert published["port"] == 3000 and published["address"] == "127.0.0.1"
    assert published["url"] == f"http://127.0.0.1:{published['hostPort']}/"
    with socket.create_connection(("127.0.0.1", published["hostPort"]), timeout=2):
        pass  # listening (nothing inside answers: the agent or the carrier closes it)
    assert client.call("dispose", {"sandboxId": result["sandboxId"]})["result"] == {
        "disposed": True
    }
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", published["hostPort"]), timeout=2).close()
    _alive(client)
