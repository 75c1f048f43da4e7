"""The ``landlock`` runtime: the command runs on the host as the caller, confined by Landlock.

No namespace and no privilege: it is the isolating runtime left where user namespaces are
forbidden (Ubuntu 23.10+'s AppArmor restriction, ``kernel.unprivileged_userns_clone=0``,
``user.max_user_namespaces=0``, CI containers without them), where bubblewrap and rootless
engines cannot start.

The bundle is translated by :func:`landlock_rules` (pure, golden-tested) into an allow-list:

- read-only (read, execute, list): the spec's read-only binds at their host paths (the system
  directories, the chosen ``/etc`` entries, ``allowedPaths``, the CA bundle, a linked
  worktree's common git dir with its ``hooks/`` and ``config``), a few static ``/proc`` files
  and ``/sys/devices/system/cpu``;
- read-write: the worktree, ``writablePaths``, caches, the git objects/refs/logs and the
  worktree's own git dir, and a private HOME and TMPDIR standing for the spec's tmpfs mounts;
- ``/dev/null``, ``/dev/zero``, ``/dev/full``, ``/dev/random``, ``/dev/urandom``;
- nothing else: ``$HOME``, other worktrees, ``/root``, ``/var``, ``/run`` (engine sockets), the
  host's ``/tmp``, host processes' ``/proc`` entries are all denied.

Landlock only adds access beneath a directory; it cannot take it away. A read-only bind that
the spec lays over a writable one (a plain repository's ``.git/hooks`` and ``.git/config``, a
linked worktree's ``.git`` file, protectedPaths such as ``.fusion/``) cannot be expressed: such
paths are copied before each command and put back after it, before the result returns, so
nothing the command wrote there reaches the host's next git call or settings load; they are
listed as not read-only (the lifecycle's ``unenforced``), since a host process reading them
*during* the command would see the command's version. A linked worktree's common dir (its
hooks and config) lies outside the worktree and is read-only in full.

Beside the ruleset: the bundle's seccomp profile, plus ``socket()`` refused for every family in
network ``none`` (``socketpair`` still works, so pipes between processes do) and for
``AF_UNIX`` in ``host`` (Landlock up to ABI 7 does not govern connecting to a pathname socket,
and ``/run/docker.sock`` must stay out of reach), ``io_uring`` refused (it opens sockets past
seccomp), System V IPC and POSIX message queues refused (no IPC namespace); every ``chmod``
handed to a supervisor in the reaper that allows it only beneath writable directories (Landlock
does not govern metadata; see landlock_child.py), and every open shown to it, which lets each
open go on as Landlock decides except a read-only one of the caller's own ``/proc/self``
entries, which it opens for it (no rule can grant a process tree its own ``/proc/<pid>``);
Landlock's TCP rules deny every bind and connect in ``none`` (ABI 4+); signal and
abstract-socket scoping keep the command from signalling or reaching host processes (ABI
6+; below it ``host processes`` is listed as unenforced); ``prlimit64``, ``setpriority``,
``ioprio_set`` and the ``sched_set*`` calls allowed on the command itself only (the kernel
lets them reach every process of the uid, and Landlock does not govern them: issue #31);
capabilities dropped and ``no_new_privs``; the rlimits; the keeper of each run ends the
whole tree on timeout. Not enforceable without namespaces or
cgroups, so listed as unenforced (refused under ``fail-hard``): ``egress`` without host
loopback (Landlock's TCP rules know ports, not addresses), memory, pids, CPU quota,
``tmpSizeMb``.

``network: filtered`` (issue #22) is how a landlock task gets egress without the host's
loopback: the task's egress proxy also listens on host ``127.0.0.1:<random port>``
(``egress_via_tcp``), the command's proxy variables name it, and nothing else is reachable.
Landlock (ABI 4+) denies every TCP bind and allows TCP connect to that port only; since its
rules know ports and not addresses (a remote host could listen on the same port), every
``connect()`` also goes to the reaper's supervisor (landlock_child.py), which reads the
address once, allows ``127.0.0.1:<port>`` and unix sockets beneath writable paths, and makes
that connect itself on the command's socket (``pidfd_getfd``); ``listen()`` too, allowed for
unix sockets only (a TCP listen autobinds on every address). seccomp leaves only TCP and
unix stream sockets (UDP, which Landlock does not govern, raw, packet, netlink, SCTP refused)
and refuses TCP Fast Open (a connect inside ``sendto``).

How a command runs: prepare starts, once per task, the reaper shim (fusion_oci/reaper.py) with
the task's launch file (``SANDBOX=``, the ruleset above as integers) and ``AGENT=``; its child
confines itself (landlock_child.py) and execs the exec agent (fusion_oci/agent) on a
socketpair, and the reaper stays outside the sandbox as the seccomp supervisor of the agent's
whole tree (every command is a grandchild of it) for the task's life. Each command is then a
spawn frame to that agent, as on every other runtime (:meth:`LandlockRuntime.plan` shows the
frame and the launch): its keeper ends the command's whole tree; no interpreter starts per
command. The launch file lies in the task's scratch beside HOME and TMPDIR (not granted to any
command) and is removed once the agent greeted; the agent's connection is CLOEXEC and closed
before every command's exec. The agent stays dumpable (``--dumpable``: its /proc walk, which
every whole-tree kill needs, goes through the supervisor, and an unprivileged one cannot read
a non-dumpable process's memory); the profile refuses ``ptrace``, ``process_vm_readv/writev``
and ``pidfd_getfd`` instead, and neither a rule nor the supervisor grants another process's
``/proc`` ``mem``, ``fd`` or ``environ``. On ABI 6+ the agent puts each run in a Landlock
domain nested in its own that scopes signals (``--scope-runs``), so no command can stop or
kill the agent or a keeper (below ABI 6 nothing scopes signals at all). A confinement that
fails, fails prepare (exit 125 of the shim, its message in a log in the scratch): no command
ever runs unconfined. Per command, still on the host: the read-only paths Landlock cannot
express are kept before and restored after it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_oci.errors import PolicyNotEnforceableError, SandboxSetupError
from fusion_oci.models import NetworkMode, RunOptions, RunResult, SandboxCapabilities
from fusion_oci.oci.model import ProcessSpec, TaskSpec
from fusion_oci.oci.seccomp import compile_bpf
from fusion_oci.oci.spec import SANDBOX_HOME
from fusion_oci.policy.layout import task_project
from fusion_oci.process import kill_group, probe, reaper_argv
from fusion_oci.runtimes.hostproc import HostProcessRuntime, native_env
from fusion_oci.runtimes.plans import AgentPlan, Plan, SandboxLaunch, own_plan, spawn_of
from fusion_oci.runtimes.protocol import Availability
from fusion_oci.runtimes.requirements import Requirement

if TYPE_CHECKING:
    from fusion_oci.agent.client import Agent
    from fusion_oci.resolve import ResolvedTask
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
reaper's supervisor (landlock_child.py, step 5); other processes' entries stay unreadable."""
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
connect the supervisor checks, landlock_child.py) and unix sockets (likewise); no UDP, no
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
) -> LandlockRules:
    """The ruleset for a spec whose sandbox HOME and /tmp are the host dirs ``home``, ``tmp``
    (and, for ``network: filtered``, whose egress proxy listens on host ``proxy_port``), with
    the exec agent at host path ``agent`` readable and executable (the confined child execs
    it; under ``filtered`` it is ssh's ProxyCommand too).

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
    return LandlockRules(
        paths,
        network.value,
        services=services,
        seccomp=landlock_seccomp(profile, service_socket_network(network, spec)),
        restored=restored,
        holes=sorted(set(holes)),
        proxy_port=proxy_port if network is NetworkMode.FILTERED else None,
    )


def service_socket_network(network: NetworkMode, spec: TaskSpec) -> NetworkMode:
    """The network whose socket rules a task gets: ``none`` with granted host services needs
    TCP and unix stream sockets (those of ``filtered``, every connect going to the
    supervisor, which lets only the grants through: :func:`launch_config`). Pure."""
    if network is NetworkMode.NONE and spec.host_services:
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
    for key in ("NO_PROXY", "no_proxy"):  # the granted services' addresses (oci/spec.py)
        if env.get(key):
            out[key] = env[key]
    return out


def _mask(names: Sequence[str], table: dict[str, tuple[int, int]], abi: int) -> int:
    return sum(bit for name in names for bit, since in [table[name]] if since <= abi)


def launch_config(rules: LandlockRules, abi: int, arch: str) -> dict[str, Any]:
    """What the child applies (landlock_child.py): integers for this kernel's ABI. Pure.

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
        "connect_port": (port or 0) if rules.network == "filtered" or rules.services else -1,
        **({"services": [list(r) for r in rules.services]} if rules.services else {}),
        "ports": [[port, _mask(["connect_tcp"], NET_RIGHTS, abi)]] if port and abi >= 4 else [],
    }


