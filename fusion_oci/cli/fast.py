"""The ``fusion-oci`` console script: a stdlib-only front end that starts in a few ms.

It answers ``--help``, ``-h``, ``CMD --help`` and ``--version`` from texts generated from the
typer app (``fusion_oci/cli/_help.py``), and sends ``run`` to the user's resident server
(``fusion-oci serve --socket ... --token-file ...``, see ``fusion_oci.server.resident``),
starting it on first use; everything else, and ``run`` whenever the server cannot be used, goes
to the full CLI (``fusion_oci.cli.main``) in this process. The server parses the argv with the
CLI's own command and resolves the settings from our cwd and environment, so both paths agree.

The server lives in ``$XDG_RUNTIME_DIR/fusion-oci`` (else ``/run/user/UID/fusion-oci``, else
``/tmp/fusion-oci.UID``): a 0700 directory of ours with a 0600 token file, one socket per
server *key* (the interpreter, the installed code and its mtime, what a command inherits from
the server process instead of from us: umask, rlimits, groups, cgroup, ignored signals, and the
environment but for per-call variables), so a client only ever talks to a server that would
start its command exactly as it would itself. It exits by
itself after ``FUSION_OCI_SERVER_IDLE`` seconds (default 60) without a client;
``FUSION_OCI_NO_SERVER=1`` runs every command in this process.

Imports here are C modules only (``_socket``, ``_signal``, ``_json`` below the pure-Python
``socket``, ``signal``, ``json``): those pull in enum and re, which with typing, subprocess,
pathlib and pydantic would each cost more than the whole start-up budget.

Why one module of ~550 lines: every module imported is paid by every invocation (a file
lookup, a read and an unmarshal), and this one exists to be cheap to start.
"""

from __future__ import annotations

import _json
import _signal  # type: ignore[import-not-found]  # no stubs; signal.py would import enum
import _socket
import binascii
import os
import select
import sys

IDLE_DEFAULT_S = 60.0
START_WAIT_S = 20.0
CHUNK = 1 << 16
STDIN_WINDOW = 4  # = fusion_oci.server.resident.STDIN_WINDOW
FORWARDED = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)


class Unusable(Exception):
    """The resident server cannot be used here: run in this process (after a warning when
    the reason is the user's to fix)."""

    def __init__(self, why: str = "", warn: bool = False) -> None:
        super().__init__(why)
        self.warn = warn


# --- where the server lives ----------------------------------------------------------------


def _own_dir(path: str, create: bool) -> str:
    """``path`` if it is a real directory of ours that nobody else may enter, else Unusable."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise Unusable(f"cannot create {path}: {exc.strerror}", warn=True) from None
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise Unusable(f"{path}: {exc.strerror}", warn=True) from None
    if (info.st_mode & 0o170000) != 0o040000:
        raise Unusable(
            f"{path} is not a directory (a symlink?); the resident server is not used: remove it",
            warn=True,
        )
    if info.st_uid != os.getuid():
        raise Unusable(
            f"{path} is owned by uid {info.st_uid}, not by you; the resident "
            "server is not used: remove it",
            warn=True,
        )
    if info.st_mode & 0o077:
        raise Unusable(
            f"{path} is open to other users (mode {info.st_mode & 0o777:o}); "
            f"the resident server is not used: chmod 700 {path}",
            warn=True,
        )
    return path


def server_dir(env: dict[str, str] | os._Environ[str]) -> str:
    uid = os.getuid()
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        base = _own_dir(xdg, create=False)
    elif os.path.isdir(f"/run/user/{uid}"):
        base = _own_dir(f"/run/user/{uid}", create=False)
    else:
        return _own_dir(f"/tmp/fusion-oci.{uid}", create=True)
    return _own_dir(os.path.join(base, "fusion-oci"), create=True)


def _code_root() -> str:
    """The fusion_oci package folder we run (its cli/ holds this file)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _code_stamp() -> str:
    """Where the code is, and the newest mtime in it: a changed install is a new server."""
    root = _code_root()
    newest = 0
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        stack.append(entry.path)
                elif entry.name.endswith(".py"):
                    newest = max(newest, entry.stat().st_mtime_ns)
    return f"{root}:{newest}"


def _inherited() -> str:
    """What a command started by the server inherits from the server, not from the caller."""
    import resource

    mask = os.umask(0)
    os.umask(mask)
    limits = [
        resource.getrlimit(getattr(resource, name))
        for name in sorted(dir(resource))
        if name.startswith("RLIMIT_")
    ]
    try:
        with open("/proc/self/cgroup", "rb") as f:
            cgroup = f.read()
    except OSError:
        cgroup = b""
    try:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:
        nice = 0
    ignored = [n for n in range(1, _signal.NSIG) if _signal_ignored(n)]
    return (
        f"{mask}|{limits}|{os.getgid()}|{sorted(os.getgroups())}|{nice}|{ignored}|"
        f"{cgroup.decode(errors='replace')}"
    )


