"""Where each granted host service appears inside a sandbox with a network namespace, the same
for every runtime (bubblewrap, oci, podman, docker). Pure.

- A TCP grant (``127.0.0.1:5432``, ``[::1]:6379``): its relay's socket is bound read-only at
  ``/run/fusion-oci/services/N.sock`` and the exec agent listens on the sandbox's own
  loopback at the granted address and port (``--service 127.0.0.1:5432=/run/...``) before any
  command runs, splicing each connection to that socket. The sandbox's 127.0.0.1 is its own
  (its network namespace's), so nothing else of the host's loopback is there to reach.
- A unix grant: its relay's socket is bound read-only at the granted path, and at the path it
  resolves to on the host when that differs (``/var/run/postgresql/...`` is
  ``/run/postgresql/...`` on Debian), so both spellings programs use find it. No agent
  part: connect needs no write access to the mount, and the file cannot be replaced inside.

Before prepare (a plan) the relay sockets are placeholders, ``<service-N.sock>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusion_oci.models.hostservice import HostService

if TYPE_CHECKING:
    from fusion_oci.models.publishport import PublishedPort
    from fusion_oci.oci.model import TaskSpec

SERVICES_DIR = "/run/fusion-oci/services"
PUBLISH_DIR = "/run/fusion-oci/publish"
"""Where each published port's relay socket is bound inside (``N.sock``,
fusion_oci.services.publish)."""
PUBLISH_KEY = "publish:"
"""Prefix of a published port's entry (``publish:N``) among the relays' sockets."""


def placeholder(index: int) -> str:
    return f"<service-{index}.sock>"


@dataclass(frozen=True)
class ServiceWiring:
    """What a runtime adds for a task's grants: read-only binds (host → sandbox) and the
    agent's arguments."""

    binds: tuple[tuple[str, str], ...] = ()
    agent_args: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.binds or self.agent_args)


def service_wiring(
    grants: Sequence[HostService],
    sockets: Mapping[str, str] | None = None,
    resolved: Mapping[str, str] | None = None,
    published: Sequence[PublishedPort] = (),
) -> ServiceWiring:
    """The binds and agent arguments for ``grants`` and the ``published`` ports.
    ``sockets``: canonical grant (``publish:N``: the N-th published port) → its relay's host
    socket (None: placeholders); ``resolved``: a unix grant → the path it resolves to on the
    host (the relay's ``target``). A published port: its relay's socket bound read-only at
    ``/run/fusion-oci/publish/N.sock``, which the agent dials before hello (``--publish
    PORT=PATH``) to be handed the host's connections. Pure."""
    binds: list[tuple[str, str]] = []
    args: list[str] = []
    for i, grant in enumerate(grants):
        source = (sockets or {}).get(str(grant), placeholder(i))
        if grant.kind == "unix":
            binds.append((source, grant.path))
            also = (resolved or {}).get(str(grant))
            if also and also != grant.path:
                binds.append((source, also))
            continue
        inside = f"{SERVICES_DIR}/{i}.sock"
        binds.append((source, inside))
        address = f"[{grant.address}]" if grant.family == 10 else grant.address
        args += ["--service", f"{address}:{grant.port}={inside}"]
    for i, entry in enumerate(published):
        inside = f"{PUBLISH_DIR}/{i}.sock"
        binds.append(((sockets or {}).get(f"{PUBLISH_KEY}{i}", f"<publish-{i}.sock>"), inside))
        args += ["--publish", f"{entry.port}={inside}"]
    return ServiceWiring(tuple(binds), tuple(args))


def service_notes(task: TaskSpec) -> list[str]:
    """A plan's lines about the task's granted host services. Pure."""
    out = []
    for i, grant in enumerate(task.host_services):
        if grant.kind == "unix":
            out.append(
                f"hostServices: {grant}: the task's relay socket bound read-only at {grant.path}; "
                f"the relay connects to exactly {grant.path} on the host (no symlink followed)"
            )
        else:
            out.append(
                f"hostServices: {grant}: the agent listens on the sandbox's own {grant} and "
                f"splices to the task's relay at {SERVICES_DIR}/{i}.sock; the relay connects to "
                f"exactly {grant} on the host"
            )
    return out
