"""landlock's ``network: filtered``: the golden ruleset, the socket filter as the kernel runs
it, the connect supervisor's verdicts and the launch file's port rule (all pure)."""

from __future__ import annotations

import socket
import struct

import pytest

from fusion_oci.models import CacheMode, PrepareContext, SandboxPolicy
from fusion_oci.oci.model import TaskSpec
from fusion_oci.oci.seccomp import compile_bpf
from fusion_oci.policy.layout import TaskLayout
from fusion_oci.runtimes.landlock import (
    NET_RIGHTS,
    enforced_requirements,
    landlock_env,
    landlock_rules,
    launch_config,
    launch_text,
)
from fusion_oci.runtimes.requirements import Requirement
from fusion_oci.shims.confine import (
    AUDIT_ARCH,
    RET_ALLOW,
    RET_USER_NOTIF,
    notify_program,
    parse,
)
from fusion_oci.shims.connects import connect_verdict
from fusion_oci.shims.seccomp_notify import CONNECT_CALL, LISTEN_CALL
from tests.bpf import run_bpf
from tests.golden import GOLDEN_HOST, assert_golden
from tests.tasks import resolved

LAYOUT = TaskLayout(
    "/work/wt/task-1", None, (), "/etc/ssl/certs/ca-certificates.crt", ca_complete=True
)
HOME, TMP, PORT, AGENT = "/run/scratch/home", "/run/scratch/tmp", 40123, "/opt/fo/agent"
ERRNO_EPERM = 0x00050000 | 1


def task_ctx(policy: SandboxPolicy) -> PrepareContext:
    """The golden task's context (task-1, run-1, LAYOUT's worktree, no caches) for ``policy``."""
    return PrepareContext(
        task_id="task-1",
        run_id="run-1",
        worktree_path=LAYOUT.worktree,
        policy=policy,
        cache_mode=CacheMode.OFF,
    )


def filtered_spec() -> TaskSpec:
    policy = SandboxPolicy(network="filtered", allowed_domains=["registry.npmjs.org"])
    return resolved(task_ctx(policy), LAYOUT, GOLDEN_HOST, {"LANG": "C.UTF-8"}).spec


def test_golden_ruleset() -> None:
    rules = landlock_rules(filtered_spec(), HOME, TMP, PORT, AGENT)
    data = rules.to_json()
    data["seccomp"] = data["seccomp"]["syscalls"][-8:]  # the filtered rules; the bundle's
    assert_golden("landlock/network-filtered.json", data)  # own are golden elsewhere
    assert rules == landlock_rules(filtered_spec(), HOME, TMP, PORT, AGENT)  # pure
    grants = dict(rules.paths)
    assert grants[AGENT] == ("execute", "read_file")  # ssh's ProxyCommand, nothing more
    assert "make_sock" in grants[LAYOUT.worktree] and "make_sock" in grants[TMP]


def test_launch_config_allows_tcp_connect_to_the_proxy_port_only() -> None:
    rules = landlock_rules(filtered_spec(), HOME, TMP, PORT, AGENT)
    cfg = launch_config(rules, 7, "x86_64")
    both = NET_RIGHTS["bind_tcp"][0] | NET_RIGHTS["connect_tcp"][0]
    assert cfg["handled_net"] == both  # bind denied: no rule grants it
    assert cfg["ports"] == [[PORT, NET_RIGHTS["connect_tcp"][0]]]
    assert cfg["connect_port"] == PORT
    back = parse(launch_text(cfg))
    assert back["ports"] == cfg["ports"] and back["connect_port"] == PORT
    # Before prepare started the proxy: supervised, and nothing is allowed.
    unprepared = launch_config(landlock_rules(filtered_spec(), HOME, TMP), 7, "x86_64")
    assert unprepared["connect_port"] == 0 and unprepared["ports"] == []


def test_other_networks_leave_connect_to_the_kernel() -> None:
    for policy in (SandboxPolicy(allow_network=False), SandboxPolicy(network="host")):
        ctx = PrepareContext(
            task_id="t",
            run_id="r",
            worktree_path=LAYOUT.worktree,
            policy=policy,
            cache_mode=CacheMode.OFF,
        )
        spec = resolved(ctx, LAYOUT, GOLDEN_HOST, {}).spec
        cfg = launch_config(landlock_rules(spec, HOME, TMP, PORT, AGENT), 7, "x86_64")
        assert cfg["connect_port"] == -1 and cfg["ports"] == []
        # The confined child execs the agent in every network (not only ssh's ProxyCommand):
        # read and execute, nothing more.
        grants = dict(landlock_rules(spec, HOME, TMP, PORT, AGENT).paths)
        assert grants[AGENT] == ("execute", "read_file")


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_connect_and_listen_go_to_the_supervisor_only_when_filtered(arch: str) -> None:
    for nr in (CONNECT_CALL[arch], LISTEN_CALL[arch]):
        assert run_bpf(notify_program(arch, connect=True), nr, AUDIT_ARCH[arch]) == RET_USER_NOTIF
        assert run_bpf(notify_program(arch), nr, AUDIT_ARCH[arch]) == RET_ALLOW


