"""Egress rules (pure): patterns, deny wins, address classes, the denial line."""

from __future__ import annotations

import re
import time

import pytest
from pydantic import ValidationError

from fusion_oci.egress import EgressRules, proxy_env
from fusion_oci.egress.http_front import http_response, rewrite_request, split_host_port
from fusion_oci.egress.meter import LoopMeter
from fusion_oci.egress.rules import (
    ALLOW_KEY,
    DENY_KEY,
    PatternError,
    address_class,
    parse_pattern,
    validate_patterns,
)
from fusion_oci.errors import SettingsError
from fusion_oci.models import SandboxPolicy
from fusion_oci.models.hostpattern import name_problem, normalize_host


@pytest.mark.parametrize(
    "text",
    [
        "example.com",
        "*.example.com",
        "example.com:443",
        "*.npmjs.org:443",
        "EXAMPLE.com.",
        "10.0.0.7",
        "10.0.0.0/24",
        "[fd00::1]:22",
        "fd00::/64",
        "::1",
    ],
)
def test_valid_patterns(text: str) -> None:
    parse_pattern(text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("*", "whole first label"),
        ("*.com", "two labels"),
        ("foo*.example.com", "whole first label"),
        ("a.*.example.com", "whole first label"),
        ("example.com:0", "port"),
        ("example.com:99999", "port"),
        ("example.com:http", "port"),
        ("-bad.example.com", "DNS label"),
        ("exa mple.com", "DNS label"),
        ("my_host.internal", "DNS label"),
        ("https://example.com", "without a scheme"),
        ("10.0.0.0/33", "range"),
        ("fd00::zz:443", "[ADDRESS]:PORT"),
        ("[fd00::1", "closing"),
    ],
)
def test_invalid_patterns(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_pattern(text)


def test_validate_patterns_names_the_settings_key_and_the_fix() -> None:
    with pytest.raises(PatternError) as info:
        validate_patterns(["ok.com", "*bad.com"], ALLOW_KEY)
    err = info.value
    assert isinstance(err, SettingsError)
    assert "sandbox.policy.allowedDomains[1]" in err.what
    assert "*bad.com" in err.what
    assert "*.example.com" in err.hint


def test_policy_rejects_a_bad_domain_pattern() -> None:
    with pytest.raises(ValidationError, match=r"deniedDomains\[0\] 'x\*y.com'"):
        SandboxPolicy(network="filtered", denied_domains=["x*y.com"])
    SandboxPolicy(network="filtered", allowed_domains=["*.example.com", "github.com:22"])


def test_exact_and_wildcard_matching() -> None:
    rules = EgressRules(allowed=("example.com", "*.npmjs.org", "github.com:22"))
    assert rules.decide("example.com", 443).allowed
    assert rules.decide("EXAMPLE.COM.", 80).allowed
    assert not rules.decide("www.example.com", 443).allowed  # exact: not its subdomains
    assert rules.decide("registry.npmjs.org", 443).allowed
    assert rules.decide("a.b.npmjs.org", 443).allowed
    assert not rules.decide("npmjs.org", 443).allowed  # wildcard: not the apex
    assert not rules.decide("evilnpmjs.org", 443).allowed
    assert rules.decide("github.com", 22).allowed
    assert not rules.decide("github.com", 443).allowed


def test_deny_wins() -> None:
    rules = EgressRules(allowed=("*.example.com",), denied=("secret.example.com",))
    assert rules.decide("www.example.com", 443).allowed
    verdict = rules.decide("secret.example.com", 443)
    assert not verdict.allowed
    assert verdict.settings_key == DENY_KEY
    assert "deniedDomains entry 'secret.example.com'" in verdict.rule
    line = verdict.denial_text("secret.example.com", 443)
    assert "secret.example.com:443" in line
    assert "remove it from sandbox.policy.deniedDomains" in line


def test_unlisted_host_names_the_allow_key() -> None:
    verdict = EgressRules(allowed=()).decide("pypi.org", 443)
    assert not verdict.allowed and verdict.settings_key == ALLOW_KEY
    assert "add it to sandbox.policy.allowedDomains" in verdict.denial_text("pypi.org", 443)


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("169.254.169.254", "the metadata address"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("10.1.2.3", "private (RFC 1918)"),
        ("172.16.0.1", "private (RFC 1918)"),
        ("192.168.1.1", "private (RFC 1918)"),
        ("100.64.0.1", "shared (CGNAT)"),
        ("fd12::1", "unique-local (ULA)"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "the metadata address"),
        ("64:ff9b::a00:1", "private (RFC 1918)"),
    ],
)
def test_forbidden_address_classes(address: str, why: str) -> None:
    import ipaddress

    assert address_class(ipaddress.ip_address(address)) == why
    assert not EgressRules(allowed=("*.example.com",)).check_address(address, 443).allowed


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:2800:220:1::1", "8.8.8.8"])
def test_public_addresses_pass(address: str) -> None:
    assert EgressRules(allowed=()).check_address(address, 443).allowed


