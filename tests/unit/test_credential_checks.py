"""The credential broker's pure checks (issue #31): the origin a request is for, the scope a
credential is swapped in, what the response scan looks for, and the settings that say so."""

from __future__ import annotations

import asyncio
import base64
import gzip
import zlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import ValidationError

from fusion_oci.egress.credentials import (
    Broker,
    Brokered,
    clean_path,
    echo_needles,
    in_scope,
    request_origin,
)
from fusion_oci.egress.mitm import Head, Scanner, decoded, sentinel_in_head
from fusion_oci.policy.credentials import CredentialSpec

TOKEN = "ghp_0123456789abcdefghijklmnopqrstuvwxyz"


def _spec(**kw: Any) -> CredentialSpec:
    data = {"name": "T", "hosts": ["registry.test"], "from": {"env": "T"}, **kw}
    return CredentialSpec.model_validate(data)


@pytest.mark.parametrize(
    ("target", "hosts", "port", "path"),
    [
        ("/a?b", ["registry.test"], 443, "/a?b"),
        ("/a", ["Registry.Test:443"], 443, "/a"),
        ("/a", ["registry.test:8443"], 8443, "/a"),
        ("https://registry.test/x?y", ["registry.test"], 443, "/x?y"),
        ("https://REGISTRY.test:443", ["registry.test:443"], 443, "/"),
    ],
)
def test_a_request_for_the_connected_origin(
    target: str, hosts: list[str], port: int, path: str
) -> None:
    assert request_origin(target, hosts, "registry.test", port) == (path, None)


@pytest.mark.parametrize(
    ("target", "hosts", "port", "why"),
    [
        ("/a", [], 443, "no Host header"),
        ("/a", ["registry.test", "registry.test"], 443, "2 Host headers"),
        ("/a", ["other.test"], 443, "Host: other.test is not registry.test:443"),
        ("/a", ["registry.test:8443"], 443, "is not registry.test:443"),
        ("/a", ["registry.test"], 8443, "is not registry.test:8443"),  # no port: 443
        ("/a", ["registry.test."], 443, "is not"),
        ("/a", ["registry.test@other.test"], 443, "is not"),
        ("https://other.test/a", ["registry.test"], 443, "authority other.test is not"),
        ("https://registry.test:8443/a", ["registry.test"], 443, "authority"),
        ("https://x@registry.test/a", ["registry.test"], 443, "authority"),
        ("http://registry.test/a", ["registry.test"], 443, "neither a path"),
        ("*", ["registry.test"], 443, "neither a path"),
        ("registry.test:443", ["registry.test"], 443, "neither a path"),
    ],
)
def test_a_request_for_another_origin(target: str, hosts: list[str], port: int, why: str) -> None:
    path, problem = request_origin(target, hosts, "registry.test", port)
    assert path == "" and problem is not None and why in problem


@pytest.mark.parametrize(
    ("scope", "method", "target", "ok"),
    [
        # git's smart HTTP
        ("git", "GET", "/acme/w.git/info/refs?service=git-upload-pack", True),
        ("git", "GET", "/acme/w.git/info/refs?service=git-receive-pack", True),
        ("git", "GET", "/acme/w.git/info/refs", False),
        ("git", "GET", "/acme/w.git/info/refs?service=x", False),
        ("git", "POST", "/acme/w.git/git-upload-pack", True),
        ("git", "POST", "/repo.git/git-receive-pack", True),
        ("git", "GET", "/repo.git/git-upload-pack", False),
        ("git", "POST", "/acme/w.git/info/lfs/objects/batch", True),
        ("git", "GET", "/user", False),
        ("git", "GET", "/private-pkg", False),
        # a registry's package paths
        ("npm", "GET", "/private-pkg", True),
        ("npm", "HEAD", "/private-pkg", True),
        ("npm", "GET", "/@acme/pkg", True),
        ("npm", "GET", "/@acme%2fpkg", True),
        ("npm", "GET", "/@acme%2Fpkg?write=true", True),
        ("npm", "GET", "/private-pkg/-/private-pkg-4.2.0.tgz", True),
        ("npm", "GET", "/@acme/pkg/-/pkg-1.0.0.tgz", True),
        ("npm", "POST", "/-/npm/v1/security/advisories/bulk", True),
        ("npm", "PUT", "/private-pkg", False),
        ("npm", "GET", "/echo/headers", False),
        ("npm", "GET", "/private-pkg/latest", False),
        ("npm", "GET", "/-/whoami", False),
        ("npm", "GET", "/private-pkg/-/../../echo.tgz", False),
        ("npm", "GET", "/a%2fb", False),
        ("npm", "GET", "/%2e%2e", False),
        ("npm", "GET", "//echo", False),
        ("npm", "GET", "/a\\b", False),
        ("npm", "POST", "/upload", False),
        ("any", "POST", "/anything/at/all", True),
    ],
)
def test_the_scope_presets(scope: str, method: str, target: str, ok: bool) -> None:
    assert in_scope(_spec(scope=scope), method, target) is ok


