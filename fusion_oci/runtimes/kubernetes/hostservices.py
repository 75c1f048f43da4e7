"""Host services on a cluster (``policy.hostServices``, TCP grants): what the pod's relay
listens on and what the executor dials for each of its connections.

A pod runs on a cluster node, where the executor's loopback is not; the agent's stream is the
way back, as for ``network: filtered``. ``mux.py`` listens on each TCP grant's own address of
the pod's loopback (``--service-listen 127.0.0.1:5432``; an IPv6 grant on ``::1`` where the
pod has it), before the agent says hello, and carries each connection over the stream with
the listener's index (its place among those options). The executor answers listener N with
the N-th grant's relay (:func:`listener_table`, fixed here at prepare): the task's relay of
that grant connects to exactly the granted address and audits the connection
(``sandbox:egress`` with ``details.service``), as for a local sandbox. The pod names a
listener, never an address: an index this side did not set up is a broken stream.

A unix socket grant is refused at ``check`` (:data:`UNIX_GRANTS`): a pod has no path of the
executor's host to bind, and its programs name the socket by that path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from fusion_oci.agent.protocol import EGRESS_PORT
from fusion_oci.agent.streamed import mux_argv
from fusion_oci.errors import SandboxSetupError
from fusion_oci.models import NetworkMode
from fusion_oci.models.hostservice import HostService
from fusion_oci.oci.model import TaskSpec
from fusion_oci.runtimes.kubernetes.tools import AGENT, MUX, path

UNIX_GRANTS = (
    "hostServices unix: grants (a unix socket of the executor's host cannot be carried to a "
    "pod; grant the service's TCP address, 127.0.0.1:PORT, instead)"
)
"""What ``check`` says for a task with a ``unix:`` grant: refused, never run weaker."""


def tcp_grants(grants: Iterable[HostService]) -> list[str]:
    """The TCP grants, canonical (``127.0.0.1:5432``, ``[::1]:6379``), in the spec's order:
    the pod's listeners 0, 1, ... Pure."""
    return [str(g) for g in grants if g.kind == "tcp"]


def pod_mux_argv(spec: TaskSpec) -> list[str]:
    """The pod's relay for ``spec``: the egress listener for ``network: filtered`` (the
    proxy variables name 127.0.0.1:3128), a listener per TCP grant. Pure."""
    return mux_argv(
        path(AGENT),
        python="python3",
        mux=path(MUX),
        egress_listen=EGRESS_PORT if spec.network is NetworkMode.FILTERED else None,
        service_listen=tcp_grants(spec.host_services),
    )


def listener_table(grants: Sequence[str], relays: Mapping[str, str] | None) -> tuple[str, ...]:
    """The relay socket (on the executor) that listener N's connections are dialled to, for
    each of ``grants`` (:func:`tcp_grants`) in order; ``relays``: the task's relays, grant
    -> socket. A grant without a relay is refused: its service would not be there. Pure."""
    if not grants:
        return ()
    missing = [g for g in grants if relays is None or g not in relays]
    if relays is None or missing:
        raise SandboxSetupError(
            "hostServices need the task's relays",
            f"none was started for {', '.join(missing)}",
            "prepare the task through fusion_oci.Sandbox",
        )
    return tuple(relays[g] for g in grants)


__all__ = ["UNIX_GRANTS", "listener_table", "pod_mux_argv", "tcp_grants"]
