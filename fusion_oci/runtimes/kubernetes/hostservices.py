"""Host services on a cluster (``policy.hostServices``): what the pod's relay listens on
and what the executor dials for each of its connections.

A pod runs on a cluster node, where the executor's loopback is not; the agent's stream is the
way back, as for ``network: filtered``. ``mux.py`` listens on each grant where the pod's
programs look for it, before the agent says hello: a TCP grant on its own address of the pod's
loopback (``--service-listen 127.0.0.1:5432``; an IPv6 grant on ``::1`` where the pod has
it), a unix grant at its own path (``--service-listen unix:/var/run/postgresql/.s.PGSQL.5432``,
in a folder the pod gives it: :func:`~.pod.unix_folders`). It carries each connection over the
stream with the listener's index (its place among those options). The executor answers
listener N with the N-th grant's relay (:func:`listener_table`, fixed here at prepare): the
task's relay of that grant connects to exactly the granted address or path and audits the
connection (``sandbox:egress`` with ``details.service``), as for a local sandbox. The pod
names a listener, never an address: an index this side did not set up is a broken stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from fusion_oci.agent.protocol import EGRESS_PORT
from fusion_oci.agent.streamed import mux_argv
from fusion_oci.errors import SandboxSetupError
from fusion_oci.models import NetworkMode
from fusion_oci.models.hostservice import HostService
from fusion_oci.oci.model import TaskSpec
from fusion_oci.runtimes.kubernetes.pod import pod_grants, unix_folder_gaps
from fusion_oci.runtimes.kubernetes.tools import AGENT, MUX, path


def listened(grants: Iterable[HostService]) -> list[str]:
    """What the pod's relay listens on for each grant, in the spec's order (listeners 0, 1,
    ...): ``127.0.0.1:5432``, ``[::1]:6379``, ``unix:/PATH``. Pure."""
    return [str(g) for g in grants]


def unix_refusals(grants: Iterable[HostService], writable: Sequence[str]) -> list[str]:
    """What ``check`` says for unix grants a pod cannot carry (:func:`~.pod.unix_folder_gaps`,
    the rule the pod's volumes follow). Pure."""
    return [gap.text() for gap in unix_folder_gaps(grants, writable)]


def pod_mux_argv(spec: TaskSpec) -> list[str]:
    """The pod's relay for ``spec``: the egress listener for ``network: filtered`` (the
    proxy variables name 127.0.0.1:3128), a listener per grant the pod does not serve itself
    (:func:`~.pod.pod_grants`: a service container listens on its own endpoint), and the
    published ports it may connect to for the executor. Pure."""
    return mux_argv(
        path(AGENT),
        python="python3",
        mux=path(MUX),
        egress_listen=EGRESS_PORT if spec.network is NetworkMode.FILTERED else None,
        service_listen=listened(pod_grants(spec)),
        publish_ports=published_ports(spec),
    )


def published_ports(spec: TaskSpec) -> list[int]:
    """The ports of the pod's loopback the executor may connect to for the task's published
    ports (``mux.py --publish-port``), each once, in order. Pure."""
    return list(dict.fromkeys(p.port for p in spec.published_ports))


def listener_table(grants: Sequence[str], relays: Mapping[str, str] | None) -> tuple[str, ...]:
    """The relay socket (on the executor) that listener N's connections are dialled to, for
    each of ``grants`` (:func:`listened`) in order; ``relays``: the task's relays, grant
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


__all__ = [
    "listened",
    "listener_table",
    "pod_mux_argv",
    "published_ports",
    "unix_refusals",
]
