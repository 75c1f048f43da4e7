"""The exec agent's wire format (PROTOCOL.md): pure encoding and decoding, no I/O.

A frame is a 4-byte big-endian length, then that many bytes: one type byte and the fields,
each ``key=value`` ended by a NUL. Repeated keys (``argv``, ``env``, ``rlimit``) keep their order.
"""

from __future__ import annotations

import signal
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

PROTOCOL_VERSION = "1"
MAX_FRAME = 64 << 20
"""The agent refuses (and drops the connection on) a longer frame."""

SPAWN = b"S"
KILL = b"K"
HELLO = b"H"
STARTED = b"T"
FAILED = b"F"
EXITED = b"X"
# Over a byte stream only (PROTOCOL.md, "Over a byte stream"): mux.py's frames beside these.
SPAWN_PIPED = b"P"
"""A spawn whose stdin the host streams (``D`` frames); ``S`` over a stream means /dev/null."""
DATA = b"D"
ACK = b"A"
STDIN, STDOUT, STDERR = b"0", b"1", b"2"
# The pod's egress connections carried back over the stream (``mux.py --egress-listen``).
EGRESS_OPEN = b"O"
"""mux -> host, ``id=N``: a command connected to the listener; ids count up from 1."""
EGRESS_BYTES = b"B"
"""Both ways, ``N`` NUL raw bytes: a chunk of connection N; none: that direction's end."""
EGRESS_ACK = b"W"
"""Both ways, ``id=N bytes=n``: n bytes of N were written on; credit back."""
EGRESS_CLOSE = b"C"
"""Both ways, ``id=N``: N is gone (reset, refused, failed); the other side drops it too."""
INBOUND_OPEN = b"N"
"""host -> mux, ``ref=R port=P``: connect to the pod's 127.0.0.1:P for a client of a published
port (``mux.py --publish-port P``); the mux answers with an ``O`` that says ``inbound=R``
(and ``error=ERRNO`` when the connect failed: nothing more follows for that id)."""
MAX_EGRESS_CONNS = 512

_HEADER = struct.Struct(">I")

# Egress in a ``network: filtered`` sandbox (PROTOCOL.md, "The egress forwarder"): the same
# paths in every runtime's sandbox, so the proxy environment is one pure thing (oci/environment.py).
EGRESS_DIR = "/run/fusion-oci"
EGRESS_SOCKET = EGRESS_DIR + "/egress.sock"
"""The host's egress proxy socket, bound into the sandbox (agent.c's EGRESS_SOCKET)."""
EGRESS_AGENT = EGRESS_DIR + "/agent"
"""The agent binary, bound read-only, for ``agent connect HOST PORT`` (ssh's ProxyCommand)."""
EGRESS_PORT = 3128
"""Where the agent's forwarder listens in the sandbox: 127.0.0.1:3128 (agent.c's FWD_PORT)."""


def forward_args(socket: str = EGRESS_SOCKET) -> list[str]:
    """The agent's option that starts its forwarder (127.0.0.1:3128 -> ``socket``). Pure."""
    return ["--egress", socket]


def ssh_proxy_command(agent: str = EGRESS_AGENT) -> str:
    """``GIT_SSH_COMMAND`` of a filtered sandbox: ssh's connection is a CONNECT tunnel through
    the egress proxy, made by the agent's ``connect`` mode. Pure."""
    return f"ssh -o ProxyCommand='{agent} connect %h %p'"


class ProtocolError(ValueError):
    """A frame the other side could not have meant."""


@dataclass(frozen=True)
class Spawn:
    """Everything the agent needs to start one command (the fds travel beside it)."""

    id: str
    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str | None = None
    rlimits: Sequence[tuple[str, int, int]] = ()
    """(RLIMIT_NAME, soft, hard); -1 is unlimited."""
    umask: int | None = None
    uid: int | None = None
    gid: int | None = None
    groups: Sequence[int] | None = None
    """Supplementary groups (set with uid/gid when the agent runs as root in a container)."""

    def fields(self) -> list[tuple[str, str]]:
        """The spawn frame's fields, in wire order: what a plan shows. Pure."""
        out: list[tuple[str, str]] = [("id", self.id)]
        if self.cwd is not None:
            out.append(("cwd", self.cwd))
        if self.umask is not None:
            out.append(("umask", f"{self.umask:o}"))
        if self.uid is not None:
            out.append(("uid", str(self.uid)))
        if self.gid is not None:
            out.append(("gid", str(self.gid)))
        if self.groups is not None:
            out.append(("groups", ",".join(str(g) for g in self.groups)))
        out.extend(("rlimit", f"{name}:{soft}:{hard}") for name, soft, hard in self.rlimits)
        out.extend(("argv", arg) for arg in self.argv)
        out.extend(("env", f"{key}={value}") for key, value in self.env.items())
        return out