def test_allow_addresses_lift_the_refusal_for_their_range_only() -> None:
    rules = EgressRules(allowed=("test.example",), allow_addresses=("10.200.0.0/24",))
    assert rules.check_address("10.200.0.2", 80).allowed
    assert rules.check_address("::ffff:10.200.0.2", 80).allowed
    assert not rules.check_address("10.201.0.2", 80).allowed


def test_dashboard_port_on_loopback_refused_even_when_loopback_is_allowed() -> None:
    rules = EgressRules(allowed=("x.test",), allow_addresses=("127.0.0.0/8", "0.0.0.0/8"))
    assert rules.check_address("127.0.0.1", 8080).allowed
    for address in ("127.0.0.1", "0.0.0.0", "::ffff:127.0.0.1"):
        verdict = rules.check_address(address, 4040)
        assert not verdict.allowed and "4040" in verdict.rule


@pytest.mark.parametrize(
    "address",
    ["192.0.2.10", "10.1.2.3", "8.8.8.8", "2001:db8::10", "::ffff:192.0.2.10", "fd00::1"],
)
def test_dashboard_port_refused_on_every_address(address: str) -> None:
    """The host's own addresses are no fixed list (every interface, mapped forms, a public
    address NATed back to it): 4040 is refused on all, whatever the ranges allow."""
    rules = EgressRules(allowed=("x.test",), allow_addresses=("0.0.0.0/0", "::/0"))
    assert rules.check_address(address, 8080).allowed
    verdict = rules.check_address(address, 4040)
    assert not verdict.allowed and "4040" in verdict.rule
    text = verdict.denial_text("x.test", 4040)
    assert "4040" in text and "no setting changes this" in text


@pytest.mark.parametrize(
    "host",
    [
        "de\xadnied.example",  # soft hyphen: IDNA nameprep drops it
        "fo\xba.example",  # 'º': nameprep maps it to 'o'
        "b\xaar.corp.example",  # 'ª' -> 'a'
        "\\100enied.corp.example",  # glibc's DNS backend reads \100 as 'd'
        "de\\nied.corp.example",  # ... and \n as 'n'
        "\u212aenied.corp.example",  # the Kelvin sign: str.lower() makes it 'k'
        "denied.example\x00.evil",
        "de nied.corp.example",
        "de%6Eied.corp.example",
        "a..corp.example",
        "-x.corp.example",
        "my_host.corp.example",  # not a host name's alphabet (the letter: #31)
    ],
)
def test_a_name_that_is_not_plain_ascii_is_refused_before_any_pattern(host: str) -> None:
    """Deny must win over every spelling a resolver folds: such names never reach a
    pattern, whatever allows them, and the line says why (not a setting to change)."""
    rules = EgressRules(allowed=("*.corp.example",), denied=("denied.corp.example",))
    verdict = rules.decide(host, 443)
    assert not verdict.allowed and verdict.rule == "the host name check"
    assert name_problem(host) is not None
    text = verdict.denial_text(host, 443)
    assert text.startswith("fusion-oci egress: refused: ") and "\n" not in text.rstrip()


@pytest.mark.parametrize(
    "host",
    [
        "allowed.corp.example",
        "ALLOWED.Corp.Example.",
        "x-1.corp.example",
        "127.1",
        "0x7f.1",
    ],
)
def test_plain_names_and_address_forms_pass_the_name_check(host: str) -> None:
    assert name_problem(host) is None
    assert EgressRules(allowed=("*.corp.example", "127.1", "0x7f.1")).decide(host, 443).allowed


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "::ffff:127.0.0.1", "fe80::1%eth0"])
def test_ip_literals_are_not_names(host: str) -> None:
    assert name_problem(host) is None


def test_normalize_host_lowers_ascii_only() -> None:
    """str.lower() folds the Kelvin sign into 'k': a non-ASCII host stays as it came, so the
    name check sees it."""
    assert normalize_host("Registry.NPMjs.org.") == "registry.npmjs.org"
    assert normalize_host("\u212aA.example") == "\u212aA.example"


def test_from_policy_merges_profile_and_lifts_named_ranges() -> None:
    policy = SandboxPolicy(
        network="filtered",
        allowed_domains=["api.example.com", "10.9.0.0/16"],
        denied_domains=["registry.yarnpkg.com"],
    )
    rules = EgressRules.from_policy(policy, ["registry.npmjs.org:443", "registry.yarnpkg.com:443"])
    assert rules.decide("registry.npmjs.org", 443).allowed
    assert not rules.decide("registry.yarnpkg.com", 443).allowed  # deny wins over the profile
    assert rules.decide("api.example.com", 443).allowed
    assert rules.allow_addresses == ("10.9.0.0/16",)
    assert rules.decide("10.9.1.1", 80).allowed and rules.check_address("10.9.1.1", 80).allowed