def test_the_default_scope_is_git_and_npm_and_allowed_requests_add_to_it() -> None:
    spec = _spec()
    assert spec.scope == ["git", "npm"]
    assert in_scope(spec, "POST", "/r.git/git-upload-pack")
    assert in_scope(spec, "GET", "/private-pkg")
    assert not in_scope(spec, "GET", "/echo/headers")
    more = _spec(scope=[], allowedRequests=["PUT /private-pkg", "* /api/v4/*"])
    assert in_scope(more, "PUT", "/private-pkg")
    assert not in_scope(more, "GET", "/private-pkg")
    assert in_scope(more, "DELETE", "/api/v4/projects/1/x?y=1")
    assert not in_scope(more, "GET", "/api/v4/../echo")
    assert clean_path("/@a%2fb/-/b-1.tgz?x") == ("/@a/b/-/b-1.tgz", "x")


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ({"scope": ["gti"]}, "scope"),
        ({"scope": []}, "scope is empty and allowedRequests is not set"),
        ({"allowedRequests": ["/x"]}, "allowedRequests entry '/x' is not 'METHOD /path'"),
        ({"allowedRequests": ["get /x"]}, "method in capitals"),
        ({"allowedRequests": ["GET x"]}, "path glob from its first /"),
    ],
)
def test_scope_settings_errors_name_the_field_and_the_fix(
    override: dict[str, Any], words: str
) -> None:
    with pytest.raises(ValidationError, match=words):
        _spec(**override)


def _found(needles: list[bytes], text: bytes) -> bool:
    return Scanner(needles).feed(text)[1] is not None


def test_the_response_scan_reads_the_value_in_its_echoed_forms() -> None:
    needles = echo_needles(TOKEN)
    raw = TOKEN.encode()
    half = len(raw) // 2
    for text in (
        raw,
        raw[::-1],
        raw.hex().encode(),
        base64.b64encode(raw),
        base64.b64encode(b"Bearer " + raw),  # inside a longer base64 text
        base64.b64encode(b"x:" + raw),
        base64.urlsafe_b64encode(b"ab" + raw),
        b'{"a": "' + raw[:half] + b'"}',  # one half of a value sent in two responses
        b'{"b": "' + raw[half:] + b'"}',
        raw[7:22],  # any piece of 15 of a 40-byte value
    ):
        assert _found(needles, b"<<" + text + b">>"), text
    assert not _found(needles, b"ghp_ and other text, 0123456789, abcdefghijk")
    assert not _found(needles, raw[::-1][3:])  # a reversed piece: not looked for
    assert len(needles) < 100  # a long value: windows at a stride, not each offset
    long = echo_needles("x" * 3 + TOKEN * 30)
    assert len(long) < 80 and max(map(len, long)) == 2 * (3 + 30 * len(TOKEN))  # hex


def test_decoded_bodies_for_the_scan() -> None:
    async def chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
        for i in range(0, len(data), size):
            yield data[i : i + size]

    async def collect(data: bytes, size: int) -> bytes:
        return b"".join([piece async for piece in decoded(chunks(data, size))])

    body = b"echo " * 50_000 + TOKEN.encode()
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    for encoded in (
        gzip.compress(body),
        gzip.compress(body[:1000]) + gzip.compress(body[1000:]),  # two members
        zlib.compress(body),
        raw_deflate.compress(body) + raw_deflate.flush(),
    ):
        for size in (1, 7, 65536):
            if size == 1 and len(encoded) > 5000:
                continue
            assert asyncio.run(collect(encoded, size)) == body


def test_a_sentinel_anywhere_in_a_head() -> None:
    cred = Brokered(_spec(), "REAL", "fusion-sentinel-t-abc")
    broker = Broker((cred,), b"", None, None)
    basic = base64.b64encode(b"u:fusion-sentinel-t-abc").decode()
    assert sentinel_in_head(Head("GET / HTTP/1.1", [("X", "fusion-sentinel-t-abc")]), broker)
    assert sentinel_in_head(Head("GET / HTTP/1.1", [("Authorization", f"Basic {basic}")]), broker)
    assert sentinel_in_head(Head("GET /?fusion-sentinel-t-abc HTTP/1.1", []), broker)
    assert sentinel_in_head(Head("GET / HTTP/1.1", [("X", "y")]), broker) is None
