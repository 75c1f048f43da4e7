"""The container-engine runtimes: ``podman`` and ``docker``, one task container through the
engine's Python SDK, each a thin parametrisation of one shared runtime.

- :mod:`.containers` — the pure translation: task spec → the engine's container plan
- :mod:`.probe` — what the engine offers on this host (availability, what it enforces)
- :mod:`.runtime` — the shared runtime: provision, the task container, its agent, dispose
- :mod:`.podman`, :mod:`.docker` — where each engine's socket is found
"""

from fusion_oci.runtimes.engine.runtime import (
    DEFAULT_IMAGE,
    ContainerRuntime,
)

__all__ = [
    "DEFAULT_IMAGE",
    "ContainerRuntime",
]