AF_INET, AF_INET6, AF_UNIX, AF_NETLINK, AF_PACKET = 2, 10, 1, 16, 17
SOCKETS = {
    # (family, type, protocol): allowed
    (AF_INET, socket.SOCK_STREAM, 0): True,
    (AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK, 6): True,
    (AF_INET6, socket.SOCK_STREAM, 0): True,
    (AF_UNIX, socket.SOCK_STREAM, 0): True,
    (AF_INET, socket.SOCK_DGRAM, 0): False,  # UDP: Landlock does not govern it
    (AF_INET6, socket.SOCK_DGRAM, 17): False,
    (AF_INET, socket.SOCK_DGRAM, 1): False,  # ICMP ping socket
    (AF_INET, socket.SOCK_RAW, 1): False,
    (AF_INET, socket.SOCK_STREAM, 132): False,  # SCTP: connectx is a setsockopt
    (AF_INET, socket.SOCK_STREAM, 262): False,  # MPTCP
    (AF_UNIX, socket.SOCK_DGRAM, 0): False,
    (AF_UNIX, socket.SOCK_SEQPACKET, 0): False,
    (AF_NETLINK, socket.SOCK_RAW, 0): False,
    (AF_PACKET, socket.SOCK_RAW, 0): False,
    (0, socket.SOCK_STREAM, 0): False,
    (38, socket.SOCK_SEQPACKET, 0): False,  # AF_ALG
    (AF_INET | (1 << 32), socket.SOCK_STREAM, 0): False,  # high bits: closed, never open
}


@pytest.mark.parametrize(("family", "kind", "proto"), sorted(SOCKETS))
def test_the_socket_filter_as_the_kernel_runs_it(family: int, kind: int, proto: int) -> None:
    rules = landlock_rules(filtered_spec(), HOME, TMP, PORT, AGENT)
    program = compile_bpf(rules.seccomp, "x86_64")
    verdict = run_bpf(program, 41, AUDIT_ARCH["x86_64"], (family, kind, proto))  # socket
    assert (verdict == RET_ALLOW) is SOCKETS[(family, kind, proto)], hex(verdict)
    if not SOCKETS[(family, kind, proto)]:
        assert verdict == ERRNO_EPERM


def test_tcp_fast_open_is_refused_plain_sends_are_not() -> None:
    program = compile_bpf(landlock_rules(filtered_spec(), HOME, TMP, PORT, AGENT).seccomp, "x86_64")
    sendto, sendmsg = 44, 46
    fastopen = 0x20000000
    assert (
        run_bpf(program, sendto, AUDIT_ARCH["x86_64"], (3, 0, 10, fastopen, 1, 16)) == ERRNO_EPERM
    )
    assert run_bpf(program, sendmsg, AUDIT_ARCH["x86_64"], (3, 0, fastopen)) == ERRNO_EPERM
    assert run_bpf(program, sendto, AUDIT_ARCH["x86_64"], (3, 0, 10, 0, 0, 0)) == RET_ALLOW


def _in4(host: str, port: int) -> bytes:
    return struct.pack("=H", AF_INET) + struct.pack("!H", port) + socket.inet_aton(host) + bytes(8)


def _in6(host: str, port: int) -> bytes:
    return (
        struct.pack("=H", AF_INET6)
        + struct.pack("!H", port)
        + bytes(4)
        + socket.inet_pton(socket.AF_INET6, host)
        + bytes(4)
    )


@pytest.mark.parametrize(
    ("addr", "verdict"),
    [
        (_in4("127.0.0.1", PORT), "proxy"),
        (_in6("::ffff:127.0.0.1", PORT), "proxy"),
        (_in4("127.0.0.1", 4040), "deny"),  # the host's other loopback ports
        (_in4("127.0.0.2", PORT), "deny"),
        (_in4("10.1.2.3", PORT), "deny"),  # a remote host listening on the proxy's port
        (_in4("169.254.169.254", 80), "deny"),
        (_in6("::1", PORT), "deny"),
        (_in6("2001:db8::1", PORT), "deny"),
        (struct.pack("=H", AF_UNIX) + b"/run/docker.sock\0", "unix"),  # checked by path
        (struct.pack("=H", AF_UNIX) + b"\0host-abstract", "deny"),
        (struct.pack("=H", 0) + bytes(14), "unspec"),
        (struct.pack("=H", AF_NETLINK) + bytes(10), "deny"),
        (b"\x02", "deny"),
        (_in4("127.0.0.1", PORT)[:6], "deny"),  # too short to name an address
    ],
)
def test_connect_verdicts(addr: bytes, verdict: str) -> None:
    assert connect_verdict(addr, PORT) == verdict
    if verdict == "proxy":
        assert connect_verdict(addr, 0) == "deny"  # no proxy yet: nothing


def test_the_proxy_env_points_at_the_host_port_and_the_agent() -> None:
    rules = landlock_rules(filtered_spec(), HOME, TMP, PORT, AGENT)
    env = landlock_env({"HTTPS_PROXY": "http://127.0.0.1:3128", "LANG": "C"}, rules, AGENT)
    assert env["HTTPS_PROXY"] == env["http_proxy"] == f"http://127.0.0.1:{PORT}"
    assert env["ALL_PROXY"] == f"socks5h://127.0.0.1:{PORT}" and env["NO_PROXY"] == ""
    assert f"{AGENT} connect %h %p" in env["GIT_SSH_COMMAND"] and env["LANG"] == "C"


def test_filtered_is_enforced_from_abi_4() -> None:
    assert Requirement.NETWORK_FILTERED not in enforced_requirements(3)
    assert Requirement.NETWORK_FILTERED in enforced_requirements(4)
    assert Requirement.NETWORK_EGRESS not in enforced_requirements(7)