def launch_text(config: dict[str, Any]) -> str:
    """The launch file landlock_child.parse() reads (not JSON: see there). Pure.

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
    for grant, relay in config.get("services", []):
        kind, _, rest = grant.partition(" ")
        if kind == "tcp":
            lines.append(f"svctcp {rest} {relay}")
        else:
            lines += [f"svcunix {rest}", f"svcto {relay}"]
    if any("\n" in p for p, _ in config["paths"]) or any(
        "\n" in g + r for g, r in config.get("services", [])
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
    if abi >= MIN_SCOPE_ABI:
        # rlimits, priorities, affinity and scheduling: the seccomp rules on any ABI
        # (other_process_rules); signals: Landlock's scoping, which ABI 6 brought.
        out.add(Requirement.HOST_PROCESSES)
    return frozenset(out)


# --- host probes ------------------------------------------------------------------------------

_ABI: int | None = None
_USERNS: str | None = None


def host_abi() -> int:
    global _ABI
    if _ABI is None:
        if not sys.platform.startswith("linux"):
            _ABI = 0
        else:
            from fusion_oci import landlock_child

            _ABI = landlock_child.abi_version()
    return _ABI


def userns_problem() -> str:
    """Why user namespaces are unusable here ('' when they work), probed once per process."""
    global _USERNS
    if _USERNS is None:
        from fusion_oci.runtimes.linux.userns import diagnose_sysctls, read_sysctls

        known = diagnose_sysctls(read_sysctls(), uid=os.geteuid())
        if known is not None:
            _USERNS = known.reason
        else:
            unshare = shutil.which("unshare")
            _USERNS = ""
            if unshare is not None:
                done = probe([unshare, "--user", "true"])
                if done.returncode is not None and done.returncode != 0:
                    why = done.text("stderr").strip().splitlines()[-1:]
                    _USERNS = (
                        "creating a user namespace fails ("
                        + (why[0] if why else f"exit {done.returncode}")
                        + ")"
                    )
    return _USERNS


CONFINE_FAILED = b"fusion-oci: cannot confine the command"


def workload_network(abi: int) -> NetworkMode:
    """The network in which a command here reaches a package registry: ``egress`` without the
    host's loopback needs a network namespace, so it is refused; ``filtered`` (the task's
    proxy) needs Landlock's TCP rules; below ABI 4 only ``host`` is left."""
    return NetworkMode.FILTERED if abi >= MIN_NET_ABI else NetworkMode.HOST


