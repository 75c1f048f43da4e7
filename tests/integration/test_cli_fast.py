"""The fast front end (fusion_oci/cli/fast.py), run as the console script runs it, with `run`
going through a real resident server in a runtime dir of the test's own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.native


def fast(*args: str, cwd: Path, env: dict[str, str], **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "fusion_oci.cli.fast", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def done(proc: subprocess.Popen[bytes], timeout: float = 60) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(), err.decode()


def call(*args: str, cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    return done(fast(*args, cwd=cwd, env=env, stdin=subprocess.DEVNULL))


def rpc(path: Path, *messages: dict[str, object]) -> list[dict[str, object]]:
    """Send messages on a fresh connection; the replies (one per message with an id)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        for m in messages:
            body = json.dumps({"jsonrpc": "2.0", **m}).encode()
            sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        want = sum(1 for m in messages if "id" in m)
        buf, out = b"", []
        while len(out) < want:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
            while b"\r\n\r\n" in buf:
                head, rest = buf.split(b"\r\n\r\n", 1)
                length = int(head.split(b":")[1])
                if len(rest) < length:
                    break
                out.append(json.loads(rest[:length]))
                buf = rest[length:]
        return out


class Resident:
    """The test's runtime dir, and the servers started in it (ended by pid at teardown)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.dir = base / "fusion-oci"

    def sockets(self) -> list[Path]:
        return sorted(self.dir.glob("*.sock")) if self.dir.is_dir() else []

    def token(self) -> str:
        return (self.dir / "token").read_text().strip()

    def pid(self, sock: Path) -> int:
        reply = rpc(sock, {"id": 1, "method": "initialize", "params": {"token": self.token()}})
        return int(reply[0]["result"]["pid"])  # type: ignore[index]

    def stop(self) -> None:
        for sock in self.sockets():
            with contextlib.suppress(OSError, KeyError, IndexError):
                os.kill(self.pid(sock), signal.SIGTERM)


@pytest.fixture
def resident(tmp_path: Path) -> Iterator[Resident]:
    base = tmp_path / "xdg"
    base.mkdir(mode=0o700)
    r = Resident(base)
    yield r
    r.stop()


@pytest.fixture
def wt(tmp_path: Path) -> Path:
    worktree = tmp_path / "wt"
    worktree.mkdir()
    subprocess.run(["git", "init", "-q", str(worktree)], check=True)
    return worktree


@pytest.fixture
def env(resident: Resident, tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "XDG_RUNTIME_DIR": str(resident.base),
        "HOME": str(home),
        "FUSION_OCI_SERVER_IDLE": "30",
    }


def test_help_lists_every_command_and_option(wt: Path, env: dict[str, str]) -> None:
    from typer.main import get_command

    from fusion_oci.cli.main import _mount_images, app

    _mount_images([])
    group = get_command(app)
    for flag in ("--help", "-h"):
        code, out, _ = call(flag, cwd=wt, env=env)
        assert code == 0
        for name in group.commands:  # type: ignore[attr-defined]
            assert f"  {name} " in out
    code, out, _ = call("run", "--help", cwd=wt, env=env)
    assert code == 0
    run = group.commands["run"]  # type: ignore[attr-defined]
    for param in run.params:
        for opt in param.opts:
            if opt.startswith("-"):
                assert opt in out, opt
    assert call("--version", cwd=wt, env=env)[1].startswith("fusion-oci ")


def test_run_goes_through_the_resident_server(
    wt: Path, env: dict[str, str], resident: Resident
) -> None:
    code, out, err = call(
        "run", "--", "sh", "-c", "echo out; echo err >&2; exit 3", cwd=wt, env=env
    )
    assert (code, out) == (3, "out\n")
    assert "err\n" in err and "native backend isolates nothing" in err
    [sock] = resident.sockets()
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(resident.dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((resident.dir / "token").stat().st_mode) == 0o600
    pid = resident.pid(sock)
    assert call("run", "--", "true", cwd=wt, env=env)[0] == 0
    assert resident.pid(sock) == pid  # the same server, warm


def test_same_results_as_in_process(wt: Path, env: dict[str, str], tmp_path: Path) -> None:
    """The server resolves from the caller's cwd and env: the command sees the caller's
    environment and working directory, relative flags are the caller's."""
    (wt / "sub").mkdir()
    (wt / "sub" / "prompt.md").write_text("**Sandbox:** native\n")
    cmd = [
        "run",
        "--cwd",
        "sub",
        "--task-prompt",
        "prompt.md",
        "--json",
        "--",
        "sh",
        "-c",
        'echo "$FUSION_FAST_PROBE:$(pwd)"; umask',
    ]
    env = {**env, "FUSION_FAST_PROBE": "seen"}
    code, out, _ = call(*cmd, cwd=wt / "sub", env=env)
    here = subprocess.run(
        [sys.executable, "-m", "fusion_oci.cli.main", *cmd],
        cwd=wt / "sub",
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert code == here.returncode == 0
    assert json.loads(out)["stdout"] == json.loads(here.stdout)["stdout"]
    assert json.loads(out)["stdout"].startswith(f"seen:{wt / 'sub'}\n")


def test_exit_statuses(wt: Path, env: dict[str, str]) -> None:
    assert call("run", "--", "true", cwd=wt, env=env)[0] == 0
    assert call("run", "--", "sh", "-c", "exit 3", cwd=wt, env=env)[0] == 3
    code, _, err = call("run", "--timeout-ms", "300", "--", "sleep", "5", cwd=wt, env=env)
    assert code == 124 and "timed out after 300 ms" in err
    code, _, err = call(
        "run",
        "--backend",
        "sandbox-exec",
        "--failure-mode",
        "fail-hard",
        "--",
        "true",
        cwd=wt,
        env=env,
    )
    assert code == 125 and err.startswith("fusion-oci: ")
    code, _, err = call("run", "--backend", "bubblewrp", "--", "true", cwd=wt, env=env)
    assert code == 2 and "Did you mean bubblewrap?" in err
    code, out, _ = call("run", "--json", "--backend", "bubblewrp", "--", "true", cwd=wt, env=env)
    assert code == 2 and json.loads(out)["error"]["kind"] == "bad-flags"
    code, out, _ = call(
        "run",
        "--json",
        "--backend",
        "sandbox-exec",
        "--failure-mode",
        "fail-hard",
        "--",
        "true",
        cwd=wt,
        env=env,
    )
    error = json.loads(out)["error"]
    assert code == 125 and set(error) == {"kind", "what", "why", "hint", "unenforced"}


def test_output_streams_as_it_comes(wt: Path, env: dict[str, str]) -> None:
    proc = fast(
        "run",
        "--",
        "sh",
        "-c",
        "echo first; sleep 3; echo second",
        cwd=wt,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"first\n"
    first_at = time.monotonic()
    assert proc.poll() is None  # still running: the line came before the end
    code, out, _ = done(proc)
    # The rest came the 3 s sleep later: "first" was not held back until the command ended
    # (however slow the start was, which is why the time is taken from the first line on).
    assert time.monotonic() - first_at > 2.0
    assert (code, out) == (0, "second\n")


def test_binary_output_is_kept_byte_for_byte(wt: Path, env: dict[str, str]) -> None:
    proc = fast(
        "run",
        "--",
        "sh",
        "-c",
        r"printf '\377\000\n\351'",
        cwd=wt,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    out, _ = proc.communicate(timeout=60)
    assert out == b"\xff\x00\n\xe9"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_ends_the_tree_and_exits_128_plus_n(
    wt: Path, env: dict[str, str], signum: int
) -> None:
    marker = f"fusion-fast-{signum}-{os.getpid()}"
    proc = fast(
        "run",
        "--",
        "sh",
        "-c",
        f"echo up; exec sleep 300 # {marker}",
        cwd=wt,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    proc.send_signal(signum)
    code, _, _ = done(proc, 30)
    assert code == 128 + signum
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout == ""


def test_stdin_is_forwarded_as_it_comes(wt: Path, env: dict[str, str]) -> None:
    proc = fast("run", "-i", "--", "cat", cwd=wt, env=env, stdin=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"one\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == b"one\n"  # before our stdin has ended
    rest = b"two\n" + bytes(range(256)) * 1024
    out, _ = proc.communicate(rest, timeout=60)
    assert proc.returncode == 0 and out == rest


def test_large_stdin_round_trips(wt: Path, env: dict[str, str]) -> None:
    data = os.urandom(3 << 20)
    proc = fast("run", "-i", "--", "sha256sum", cwd=wt, env=env, stdin=subprocess.PIPE)
    out, _ = proc.communicate(data, timeout=120)
    import hashlib

    assert proc.returncode == 0 and out.split()[0].decode() == hashlib.sha256(data).hexdigest()


def test_server_exits_after_its_idle_timeout(
    wt: Path, env: dict[str, str], resident: Resident
) -> None:
    env = {**env, "FUSION_OCI_SERVER_IDLE": "1"}
    assert call("run", "--", "true", cwd=wt, env=env)[0] == 0
    [sock] = resident.sockets()
    pid = resident.pid(sock)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sock.exists():
        time.sleep(0.2)
    assert not sock.exists()
    assert gone(pid)
    # nothing of it is left in the user's folder: no lock, no log (the token stays)
    assert sorted(p.name for p in resident.dir.iterdir()) == ["token"]


def gone(pid: int, within: float = 15) -> bool:
    """The process has exited (a zombie waiting for its reaper counts)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def test_stale_socket_is_recovered(wt: Path, env: dict[str, str], resident: Resident) -> None:
    assert call("run", "--", "true", cwd=wt, env=env)[0] == 0
    [sock] = resident.sockets()
    os.kill(resident.pid(sock), signal.SIGKILL)  # leaves its socket behind
    time.sleep(0.5)
    assert sock.exists()
    code, out, _ = call("run", "--", "echo", "again", cwd=wt, env=env)
    assert (code, out) == (0, "again\n")
    assert resident.sockets() == [sock]
    resident.pid(sock)  # a new server answers there


def test_two_first_calls_start_one_server(
    wt: Path, env: dict[str, str], resident: Resident
) -> None:
    procs = [fast("run", "--", "true", cwd=wt, env=env, stdin=subprocess.DEVNULL) for _ in range(3)]
    assert [done(p)[0] for p in procs] == [0, 0, 0]
    assert len(resident.sockets()) == 1
    log = next(resident.dir.glob("*.log")).read_text()
    assert log.count("listening on") == 1


def test_a_folder_open_to_others_is_refused(
    wt: Path, env: dict[str, str], resident: Resident
) -> None:
    resident.dir.mkdir(mode=0o700)
    resident.dir.chmod(0o755)
    code, out, err = call("run", "--", "echo", "still", cwd=wt, env=env)
    assert (code, out) == (0, "still\n")  # in this process instead
    assert "open to other users" in err and f"chmod 700 {resident.dir}" in err
    assert resident.sockets() == []


def test_a_socket_not_a_socket_is_refused(
    wt: Path, env: dict[str, str], resident: Resident
) -> None:
    assert call("run", "--", "true", cwd=wt, env=env)[0] == 0
    [sock] = resident.sockets()
    os.kill(resident.pid(sock), signal.SIGKILL)
    time.sleep(0.3)
    sock.unlink()
    sock.write_text("not a socket")
    code, out, err = call("run", "--", "echo", "here", cwd=wt, env=env)
    assert (code, out) == (0, "here\n") and "is not a socket of yours" in err
    sock.unlink()


def test_the_server_wants_the_token(resident: Resident, wt: Path, env: dict[str, str]) -> None:
    assert call("run", "--", "true", cwd=wt, env=env)[0] == 0
    [sock] = resident.sockets()
    [reply] = rpc(
        sock,
        {
            "id": 1,
            "method": "cli/run",
            "params": {"argv": ["--", "touch", str(wt / "pwned")], "cwd": str(wt), "env": {}},
        },
    )
    assert "error" in reply
    [reply] = rpc(sock, {"id": 1, "method": "initialize", "params": {"token": "guess"}})
    assert "error" in reply
    assert not (wt / "pwned").exists()


def test_backpressure_bounds_what_the_server_buffers(
    wt: Path, env: dict[str, str], resident: Resident
) -> None:
    """A client that does not read: the command is held (its pipe full), the server's memory
    does not grow with the output."""
    assert call("run", "--", "true", cwd=wt, env=env)[0] == 0
    [sock] = resident.sockets()
    pid = resident.pid(sock)

    def rss_kib() -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1])

    before = rss_kib()
    counter = wt / "written"
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(sock))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        script = (
            f"i=0; while [ $i -lt 4000 ]; do head -c 65536 /dev/zero; i=$((i+1)); "
            f"echo $i > {counter}; done"
        )
        for m in (
            {"id": 1, "method": "initialize", "params": {"token": resident.token()}},
            {
                "id": 2,
                "method": "cli/run",
                "params": {
                    "argv": ["--", "sh", "-c", script],
                    "cwd": str(wt),
                    "env": env,
                    "execId": "slow",
                },
            },
        ):
            body = json.dumps({"jsonrpc": "2.0", **m}).encode()
            conn.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)

        def count() -> int:  # the shell rewrites the file: retry a half-written read
            for _ in range(50):
                text = counter.read_text().strip() if counter.exists() else "0"
                if text:
                    return int(text)
                time.sleep(0.01)
            return 0

        time.sleep(6)  # we read nothing meanwhile
        written = count()
        grown = rss_kib() - before
        assert written < 200, f"the command wrote {written} x 64 KiB to a client not reading"
        assert grown < 64 * 1024, f"the server grew by {grown} KiB"
        # Reading resumes the command; closing ends it.
        conn.settimeout(10)
        got = 0
        while got < 8 << 20:
            got += len(conn.recv(1 << 20))
        later = count()
        assert later > written


def test_stdin_streams_in_process_too(wt: Path, env: dict[str, str]) -> None:
    """The full CLI (FUSION_OCI_NO_SERVER=1, or `python -m fusion_oci.cli.main`) forwards -i
    as it comes as well: a line arrives back before our stdin has ended."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fusion_oci.cli.main", "run", "-i", "--", "cat"],
        cwd=wt,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"one\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == b"one\n"
    out, _ = proc.communicate(b"two\n", timeout=60)
    assert (proc.returncode, out) == (0, b"two\n")


def test_no_server_runs_in_process(wt: Path, env: dict[str, str], resident: Resident) -> None:
    code, out, _ = call(
        "run", "--", "echo", "here", cwd=wt, env={**env, "FUSION_OCI_NO_SERVER": "1"}
    )
    assert (code, out) == (0, "here\n")
    assert resident.sockets() == []


def test_a_different_environment_gets_its_own_server(
    wt: Path, env: dict[str, str], resident: Resident, tmp_path: Path
) -> None:
    """What reads the process environment (the audit key's path under HOME) must see the
    caller's: a caller with another HOME does not share a server started with the first."""
    other = tmp_path / "other-home"
    other.mkdir()
    assert call("run", "--", "true", cwd=wt, env=env)[0] == 0
    assert call("run", "--", "true", cwd=wt, env={**env, "HOME": str(other)})[0] == 0
    assert len(resident.sockets()) == 2
    assert (other / ".local" / "state" / "fusion-oci" / "audit.key").is_file()
    # A change of directory or of shell level is the same server.
    assert call("run", "--", "true", cwd=wt, env={**env, "OLDPWD": "/", "SHLVL": "9"})[0] == 0
    assert len(resident.sockets()) == 2


def test_a_client_killed_mid_run_leaves_no_process(
    wt: Path, env: dict[str, str], resident: Resident
) -> None:
    """SIGKILL gives the client no chance to cancel: its connection closing is what ends the
    command's tree in the server."""
    marker = f"fusion-fast-killed-{os.getpid()}"
    proc = fast(
        "run",
        "--",
        "sh",
        "-c",
        f"echo up; exec sleep 300 # {marker}",
        cwd=wt,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    proc.kill()
    proc.communicate(timeout=10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
        if not left:
            break
        time.sleep(0.2)
    assert left == ""
    [sock] = resident.sockets()
    resident.pid(sock)  # and the server goes on serving


@pytest.mark.docker
def test_an_ask_gate_is_asked_of_the_client(wt: Path, env: dict[str, str]) -> None:
    """The server asks the fast client (an `ask` request), which answers as the CLI does: no
    terminal, no; --allow-provision, yes without asking."""
    from tests.backends import require_runtime

    require_runtime("docker")
    image = "localhost/fusion-oci/never-built:1"
    code, _, err = call(
        "run", "--backend", "docker", "--image", image, "--", "true", cwd=wt, env=env
    )
    assert code == 125, err
    assert "sandbox_provision" in err and "--allow-provision" in err
    assert "the answer was no" in err  # asked (of us, not a terminal), as the CLI would
    events = [
        json.loads(line) for line in (wt / ".fusion/sandbox-audit.jsonl").read_text().splitlines()
    ]
    assert any(e["type"] == "sandbox:gate" for e in events)
