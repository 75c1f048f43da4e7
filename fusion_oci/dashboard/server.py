"""Binding and serving the dashboard: loopback and a free port by default, never port 4040.

The port is checked before any socket exists, so a refused port is never bound or probed. The
server binds its own socket and hands it to uvicorn: the port printed is the port served, with
no window in which another process could take it.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

from fusion_oci.errors import FlagError

RESERVED_PORTS = {4040: "the product's own dashboard owns port 4040"}
NO_TOKEN_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
"""The only hosts served without a token. Any other address needs one, even another 127/8
alias: an explicit choice of address is treated as reachable by someone else (fail closed)."""


def check_port(port: int) -> None:
    """Refuse reserved and impossible ports (exit 2), before anything is bound."""
    if port in RESERVED_PORTS:
        raise FlagError(
            f"--port {port} is refused: {RESERVED_PORTS[port]}",
            "fusion-oci never binds or probes it, whatever the flags say",
            "leave --port out for a free port, or pick another one",
        )
    if not 0 <= port <= 65535:
        raise FlagError(
            f"--port {port} is not a TCP port",
            "ports are 0..65535",
            "leave --port out for a free port",
        )


def needs_token(host: str) -> bool:
    return host not in NO_TOKEN_HOSTS


def bind(host: str, port: int) -> socket.socket:
    """A bound socket on ``host``:``port`` (0: a free port, never a reserved one)."""
    check_port(port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise FlagError(
            f"--host {host!r} does not resolve", str(exc), "use an IP address such as 127.0.0.1"
        ) from exc
    # "localhost" may resolve to ::1 and 127.0.0.1: take IPv4 first, the address people type
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, kind, proto, _, address = infos[0]
    for _attempt in range(5):
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            sock.close()
            raise FlagError(
                f"cannot listen on {host}:{port}",
                exc.strerror or str(exc),
                "leave --port out for a free port, or free that one",
            ) from exc
        if sock.getsockname()[1] not in RESERVED_PORTS:
            sock.set_inheritable(False)
            return sock
        sock.close()  # the OS handed out a reserved port for port 0: ask again
    raise FlagError("no free port", "the OS kept choosing a reserved port", "pass --port N")


def url_for(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    return f"http://{shown}:{port}/"


def serve(
    audit_path: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    echo: Callable[[str], None] = print,
    poll_interval: float = 0.5,
    chain_key: bytes | None = None,
) -> None:
    """Serve until interrupted (SIGINT/SIGTERM). Prints the address (and the token) once.
    ``chain_key``: the host's audit key, so the chain status covers MACs too."""
    check_port(port)  # before importing the web stack or touching the network
    import uvicorn

    from fusion_oci.dashboard.app import create_app

    token = secrets.token_urlsafe(24) if needs_token(host) else None
    sock = bind(host, port)
    sock.listen(128)  # before the address is printed: a client that connects at once waits
    url = url_for(sock)
    # Loopback without a token: the Host header must name loopback too (DNS rebinding).
    allowed = sorted(NO_TOKEN_HOSTS) if token is None else None
    app = create_app(
        audit_path,
        token=token,
        allowed_hosts=allowed,
        poll_interval=poll_interval,
        chain_key=chain_key,
    )
    echo(f"fusion-oci dashboard: {url}  (audit log {audit_path})")
    if token is not None:
        echo(f"token (printed only now): {token}")
        echo(f"open {url}?token={token}  or send 'Authorization: Bearer <token>'")
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=1,
        server_header=False,
        proxy_headers=False,
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
