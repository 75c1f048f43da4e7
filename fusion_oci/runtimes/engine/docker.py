"""The docker runtime: the task container through the ``docker`` Python SDK.

Thin: the translation is :mod:`fusion_oci.runtimes.engine.containers`, the lifecycle
:class:`~fusion_oci.runtimes.engine.ContainerRuntime`, the SDK client
:class:`~fusion_oci.engines.docker.DockerAdapter`. The daemon is found as the Docker CLI
finds it (:func:`~fusion_oci.engines.docker_endpoints`: ``docker.url``, ``DOCKER_HOST``, the
current context, the system socket, then a rootless dockerd's); fusion-oci never starts
dockerd itself (it needs root and owns the host's iptables), it says how to start it instead.
"""

from __future__ import annotations

from fusion_oci.engines import Endpoint, docker_endpoints
from fusion_oci.runtimes.engine.runtime import ContainerRuntime


class DockerRuntime(ContainerRuntime):
    id = "docker"
    engine = "docker"

    def endpoints(self) -> list[Endpoint]:
        return docker_endpoints(self.settings.docker.url, self.env, self.host.uid)