def encode(kind: bytes, fields: Iterable[tuple[str, str]]) -> bytes:
    """One frame. A NUL inside a field cannot be sent (argv and env are C strings)."""
    body = bytearray(kind)
    for key, value in fields:
        if "\0" in key or "=" in key or "\0" in value:
            raise ValueError(f"embedded null byte in {key!r}: {value[:40]!r}")
        body += key.encode() + b"=" + value.encode("utf-8", "surrogateescape") + b"\0"
    if len(body) > MAX_FRAME:
        raise ValueError(f"the command is too large for the agent ({len(body)} bytes)")
    return _HEADER.pack(len(body)) + bytes(body)


def encode_spawn(spawn: Spawn) -> bytes:
    if not spawn.argv:
        raise ValueError("an empty argv cannot be run")
    return encode(SPAWN, spawn.fields())


def encode_kill(run_id: str, sig: int, tree: bool = True, grace_ms: int = 2000) -> bytes:
    return encode(
        KILL,
        [
            ("id", run_id),
            ("signal", str(sig)),
            ("tree", "1" if tree else "0"),
            ("grace_ms", str(max(0, grace_ms))),
        ],
    )


def decode_fields(body: bytes) -> dict[str, str]:
    """The fields of a frame whose keys do not repeat (every agent->host frame)."""
    if body and not body.endswith(b"\0"):
        raise ProtocolError("fields must end with NUL")
    out: dict[str, str] = {}
    for item in body.split(b"\0")[:-1]:
        key, sep, value = item.partition(b"=")
        if not sep:
            raise ProtocolError(f"field without '=': {item[:40]!r}")
        out[key.decode()] = value.decode("utf-8", "surrogateescape")
    return out


def encode_data(run_id: str, stream: bytes, data: bytes) -> bytes:
    """A ``D`` frame: ``id`` NUL, the stream (``0`` stdin, ``1`` stdout, ``2`` stderr), the
    bytes as they are (none: that stream's end)."""
    body = b"".join((DATA, run_id.encode(), b"\0", stream, data))
    return _HEADER.pack(len(body)) + body


def encode_bytes(conn_id: int, data: bytes) -> bytes:
    """A ``B`` frame: connection ``conn_id``'s bytes (none: that direction's end)."""
    body = b"%b%d\0%b" % (EGRESS_BYTES, conn_id, data)
    return _HEADER.pack(len(body)) + body


def decode_data(body: bytes) -> tuple[str, bytes, bytes]:
    """(run id, stream, bytes) of a ``D`` frame's body (after its type byte)."""
    end = body.find(b"\0")
    if end < 0 or end + 1 >= len(body):
        raise ProtocolError(f"a data frame without id or stream: {body[:40]!r}")
    # One copy of the bytes (slices of bytes are copies): this runs per chunk of output.
    return body[:end].decode("utf-8", "surrogateescape"), body[end + 1 : end + 2], body[end + 2 :]


class Framer:
    """Splits a byte stream into (type, body) frames, the body still raw (a ``D`` frame's
    bytes are not fields)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        buf = self._buf
        buf += data
        frames: list[tuple[bytes, bytes]] = []
        at = 0
        while len(buf) - at >= 4:
            (size,) = _HEADER.unpack_from(buf, at)
            if size == 0 or size > MAX_FRAME:
                raise ProtocolError(f"bad frame length {size}")
            if len(buf) - at < 4 + size:
                break
            frames.append((bytes(buf[at + 4 : at + 5]), bytes(buf[at + 5 : at + 4 + size])))
            at += 4 + size
        del buf[:at]  # once per feed, not per frame: many small frames in one read stay cheap
        return frames


class Decoder:
    """Splits a byte stream into (type, fields) frames."""

    def __init__(self) -> None:
        self._framer = Framer()

    def feed(self, data: bytes) -> list[tuple[bytes, dict[str, str]]]:
        return [(kind, decode_fields(body)) for kind, body in self._framer.feed(data)]


def parse_exec_status(text: str) -> tuple[int | None, str | None] | None:
    """What ``fusion-oci-agent --exec-status`` wrote: ``exit N`` -> (N, None), ``signal N`` ->
    (None, "SIGNAME"); None for anything else (nothing written: the agent was killed too).
    A signal without a name here (a real-time one) reads as a shell's 128+N, as
    ``runtimes.outcome.status_from_code`` reads a launcher's status (the agent names no runtime)."""
    words = text.split()
    if len(words) != 2 or not words[1].isdigit():
        return None
    if words[0] == "exit":
        return int(words[1]), None
    if words[0] == "signal" and 0 < (number := int(words[1])) < 65:
        try:
            return None, signal.Signals(number).name
        except ValueError:
            return 128 + number, None
    return None
