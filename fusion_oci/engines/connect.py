"""Opening an adapter: the first endpoint of the resolver that answers.

One loop for the runtimes, image operations and ``gc``: each endpoint's unix socket is
checked before any HTTP (a missing socket and a forbidden one are told apart), then one quick
round trip. An endpoint the user named (settings, env, a context or connection) that does not
answer is an error, never silently replaced by the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

from fusion_oci.engines.base import API_TIMEOUT_S, LONG_TIMEOUT_S, EngineAdapter
from fusion_oci.engines.endpoints import Endpoint, EngineKind, EngineTarget, preflight
from fusion_oci.engines.errors import EngineForbiddenError, engine_errors, image_errors
from fusion_oci.errors import SandboxSetupError


class NotAnswering(Exception):
    """No listed endpoint answered (and none was named by the user)."""

    def __init__(self, tried: list[Endpoint]) -> None:
        super().__init__("no endpoint answered")
        self.tried = tried


def open_adapter(
    kind: EngineKind,
    endpoint: Endpoint,
    *,
    name: str | None = None,
    timeout: float = LONG_TIMEOUT_S,
) -> EngineAdapter:
    """An adapter on ``endpoint`` (no round trip yet); closed by its ``close()``."""
    if kind == "podman":
        from fusion_oci.engines.podman import PodmanAdapter

        return PodmanAdapter.open(endpoint, name=name or kind, timeout=timeout)
    from fusion_oci.engines.docker import DockerAdapter

    return DockerAdapter.open(endpoint, name=name or kind, timeout=timeout)


def open_target(target: EngineTarget) -> EngineAdapter:
    """An adapter for an image target (see :func:`~fusion_oci.engines.engine_targets`)."""
    endpoint = target.endpoint or Endpoint(target.url, target.name)
    with image_errors(f"connect to {target.name}", target.name, target.url):
        return open_adapter(target.kind, endpoint, name=target.name)


def connect(
    kind: EngineKind, endpoints: Sequence[Endpoint], *, timeout: float = API_TIMEOUT_S
) -> EngineAdapter:
    """The first endpoint that answers. Raises the translated error of an explicit endpoint
    or a forbidden socket; :class:`NotAnswering` when none answers."""
    tried: list[Endpoint] = []
    last: SandboxSetupError | None = None
    for endpoint in endpoints:
        tried.append(endpoint)
        try:
            with engine_errors(kind, "connect", endpoint):
                preflight(endpoint)
                adapter = open_adapter(kind, endpoint, timeout=timeout)
                try:
                    adapter.probe()
                except BaseException:
                    adapter.close()
                    raise
        except SandboxSetupError as exc:
            last = exc
            if endpoint.explicit:
                raise
            continue
        return adapter
    if isinstance(last, EngineForbiddenError):
        raise last  # a socket that is there but not ours: say so, do not start another
    raise NotAnswering(tried)
