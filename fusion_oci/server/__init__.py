"""``fusion-oci serve``: the sandbox lifecycle as JSON-RPC 2.0 over stdio or a unix socket.

The protocol is in docs/protocol.md. Each connection is one :class:`~.methods.Session`; when
its client goes away (EOF, socket closed) every sandbox it prepared is disposed and every
process tree it started is ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_oci.errors import FlagError
from fusion_oci.server.methods import PROTOCOL_VERSION, Session
from fusion_oci.server.rpc import Connection, Writer

if TYPE_CHECKING:
    from fusion_oci.caller import RunParser

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "PROTOCOL_VERSION", "serve_socket", "serve_stdio"]

DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
STREAM_LIMIT = 1 << 16  # longest header line asyncio's reader buffers


async def _session(
    reader: asyncio.StreamReader, writer: Writer, max_bytes: int, session: Session | None = None
) -> None:
    session = session or Session()
    conn = Connection(reader, writer, session.handlers(), max_bytes=max_bytes)
    session.conn = conn
    try:
        await conn.serve()
    finally:
        await asyncio.shield(session.close())


def _on_signals(task: asyncio.Task[None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, task.cancel)


async def serve_stdio(max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
    """One session on this process's stdin/stdout.

    stdout carries only protocol: the real fd 1 is kept for it and fd 1 is pointed at stderr,
    so a stray print (ours or a library's) cannot corrupt the stream.
    """
    loop = asyncio.get_running_loop()
    out_fd = os.dup(1)
    os.dup2(2, 1)
    in_fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # nothing else reads the protocol's stdin
    os.close(devnull)
    reader = asyncio.StreamReader(limit=STREAM_LIMIT)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(in_fd, "rb", buffering=0)
    )
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(out_fd, "wb", buffering=0)
    )
    stream = asyncio.StreamWriter(transport, protocol, reader, loop)
    task = asyncio.ensure_future(_session(reader, Writer(stream), max_bytes))
    _on_signals(task)
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _claim_socket_path(path: Path) -> None:
    """Refuse an existing path unless it is a socket nobody answers on (then remove it)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise FlagError(
            f"--socket {path}",
            "the path exists and is not a socket",
            "choose a path that does not exist",
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # stale: its server has gone
        return
    finally:
        probe.close()
    raise FlagError(
        f"--socket {path}", "a server is already listening there", "stop it, or choose another path"
    )


async def serve_socket(
    path: Path,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    idle_timeout_s: float | None = None,
    token: str | None = None,
    parse_run: RunParser | None = None,
) -> None:
    """A session per connection on a unix socket created mode 0600, until SIGTERM/SIGINT, or
    until no client has been connected for ``idle_timeout_s``. With ``token`` (the resident
    server of the fast CLI) a client must be our uid and initialize with the token, and
    ``cli/run`` parses its argv with ``parse_run`` (the CLI's, given by whoever starts us)."""
    if token is not None and parse_run is None:
        raise TypeError("a resident server (token) needs the CLI's parse_run")
    _claim_socket_path(path)
    sessions: set[asyncio.Task[None]] = set()
    changed = asyncio.Event()  # a client came or went

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        sessions.add(task)
        changed.set()
        try:
            session: Session | None = None
            if token is not None:
                from fusion_oci.server.resident import ResidentSession, peer_uid

                assert parse_run is not None
                session = ResidentSession(
                    token, uid_ok=peer_uid(writer) == os.getuid(), parse_run=parse_run
                )
            await _session(reader, Writer(writer), max_bytes, session)
        finally:
            sessions.discard(task)
            changed.set()

    old = os.umask(0o177)  # the socket is born 0600: no window where others may connect
    try:
        server = await asyncio.start_unix_server(client, path=str(path), limit=STREAM_LIMIT)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)  # noqa: PTH101  (belt and braces; pathlib here trips ASYNC240)
    ours = os.lstat(path).st_ino  # at exit, remove only our socket, not a successor's
    print(
        f"fusion-oci serve: listening on {path} (protocol {PROTOCOL_VERSION})",
        file=sys.stderr,
        flush=True,
    )
    main = asyncio.current_task()
    assert main is not None
    _on_signals(main)
    watcher = None
    if idle_timeout_s is not None:
        timeout = idle_timeout_s

        async def exit_when_idle() -> None:
            while True:
                changed.clear()
                if sessions:
                    await changed.wait()
                    continue
                try:
                    await asyncio.wait_for(changed.wait(), timeout)
                except TimeoutError:
                    main.cancel()
                    return

        watcher = asyncio.ensure_future(exit_when_idle())
    try:
        async with server:
            await server.serve_forever()
    except asyncio.CancelledError:
        pass
    finally:
        if watcher is not None:
            watcher.cancel()
        server.close()
        for task in list(sessions):
            task.cancel()
        if sessions:
            await asyncio.gather(*sessions, return_exceptions=True)
        if token is not None:
            from fusion_oci.server.resident import leave_no_files

            leave_no_files(path, lambda: _remove_socket(path, ours))
        else:
            _remove_socket(path, ours)


def _remove_socket(path: Path, inode: int | None = None) -> None:
    with contextlib.suppress(FileNotFoundError):
        info = path.lstat()
        if stat.S_ISSOCK(info.st_mode) and inode in (None, info.st_ino):
            path.unlink()