def _signal_ignored(signum: int) -> bool:
    try:
        return bool(_signal.getsignal(signum) == _signal.SIG_IGN)
    except (ValueError, OSError):
        return False


VOLATILE = frozenset(
    {
        "PWD",
        "OLDPWD",
        "_",
        "SHLVL",
        "COLUMNS",
        "LINES",
        "FUSION_OCI_SERVER_IDLE",
        "FUSION_OCI_NO_SERVER",
    }
)
"""Variables that change between calls of one shell and that nothing reads from the server's
own environment (the command gets the client's, sent with each call)."""


def server_key(env: dict[str, str]) -> str:
    """Which server this client may use: the same interpreter and code, the same inherited
    process state, and the same environment but for VOLATILE (a few things read the process
    environment rather than the one a call brings: the audit key's path, tempfile's TMPDIR)."""
    stable = "\0".join(f"{k}={v}" for k, v in sorted(env.items()) if k not in VOLATILE)
    text = f"{sys.executable}|{sys.version}|{_code_stamp()}|{_inherited()}|{stable}"
    return f"{binascii.crc32(text.encode()):08x}{binascii.crc32(text[::-1].encode()):08x}"


def _token(folder: str) -> str:
    path = os.path.join(folder, "token")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(binascii.hexlify(os.urandom(32)).decode())
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise Unusable(f"{path} is not yours alone; remove it", warn=True)
        return os.read(fd, 256).decode().strip()
    finally:
        os.close(fd)


# --- connecting, starting ------------------------------------------------------------------


def _connect(path: str) -> _socket.socket | None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if (info.st_mode & 0o170000) != 0o140000 or info.st_uid != os.getuid():
        raise Unusable(f"{path} is not a socket of yours; remove it", warn=True)
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None  # stale: its server has gone (the next server removes it)
    return sock


def _start(folder: str, key: str, token_path: str, env: dict[str, str]) -> _socket.socket:
    """The server's socket, the server started first (detached, in its own session) unless
    one is already up; the lock makes two first calls start one server."""
    import fcntl

    path = os.path.join(folder, f"{key}.sock")
    lock_path = os.path.join(folder, f"{key}.lock")
    for _ in range(10):
        lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.stat(lock_path).st_ino == os.fstat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(lock)  # an exiting server removed it while we waited: take the new one
    else:
        raise Unusable(f"{lock_path} keeps being replaced", warn=True)
    try:
        sock = _connect(path)
        if sock is not None:
            return sock
        log = os.open(
            os.path.join(folder, f"{key}.log"),
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
            0o600,
        )
        devnull = os.open(os.devnull, os.O_RDWR)
        idle = env.get("FUSION_OCI_SERVER_IDLE") or str(IDLE_DEFAULT_S)
        argv = [
            sys.executable,
            "-m",
            "fusion_oci.cli.main",
            "serve",
            "--socket",
            path,
            "--idle-timeout",
            idle,
            "--token-file",
            token_path,
        ]
        # Our environment, cwd and interpreter: it imports the fusion_oci we were imported
        # from, and refuses to start if not (FUSION_OCI_SERVER_CODE; then we run in-process).
        server_env = {k: v for k, v in env.items() if k != "FUSION_OCI_NO_SERVER"}
        server_env["FUSION_OCI_SERVER_CODE"] = _code_root()
        pid = os.posix_spawn(
            sys.executable,
            argv,
            server_env,
            setsid=True,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, devnull, 0),
                (os.POSIX_SPAWN_DUP2, devnull, 1),
                (os.POSIX_SPAWN_DUP2, log, 2),
            ],
        )
        os.close(devnull)
        os.close(log)
        import time

        deadline = time.monotonic() + START_WAIT_S
        while time.monotonic() < deadline:
            sock = _connect(path)
            if sock is not None:
                return sock
            done, _status = os.waitpid(pid, os.WNOHANG)
            if done:
                raise Unusable(
                    f"the resident server did not start (see {folder}/{key}.log)", warn=True
                )
            time.sleep(0.01)
        raise Unusable(
            f"the resident server did not start in {START_WAIT_S:.0f} s (see {folder}/{key}.log)",
            warn=True,
        )
    finally:
        os.close(lock)


# --- the protocol (LSP-framed JSON-RPC, as fusion_oci.server.framing) -----------------------