def workload_note(abi: int) -> str:
    """What ``fusion-oci doctor`` says about real projects (package installs) here."""
    if workload_network(abi) is NetworkMode.FILTERED:
        return (
            "a real project (an install from a package registry) runs under network: "
            "filtered (the task's proxy, the built-in git/npm hosts or allowedDomains); "
            "egress is refused (no network namespace)"
        )
    return (
        "a real project (an install from a package registry) runs only under network: "
        f"host (filtered needs ABI {MIN_NET_ABI}), where the host's loopback (every port) "
        "is reachable too"
    )


START_TIMEOUT_S = 10.0
"""How long prepare waits for the confined agent's hello."""
LAUNCH_ENV: dict[str, str] = {}
"""The shim's and the agent's own environment: nothing of the caller's (each command's comes
in its spawn frame)."""
PLAN_FD = "N"
"""The connection's fd number in a plan made before prepare (chosen when the agent starts)."""


@dataclass(frozen=True)
class LandlockPlan(AgentPlan):
    """A spawn frame to the task's confined exec agent, with the ruleset its launch held
    (not in :meth:`to_json`: the notes say it in words) and the scratch it was planned for."""

    rules: LandlockRules = field(kw_only=True, repr=False, compare=False)
    scratch: str | None = field(kw_only=True, repr=False, compare=False)
    """The task scratch of the prepare the plan was made after (None: before any)."""


