"""``policy.hostServices`` (issue #35): the settings, the pure grant parser, where each grant
appears inside, the landlock supervisor's redirect, and the relay's symlink-proof open."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import pytest
from pydantic import ValidationError

from fusion_oci.models import SandboxPolicy
from fusion_oci.models.hostservice import HostService, hands_over, parse_grant
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.landlock import landlock_rules, launch_config, launch_text
from fusion_oci.services.inside import service_wiring
from fusion_oci.services.relay import open_unix_target
from fusion_oci.shims.confine import parse
from fusion_oci.shims.connects import service_redirect, service_table

GRANTS = ["127.0.0.1:5432", "[::1]:6379", "unix:/var/run/postgresql/.s.PGSQL.5432"]


def test_the_three_forms_parse_to_what_programs_name() -> None:
    assert [parse_grant(g) for g in GRANTS] == [
        HostService("tcp", address="127.0.0.1", port=5432),
        HostService("tcp", address="::1", port=6379),
        HostService("unix", path="/var/run/postgresql/.s.PGSQL.5432"),
    ]
    assert [str(parse_grant(g)) for g in GRANTS] == GRANTS
    assert str(parse_grant("[0:0:0:0:0:0:0:1]:6379")) == "[::1]:6379"  # one canonical form


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("localhost:5432", "not an address"),
        ("db.internal:5432", "not an address"),
        ("0.0.0.0:5432", "unspecified address"),
        ("[::]:5432", "unspecified address"),
        ("[::ffff:127.0.0.1]:5432", "write it as 127.0.0.1:PORT"),
        ("[::ffff:7f00:1]:5432", "write it as 127.0.0.1:PORT"),
        ("[64:ff9b::7f00:1]:5432", "IPv4 address in an IPv6 form"),
        ("[2002:7f00:1::]:5432", "IPv4 address in an IPv6 form"),
        ("10.0.0.5:5432", "not the host's loopback"),
        ("[fe80::1]:5432", "not the host's loopback"),
        ("127.0.0.1", "ADDRESS:PORT"),
        ("127.0.0.1:0", "not a port"),
        ("127.0.0.1:65536", "not a port"),
        ("tcp://127.0.0.1:5432", "without a scheme"),
        ("unix:relative.sock", "not an absolute path"),
        ("unix:/run/../etc/x.sock", "'..' segments"),
        ("unix:/run/./x.sock", "'..' segments"),
        ("unix://run/x.sock", "'//'"),
        ("unix:/" + "a" * 120, "longer than a unix socket path"),
    ],
)
def test_a_bad_entry_is_a_settings_error_naming_the_field_and_the_fix(
    entry: str, says: str
) -> None:
    with pytest.raises(ValidationError) as err:
        SandboxPolicy(host_services=["127.0.0.1:1", entry])
    assert "hostServices[1]" in str(err.value) and says in str(err.value)


@pytest.mark.parametrize(
    "entry",
    [
        "unix:/run/docker.sock",
        "unix:/var/run/docker.sock",
        "unix:/run/user/1000/docker.sock",
        "unix:/run/podman/podman.sock",
        "unix:/run/user/1000/podman/podman.sock",
        "unix:/run/containerd/containerd.sock",
        "unix:/run/user/1000/fusion-oci/abc123.sock",
        "unix:/tmp/fusion-oci.1000/abc.sock",
        "unix:/tmp/ssh-XXXXabc/agent.1234",
        "unix:/run/user/1000/gnupg/S.gpg-agent",
        "unix:/run/user/1000/gnupg/S.gpg-agent.ssh",
        "unix:/tmp/fusion-oci-services-t2-abcd/0.sock",
        "unix:/tmp/fusion-oci-egress-t2-abcd/egress.sock",
        "127.0.0.1:4040",
    ],
)
def test_a_grant_that_hands_over_the_host_needs_dangerous_true(entry: str) -> None:
    with pytest.raises(ValidationError, match="hands over the host") as err:
        SandboxPolicy(host_services=[entry])
    assert "dangerous: true" in str(err.value)
    policy = SandboxPolicy.model_validate({"hostServices": [{"address": entry, "dangerous": True}]})
    assert policy.grants() == [(parse_grant(entry), True)]


def test_a_symlink_to_an_engine_socket_is_judged_by_its_target() -> None:
    grant = parse_grant("unix:/srv/db.sock")
    assert hands_over(grant) is None
    assert hands_over(grant, "/run/docker.sock") is not None


def test_settings_take_the_camel_case_key_and_refuse_host_network_and_duplicates() -> None:
    settings = SandboxSettings.model_validate({"policy": {"hostServices": GRANTS}})
    assert [str(g) for g, _ in settings.policy.grants()] == GRANTS
    with pytest.raises(ValidationError, match="network host"):
        SandboxPolicy(network="host", host_services=["127.0.0.1:5432"])
    with pytest.raises(ValidationError, match="port 3128 with network filtered"):
        SandboxPolicy(network="filtered", host_services=["127.0.0.1:3128"])
    SandboxPolicy(network="none", host_services=["127.0.0.1:3128"])
    with pytest.raises(ValidationError, match=r"granted already \(hostServices\[0\]\)"):
        SandboxPolicy(host_services=["127.0.0.1:5432", "127.0.0.1:5432"])


def test_no_grant_keeps_every_policy_hash() -> None:
    # The field's default must not change the hash of any existing policy (audit, replay).
    assert SandboxPolicy().digest() == SandboxPolicy(host_services=[]).digest()
    assert SandboxPolicy().digest() != SandboxPolicy(host_services=["127.0.0.1:1"]).digest()


def test_inside_a_tcp_grant_is_an_agent_listener_and_a_unix_grant_a_bind() -> None:
    grants = [parse_grant(g) for g in GRANTS]
    wiring = service_wiring(
        grants,
        {GRANTS[0]: "/h/0.sock", GRANTS[1]: "/h/1.sock", GRANTS[2]: "/h/2.sock"},
        {GRANTS[2]: "/run/postgresql/.s.PGSQL.5432"},
    )
    assert wiring.agent_args == (
        "--service",
        "127.0.0.1:5432=/run/fusion-oci/services/0.sock",
        "--service",
        "[::1]:6379=/run/fusion-oci/services/1.sock",
    )
    assert wiring.binds == (
        ("/h/0.sock", "/run/fusion-oci/services/0.sock"),
        ("/h/1.sock", "/run/fusion-oci/services/1.sock"),
        ("/h/2.sock", "/var/run/postgresql/.s.PGSQL.5432"),
        ("/h/2.sock", "/run/postgresql/.s.PGSQL.5432"),  # the spelling it resolves to
    )


# --- landlock: the connect supervisor's redirect --------------------------------------------

SERVICES = (
    ("tcp 4 127.0.0.1 5432", "/tmp/relay dir/0.report"),
    ("tcp 6 ::1 6379", "/tmp/relay dir/1.report"),
    ("unix /var/run/postgresql/.s.PGSQL.5432", "/tmp/relay/2.sock"),
)


def _in4(ip: str, port: int) -> bytes:
    return (
        struct.pack("=H", socket.AF_INET)
        + struct.pack("!H", port)
        + socket.inet_aton(ip)
        + bytes(8)
    )


def _in6(ip: str, port: int) -> bytes:
    return (
        struct.pack("=H", socket.AF_INET6)
        + struct.pack("!H", port)
        + bytes(4)
        + socket.inet_pton(socket.AF_INET6, ip)
        + bytes(4)
    )


def _un(path: str) -> bytes:
    return struct.pack("=H", socket.AF_UNIX) + path.encode() + b"\0"


def _table() -> dict:  # type: ignore[type-arg]
    rules = landlock_rules(_spec(), "/h", "/t", services=SERVICES)
    return service_table(parse(launch_text(launch_config(rules, 7, "x86_64"))))


def _spec():  # type: ignore[no-untyped-def]
    from tests.unit.test_landlock_rules import spec_for

    return spec_for("host-services")


def test_landlock_redirects_exactly_the_granted_addresses_to_their_relays() -> None:
    """TCP: the command's socket goes to the grant itself (rebuilt from the grant's bytes),
    reported to the relay's socket; unix: to the relay's socket."""
    table = _table()
    cwd = "/var/run/postgresql"
    assert service_redirect(_in4("127.0.0.1", 5432), table, lambda: cwd) == (
        _in4("127.0.0.1", 5432),
        "/tmp/relay dir/0.report",
    )
    flow_label = bytearray(_in6("::1", 6379))
    flow_label[4:8] = b"\x00\x0a\xbc\xde"  # the caller's extras are not passed on
    assert service_redirect(bytes(flow_label), table, lambda: cwd) == (
        _in6("::1", 6379),
        "/tmp/relay dir/1.report",
    )
    # the v4 grant asked for by its v4-mapped form: the same service
    mapped = service_redirect(_in6("::ffff:127.0.0.1", 5432), table, lambda: cwd)
    assert mapped == (_in6("::ffff:127.0.0.1", 5432), "/tmp/relay dir/0.report")
    assert service_redirect(_un("/var/run/postgresql/.s.PGSQL.5432"), table, lambda: cwd) == (
        "/tmp/relay/2.sock"
    )
    assert service_redirect(_un(".s.PGSQL.5432"), table, lambda: cwd) == "/tmp/relay/2.sock"
    for other in (
        _in4("127.0.0.1", 5433),  # another port
        _in4("127.0.0.1", 4040),
        _in4("127.0.0.2", 5432),  # another loopback address
        _in4("10.0.2.2", 5432),
        _in6("::1", 5432),  # the v4 grant's port on v6: not granted
        _in6("::ffff:127.0.0.1", 6379),  # the v6 grant's port as mapped v4: not granted
        _un("/var/run/postgresql/.s.PGSQL.5433"),
        _un("/run/docker.sock"),
        b"\x01\x00\x00abstract",
    ):
        assert service_redirect(other, table, lambda: cwd) is None


def test_landlock_none_with_grants_gets_stream_sockets_and_a_supervised_connect() -> None:
    rules = landlock_rules(_spec(), "/h", "/t", services=SERVICES)
    config = launch_config(rules, 7, "x86_64")
    assert rules.network == "none" and config["connect_port"] == 0  # every connect supervised
    assert config["ports"] == []  # and Landlock lets no TCP connect through by itself
    names = {n for r in rules.seccomp["syscalls"] for n in r["names"]}
    assert "socket" in names  # the filtered socket rules, not every socket() refused
    plain = landlock_rules(_spec().model_copy(update={"annotations": {}}), "/h", "/t")
    assert launch_config(plain, 7, "x86_64")["connect_port"] == -1


# --- the relay's open: never a symlink ----------------------------------------------------


def test_the_relay_opens_the_granted_socket_without_following_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(real / "s.sock"))
    try:
        fd = open_unix_target(str(real / "s.sock"))
        os.close(fd)
        # the socket swapped for a symlink to another socket: refused, not followed
        other = socket.socket(socket.AF_UNIX)
        other.bind(str(tmp_path / "other.sock"))
        (real / "s.sock").unlink()
        (real / "s.sock").symlink_to(tmp_path / "other.sock")
        with pytest.raises(OSError):
            os.close(open_unix_target(str(real / "s.sock")))
        # a folder on the way swapped for a symlink: refused too
        (real / "s.sock").unlink()
        real.rename(tmp_path / "moved")
        real.symlink_to(tmp_path / "moved")
        with pytest.raises(OSError):
            os.close(open_unix_target(str(real / "s.sock")))
        # not a socket
        (tmp_path / "file").write_text("x")
        with pytest.raises(OSError):
            os.close(open_unix_target(str(tmp_path / "file")))
        other.close()
    finally:
        srv.close()


def test_filtered_lets_http_clients_reach_the_granted_services_directly() -> None:
    """NO_PROXY names the granted addresses (the proxy refuses loopback); nothing else."""
    from fusion_oci.oci.environment import sandbox_env
    from tests.unit.test_bubblewrap_argv import PLAIN

    env = sandbox_env(SandboxPolicy(network="filtered", host_services=GRANTS), PLAIN, {})
    assert env["NO_PROXY"] == env["no_proxy"] == "127.0.0.1,::1,localhost"
    assert env["HTTP_PROXY"] == "http://127.0.0.1:3128"
    plain = sandbox_env(SandboxPolicy(network="filtered"), PLAIN, {})
    assert plain["NO_PROXY"] == ""
    unix_only = sandbox_env(SandboxPolicy(network="filtered", host_services=GRANTS[2:]), PLAIN, {})
    assert unix_only["NO_PROXY"] == ""
