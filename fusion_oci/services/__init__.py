"""Host services by grant (``policy.hostServices``): the host side.

- :mod:`fusion_oci.models.hostservice` (a top-level helper, read by the settings too): a grant
  parsed, and what it hands over;
- :mod:`~fusion_oci.services.relay`: one relay per grant per task, connecting to exactly the
  granted address or socket, audited;
- :mod:`~fusion_oci.services.netns`: sockets made inside a service container's network
  namespace, for the relays of ``policy.services`` (started by :mod:`fusion_oci.sidecars`);
- :mod:`~fusion_oci.services.inside`: where each grant appears inside the sandbox (pure: the
  agent's listeners, the binds), for every runtime's translation;
- :mod:`~fusion_oci.services.publish`: the other direction, ``policy.publishPorts``: the
  host's listeners whose connections are handed to the sandbox's agent.

The sandbox side is the exec agent's (``--service``: a listener on the sandbox's own loopback
spliced to the relay's socket), a bind of the relay's socket at the granted path, or on
landlock the connect supervisor's redirect; see docs/egress.md, "Host services".
"""

from fusion_oci.services.relay import (
    ContainerUpstream,
    Limits,
    TaskRelays,
    start_relays,
    stop_relays,
)

__all__ = ["ContainerUpstream", "Limits", "TaskRelays", "start_relays", "stop_relays"]