class LandlockRuntime(HostProcessRuntime):
    id = "landlock"
    egress_via_tcp = True
    """No network namespace: the task's egress proxy also listens on host 127.0.0.1:<port>,
    the one TCP destination a ``filtered`` command may connect to."""
    _proxy_port: int | None = None
    """``filtered``: that port, from prepare."""
    _services: tuple[tuple[str, str], ...] = ()
    """``hostServices``: the connect supervisor's redirects to the relays, from prepare."""
    _rules: LandlockRules | None = None
    """The task's ruleset, made at prepare (it depends on the task spec only)."""
    _exec: Agent | None = None
    """The task's confined exec agent, started at prepare."""
    _launch: SandboxLaunch | None = None
    """How prepare started it (the shim's argv with its real fd)."""

    def capabilities(self) -> SandboxCapabilities:
        return SandboxCapabilities(
            filesystem_isolation="strong" if host_abi() >= MIN_FS_ABI else "none",
            network_policy="fine" if host_abi() >= MIN_NET_ABI else "coarse",
            resource_limits="basic",
            requires_install=False,
            supports_mac=False,
            supports_linux=True,
            supports_windows=False,
        )

    def availability(self) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability(
                False, "Landlock is a Linux security module", "use sandbox-exec on macOS"
            )
        abi = host_abi()
        if abi < 1:
            return Availability(
                False,
                "this kernel offers no Landlock (it needs Linux 5.13+ built with "
                "CONFIG_SECURITY_LANDLOCK, and 'landlock' in the lsm= boot list)",
                "boot with lsm=landlock,... or choose bubblewrap",
            )
        details = {"abi": str(abi)}
        for version, what in ABI_FEATURES.items():
            details[f"abi{version}"] = ("" if version <= abi else "missing: ") + what
        if abi < MIN_FS_ABI:
            details["filesystem"] = (
                f"not enforced: ABI {abi} < {MIN_FS_ABI} lets read-only files be truncated"
            )
        details["network"] = (
            "none: socket() refused by seccomp, TCP bind/connect denied"
            + (" by Landlock" if abi >= 4 else " (no Landlock TCP rules)")
            + "; egress without host loopback: not enforced (no network "
            "namespace); host: AF_UNIX refused; filtered: "
            + (
                "TCP connect only to the task's proxy on host loopback "
                "(Landlock port rule, every connect() checked by the "
                "supervisor), TCP and unix stream sockets only"
                if abi >= MIN_NET_ABI
                else f"not enforced (needs ABI {MIN_NET_ABI})"
            )
        )
        details["workloads"] = workload_note(abi)
        from fusion_oci.agent.client import BUILD_HINT, agent_binary

        try:
            details["agent"] = str(agent_binary())
        except SandboxSetupError as exc:
            return Availability(False, f"the exec agent is missing: {exc.why}", BUILD_HINT)
        details["limits"] = (
            "rlimits (CPU time, file size, open files) only; memory, pids, "
            "CPU quota and tmpSizeMb are not enforced (no cgroup)"
        )
        details["processes"] = (
            "rlimits, priorities, I/O priorities, affinity and scheduling of other "
            "processes: refused (seccomp; a command changes only its own)"
        )
        if abi < MIN_SCOPE_ABI:
            details["signals"] = (
                "not scoped: the command can signal the caller's other processes, the task's "
                f"owner among them (needs ABI {MIN_SCOPE_ABI}); 'host processes' is listed "
                "as not enforced (refused under fail-hard)"
            )
        problem = userns_problem()
        details["userns"] = problem or "ok"
        if problem:
            details["recommendation"] = (
                f"user namespaces are forbidden here ({problem}): "
                "bubblewrap and rootless engines cannot start; "
                "landlock is the runtime that still isolates"
            )
        return Availability(
            True, version=f"landlock ABI {abi}", rootless=os.geteuid() != 0, details=details
        )

    def enforces(self) -> frozenset[Requirement]:
        return enforced_requirements(host_abi())

    def rules(self, spec: TaskSpec) -> LandlockRules:
        home, tmp = self._dirs()
        return landlock_rules(
            spec, home, tmp, self._proxy_port, self._agent(), services=self._services
        )

    @staticmethod
    def _agent() -> str:
        """The shipped agent's host path (not checked here, so plans need none; prepare
        checks it)."""
        from fusion_oci.agent import client

        return str(Path(client.__file__).with_name(client.BINARY_NAME))

    def _launch_path(self) -> str:
        where = str(self._scratch) if self._scratch is not None else "<task scratch>"
        return f"{where}/launch"

    def launch_command(self, launch: str, fd: int | str) -> list[str]:
        """The task's launch, for plan and prepare alike: the subreaper shim (the seccomp
        supervisor, outside the sandbox) with the launch file, whose confined child execs the
        exec agent on the connection ``fd`` (the shim adds ``--parent``, its own pid)."""
        agent = [self._agent(), "--fd", str(fd), "--dumpable"]
        if host_abi() >= MIN_SCOPE_ABI:
            # Each run in a domain nested in the agent's: no command signals the agent or a
            # keeper (Landlock lets a domain signal its own and nested ones only).
            agent.append("--scope-runs")
        argv = reaper_argv(agent)
        at = argv.index("--")
        argv[at:at] = [f"SANDBOX={launch}", f"AGENT={fd}"]
        return argv

    def plan(self, process: ProcessSpec) -> LandlockPlan:
        """The spawn frame :meth:`execute` sends, beside the launch prepare made (or would
        make: its fd and scratch as placeholders before prepare)."""
        home, tmp = self._dirs()
        spec = self.task_spec
        rules = self._rules if self._rules is not None else self.rules(spec)
        abi = host_abi()
        notes = [
            "runs on the host as the caller, confined before the agent's exec: capabilities "
            f"dropped, no_new_privs, Landlock ABI {abi} ruleset, seccomp",
            "through the task's exec agent (started at prepare under the reaper shim, whose "
            "child confines itself and execs it; the reaper stays outside as the seccomp "
            "supervisor of its whole tree): the spawn frame's fields above; a keeper per run "
            "ends the whole tree",
            "read-write: " + ", ".join(p for p, a in rules.paths if "write_file" in a),
            "network "
            + rules.network
            + {
                "none": ": every socket() refused",
                "host": ": AF_UNIX sockets refused",
                "filtered": f": TCP connect only to the task's egress proxy at 127.0.0.1:"
                f"{rules.proxy_port or '<port chosen at prepare>'} (Landlock port "
                "rule; every connect() checked by the supervisor), TCP bind "
                "denied; TCP and unix stream sockets only (no UDP, raw, packet, "
                "netlink); unix connects only beneath writable paths",
            }[rules.network],
            process.shown_limits(),
        ]
        notes += [
            f"not read-only during the command (restored after it): {p}" for p in rules.restored
        ]
        launch = self._launch or SandboxLaunch(
            argv=self.launch_command(self._launch_path(), PLAN_FD), env=LAUNCH_ENV, cwd="/"
        )
        env = landlock_env(native_env(spec, process, home, tmp), rules, self._agent())
        return LandlockPlan(
            backend=self.id,
            spawn=spawn_of(process, env=env),
            sandbox=launch,
            notes=notes,
            process=process,
            rules=rules,
            scratch=str(self._scratch) if self._scratch is not None else None,
        )

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        task = await super().prepare(task)
        ctx = task.ctx
        try:
            if task.spec.network is NetworkMode.FILTERED:
                if task.egress is None or task.egress.tcp_port is None:
                    raise SandboxSetupError(
                        "network filtered needs the task's egress proxy on host loopback",
                        "none was started for this task (the landlock runtime asks for a "
                        "TCP listener: egress_via_tcp)",
                        "prepare the task through fusion_oci.Sandbox",
                    )
                self._proxy_port = task.egress.tcp_port
            self._services = service_redirects(task.services)
            if task.spec.image:
                raise SandboxSetupError(
                    "the landlock runtime cannot use an image",
                    "it runs the command on the host's own system directories",
                    "drop sandbox.image, or choose podman, docker or oci for images",
                )
            # The carve-outs depend on the task's layout only: known before anything runs.
            probe = self._rules = self.rules(task.spec)
            fusion = str(task_project(ctx).resolve() / ".fusion")
            exposed = [
                p
                for p in probe.restored
                if p == fusion or p.startswith(fusion + "/") or fusion.startswith(p + "/")
            ]
            if exposed:
                # Keep-and-restore is not enough here: the settings would be writable while the
                # command runs, and restoring the folder would drop the audit lines the host
                # appends for other commands meanwhile. Refused, never weakened.
                raise PolicyNotEnforceableError(
                    self.id,
                    [
                        f"protectedPaths: {fusion}/ (the project's settings and audit "
                        "log, inside the writable worktree)"
                    ],
                    "use a linked worktree (git worktree add) or --project-dir outside the "
                    "worktree, whose .fusion/ the command cannot reach; or bubblewrap where "
                    "user namespaces are allowed",
                )
            if probe.restored and self.layout is not None:
                # Listed as not read-only (the lifecycle reports layout.unprotected), though
                # put back after every command.
                extra = tuple(
                    f"{p} (writable during the command: Landlock cannot make it "
                    "read-only inside the writable worktree; restored after each "
                    "command)"
                    for p in probe.restored
                )
                self.layout = replace(self.layout, unprotected=(*self.layout.unprotected, *extra))
                task = replace(task, layout=self.layout)
                self.adopt(task)
            # Last: a task refused above starts nothing.
            self._exec = await self._start_agent(probe)
            if task.services is not None:
                # The shim is the connect supervisor: its reports of the TCP grants'
                # connects are the only ones the relays take.
                task.services.reporter_pid = self._exec.peer_pid
        except BaseException:
            await self.dispose()
            raise
        return task

    async def _start_agent(self, rules: LandlockRules) -> Agent:
        """The shim and, as its confined child, the task's exec agent; greeted before this
        returns. The launch file is gone afterwards, whatever happened."""
        import platform

        from fusion_oci.agent.client import Agent, agent_binary

        agent_binary()  # a clear setup error (how to build it) when it is missing
        assert self._scratch is not None
        launch = self._scratch / "launch"
        log_path = self._scratch / "agent.log"
        # Beside HOME and TMPDIR, not in them: no command can read or change it.
        _write_launch(launch, launch_text(launch_config(rules, host_abi(), platform.machine())))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = self.launch_command(str(launch), theirs.fileno())
        proc: asyncio.subprocess.Process | None = None
        try:
            # The shim's errors and the agent's last words go to a log read on failure (not a
            # pipe: nobody would drain it for the task's life).
            log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    env=LAUNCH_ENV,
                    cwd="/",
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
            finally:
                os.close(log)
            theirs.close()
            agent = await Agent.over(ours, proc, START_TIMEOUT_S)
        except BaseException as exc:
            ours.close()
            await kill_group(proc)
            said = _tail(log_path)
            if CONFINE_FAILED.decode() in said:
                raise SandboxSetupError(
                    "the landlock runtime could not confine the task's commands",
                    said,
                    "see `fusion-oci doctor` for this kernel's Landlock ABI",
                ) from exc
            if isinstance(exc, OSError):
                raise SandboxSetupError(
                    "the landlock runtime could not start its exec agent",
                    str(exc),
                    "check the host's process and file limits (ulimit -a)",
                ) from exc
            raise
        finally:
            theirs.close()  # idempotent
            _remove_launch(launch)
        self._launch = SandboxLaunch(argv=argv, env=LAUNCH_ENV, cwd="/")
        return agent

    async def execute(self, plan: Plan, opts: RunOptions) -> RunResult:
        landlock_plan = own_plan(self, plan, LandlockPlan)
        process, rules = landlock_plan.process, landlock_plan.rules
        agent = self._exec
        if agent is None or self._scratch is None or landlock_plan.scratch != str(self._scratch):
            raise SandboxSetupError(
                f"runtime '{self.id}' was not prepared",
                "its exec agent is not running, or the plan was made before prepare()",
                "call prepare(ctx) first, then plan the command",
            )
        from fusion_oci.runtimes.linux import snapshot

        kept = snapshot.take(rules.restored, holes=rules.holes)
        try:
            outcome = await agent.run_command(landlock_plan.spawn, opts)
        finally:
            # The run's keeper ended the command's whole tree before it reported: nothing of
            # it can race the restore.
            changed = snapshot.restore(kept)
        notes = []
        if changed:
            notes.append(
                "restored what the command changed in read-only paths: "
                + ", ".join(changed[:10])
                + ("" if len(changed) <= 10 else ", ...")
            )
        if kept.too_big:
            notes.append(
                "not kept, so not restored (too large to copy per command): "
                + ", ".join(kept.too_big[:10])
            )
        if notes:
            text = "".join(f"fusion-oci: {n}\n" for n in notes)
            outcome = replace(outcome, stderr=outcome.stderr + text.encode())
        return self.result(outcome, process)

    async def dispose(self) -> None:
        agent, self._exec = self._exec, None
        self._launch = None
        self._proxy_port = None
        self._services = ()
        self._rules = None
        try:
            if agent is not None:
                await agent.close()
        finally:
            await super().dispose()


def _write_launch(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")  # a few KiB in the task's scratch: not worth a thread


def _remove_launch(path: Path) -> None:
    path.unlink(missing_ok=True)


def _tail(path: Path, limit: int = 500) -> str:
    """The last words of the shim and the agent (empty when they left none)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()[-limit:]
    except OSError:
        return ""
