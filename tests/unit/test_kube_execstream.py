"""The pure parts of the ``pods/exec`` WebSocket client: the accept key, masking and client
frames (RFC 6455), the exec URL, the final Status → exit code. The stream itself is tested
against the real cluster (tests/cluster/test_kube_exec_cluster.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import pytest

from fusion_oci.runtimes.kubernetes.execstream import (
    ExecError,
    ExecStreamLost,
    exec_path,
    exit_status,
)
from fusion_oci.runtimes.kubernetes.websocket import (
    WebSocketError,
    accept_key,
    client_frame,
    mask,
    read_frame,
)


def test_accept_key_is_rfc_6455s_example() -> None:
    assert accept_key("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


def test_masking_is_its_own_inverse_and_matches_the_bytewise_definition() -> None:
    key = bytes([0x37, 0xFA, 0x21, 0x3D])
    data = bytes(range(256)) * 3 + b"tail"
    masked = mask(data, key)
    assert masked == bytes(b ^ key[i % 4] for i, b in enumerate(data))
    assert mask(masked, key) == data
    assert mask(b"", key) == b""
    # RFC 6455 5.7: a masked "Hello"
    assert mask(b"Hello", key) == bytes.fromhex("7f9f4d5158")


@pytest.mark.parametrize(
    ("size", "head"),
    [
        (0, "8280"),
        (125, "82fd"),
        (126, "82fe007e"),
        (65535, "82feffff"),
        (65536, "82ff0000000000010000"),
    ],
)
def test_client_frames_are_final_masked_and_sized(size: int, head: str) -> None:
    key = b"\x01\x02\x03\x04"
    frame = client_frame(2, b"a" * size, key)
    start = len(head) // 2
    assert frame[:start].hex() == head
    assert frame[start : start + 4] == key
    assert mask(frame[start + 4 :], key) == b"a" * size


def test_exec_path() -> None:
    assert exec_path("ns", "pod", ["sh", "-c", "echo a&b"], None, True) == (
        "/api/v1/namespaces/ns/pods/pod/exec?command=sh&command=-c&command=echo+a%26b"
        "&stdin=true&stdout=true&stderr=true"
    )
    assert exec_path("ns", "pod", ["true"], "main", False) == (
        "/api/v1/namespaces/ns/pods/pod/exec?command=true&container=main&stdout=true&stderr=true"
    )


def _status(doc: Mapping[str, object]) -> bytes:
    return json.dumps(doc).encode()


def test_exit_status_from_the_final_status() -> None:
    assert exit_status(_status({"metadata": {}, "status": "Success"}), "x") == 0
    failure = {
        "status": "Failure",
        "message": "command terminated with non-zero exit code: error executing command "
        "[sh -c exit 3], exit code 3",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": "3"}]},
    }
    assert exit_status(_status(failure), "x") == 3
    internal = {"status": "Failure", "message": 'exec: "nope": executable file not found'}
    with pytest.raises(ExecError, match="could not run") as info:
        exit_status(_status(internal), "ns/p -- nope")
    assert "executable file not found" in info.value.why
    with pytest.raises(ExecError, match="not JSON"):
        exit_status(b"{", "x")


def test_a_lost_stream_is_a_connection_error_of_the_engine_kind() -> None:
    lost = ExecStreamLost("the exec stream x ended", "the connection broke", "retry")
    assert isinstance(lost, ConnectionError) and isinstance(lost, ExecError)
    assert lost.kind == "engine-error" and "hint: retry" in str(lost)


async def _frames(data: bytes, max_size: int = 1 << 20) -> list[tuple[bool, int, bytes]]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    out = []
    while not reader.at_eof():
        out.append(await read_frame(reader, max_size, "t"))
    return out


async def test_server_frames_are_read_with_their_sizes_checked_first() -> None:
    # RFC 6455 5.7: "Hel" then "lo" (a fragmented text message), a ping, 256 bytes binary
    data = bytes.fromhex("010348656c80026c6f890548656c6c6f827e0100") + bytes(256)
    assert await _frames(data) == [
        (False, 1, b"Hel"), (True, 0, b"lo"), (True, 9, b"Hello"), (True, 2, bytes(256)),
    ]  # fmt: skip
    with pytest.raises(WebSocketError, match="a frame of 65536 bytes"):
        await _frames(bytes.fromhex("827f0000000000010000"), max_size=1000)
    with pytest.raises(WebSocketError, match="malformed WebSocket frame"):
        await _frames(bytes.fromhex("8185") + b"mask" + b"hello")  # servers must not mask
    with pytest.raises(WebSocketError, match="malformed control frame"):
        await _frames(bytes.fromhex("0900"))  # a fragmented ping
    with pytest.raises(asyncio.IncompleteReadError):
        await _frames(bytes.fromhex("8205") + b"ab")  # the connection ended mid-frame