class _ScanContext:
    """What ``_json.make_scanner`` reads off a JSONDecoder."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float
    memo: dict[str, str] = {}  # noqa: RUF012  (the C scanner's cache)


_scan = _json.make_scanner(_ScanContext())  # type: ignore[arg-type]  # duck-typed


def dumps(value: object) -> str:
    """JSON of str, int, bool, None, lists and str-keyed dicts (all this client sends)."""
    if isinstance(value, str):
        return str(_json.encode_basestring(value))
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{dumps(str(k))}:{dumps(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot send {type(value).__name__}")


def loads(text: str) -> object:
    value, _end = _scan(text, 0)
    return value


class Conn:
    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def send(self, message: dict[str, object]) -> None:
        body = dumps({"jsonrpc": "2.0", **message}).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def feed(self) -> bool:
        """Read what is there; False at end of stream."""
        data = self.sock.recv(CHUNK * 4)
        self.buf += data
        return bool(data)

    def messages(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return out
            length = 0
            for line in self.buf[:end].split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return out
            message = loads(self.buf[end + 4 : end + 4 + length].decode())
            if isinstance(message, dict):
                out.append(message)
            self.buf = self.buf[end + 4 + length :]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _ask(question: str) -> bool:
    """A gate's question, on our terminal (no terminal: no), as fusion_oci.images.gates."""
    if not os.isatty(0):
        return False
    os.write(2, (question + " [y/N] ").encode())
    line = b""
    while not line.endswith(b"\n"):
        got = os.read(0, 1024)
        if not got:
            break
        line += got
    return line.decode(errors="replace").strip().lower() in ("y", "yes")


def run_remote(argv: list[str], env: dict[str, str]) -> int:
    """``fusion-oci run ARGV`` through the resident server; its exit status."""
    folder = server_dir(env)
    key = server_key(env)
    token = _token(folder)
    for attempt in (1, 2):
        try:
            sock = _connect(os.path.join(folder, f"{key}.sock"))
            if sock is None:
                sock = _start(folder, key, os.path.join(folder, "token"), env)
        except OSError as exc:
            raise Unusable(f"cannot reach the resident server: {exc}", warn=True) from None
        try:
            return _session(Conn(sock), argv, env, token)
        except Unusable as exc:
            # Closed before it answered: it was leaving (its idle timeout) as we came; the
            # next attempt starts a new one. Nothing ran.
            if attempt == 2 or exc.warn:
                raise
        finally:
            sock.close()
    raise Unusable("unreachable")


def _session(conn: Conn, argv: list[str], env: dict[str, str], token: str) -> int:
    size = None
    if os.isatty(1):
        try:
            cols, lines = os.get_terminal_size(1)
            size = [cols, lines]
        except OSError:
            pass
    exec_id = f"cli{os.getpid()}"
    # Signals wake the poll through a pipe and become cli/signal (the server ends the tree);
    # set up before anything is sent, so none is lost in between.
    sig_r, sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    old_fd = _signal.set_wakeup_fd(sig_w, warn_on_full_buffer=False)
    old = {signum: _signal.signal(signum, lambda *_: None) for signum in FORWARDED}
    state: dict[str, int] = {"started": 0, "signal": 0}
    try:
        conn.send({"id": 1, "method": "initialize", "params": {"token": token}})
        conn.send(
            {
                "id": 2,
                "method": "cli/run",
                "params": {
                    "argv": argv,
                    "cwd": os.getcwd(),
                    "env": env,
                    "execId": exec_id,
                    "stdoutTty": os.isatty(1),
                    "terminalSize": size,
                },
            }
        )
        return _loop(conn, exec_id, sig_r, state)
    except (OSError, Unusable) as exc:
        if state["signal"]:  # we were told to stop: not the moment to run it here instead
            return 128 + state["signal"]
        if not state["started"]:  # nothing ran: the server answers before it runs anything
            raise (
                exc if isinstance(exc, Unusable) else Unusable(f"the resident server failed: {exc}")
            ) from None
        os.write(2, f"fusion-oci: the resident server went away mid-run: {exc}\n".encode())
        return 125
    finally:
        _signal.set_wakeup_fd(old_fd)
        for signum, handler in old.items():
            _signal.signal(signum, handler)
        os.close(sig_r)
        os.close(sig_w)


