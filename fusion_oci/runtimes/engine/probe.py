"""Which engine a container runtime talks to, and what it is: the part of the podman and
docker runtimes that connects (through :mod:`fusion_oci.engines`) and answers
``availability()``, apart from the task container's lifecycle in :mod:`.engine`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from fusion_oci.engines import (
    Endpoint,
    EngineAdapter,
    EngineInfo,
    NotAnswering,
    connect,
    engine_errors,
)
from fusion_oci.errors import RuntimeUnavailableError, SandboxSetupError
from fusion_oci.runtimes.engine.containers import ContainerMode, Engine
from fusion_oci.runtimes.protocol import Availability
from fusion_oci.runtimes.skeleton import SpecRuntime


def nproc_limit(rlimits: Mapping[str, tuple[int, int]]) -> tuple[int, int] | None:
    """RLIMIT_NPROC for containers: the caller's, capped at pid_max.

    Engines reject a limit above their own hard limit, and rootful podman raises its default
    far beyond (then runc fails with "setrlimit ... operation not permitted"); no host can run
    more processes than pid_max, which is what podman's service caps itself at.
    """
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = 32768
    soft, hard = rlimits.get("RLIMIT_NPROC", (-1, -1))
    hard = pid_max if hard < 0 else min(hard, pid_max)
    soft = hard if soft < 0 else min(soft, hard)
    return soft, hard


# --------------------------------------------------------------------------- probing


_ENGINE_INFO: dict[tuple[str, str], EngineInfo] = {}
"""What each engine socket said it is, once per process: podman's /info walks its storage
(0.5-1 s on a busy host) and was most of every prepare; version, rootless and cgroup mode of
the service behind one socket do not change while we run."""


class EngineProbe(SpecRuntime):
    """Connecting to the engine (the first endpoint of the resolver that answers, or a
    service the subclass starts) and asking it what it is; probing never starts anything."""

    engine: Engine = "docker"
    mode: ContainerMode = "warm"
    _adapter: EngineAdapter | None = None
    _info: EngineInfo | None = None

    # -- engine-specific hooks ------------------------------------------------------------

    def endpoints(self) -> list[Endpoint]:
        raise NotImplementedError

    def no_endpoint(self, tried: Sequence[Endpoint]) -> EngineAdapter:
        """Called when no listed socket answers; may start a service (podman) or raise."""
        raise RuntimeUnavailableError(
            self.engine,
            "no engine answers at " + ", ".join(f"{e.url} ({e.source})" for e in tried),
            "start the engine, or point docker.url / DOCKER_HOST at it",
        )

    def release_endpoint(self) -> None:
        """Undo what :meth:`no_endpoint` started."""

    def offline_info(self) -> EngineInfo | None:
        """What the engine would be when no socket answers but prepare can start one (podman);
        None: no socket means unavailable."""
        return None

    # -- probing --------------------------------------------------------------------------

    def _connect(self, *, start: bool = True) -> EngineAdapter:
        """The first endpoint that answers; when none does, :meth:`no_endpoint` (which may
        start a service) only with ``start``, else :class:`NotAnswering`."""
        if self._adapter is not None:
            return self._adapter
        try:
            self._adapter = connect(self.engine, self.endpoints())
        except NotAnswering as exc:
            if not start:
                raise
            self._adapter = self.no_endpoint(exc.tried)
        return self._adapter

    def _probe(self, *, start: bool = True) -> tuple[EngineAdapter | None, EngineInfo]:
        """Connect and ask the engine what it is. ``start=False`` (availability, enforces,
        doctor, plan) never starts a service: with none answering, :meth:`offline_info`."""
        try:
            adapter = self._connect(start=start)
        except NotAnswering as exc:
            info = self.offline_info()
            if info is None:
                self._adapter = self.no_endpoint(exc.tried)  # raises: nothing to start
                raise AssertionError("unreachable") from None
            return None, info
        if self._info is None:
            key = (self.engine, adapter.endpoint.url)
            self._info = _ENGINE_INFO.get(key)
            if self._info is None:
                with engine_errors(self.engine, "info", adapter.endpoint):
                    self._info = _ENGINE_INFO[key] = adapter.info()
        return adapter, self._info

    def availability(self) -> Availability:
        try:
            adapter, info = self._probe(start=False)
        except SandboxSetupError as exc:
            return Availability(False, exc.why or exc.what, exc.hint)
        details = {
            "socket": adapter.endpoint.url if adapter else "none answers yet",
            "socket source": adapter.endpoint.source
            if adapter
            else f"`{self.engine} system service` is started for the task at prepare",
            "rootless": "yes" if info.rootless else "no",
            "cgroup": info.cgroup_version,
            "mode": self.mode,
        }
        if info.runtime:
            details["oci runtime"] = info.runtime
        return Availability(True, version=info.version, rootless=info.rootless, details=details)
