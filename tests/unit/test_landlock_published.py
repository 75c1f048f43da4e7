"""landlock's ``publishPorts``: the bind supervisor's verdicts, its report as the host reads
it, the ``/proc/net/tcp`` check, the notify filter, the launch file (a golden) and what the
runtime enforces (all pure: the kernel's side is tests/security/test_published_ports.py)."""

from __future__ import annotations

import socket
import struct

import pytest

from fusion_oci.models import SandboxPolicy
from fusion_oci.oci.model import TaskSpec
from fusion_oci.runtimes.landlock import (
    enforced_requirements,
    landlock_rules,
    launch_config,
    launch_text,
)
from fusion_oci.runtimes.landlock.published import parse_report
from fusion_oci.runtimes.requirements import Requirement
from fusion_oci.shims.confine import AUDIT_ARCH, RET_ALLOW, RET_USER_NOTIF, notify_program, parse
from fusion_oci.shims.connects import (
    bind_report,
    bind_verdict,
    diag_listeners,
    diag_request,
    ephemeral_choices,
    listening_inodes,
    local_port_range,
    own_server,
    published_loopback,
)
from fusion_oci.shims.seccomp_notify import BIND_CALL, CONNECT_CALL, LISTEN_CALL
from tests.bpf import run_bpf
from tests.golden import GOLDEN_HOST, assert_golden
from tests.tasks import resolved
from tests.unit.test_landlock_filtered import LAYOUT, task_ctx

HOME, TMP, AGENT, REPORT = "/run/scratch/home", "/run/scratch/tmp", "/opt/fo/agent", "/s/binds"
PUBLISHED = frozenset({8080, 3000})


def spec_for(network: str, publish: list[str]) -> TaskSpec:
    policy = SandboxPolicy(network=network, publish_ports=publish)  # type: ignore[arg-type]
    return resolved(task_ctx(policy), LAYOUT, GOLDEN_HOST, {"LANG": "C.UTF-8"}).spec


def v4(address: str, port: int) -> bytes:
    return struct.pack("=H", 2) + struct.pack("!H", port) + socket.inet_aton(address) + bytes(8)


def v6(address: str, port: int) -> bytes:
    packed = socket.inet_pton(socket.AF_INET6, address)
    return struct.pack("=H", 10) + struct.pack("!H", port) + bytes(4) + packed + bytes(4)


BINDS = {
    # A published port on loopback or the wildcard, either family: the supervisor's.
    v4("127.0.0.1", 8080): ("publish", 2, 8080),
    v4("0.0.0.0", 3000): ("publish", 2, 3000),
    v6("::1", 8080): ("publish", 10, 8080),
    v6("::", 8080): ("publish", 10, 8080),
    v6("::ffff:127.0.0.1", 8080): ("publish", 10, 8080),
    v6("::ffff:0.0.0.0", 8080): ("publish", 10, 8080),
    # Unix addresses go on as the kernel decides (Landlock rules the path).
    struct.pack("=H", 1) + b"/work/wt/s.sock\0": ("unix", 0, 0),
    struct.pack("=H", 1) + b"\0abstract": ("unix", 0, 0),
    # Every other port or address: refused.
    v4("127.0.0.1", 8081): ("deny", 0, 0),
    v4("0.0.0.0", 8081): ("deny", 0, 0),
    v4("0.0.0.0", 0): ("deny", 0, 0),  # an ephemeral port of the wildcard
    v4("127.0.0.2", 8080): ("deny", 0, 0),
    v4("192.168.1.5", 8080): ("deny", 0, 0),
    v6("fe80::1", 8080): ("deny", 0, 0),
    v6("::ffff:10.0.0.1", 8080): ("deny", 0, 0),
    v4("127.0.0.1", 8080)[:6]: ("deny", 0, 0),  # short
    v6("::1", 8080)[:20]: ("deny", 0, 0),
    struct.pack("=H", 0) + bytes(14): ("deny", 0, 0),  # AF_UNSPEC
    struct.pack("=H", 17) + bytes(14): ("deny", 0, 0),  # AF_PACKET
    b"\x02": ("deny", 0, 0),
}


@pytest.mark.parametrize(("addr", "verdict"), BINDS.items())
def test_bind_verdicts(addr: bytes, verdict: tuple[str, int, int]) -> None:
    assert bind_verdict(addr, PUBLISHED) == verdict


def test_nothing_published_binds_nothing() -> None:
    assert bind_verdict(v4("127.0.0.1", 8080), frozenset()) == ("deny", 0, 0)


def test_the_host_reads_the_supervisor_s_report_and_nothing_else() -> None:
    assert parse_report(bind_report(8080, 10, 41234, 987654)) == (8080, 10, 41234, 987654)
    for bad in (
        b"",
        b"B 8080 2 41234",
        b"B 8080 2 41234 9 9",
        b"O",
        b"B 8080 17 41234 9",  # not a TCP family
        b"B 0 2 41234 9",
        b"B 8080 2 70000 9",
        b"B -1 2 41234 9",
        b"X 8080 2 41234 9",
    ):
        assert parse_report(bad) is None, bad


TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:A112 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 555 1
   1: 00000000:A112 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 777 1
   2: 0100007F:A113 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 888 1
   3: 0100007F:A113 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 999 1
   4: garbage
"""


def test_the_listeners_of_a_port_are_read_from_the_proc_table() -> None:
    assert listening_inodes(TCP, 0xA112) == {555, 777}  # two: not the command's alone
    assert listening_inodes(TCP, 0xA113) == {888}  # the established one is not a listener
    assert listening_inodes(TCP, 0xA114) == set()


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_bind_goes_to_the_supervisor_only_with_published_ports(arch: str) -> None:
    with_bind = notify_program(arch, connect=True, bind=True)
    for nr in (CONNECT_CALL[arch], LISTEN_CALL[arch], BIND_CALL[arch]):
        assert run_bpf(with_bind, nr, AUDIT_ARCH[arch]) == RET_USER_NOTIF
    assert run_bpf(notify_program(arch, connect=True), BIND_CALL[arch], AUDIT_ARCH[arch]) == (
        RET_ALLOW
    )


@pytest.mark.parametrize("network", ["none", "filtered"])
def test_the_launch_file_carries_the_ports_and_the_report_socket(network: str) -> None:
    spec = spec_for(network, ["3000", "8080:80"])
    rules = landlock_rules(spec, HOME, TMP, 40123, AGENT, bind_report=REPORT)
    cfg = launch_config(rules, 7, "x86_64")
    assert cfg["publish"] == [3000, 80] and cfg["publish_report"] == REPORT
    # connect, listen and bind supervised; every TCP bind still denied by Landlock (no
    # rule grants bind_tcp), so the supervisor's are the only ones.
    assert cfg["connect_port"] == (40123 if network == "filtered" else 0)
    assert cfg["handled_net"] == 3
    assert all(mask == 2 for _, mask in cfg["ports"])  # connect_tcp only, never bind_tcp
    assert parse(launch_text(cfg)) == {**cfg, "drop_capabilities": 1}
    if network == "none":
        data = rules.to_json()
        data["seccomp"] = data["seccomp"]["syscalls"][-8:]  # stream sockets, as filtered's
        assert_golden("landlock/published-ports.json", {"rules": data, "launch": {
            k: v for k, v in cfg.items() if k not in ("seccomp", "paths")
        }})  # fmt: skip


def test_none_with_published_ports_opens_tcp_and_unix_stream_sockets_only() -> None:
    plain = landlock_rules(spec_for("none", []), HOME, TMP)
    published = landlock_rules(spec_for("none", ["3000"]), HOME, TMP)
    filtered = landlock_rules(spec_for("filtered", []), HOME, TMP)
    assert published.seccomp["syscalls"][-8:] == filtered.seccomp["syscalls"][-8:]
    assert plain.seccomp["syscalls"][-1] == {
        "names": ["socket"],
        "action": "SCMP_ACT_ERRNO",
        "errnoRet": 1,
    }
    assert launch_config(plain, 7, "x86_64")["connect_port"] == -1
    assert "publish" not in launch_config(plain, 7, "x86_64")


def test_before_prepare_the_ports_are_planned_without_a_report_socket() -> None:
    rules = landlock_rules(spec_for("none", ["3000"]), HOME, TMP)
    assert rules.published == (3000,) and rules.bind_report is None
    cfg = launch_config(rules, 7, "x86_64")
    assert cfg["publish_report"] == ""
    assert parse(launch_text(cfg))["publish_report"] == ""


def test_published_ports_are_enforced_from_abi_4() -> None:
    assert Requirement.PUBLISHED_PORTS not in enforced_requirements(3)
    assert Requirement.PUBLISHED_PORTS in enforced_requirements(4)
    assert Requirement.PUBLISHED_PORTS in enforced_requirements(7)


def test_plan_says_how_the_ports_are_published(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's notes name the published ports and how a client reaches the server."""
    from pathlib import Path

    import fusion_oci.runtimes.landlock.host as mod
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.runtimes.landlock import LandlockRuntime
    from tests.tasks import plan_for

    monkeypatch.setattr(mod, "_ABI", 7)
    runtime = LandlockRuntime(
        SandboxSettings(backend="landlock"),
        {"PATH": "/usr/bin"},
        cache_root=Path("/nonexistent-cache"),
        host=GOLDEN_HOST,
    )
    policy = SandboxPolicy(network="none", publish_ports=["3000", "8080:80"])
    plan = plan_for(runtime, resolved(task_ctx(policy), LAYOUT, GOLDEN_HOST, {}), "npm run dev")
    [note] = [n for n in plan.notes if n.startswith("published ports")]
    assert note.startswith("published ports 3000, 80: the command's bind to one")
    assert "ephemeral port (what getsockname shows)" in note
    assert "every other TCP bind denied" in note


def _v4(ip: str, port: int) -> bytes:
    return (
        struct.pack("=H", socket.AF_INET)
        + struct.pack("!H", port)
        + socket.inet_aton(ip)
        + bytes(8)
    )


