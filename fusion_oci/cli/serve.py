"""``fusion-oci serve``: kept apart from main.py so that the CLI's start-up imports none of it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def serve(
    ctx: typer.Context,
    socket: Annotated[
        Path | None,
        typer.Option(
            "--socket",
            help="Listen on this unix socket (created mode 0600) instead of stdio; "
            "refused when the path exists and is not a stale socket.",
        ),
    ] = None,
    max_message_bytes: Annotated[
        int,
        typer.Option(
            "--max-message-bytes",
            min=1024,
            help="Largest JSON-RPC message accepted; a larger one gets an error.",
        ),
    ] = 16 << 20,
    idle_timeout: Annotated[
        float | None,
        typer.Option(
            "--idle-timeout",
            min=0.1,
            help="With --socket: exit after this many seconds with no client connected.",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="With --socket: serve only clients of our uid that initialize with the token in "
            "this file, and serve `cli/run` (the fast CLI's resident server).",
        ),
    ] = None,
) -> None:
    """Serve the sandbox lifecycle as JSON-RPC 2.0 (docs/protocol.md) on stdio or a socket.

    Every sandbox a client prepared is disposed, and every process tree it started is ended,
    when that client goes away.
    """
    import asyncio
    import os

    from fusion_oci.errors import FusionOCIError
    from fusion_oci.host.hardening import harden_owner
    from fusion_oci.server import serve_socket, serve_stdio

    # Every task it serves has its proxy, CA key and brokered tokens here, and a resident
    # server its clients' environments: no core of it, no /proc/PID/mem (issue #31).
    harden_owner()
    try:
        if socket is None:
            asyncio.run(serve_stdio(max_message_bytes))
        else:
            token, parser = None, None
            if token_file is not None:
                from fusion_oci.cli.run import run_parser
                from fusion_oci.server.resident import check_code, read_token, warm_up

                # the CLI's own command, as this invocation was parsed by it
                parser = run_parser(ctx.find_root().command)
                token = read_token(token_file)
                check_code(os.environ.get("FUSION_OCI_SERVER_CODE"))
                warm_up(parser)
                os.chdir("/")  # a resident server holds no caller's directory busy
            asyncio.run(
                serve_socket(socket.absolute(), max_message_bytes, idle_timeout, token, parser)
            )
    except FusionOCIError as exc:
        typer.echo(f"fusion-oci: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
