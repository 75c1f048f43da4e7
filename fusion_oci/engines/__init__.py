"""The engines layer: one way to find, open and talk to docker and podman.

::

    endpoints.py   where the APIs are: settings, then DOCKER_HOST / Docker contexts /
                   DOCKER_TLS_VERIFY, CONTAINER_HOST / podman connections, then defaults
    errors.py      the one mapping of SDK exceptions (by type and status) to fusion-oci errors
    base.py        EngineAdapter: containers, volumes and images over one SDK client, and
                   what it creates (ContainerPlan, CacheVolume)
    labels.py      the labels on every object we create, and the owner they name
    docker.py      the docker SDK's adapter
    podman.py      the podman SDK's adapter
    connect.py     the first endpoint that answers
    service.py     a podman API service of our own when none answers

The podman and docker runtimes, image provisioning and ``gc`` all use these; nothing here
imports a runtime, the image pipeline or ``gc`` (tests/unit/test_rooms.py holds it).
"""

from fusion_oci.engines.base import EngineAdapter, EngineInfo, Found, ImageInfo
from fusion_oci.engines.connect import NotAnswering, connect, open_adapter, open_target
from fusion_oci.engines.endpoints import (
    Endpoint,
    EngineKind,
    EngineTarget,
    TLSFiles,
    docker_endpoints,
    engine_targets,
    podman_endpoints,
)
from fusion_oci.engines.errors import (
    ContainerGoneError,
    EngineOpError,
    describe,
    engine_errors,
    image_errors,
)

__all__ = [
    "ContainerGoneError",
    "Endpoint",
    "EngineAdapter",
    "EngineInfo",
    "EngineKind",
    "EngineOpError",
    "EngineTarget",
    "Found",
    "ImageInfo",
    "NotAnswering",
    "TLSFiles",
    "connect",
    "describe",
    "docker_endpoints",
    "engine_errors",
    "engine_targets",
    "image_errors",
    "open_adapter",
    "open_target",
    "podman_endpoints",
]
