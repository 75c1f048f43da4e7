"""The per-user resident server behind the fast front end (``fusion_oci.cli.fast``).

``fusion-oci serve --socket PATH --idle-timeout S --token-file F`` as the fast client starts
it: besides the protocol's methods it serves ``cli/run``, which is ``fusion-oci run`` for a
client that stands elsewhere. The client sends its argv, cwd and environment; the argv is parsed
by the parser the server is handed (the CLI's own typer command, ``fusion_oci.cli.run.run_parser``:
``server/`` never imports ``cli/``) and the run is
:func:`fusion_oci.caller.runrequest.execute`, so the settings, notes, errors and exit status are
the in-process CLI's. Output goes back as ``output`` notifications (bytes base64), our lines as
``cli/echo``, gates as ``ask`` requests; the client sends ``cli/stdin`` chunks (acknowledged
by ``cli/stdinTaken``, at most a few in flight) and ``cli/signal``.

Who may connect: the socket is 0600 in a 0700 directory of the user's; the peer's uid is
checked (SO_PEERCRED); and the first request must be ``initialize`` with the token from the
0600 token file beside the socket. The token is what keeps out a sandboxed command that could
name the socket but not read the file (Landlock checks no ``connect(2)`` to a path).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fusion_oci.caller import Control, RunParser, RunRequest, execute
from fusion_oci.errors import error_body
from fusion_oci.images.gates import AskCallback, GateRequest
from fusion_oci.models.stdin import StdinStream
from fusion_oci.server.methods import Session
from fusion_oci.server.rpc import INVALID_REQUEST, Handler, Params, RequestId, RpcError

STDIN_WINDOW = 4
"""stdin chunks a client sends before the command has taken them (cli/stdinTaken)."""


def leave_no_files(sock: Path, remove_socket: Callable[[], None]) -> None:
    """At a resident server's exit: its socket, lock and log go, under the lock the fast
    client takes to start a server (so none starts half-way through), else one file per
    server key would pile up in the user's folder. The log is only read when a server fails
    to start; one that ran and exited has nothing in it worth keeping."""
    import fcntl

    lock_path, log_path = sock.with_suffix(".lock"), sock.with_suffix(".log")
    try:
        lock = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        remove_socket()
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        remove_socket()
        with contextlib.suppress(OSError):
            if lock_path.stat().st_ino == os.fstat(lock).st_ino:
                lock_path.unlink()  # a client waiting on it sees it gone and retries
        with contextlib.suppress(OSError):
            log_path.unlink()
    finally:
        os.close(lock)


def peer_uid(writer: asyncio.StreamWriter) -> int | None:
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


class ClientIO:
    """A run's I/O over the client's connection."""

    def __init__(self, session: ResidentSession, exec_id: str, params: Params) -> None:
        self.session = session
        self.exec_id = exec_id
        self.stdout_tty = bool(params.get("stdoutTty"))
        size = params.get("terminalSize")
        self.terminal_size = (
            (int(size[0]), int(size[1])) if isinstance(size, list) and len(size) == 2 else None
        )
        self.gone = False
        self.stream = StdinStream(max_chunks=STDIN_WINDOW)

        def taken() -> None:  # the command has it: the client may send one more
            conn = session.conn
            if conn is not None:
                conn.notify("cli/stdinTaken", {"execId": exec_id})

        self.stream.on_take = taken

    def write(self, stream: str, chunk: bytes) -> bool | Awaitable[None]:
        conn = self.session.conn
        if conn is None or conn.closed.is_set():
            return True
        conn.notify(
            "output",
            {"execId": self.exec_id, "stream": stream, "data": base64.b64encode(chunk).decode()},
        )
        if self.gone and stream == "stdout":
            return False
        # Backpressure: a client behind stops the reading of the command's pipes.
        return conn.writer.behind() or True

    def echo(self, text: str, err: bool = False) -> None:
        conn = self.session.conn
        if conn is not None:
            conn.notify("cli/echo", {"execId": self.exec_id, "text": text, "err": err})

    def ask(self, assume_yes: bool) -> AskCallback:
        async def ask(request: GateRequest) -> bool:
            if assume_yes:
                return True
            conn = self.session.conn
            if conn is None:
                return False
            try:
                answer = await conn.request(
                    "ask", {"execId": self.exec_id, "question": request.question()}
                )
            except (RpcError, ConnectionError):
                return False
            return bool(answer.get("allow")) if isinstance(answer, dict) else bool(answer)

        return ask

    def stdin(self) -> StdinStream:
        conn = self.session.conn
        if conn is not None:  # -i: the client forwards its stdin from now on
            conn.notify("cli/stdinWanted", {"execId": self.exec_id})
        return self.stream


class ResidentSession(Session):
    """A session of the resident server: ``cli/*`` methods, and nothing before the token."""

    def __init__(self, token: str, uid_ok: bool, parse_run: RunParser) -> None:
        super().__init__()
        self.token = token
        self.parse_run = parse_run
        self.uid_ok = uid_ok
        self.authed = False
        self.cli_runs: dict[str, tuple[Control, ClientIO]] = {}

    def handlers(self) -> dict[str, Handler]:
        table = {
            **super().handlers(),
            "cli/run": self.cli_run,
            "cli/signal": self.cli_signal,
            "cli/stdin": self.cli_stdin,
        }
        return {name: self._guard(name, handler) for name, handler in table.items()}

    def _guard(self, name: str, handler: Handler) -> Handler:
        async def guarded(params: Params, rid: RequestId | None) -> Any:
            if name == "initialize" and not self.authed:
                given = params.get("token")
                if (
                    not self.uid_ok
                    or not isinstance(given, str)
                    or not hmac.compare_digest(given.encode(), self.token.encode())
                ):
                    self._drop_soon()
                    raise RpcError(
                        INVALID_REQUEST,
                        "not allowed",
                        error_body(
                            "bad-request",
                            "wrong token or user",
                            hint="the resident server serves only its own user's fast CLI",
                        ),
                    )
                self.authed = True
            elif not self.authed:
                raise RpcError(
                    INVALID_REQUEST,
                    "initialize with the token first",
                    error_body(
                        "bad-request", "not initialized", hint="send initialize {token} first"
                    ),
                )
            return await handler(params, rid)

        return guarded

    def _drop_soon(self) -> None:
        """End the connection once the error has been sent."""
        if self.conn is not None:
            asyncio.get_running_loop().call_soon(self.conn.writer.close)

    async def cli_run(self, params: Params, rid: RequestId | None) -> Any:
        argv, cwd, env = params.get("argv"), params.get("cwd"), params.get("env")
        if not (
            isinstance(argv, list)
            and all(isinstance(a, str) for a in argv)
            and isinstance(cwd, str)
            and Path(cwd).is_absolute()
            and isinstance(env, dict)
        ):
            raise RpcError(INVALID_REQUEST, "cli/run takes argv, an absolute cwd and env")
        parsed = self.parse_run(argv)
        if not isinstance(parsed, RunRequest):
            code, out, err = parsed
            return {"exitCode": code, "stdout": out, "stderr": err}
        exec_id = str(params.get("execId") or rid)
        control = Control()
        cio = ClientIO(self, exec_id, params)
        self.cli_runs[exec_id] = (control, cio)
        try:
            code = await execute(
                parsed, cio, {str(k): str(v) for k, v in env.items()}, Path(cwd), control
            )
        finally:
            self.cli_runs.pop(exec_id, None)
        return {"exitCode": code, "stdout": "", "stderr": ""}

    async def cli_signal(self, params: Params, rid: RequestId | None) -> Any:
        run = self.cli_runs.get(str(params.get("execId")))
        signum = params.get("signal")
        if run is not None and isinstance(signum, int):
            if params.get("stdoutGone"):
                run[1].gone = True
            run[0].signal(signum)
        return None

    async def cli_stdin(self, params: Params, rid: RequestId | None) -> Any:
        run = self.cli_runs.get(str(params.get("execId")))
        if run is None:
            return None
        stream = run[1].stream
        data = params.get("data")
        if isinstance(data, str) and data:
            # The client has at most STDIN_WINDOW chunks in flight: room is always there.
            await stream.put(base64.b64decode(data))
        if params.get("eof"):
            stream.close()
        return None


def warm_up(parse_run: RunParser) -> None:
    """Import and build now what the first run would (the parser, the sandbox, the
    runtimes), so that a client's first run is as quick as the next."""
    import fusion_oci.runtimes.registry
    import fusion_oci.sandbox  # noqa: F401

    parse_run(["--", "true"])


def check_code(expected: str | None) -> None:
    """The fast client that starts us names the fusion_oci it runs: refuse to serve another
    (its key says which code it talks to)."""
    import fusion_oci
    from fusion_oci.errors import SandboxSetupError

    ours = Path(fusion_oci.__file__).resolve().parent
    if expected is not None and Path(expected).resolve() != ours:
        raise SandboxSetupError(
            "the resident server would run other code than its client",
            f"it imports fusion_oci from {ours}, the client from {expected}",
            "run the CLI with the interpreter and PYTHONPATH it was installed with",
        )


def read_token(path: Path) -> str:
    return path.read_text(encoding="ascii").strip()