def _v6(ip: str, port: int) -> bytes:
    packed = socket.inet_pton(socket.AF_INET6, ip)
    return (
        struct.pack("=H", socket.AF_INET6) + struct.pack("!H", port) + bytes(4) + packed + bytes(4)
    )


def test_a_connect_to_its_own_published_server_goes_to_the_ephemeral_port_on_loopback_only() -> (
    None
):
    servers = {8080: (socket.AF_INET, 40001, 77), 3000: (socket.AF_INET6, 40002, 78)}
    # An IPv4 server: 127.0.0.1 and its v4-mapped form, in the caller's own form.
    assert own_server(_v4("127.0.0.1", 8080), servers) == (
        _v4("127.0.0.1", 40001), socket.AF_INET, 40001, 77
    )  # fmt: skip
    assert own_server(_v6("::ffff:127.0.0.1", 8080), servers) == (
        _v6("::ffff:127.0.0.1", 40001), socket.AF_INET, 40001, 77
    )  # fmt: skip
    # An IPv6 server: ::1 only (an IPv4 client does not reach ::1 on any network).
    assert own_server(_v6("::1", 3000), servers) == (_v6("::1", 40002), socket.AF_INET6, 40002, 78)
    assert own_server(_v4("127.0.0.1", 3000), servers) is None
    # Nothing else: another address, another port, the wildcard, a short address.
    for addr in (
        _v4("127.0.0.2", 8080),
        _v4("10.0.0.1", 8080),
        _v4("0.0.0.0", 8080),
        _v4("127.0.0.1", 8081),
        _v6("::1", 8080),
        _v6("::", 3000),
        _v4("127.0.0.1", 8080)[:6],
    ):
        assert own_server(addr, servers) is None, addr
    assert own_server(_v4("127.0.0.1", 8080), {}) is None


def _diag_msg(sport: int, inode: int) -> bytes:
    body = bytearray(72)
    body[0], body[1] = socket.AF_INET, 10  # family, TCP_LISTEN
    struct.pack_into("!H", body, 4, sport)
    struct.pack_into("=I", body, 68, inode)
    return struct.pack("=IHHII", 16 + len(body), 20, 2, 1, 0) + bytes(body)


def test_the_listener_check_reads_a_sock_diag_dump() -> None:
    """The supervisor's and the host's check that a port's listener is still the command's
    asks the kernel for listeners only (sock_diag), not the whole /proc/net/tcp."""
    request = diag_request(socket.AF_INET6)
    assert len(request) == 16 + 56
    assert struct.unpack_from("=IHH", request) == (72, 20, 0x301)  # a dump request
    assert request[16:18] == bytes([socket.AF_INET6, 6])  # TCP
    assert struct.unpack_from("=I", request, 20)[0] == 1 << 10  # listeners only
    answer = _diag_msg(40001, 77) + _diag_msg(40002, 78) + _diag_msg(40001, 79)
    assert diag_listeners(answer, 40001) == ({77, 79}, False)  # two: not the command's alone
    done = struct.pack("=IHHII", 20, 3, 2, 1, 0) + bytes(4)
    assert diag_listeners(_diag_msg(40002, 78) + done, 40002) == ({78}, True)
    assert diag_listeners(done, 40002) == (set(), True)
    error = struct.pack("=IHHII", 36, 2, 0, 1, 0) + struct.pack("=i", -22) + bytes(16)
    with pytest.raises(OSError):
        diag_listeners(error, 40002)


def test_a_published_servers_port_is_never_the_dashboards() -> None:
    """The supervisor binds a published port's socket to an ephemeral port: the kernel's
    choice where its range cannot yield 4040, else random ports of the range but 4040."""
    assert local_port_range("32768\t60999\n") == (32768, 60999)
    assert local_port_range("1024 65000") == (1024, 65000)
    assert local_port_range("garbage") == (32768, 60999)
    assert local_port_range("0 70000") == (32768, 60999)
    assert ephemeral_choices((32768, 60999)) == [0]
    wide = ephemeral_choices((1024, 65000))
    assert len(wide) == 16 and 4040 not in wide and all(1024 <= p <= 65000 for p in wide)
    # a range of 4040 and one other port: only the other one is ever tried
    assert set(ephemeral_choices((4040, 4041))) == {4041}


def test_a_published_port_nothing_listens_on_yet_is_refused_not_denied() -> None:
    """Before the dev server binds, a client inside sees ECONNREFUSED (and retries), as on a
    loopback of its own: the supervisor tells a published port on loopback from the rest."""
    published = frozenset({8080})
    assert published_loopback(_v4("127.0.0.1", 8080), published)
    assert published_loopback(_v6("::1", 8080), published)
    assert published_loopback(_v6("::ffff:127.0.0.1", 8080), published)
    assert not published_loopback(_v4("127.0.0.1", 8081), published)
    assert not published_loopback(_v4("10.0.0.1", 8080), published)
    assert not published_loopback(_v6("::", 8080), published)
    assert not published_loopback(_v4("127.0.0.1", 8080), frozenset())
