"""The podman runtime: the task container through the ``podman`` Python SDK.

Rootful or rootless, whichever socket answers, found as podman finds it
(:func:`~fusion_oci.engines.podman_endpoints`: ``podman.url``, ``CONTAINER_HOST``, a system
connection, then podman's own default for this user: ``/run/podman/podman.sock`` for root,
``$XDG_RUNTIME_DIR/podman/podman.sock`` otherwise). Rootless containers use ``keep-id``
user-namespace semantics, so the caller's uid is the same number inside and the worktree's
files stay the caller's.

When no socket answers and podman is installed, the runtime starts ``podman system service``
itself at prepare (:class:`~fusion_oci.engines.service.PodmanService`; never to answer
``availability()``: probing starts nothing); it ends when the runtime closes.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_oci.engines import Endpoint, EngineAdapter, EngineInfo, podman_endpoints
from fusion_oci.engines.service import PodmanService
from fusion_oci.runtimes.engine.runtime import ContainerRuntime

if TYPE_CHECKING:
    pass


class PodmanRuntime(ContainerRuntime):
    id = "podman"
    engine = "podman"

    _service: PodmanService | None = None
    """The ``podman system service`` this runtime started (None: a socket answered)."""

    def endpoints(self) -> list[Endpoint]:
        return podman_endpoints(self.settings.podman.url, self.env, self.host.uid)

    def no_endpoint(self, tried: Sequence[Endpoint]) -> EngineAdapter:
        self._service = PodmanService(self.env)
        return self._service.start(tried)

    def offline_info(self) -> EngineInfo | None:
        """No socket answers yet, but podman is installed: prepare starts a service, so the
        runtime is available; what it enforces follows from this host (rootless on cgroup v1
        cannot hold limits)."""
        if shutil.which("podman", path=self.env.get("PATH")) is None:
            return None
        cgroup = "v2" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else "v1"
        return EngineInfo(version="not running", rootless=self.host.uid != 0, cgroup_version=cgroup)

    def release_endpoint(self) -> None:
        service, self._service = self._service, None
        if service is not None:
            service.stop()