def test_address_literals_match_address_patterns() -> None:
    rules = EgressRules(allowed=("[fd00::1]:22", "192.0.2.0/24"))
    assert rules.decide("[fd00::1]", 22).allowed
    assert rules.decide("fd00:0::1", 22).allowed
    assert rules.decide("192.0.2.9", 443).allowed
    assert not rules.decide("192.0.3.9", 443).allowed


def test_proxy_env_points_everything_at_the_forwarder() -> None:
    env = proxy_env()
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://127.0.0.1:3128"
    assert env["ALL_PROXY"] == "socks5h://127.0.0.1:3128"
    assert env["NO_PROXY"] == env["no_proxy"] == ""
    assert env["npm_config_https_proxy"] == "http://127.0.0.1:3128"
    assert "ProxyCommand='/dev/fusion-oci-agent connect %h %p'" in env["GIT_SSH_COMMAND"]
    assert proxy_env(port=9, agent="/a")["GIT_SSH_COMMAND"].endswith("'/a connect %h %p'")


def test_split_host_port() -> None:
    assert split_host_port("example.com:443") == ("example.com", 443)
    assert split_host_port("[::1]:22") == ("::1", 22)
    assert split_host_port("example.com", 80) == ("example.com", 80)
    for bad in ("example.com", "example.com:x", "example.com:0", "[::1"):
        with pytest.raises(ValueError):
            split_host_port(bad)


def test_rewrite_request_drops_hop_by_hop_headers() -> None:
    lines = [
        "GET http://a.test/x?y=1 HTTP/1.1",
        "Host: wrong",
        "Proxy-Connection: keep-alive",
        "Connection: keep-alive, X-Trace",
        "X-Trace: 1",
        "Proxy-Authorization: Basic x",
        "Accept: */*",
        "TE: trailers",
    ]
    head = rewrite_request(lines, "/x?y=1", "a.test").decode()
    assert head.startswith("GET /x?y=1 HTTP/1.1\r\nHost: a.test\r\n")
    assert "Accept: */*" in head and head.endswith("Connection: close\r\n\r\n")
    for gone in (
        "Proxy-Connection",
        "keep-alive",
        "X-Trace",
        "Proxy-Authorization",
        "TE:",
        "wrong",
    ):
        assert gone not in head


def test_http_refusal_response() -> None:
    raw = http_response(403, "fusion-oci egress: x denied")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 403 Forbidden")
    assert b"Content-Length: %d" % len(body) in head
    assert body == b"fusion-oci egress: x denied\n"


def test_the_default_network_stays_egress() -> None:
    """The documented decision (docs/egress.md): filtered is chosen, never the default."""
    from fusion_oci.models import NetworkMode

    assert SandboxPolicy().network_mode is NetworkMode.EGRESS
    assert SandboxPolicy(allow_network=False).network_mode is NetworkMode.NONE


def test_scoped_and_bad_addresses_are_refused() -> None:
    rules = EgressRules(allowed=("x.test",))
    assert "link-local" in rules.check_address("fe80::1%eth0", 443).rule
    assert not rules.check_address("not-an-address", 443).allowed


def test_a_task_over_its_loop_share_waits_only_while_another_has_work_under_way() -> None:
    """Work-conserving and fair: the over-budget task waits at accept only while a neighbour
    has a connection past its first byte (idle connections are no demand), and only past an
    equal part of the loop among the tasks with work (never below the floor, loop_share)."""
    hog, other = LoopMeter(0.10), LoopMeter(0.10)
    hog.register()
    other.register()
    try:
        hog.charge(0.9)  # 90% of the last second on the loop
        assert hog.over_budget() == 0.0  # the neighbour wants nothing
        assert hog.step_wait() == 0.0
        other.working = 1
        assert hog.fair_share() == 0.5  # two tasks with work: half each
        wait = hog.over_budget()
        assert 0.4 < wait < 0.8  # ln(0.9 / 0.5): back under half in about 0.6 s
        assert 0.4 < hog.step_wait() < 0.8
        other.charge(0.01)
        assert other.over_budget() == 0.0  # under half its share
        other.charge(0.29)
        other.admitted_at = time.monotonic()
        hog.working = 1
        assert 0.0 < other.over_budget() <= 0.01  # near it: one connection per 10 ms
    finally:
        hog.unregister()
        other.unregister()


def test_a_task_that_keeps_being_refused_gets_only_the_floor() -> None:
    """Work nobody asked for (denied CONNECTs, refused pushes) earns no fair share."""
    meter = LoopMeter(0.10)
    assert meter.fair_share() == 1.0  # alone
    for _ in range(20):
        meter.refused()
    assert meter.fair_share() == 0.10
