"""The landlock runtime's pure translation: a TaskSpec as a Landlock ruleset, its seccomp
profile and the launch file the confined child reads (see :mod:`fusion_oci.runtimes.landlock`
for what it enforces and why). Pure: golden-tested."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fusion_oci.errors import SandboxSetupError
from fusion_oci.models import NetworkMode
from fusion_oci.oci.environment import SANDBOX_HOME
from fusion_oci.oci.model import TaskSpec
from fusion_oci.oci.seccomp import compile_bpf
from fusion_oci.runtimes.requirements import Requirement

if TYPE_CHECKING:
    from fusion_oci.services import TaskRelays

# Landlock access rights (include/uapi/linux/landlock.h), and the ABI that introduced each.
FS_RIGHTS: dict[str, tuple[int, int]] = {
    "execute": (1 << 0, 1),
    "write_file": (1 << 1, 1),
    "read_file": (1 << 2, 1),
    "read_dir": (1 << 3, 1),
    "remove_dir": (1 << 4, 1),
    "remove_file": (1 << 5, 1),
    "make_char": (1 << 6, 1),
    "make_dir": (1 << 7, 1),
    "make_reg": (1 << 8, 1),
    "make_sock": (1 << 9, 1),
    "make_fifo": (1 << 10, 1),
    "make_block": (1 << 11, 1),
    "make_sym": (1 << 12, 1),
    "refer": (1 << 13, 2),
    "truncate": (1 << 14, 3),
    "ioctl_dev": (1 << 15, 5),
}
NET_RIGHTS: dict[str, tuple[int, int]] = {"bind_tcp": (1 << 0, 4), "connect_tcp": (1 << 1, 4)}
SCOPES: dict[str, tuple[int, int]] = {"abstract_unix_socket": (1 << 0, 6), "signal": (1 << 1, 6)}

ABI_FEATURES: dict[int, str] = {
    1: "filesystem: read, write, execute, create and remove beneath granted paths",
    2: "refer: links and renames across directories (ABI 1 refuses them all)",
    3: "truncate: truncating a file needs write access (before ABI 3 any file could be truncated)",
    4: "network: TCP bind and connect (network none denies both)",
    5: "ioctl on device files",
    6: "scoping: no signals to, no abstract unix sockets of, processes outside the sandbox",
    7: "audit logging of denials (no new restriction)",
}

RO = ("execute", "read_file", "read_dir")
RW = (
    *RO,
    "write_file",
    "remove_dir",
    "remove_file",
    "make_dir",
    "make_reg",
    "make_fifo",
    "make_sym",
    "refer",
    "truncate",
)
DEV_RW = ("read_file", "write_file", "truncate")
DEVICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("/dev/null", DEV_RW),
    ("/dev/zero", DEV_RW),
    ("/dev/full", DEV_RW),
    ("/dev/random", ("read_file",)),
    ("/dev/urandom", ("read_file",)),
)
PROC_FILES = (
    "/proc/cpuinfo",
    "/proc/meminfo",
    "/proc/stat",
    "/proc/loadavg",
    "/proc/uptime",
    "/proc/version",
    "/proc/filesystems",
)
"""Static /proc files that runtimes read (node's os.cpus(), free memory, load). Rules bind to
inodes, so the per-process directories of the command's children cannot be granted by a rule:
each process's own /proc/self (status, maps, fd, cgroup, limits, ...) is opened for it by the
reaper's supervisor (shims/supervisor.py); other processes' entries stay unreadable."""
SYS_DIRS = ("/sys/devices/system/cpu",)

AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
SOCK_STREAM = 1
SOCK_TYPE_MASK = 0xF
IPPROTO_TCP = 6
MSG_FASTOPEN = 0x20000000
FILTERED_FAMILIES = (AF_UNIX, AF_INET, AF_INET6)
"""The socket families a ``filtered`` command may open, stream sockets only: TCP (whose
connect the supervisor checks, shims/connects.py) and unix sockets (likewise); no UDP, no
raw, packet or netlink socket, none of the families Landlock does not govern."""
SYSV_IPC = (
    "shmget",
    "shmat",
    "shmctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "mq_open",
    "mq_unlink",
)
MIN_FS_ABI = 3
"""Below ABI 3 any file, read-only ones included, can be truncated: the filesystem view is not
enforced there."""
MIN_SCOPE_ABI = 6
"""Signal and abstract-socket scoping (ABI 6): the agent puts each run in a nested domain."""
MIN_NET_ABI = 4
"""Landlock's TCP rules (ABI 4): ``network: filtered`` denies TCP bind and allows TCP connect
to the proxy's port only; below it TCP bind would be open and every connect the supervisor's
alone to keep, so filtered is not enforced there."""


@dataclass(frozen=True)
class LandlockRules:
    """What the command may touch, in Landlock terms. Pure data; golden-tested."""

    paths: list[tuple[str, tuple[str, ...]]]
    """(host path, access right names), sorted; a path's rights are the union of its rules."""
    network: str
    """``none``: every socket() refused and TCP bind/connect denied; ``host``: AF_UNIX refused;
    ``filtered``: TCP and unix stream sockets only, TCP bind denied and TCP connect allowed
    only to the task's egress proxy on host loopback (Landlock ABI 4+ by port, and the
    connect supervisor by address)."""
    proxy_port: int | None = None
    """``filtered``: the host loopback port of the task's egress proxy (None before prepare
    started it: nothing can connect then)."""
    services: tuple[tuple[str, str], ...] = ()
    """``hostServices``: each grant and its relay on the host, as the connect supervisor
    redirects to it: ``("tcp 4 127.0.0.1 5432", "/relay/0.report")`` (the grant, connected
    to as it is, and the relay's report socket; family 4 or 6), ``("tcp 4 127.0.0.1 5432",
    "PORT")`` (a service container's endpoint: the relay's loopback port) and
    ``("unix /granted/path", "/relay.sock")`` (also for the path it resolved to). Empty: none
    (or a plan before prepare started the relays)."""
    published: tuple[int, ...] = ()
    """``publishPorts``: the published sandbox ports (none and filtered only). A bind to one
    of them on loopback or the wildcard is the connect supervisor's, to loopback at an
    ephemeral port reported to the host, which carries the published port's clients there
    (shims/connects.py, published.py); every other TCP bind stays denied."""
    bind_report: str | None = None
    """Where the supervisor reports those binds: the runtime's datagram socket in the task's
    scratch (None: a plan before prepare)."""
    scopes: tuple[str, ...] = ("abstract_unix_socket", "signal")
    seccomp: dict[str, Any] = field(default_factory=dict)
    """The bundle's profile plus the rules above (OCI JSON)."""
    restored: list[str] = field(default_factory=list)
    """Read-only paths the spec lays over a writable one (a plain repository's ``.git/hooks``
    and ``.git/config``, a linked worktree's ``.git`` file, protectedPaths such as
    ``.fusion/``): the ruleset cannot express them, so they are writable during the command,
    kept before it and put back after it (fusion_oci.runtimes.linux.snapshot), and listed as
    not read-only."""
    holes: list[str] = field(default_factory=list)
    """Writable paths the spec lays back inside a restored one (they are not restored)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "paths": {p: " ".join(a) for p, a in self.paths},
            "network": self.network,
            "proxy_port": self.proxy_port,
            **({"services": dict(self.services)} if self.services else {}),
            **(
                {"published": list(self.published), "bind_report": self.bind_report}
                if self.published
                else {}
            ),
            "scopes": list(self.scopes),
            "seccomp": self.seccomp,
            "restored": self.restored,
            "holes": self.holes,
        }


def _beneath(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def landlock_seccomp(profile: dict[str, Any], network: NetworkMode) -> dict[str, Any]:
    """The bundle's seccomp profile plus what a namespace-less sandbox needs. Pure."""
    import errno

    rules = [dict(r) for r in profile.get("syscalls", [])]
    rules.append(
        {
            "names": ["io_uring_setup", "io_uring_enter", "io_uring_register"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": errno.EPERM,
        }
    )
    # The task's exec agent is dumpable (its /proc walk goes through the supervisor, which
    # reads the path from its memory; agent.c --dumpable) and shares the commands' uid and
    # Landlock domain: no command may take its connection (or any process's fd) from it. The
    # profile already refuses ptrace and process_vm_readv/writev.
    rules.append({"names": ["pidfd_getfd"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM})
    # No IPC namespace either: System V IPC and POSIX message queues of the caller's other
    # processes (a database's shared memory, say) are governed by uid alone.
    rules.append({"names": list(SYSV_IPC), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM})
    rules += other_process_rules()
    if network is NetworkMode.HOST:
        rules.append(
            {
                "names": ["socket"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": errno.EPERM,
                "args": [{"index": 0, "value": AF_UNIX, "op": "SCMP_CMP_EQ"}],
            }
        )
    elif network is NetworkMode.FILTERED:
        rules += filtered_socket_rules()
    else:
        rules.append({"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM})
    return {**profile, "syscalls": rules}


SELF_ONLY = (
    "prlimit64",
    "sched_setaffinity",
    "sched_setscheduler",
    "sched_setparam",
    "sched_setattr",
    "migrate_pages",
    "move_pages",
)
"""Syscalls whose first argument names the process they act on, allowed on the caller only
(pid 0). The kernel lets a process change another's rlimits, affinity and scheduling by uid
alone, and neither Landlock nor a namespace stands between a command and the caller's other
processes here: ``prlimit64`` raised the owner's ``RLIMIT_CORE`` and set its ``RLIMIT_CPU``
to 1 s (issue #31). migrate_pages and move_pages are also behind Landlock's ptrace scoping."""
PRIO_PROCESS = 0
IOPRIO_WHO_PROCESS = 1


def other_process_rules() -> list[dict[str, Any]]:
    """seccomp rules (OCI JSON) that keep a command's rlimit, priority, I/O priority, affinity
    and scheduling changes to itself. Pure.

    Written as deny rules on the full 64-bit argument: anything but exactly 0 (or exactly
    ``PRIO_PROCESS``/``IOPRIO_WHO_PROCESS``) is refused, so high bits can only make a call
    refused that the kernel would have aimed at the caller. ``setpriority``/``ioprio_set`` with
    a process group or a user (``PRIO_USER`` reaches every process of the uid) are refused
    whatever ``who`` is. The cost: a command cannot aim these at its own children or threads
    by id (``renice -p``, ``taskset -p``, ``pthread_setaffinity_np``), only at itself (``nice``,
    ``ionice -c3 CMD``, ``taskset -c 0 CMD`` and ``ulimit`` all do).
    """
    import errno

    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}

    def not_equal(index: int, value: int) -> dict[str, Any]:
        return {"index": index, "value": value, "op": "SCMP_CMP_NE"}

    return [
        {"names": list(SELF_ONLY), **eperm, "args": [not_equal(0, 0)]},
        {"names": ["setpriority"], **eperm, "args": [not_equal(0, PRIO_PROCESS)]},
        {"names": ["setpriority"], **eperm, "args": [not_equal(1, 0)]},
        {"names": ["ioprio_set"], **eperm, "args": [not_equal(0, IOPRIO_WHO_PROCESS)]},
        {"names": ["ioprio_set"], **eperm, "args": [not_equal(1, 0)]},
    ]


def filtered_socket_rules() -> list[dict[str, Any]]:
    """seccomp rules (OCI JSON) of ``network: filtered``: every socket refused but TCP and unix
    stream ones, and TCP Fast Open (a connect inside sendto/sendmsg) refused. Pure.

    Landlock governs TCP only (no UDP, no raw, netlink or packet socket, no SCTP, whose
    ``connectx`` is a setsockopt): whatever it does not govern is not opened. Written as deny
    rules whose alternatives cover every other value (an argument with high bits set is
    caught by the ``GT`` alternatives: closed, never open).
    """
    import errno

    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}
    families = [v for v in range(max(FILTERED_FAMILIES) + 1) if v not in FILTERED_FAMILIES]
    rules: list[dict[str, Any]] = [
        {
            "names": ["socket"],
            **eperm,
            "args": [
                *({"index": 0, "value": v, "op": "SCMP_CMP_EQ"} for v in families),
                {"index": 0, "value": max(FILTERED_FAMILIES), "op": "SCMP_CMP_GT"},
            ],
        },
        {
            "names": ["socket"],
            **eperm,
            "args": [
                {"index": 1, "value": SOCK_TYPE_MASK, "valueTwo": t, "op": "SCMP_CMP_MASKED_EQ"}
                for t in range(SOCK_TYPE_MASK + 1)
                if t != SOCK_STREAM
            ],
        },
    ]
    for family in (AF_INET, AF_INET6):  # protocol 0 or IPPROTO_TCP: not SCTP or MPTCP
        rules += [
            {
                "names": ["socket"],
                **eperm,
                "args": [{"index": 0, "value": family, "op": "SCMP_CMP_EQ"}, other],
            }
            for other in [
                *({"index": 2, "value": p, "op": "SCMP_CMP_EQ"} for p in range(1, IPPROTO_TCP)),
                {"index": 2, "value": IPPROTO_TCP, "op": "SCMP_CMP_GT"},
            ]
        ]
    for name, index in (("sendto", 3), ("sendmsg", 2), ("sendmmsg", 3)):
        rules.append(
            {
                "names": [name],
                **eperm,
                "args": [
                    {
                        "index": index,
                        "value": MSG_FASTOPEN,
                        "valueTwo": MSG_FASTOPEN,
                        "op": "SCMP_CMP_MASKED_EQ",
                    }
                ],
            }
        )
    return rules


def landlock_rules(
    spec: TaskSpec,
    home: str,
    tmp: str,
    proxy_port: int | None = None,
    agent: str | None = None,
    services: tuple[tuple[str, str], ...] = (),
    bind_report: str | None = None,
) -> LandlockRules:
    """The ruleset for a spec whose sandbox HOME and /tmp are the host dirs ``home``, ``tmp``
    (and, for ``network: filtered``, whose egress proxy listens on host ``proxy_port``), with
    the exec agent at host path ``agent`` readable and executable (the confined child execs
    it; under ``filtered`` it is ssh's ProxyCommand too), and published ports' binds
    reported to ``bind_report``.

    Mounts are read in order, as the spec means them: a later mount covers an earlier one. A
    later read-only bind beneath an earlier writable one is a carve-out Landlock cannot make.
    """
    grants: list[tuple[str, bool]] = []  # (host path, writable) in mount order
    for mount in spec.mounts:
        kind, dest = mount.type, mount.destination
        if kind == "bind" and mount.source is not None:
            writable = "rw" in (mount.options or [])
            grants.append((mount.source, writable))
        elif kind == "tmpfs" and dest in (SANDBOX_HOME, "/tmp"):
            grants.append((home if dest == SANDBOX_HOME else tmp, True))
    restored: list[str] = []
    holes: list[str] = []
    for i, (path, writable) in enumerate(grants):
        if writable:
            continue
        covering = [p for p, w in grants[:i] if w and _beneath(path, p)]
        if not covering or any(w and p == path for p, w in grants[i + 1 :]):
            continue  # not beneath anything writable, or made writable again later
        if path not in restored:
            restored.append(path)
            holes += [p for p, w in grants[i + 1 :] if w and _beneath(p, path) and p != path]
    network = spec.network
    # filtered: the command's own unix sockets (beneath writable paths) work; elsewhere no
    # AF_UNIX socket can be opened, so making one is moot.
    writable_rights = (*RW, "make_sock") if network is NetworkMode.FILTERED else RW
    rights: dict[str, set[str]] = {}
    for path, writable in grants:
        rights.setdefault(path, set()).update(writable_rights if writable else RO)
    for path, access in DEVICES:
        rights.setdefault(path, set()).update(access)
    for path in (*PROC_FILES, *SYS_DIRS):
        rights.setdefault(path, set()).update(RO)
    if agent is not None:  # what the confined child execs; ssh's ProxyCommand too (filtered)
        rights.setdefault(agent, set()).update(("execute", "read_file"))
    order = list(FS_RIGHTS)
    paths = [(p, tuple(sorted(a, key=order.index))) for p, a in sorted(rights.items())]
    if network is NetworkMode.EGRESS:
        network = NetworkMode.NONE  # not enforceable here (no netns): refused, else closed
    seccomp = spec.linux.seccomp
    profile = (
        seccomp.to_oci()
        if seccomp is not None
        else {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}
    )
    # Published ports need the command on a network Landlock confines (every TCP bind
    # denied but the supervisor's); under host, refused (the settings refuse it already).
    published = (
        tuple(p.port for p in spec.published_ports)
        if network in (NetworkMode.NONE, NetworkMode.FILTERED)
        else ()
    )
    return LandlockRules(
        paths,
        network.value,
        services=services,
        published=published,
        bind_report=bind_report if published else None,
        seccomp=landlock_seccomp(profile, service_socket_network(network, spec)),
        restored=restored,
        holes=sorted(set(holes)),
        proxy_port=proxy_port if network is NetworkMode.FILTERED else None,
    )


def service_socket_network(network: NetworkMode, spec: TaskSpec) -> NetworkMode:
    """The network whose socket rules a task gets: ``none`` with granted host services or
    published ports needs TCP and unix stream sockets (those of ``filtered``, every connect
    going to the supervisor, which lets only the grants through, and every bind, which binds
    only the published ports: :func:`launch_config`; Landlock still denies the command's own
    TCP binds and connects). Pure."""
    if network is NetworkMode.NONE and (spec.host_services or spec.published_ports):
        return NetworkMode.FILTERED
    return network


def service_redirects(relays: TaskRelays | None) -> tuple[tuple[str, str], ...]:
    """The connect supervisor's redirects (:attr:`LandlockRules.services`) to a task's
    relays. Pure."""
    if relays is None:
        return ()
    out: list[tuple[str, str]] = []
    for relay in relays.relays:
        grant = relay.grant
        if grant.kind == "tcp":
            family = "6" if grant.family == 10 else "4"
            # A host grant: the command's socket connected to it, reported to the relay; a
            # service container's endpoint: redirected to the relay's loopback port.
            to = str(relay.tcp_port) if relay.tcp_port is not None else str(relay.report or "")
            out.append((f"tcp {family} {grant.address} {grant.port}", to))
        else:
            for path in dict.fromkeys((grant.path, relay.target)):
                out.append((f"unix {path}", str(relay.socket)))
    return tuple(out)


def landlock_env(env: dict[str, str], rules: LandlockRules, agent: str) -> dict[str, str]:
    """The command's env: for ``filtered``, the proxy variables (compiled for an in-sandbox
    forwarder on 127.0.0.1:3128) at the proxy's own host loopback port instead, and ssh's
    ProxyCommand at the agent's host path (its ``connect`` mode dials the numeric
    ``https_proxy`` where no proxy socket is bound). Pure."""
    if rules.network != "filtered":
        return env
    from fusion_oci.egress import proxy_env

    out = {**env, **proxy_env("127.0.0.1", rules.proxy_port or 0, agent=agent)}
    for key in ("NO_PROXY", "no_proxy"):  # the granted services' addresses (oci/environment.py)
        if env.get(key):
            out[key] = env[key]
    return out


def _mask(names: Sequence[str], table: dict[str, tuple[int, int]], abi: int) -> int:
    return sum(bit for name in names for bit, since in [table[name]] if since <= abi)


def launch_config(rules: LandlockRules, abi: int, arch: str) -> dict[str, Any]:
    """What the child applies (shims/confine.py): integers for this kernel's ABI. Pure.

    Every right the ABI knows is handled, so whatever no rule grants is denied.
    """
    handled_net = _mask(list(NET_RIGHTS), NET_RIGHTS, abi) if rules.network != "host" else 0
    # filtered: TCP connect to the proxy's port only (any address: Landlock knows ports; the
    # connect supervisor, which every connect() goes through, allows host loopback alone).
    port = rules.proxy_port if rules.network == "filtered" else None
    return {
        "arch": arch,
        "abi": abi,
        "handled_fs": _mask(list(FS_RIGHTS), FS_RIGHTS, abi),
        "handled_net": handled_net,
        "scoped": _mask(rules.scopes, SCOPES, abi),
        "paths": [[p, _mask(a, FS_RIGHTS, abi)] for p, a in rules.paths],
        "seccomp": compile_bpf(rules.seccomp, arch).hex(),
        "drop_capabilities": True,
        # Where the chmod supervisor may change modes: the writable directories, never a
        # device node such as /dev/null.
        "writable": [p for p, a in rules.paths if "make_reg" in a],
        # 0: every connect() goes to the supervisor, which allows 127.0.0.1:PORT, the granted
        # host services (to their relays) and unix sockets beneath writable paths; -1: connect
        # is left to the kernel (none, host), where every socket() is refused.
        "connect_port": (
            (port or 0) if rules.network == "filtered" or rules.services or rules.published else -1
        ),
        **({"services": [list(r) for r in rules.services]} if rules.services else {}),
        # Every bind() to the supervisor too, which binds the published ports to loopback at
        # an ephemeral port and reports each to the host (shims/connects.py).
        **(
            {"publish": list(rules.published), "publish_report": rules.bind_report or ""}
            if rules.published
            else {}
        ),
        "ports": [[port, _mask(["connect_tcp"], NET_RIGHTS, abi)]] if port and abi >= 4 else [],
    }


def launch_text(config: dict[str, Any]) -> str:
    """The launch file shims/confine.py's parse() reads (not JSON: see there). Pure.

    A path with a newline cannot be written in it; such a task is refused, never confined
    with that path left out or misread.
    """
    lines = [
        f"{key} {int(config[key]) if isinstance(config[key], bool) else config[key]}"
        for key in (
            "arch",
            "abi",
            "handled_fs",
            "handled_net",
            "scoped",
            "drop_capabilities",
            "connect_port",
            "seccomp",
        )
    ]
    lines += [f"port {mask} {port}" for port, mask in config["ports"]]
    lines += [f"path {mask} {path}" for path, mask in config["paths"]]
    lines += [f"writable {path}" for path in config["writable"]]
    lines += [f"publish {port}" for port in config.get("publish", [])]
    if config.get("publish"):
        lines.append(f"publish_report {config['publish_report']}")
    for grant, relay in config.get("services", []):
        kind, _, rest = grant.partition(" ")
        if kind == "tcp":
            lines.append(f"svctcp {rest} {relay}")
        else:
            lines += [f"svcunix {rest}", f"svcto {relay}"]
    if (
        any("\n" in p for p, _ in config["paths"])
        or any("\n" in g + r for g, r in config.get("services", []))
        or "\n" in config.get("publish_report", "")
    ):
        raise SandboxSetupError(
            "the landlock runtime cannot confine this task",
            "a granted path contains a newline",
            "rename the worktree or the configured paths",
        )
    return "\n".join(lines) + "\n"


def enforced_requirements(abi: int) -> frozenset[Requirement]:
    """What the runtime enforces on a kernel with this Landlock ABI. Pure."""
    if abi < 1:
        return frozenset()
    # PROC_PATHS: /proc and /sys are granted only as a few static files, none of them masked
    # or writable, so maskedPaths and readonlyPaths hold by omission.
    out = {
        Requirement.ENV,
        Requirement.CPU_TIME,
        Requirement.FILE_SIZE,
        Requirement.NETWORK_NONE,
        Requirement.PROC_PATHS,
    }
    if abi >= MIN_FS_ABI:
        out.add(Requirement.FILESYSTEM)
    if abi >= MIN_NET_ABI:
        out.add(Requirement.NETWORK_FILTERED)
        # The connect supervisor redirects a grant's address to its relay; every other
        # connect is checked as under filtered (TCP to nothing else, Landlock's port rules).
        out.add(Requirement.HOST_SERVICES)
        # The supervisor binds a published port's socket to loopback at an ephemeral port
        # and the host carries the port's clients there; Landlock denies every other TCP
        # bind (none, filtered; host network with publishPorts is refused by the settings).
        out.add(Requirement.PUBLISHED_PORTS)
    if abi >= MIN_SCOPE_ABI:
        # rlimits, priorities, affinity and scheduling: the seccomp rules on any ABI
        # (other_process_rules); signals: Landlock's scoping, which ABI 6 brought.
        out.add(Requirement.HOST_PROCESSES)
    return frozenset(out)
