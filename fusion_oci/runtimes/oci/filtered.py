"""``network: filtered`` for the ``oci`` runtime (runc and runsc): the container's own empty
network namespace, the task's egress proxy socket bound in, and the agent's forwarder.

The task's container has the agent as its init (see fusion_oci.runtimes.oci), so the forwarder
lives as long as the task: the init gets ``--egress SOCKET``, listens on 127.0.0.1:3128 in the
container's namespace before it says hello (before any command runs) and serves in its own
poll loop (agent.c; PROTOCOL.md, "The egress forwarder"). The commands' proxy variables
(compiled into the spec, fusion_oci.oci.spec) name that port.

- runc: the spec's network namespace has only ``lo`` (runc brings it up); nothing routes out.
- runsc (gVisor): ``--network=none`` is gVisor's own netstack with loopback only, so the
  forwarder listens inside the Sentry; a bind-mounted host unix socket is not connectable from
  inside gVisor unless the gofer may open host sockets, so runsc gets ``--host-uds=open``
  (connect only; the sandbox still cannot create host sockets). Chosen over a forwarder on the
  host side of a netns runsc joins (``--network=host`` in an ``unshare --net`` namespace, as
  egress does): that path needs a second host process per task and hands gVisor a host
  network stack; this one keeps gVisor's netstack closed and reuses the runc wiring. Fail
  closed: a runsc without ``--host-uds`` refuses the flag and the container does not start;
  one whose gofer refuses the connect leaves the forwarder unable to reach the proxy, so
  nothing is reachable (tests/integration/test_egress_filtered_ll.py).

What else a command could reach through ``--host-uds=open``: host unix sockets inside the
container's bind mounts (the worktree, writable paths), which runc's bind mounts expose the
same way; the system directories bound read-only hold none.
"""

from __future__ import annotations

from fusion_oci.agent.protocol import EGRESS_AGENT, EGRESS_DIR, EGRESS_SOCKET, forward_args
from fusion_oci.errors import BundleError
from fusion_oci.oci.model import ConfigSpec, Mount
from fusion_oci.oci.ops import EXEC_STATUS_IN_SANDBOX
from fusion_oci.oci.spec import bind, tmpfs, with_mounts
from fusion_oci.services.inside import ServiceWiring

AGENT_INIT_IN_SANDBOX = "/dev/fusion-oci-agent"
"""The agent as the task's init (launch.py's AGENT_IN_SANDBOX)."""

SOCKET_PLACEHOLDER = "<egress-proxy.sock>"
"""The host path of the task's proxy socket in a plan made before prepare started it."""
RUNSC_FLAGS = ("--network=none", "--host-uds=open")
"""runsc's flags for filtered (see the module docstring)."""


def with_egress_forwarder(spec: ConfigSpec, socket: str, agent: str) -> ConfigSpec:
    """The task's proxy socket (host path ``socket``) at /run/fusion-oci/egress.sock, the agent
    (host path ``agent``) at /run/fusion-oci/agent for ssh's ProxyCommand, and the forwarder
    started by the agent that is the container's init (launch.with_agent_init) or wraps its
    one command (:func:`fusion_oci.oci.ops.with_exec_status`), applied before this. Pure.

    /run gets a tmpfs of the container's own when the spec has none: the mount points are then
    made there, never in a shared image rootfs. Both binds are read-only: connect needs no
    write access to the mount, and neither file can be replaced from inside.
    """
    args = spec.process.args
    if not args or args[0] not in (AGENT_INIT_IN_SANDBOX, EXEC_STATUS_IN_SANDBOX):
        raise BundleError(
            "network filtered needs the exec agent as the container's process",
            "the forwarder is the agent's (--egress); the bundle has no agent",
            "apply with_agent_init (or with_exec_status) before with_egress_forwarder",
        )
    mounts = [
        *_run_tmpfs(spec),
        bind(EGRESS_SOCKET, socket, writable=False),
        bind(EGRESS_AGENT, agent, writable=False),
    ]
    return ConfigSpec(
        with_mounts(spec.task, mounts),
        spec.process.with_args([args[0], *forward_args(EGRESS_SOCKET), *args[1:]]),
    )


def _run_tmpfs(spec: ConfigSpec) -> list[Mount]:
    """A tmpfs of the container's own at /run where the spec has none (the mount points of
    the binds under it are made there, never in a shared image rootfs)."""
    if any(m.destination in ("/run", EGRESS_DIR) for m in spec.task.mounts):
        return []
    return [tmpfs("/run", mode="755")]


def with_service_relays(spec: ConfigSpec, services: ServiceWiring) -> ConfigSpec:
    """``hostServices``: each relay's socket bound read-only (at /run/fusion-oci/services/N.sock
    for a TCP grant, at the granted path for a unix one) and a listener per TCP grant on the
    container's own loopback, started by the agent that is its init before hello (the same
    forwarder as ``--egress``). /run gets a tmpfs of the container's own, as for filtered.
    runsc needs ``--host-uds=open`` to connect the bound sockets (:func:`runsc_service_flags`).
    Pure."""
    if not services:
        return spec
    args = spec.process.args
    if not args or args[0] not in (AGENT_INIT_IN_SANDBOX, EXEC_STATUS_IN_SANDBOX):
        raise BundleError(
            "hostServices needs the exec agent as the container's process",
            "the listeners are the agent's (--service); the bundle has no agent",
            "apply with_agent_init (or with_exec_status) before with_service_relays",
        )
    binds = [bind(dest, source, writable=False) for source, dest in services.binds]
    return ConfigSpec(
        with_mounts(spec.task, [*_run_tmpfs(spec), *binds]),
        spec.process.with_args([args[0], *services.agent_args, *args[1:]]),
    )


def runsc_service_flags(flags: list[str]) -> list[str]:
    """runsc's flags with ``--host-uds=open`` once (the relays' bound sockets). Pure."""
    return flags if "--host-uds=open" in flags else [*flags, "--host-uds=open"]
