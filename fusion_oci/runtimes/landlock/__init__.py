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
does not govern metadata; see shims/supervisor.py), and every open shown to it, which lets each
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
``connect()`` also goes to the reaper's supervisor (shims/connects.py), which reads the
address once, allows ``127.0.0.1:<port>`` and unix sockets beneath writable paths, and makes
that connect itself on the command's socket (``pidfd_getfd``); ``listen()`` too, allowed for
unix sockets only (a TCP listen autobinds on every address). seccomp leaves only TCP and
unix stream sockets (UDP, which Landlock does not govern, raw, packet, netlink, SCTP refused)
and refuses TCP Fast Open (a connect inside ``sendto``).

``policy.publishPorts`` (network ``none`` or ``filtered``, ABI 4+; ``host`` is refused by the
settings): the command's server cannot listen on the published port itself, since it is on
the host's network and Landlock denies it every TCP bind. So ``bind()`` goes to the supervisor
too (and ``none`` gets the TCP and unix stream sockets of ``filtered``, its connects checked
the same way): a bind to a published port on loopback or the wildcard is the supervisor's, on
the command's own socket, to loopback of that family at an ephemeral port (never the
wildcard, never another address), reported to the host (:mod:`.published`); a listen on that
socket is allowed, and every other TCP bind is EACCES (a unix bind goes on: Landlock rules its
path). The host carries each client of the published port to that loopback port, on the
proxy loop, while every listener of that port (the kernel's sock_diag) is the reported socket
(a stale report delivers no client to another host process). The command's ``getsockname``
shows the ephemeral port, not the one it asked for; other host processes can reach that
port on loopback as they could the published one. The command's own connect to the port it
asked for (its tests talking to its dev server) goes there too, under the same check.

How a command runs: prepare starts, once per task, the reaper shim (fusion_oci/shims/reaper.py)
with the task's launch file (``SANDBOX=``, the ruleset above as integers) and ``AGENT=``; its child
confines itself (shims/confine.py) and execs the exec agent (fusion_oci/agent) on a
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

from fusion_oci.runtimes.landlock.host import (
    host_abi,
    userns_problem,
    workload_network,
    workload_note,
)
from fusion_oci.runtimes.landlock.rules import (
    FS_RIGHTS,
    MIN_SCOPE_ABI,
    NET_RIGHTS,
    LandlockRules,
    enforced_requirements,
    landlock_env,
    landlock_rules,
    landlock_seccomp,
    launch_config,
    launch_text,
)
from fusion_oci.runtimes.landlock.runtime import LandlockPlan, LandlockRuntime

__all__ = [
    "FS_RIGHTS",
    "MIN_SCOPE_ABI",
    "NET_RIGHTS",
    "LandlockPlan",
    "LandlockRules",
    "LandlockRuntime",
    "enforced_requirements",
    "host_abi",
    "landlock_env",
    "landlock_rules",
    "landlock_seccomp",
    "launch_config",
    "launch_text",
    "userns_problem",
    "workload_network",
    "workload_note",
]