def _loop(conn: Conn, exec_id: str, sig_r: int, state: dict[str, int]) -> int:
    poller = select.poll()
    poller.register(conn.sock.fileno(), select.POLLIN)
    poller.register(sig_r, select.POLLIN)
    stdin_on = False  # the server asks for stdin (-i) with cli/stdinWanted
    window = STDIN_WINDOW
    stdout_gone = False
    while True:
        for fd, _event in poller.poll():
            if fd == sig_r:
                for signum in os.read(sig_r, 64):
                    state["signal"] = state["signal"] or signum
                    conn.send(
                        {"method": "cli/signal", "params": {"execId": exec_id, "signal": signum}}
                    )
                continue
            if fd == 0:
                chunk = os.read(0, CHUNK)
                window -= 1
                sent: dict[str, object] = {"execId": exec_id}
                if chunk:
                    sent["data"] = binascii.b2a_base64(chunk, newline=False).decode()
                else:
                    sent["eof"] = True
                    stdin_on = False
                conn.send({"method": "cli/stdin", "params": sent})
                if not chunk or window == 0:
                    poller.unregister(0)
                continue
            if not conn.feed():
                if not state["started"]:
                    raise Unusable("the resident server closed the connection")
                os.write(2, b"fusion-oci: the resident server went away mid-run\n")
                return 125
            for msg in conn.messages():
                state["started"] = 1
                method = msg.get("method")
                params = msg.get("params")
                if not isinstance(params, dict):
                    params = {}
                if method == "output":
                    data = binascii.a2b_base64(str(params["data"]))
                    if params["stream"] == "stdout":
                        if stdout_gone:
                            continue
                        try:
                            _write_all(1, data)
                        except BrokenPipeError:
                            # Like a shell pipeline: our reader gone ends the command.
                            stdout_gone = True
                            devnull = os.open(os.devnull, os.O_WRONLY)
                            os.dup2(devnull, 1)
                            os.close(devnull)
                            conn.send(
                                {
                                    "method": "cli/signal",
                                    "params": {"execId": exec_id, "signal": 13, "stdoutGone": True},
                                }
                            )
                    else:
                        _write_all(2, data)
                elif method == "cli/echo":
                    _write_all(2 if params.get("err") else 1, (str(params["text"]) + "\n").encode())
                elif method == "cli/stdinWanted":
                    stdin_on = True
                    poller.register(0, select.POLLIN)
                elif method == "cli/stdinTaken":
                    window += 1
                    if stdin_on and window == 1:
                        poller.register(0, select.POLLIN)
                elif method == "ask":
                    conn.send(
                        {
                            "id": msg["id"],
                            "result": {"allow": _ask(str(params.get("question", "")))},
                        }
                    )
                elif msg.get("id") == 1 and "error" in msg:
                    state["started"] = 0  # refused before anything ran
                    raise Unusable(
                        "the resident server refused our token (was the token file replaced?)",
                        warn=True,
                    )
                elif msg.get("id") == 2:
                    if "error" in msg:
                        error = msg["error"]
                        what = error.get("message") if isinstance(error, dict) else error
                        os.write(2, f"fusion-oci: internal error: {what}\n".encode())
                        return 125
                    result = msg["result"]
                    assert isinstance(result, dict)
                    _write_all(1, str(result.get("stdout", "")).encode())
                    _write_all(2, str(result.get("stderr", "")).encode())
                    return int(result["exitCode"])


# --- the front end -------------------------------------------------------------------------


def _fast_run_ok(argv: list[str], env: dict[str, str]) -> bool:
    """Can the server run this? Help and a prompt read from our stdin stay here."""
    if env.get("FUSION_OCI_NO_SERVER") or not sys.platform.startswith("linux"):
        return False
    head = argv[: argv.index("--")] if "--" in argv else argv
    for i, arg in enumerate(head):
        if arg in ("-h", "--help", "--task-prompt=-"):
            return False
        if arg == "--task-prompt" and head[i + 1 : i + 2] == ["-"]:
            return False
        if arg.startswith("-") and not arg.startswith("--") and "h" in arg:
            return False
    return True


def _help(argv: list[str]) -> str | None:
    """The static help text ``argv`` asks for, if that is all it asks."""
    if not argv or argv[-1] not in ("-h", "--help"):
        return None
    from fusion_oci.cli._help import HELP

    return HELP.get(" ".join(argv[:-1]))


def _std_fds() -> None:
    """A closed stdin, stdout or stderr becomes /dev/null, so that no socket or pipe of ours
    is opened as fd 0-2 (and read as stdin, or written to as output)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def main() -> None:
    argv = sys.argv[1:]
    if argv == ["--version"]:
        from fusion_oci.cli._help import VERSION

        sys.stdout.write(f"fusion-oci {VERSION}\n")
        sys.exit(0)
    text = _help(argv)
    if text is not None:
        sys.stdout.write(text)
        sys.exit(0)
    if argv[:1] == ["run"]:
        _std_fds()
        env = dict(os.environ)
        if _fast_run_ok(argv[1:], env):
            try:
                code = run_remote(argv[1:], env)
            except Unusable as exc:
                if exc.warn:
                    os.write(2, f"fusion-oci: warning: {exc}\n".encode())
            except BrokenPipeError:
                code = 141
            else:
                sys.stdout.flush()
                os._exit(code)  # nothing left to tidy; skip the interpreter's teardown
    from fusion_oci.cli.main import main as full

    full()


if __name__ == "__main__":
    main()
