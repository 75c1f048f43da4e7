"""A task's service containers, from prepare to dispose.

:meth:`TaskServices.start` (the lifecycle awaits it at prepare, before the relays): one engine
for the task (the task's own when it is podman or docker, else podman, else docker; a podman
API service of our own when no socket answers), each service's image provisioned the usual
way (:func:`fusion_oci.images.ensure_image`: the ``sandbox_provision`` gate, retries, audit),
its container created and started (:func:`~fusion_oci.sidecars.plan.plan_service`), its
network namespace taken (:class:`~fusion_oci.services.netns.NetnsSockets`), then waited for
until its port accepts and its ``ready`` command exits 0. :meth:`TaskServices.upstreams` is
what the relays connect to. :meth:`TaskServices.stop` removes every container and lets go of
the namespaces; it runs at dispose, on a failed prepare, and so after a timeout or an abort
(the caller disposes). A crash leaves labelled containers for ``gc``.

Every engine call is bounded (:data:`CALL_TIMEOUT_S`; podman 4.3's API can hang) and runs on
a small thread pool of the task's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from fusion_oci.engines import (
    EngineAdapter,
    NotAnswering,
    connect,
    docker_endpoints,
    engine_errors,
    podman_endpoints,
)
from fusion_oci.engines.labels import current_owner
from fusion_oci.errors import FusionOCIError, SandboxSetupError
from fusion_oci.host.scratch import make_scratch
from fusion_oci.models import ServiceContainer
from fusion_oci.services import ContainerUpstream
from fusion_oci.services.netns import NetnsSockets
from fusion_oci.sidecars.plan import plan_service, ready_argv

if TYPE_CHECKING:
    from fusion_oci.audit import AuditLog
    from fusion_oci.engines.service import PodmanService
    from fusion_oci.images.gates import AskCallback
    from fusion_oci.policy.settings import SandboxSettings

T = TypeVar("T")
EngineKind = Literal["podman", "docker"]

CALL_TIMEOUT_S = 60.0
"""One container call (create, start, inspect, exec, remove)."""
POLL_S = 0.02
"""Between two looks at a starting service's port."""
READY_POLL_S = 0.25
"""Between two runs of its ``ready`` command (each is an exec: ~0.1 s on podman here, which
holds the container's lock: others' calls on the engine get their turn in between)."""


@dataclass
class Started:
    """One service container while the task lives."""

    service: ServiceContainer
    index: int
    name: str
    image: str
    container: str | None = None
    sockets: NetnsSockets | None = None
    ready_ms: int | None = None
    image_action: str = "present"
    removed: bool = False

    def audit(self) -> dict[str, object]:
        """What the prepare event records (env by name only)."""
        return {
            "name": self.service.name,
            "image": self.image,
            "image_action": self.image_action,
            "container": self.name,
            "port": self.service.port,
            "env_names": sorted(self.service.env) or None,
            "ready_ms": self.ready_ms,
        }


@dataclass
class TaskServices:
    """The service containers of one task (module docstring)."""

    services: list[ServiceContainer]
    task_id: str
    run_id: str
    settings: SandboxSettings
    env: Mapping[str, str]
    audit: AuditLog | None = None
    ask: AskCallback | None = None
    prefer: str | None = None
    """The task's runtime id: its engine first when it is podman or docker."""
    started: list[Started] = field(default_factory=list)
    engine: str = ""
    """``podman at unix:///...`` once connected."""
    _adapter: EngineAdapter | None = None
    _kind: EngineKind = "podman"
    _service: PodmanService | None = None
    _pool: ThreadPoolExecutor | None = None
    _scratch: Path | None = None

    # -- engine ---------------------------------------------------------------------------

    async def _call(self, what: str, fn: Callable[[], T], bound_s: float = CALL_TIMEOUT_S) -> T:
        adapter = self._adapter
        assert adapter is not None and self._pool is not None

        def guarded() -> T:
            with engine_errors(self._kind, what, adapter.endpoint):
                return fn()

        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, guarded), bound_s)
        except TimeoutError:
            raise SandboxSetupError(
                f"{self._kind}: {what} did not answer",
                f"no answer within {bound_s:.0f} s (the engine's API may be stuck)",
                f"check `{self._kind} ps`; restart the engine's service if it hangs",
            ) from None

    def _connect(self) -> None:
        adapter, kind, service = open_services_engine(self.settings, self.env, self.prefer)
        self._adapter, self._kind, self._service = adapter, kind, service
        self.engine = f"{kind} at {adapter.endpoint.url}"

    # -- life -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every service and wait until each is ready; on any failure, what was
        started is removed before the error is raised."""
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fusion-services")
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._pool, self._connect),
                CALL_TIMEOUT_S,
            )
            self.started = [Started(svc, i, "", svc.image) for i, svc in enumerate(self.services)]
            await asyncio.gather(*(self._start_one(s) for s in self.started))
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.stop())
            raise

    async def _image(self, one: Started) -> str:
        from fusion_oci.audit import AuditLog
        from fusion_oci.images.provision import ProvisionOptions, ensure_image

        adapter = self._adapter
        assert adapter is not None
        provisioned = await ensure_image(
            self._kind,
            adapter.borrowed(),
            one.service.image,
            self.settings,
            self.audit or AuditLog(),
            self.task_id,
            self.run_id,
            ask=self.ask,
            options=ProvisionOptions(env=self.env),
        )
        one.image_action = provisioned.action
        return provisioned.ref

    async def _start_one(self, one: Started) -> None:
        adapter = self._adapter
        assert adapter is not None
        svc = one.service
        one.image = await self._image(one)
        plan = plan_service(
            svc,
            one.image,
            engine=self._kind,
            task_id=self.task_id,
            owner=current_owner(),
            nonce=secrets.token_hex(4),
            rlimits=host_rlimits(),
        )
        one.name = plan.name
        started = time.monotonic()
        one.container = await self._call(
            f"create service container {svc.name}", lambda: adapter.create(plan)
        )
        cid = one.container
        await self._call(f"start service container {svc.name}", lambda: adapter.start(cid))
        one.sockets = await self._namespace(one, cid)
        await self._wait_ready(one, cid, started)
        one.ready_ms = int((time.monotonic() - started) * 1000)

    async def _namespace(self, one: Started, cid: str) -> NetnsSockets:
        adapter = self._adapter
        assert adapter is not None
        running, pid, _ = await self._call("inspect", lambda: adapter.container_state(cid))
        if not running:
            raise await self._failed(one, cid, "it exited as it started")
        try:
            sockets = NetnsSockets.of_pid(pid, one.service.name)
        except OSError as exc:
            raise SandboxSetupError(
                f"service '{one.service.name}': its network namespace could not be entered",
                f"/proc/{pid}/ns/net: {exc.strerror or exc}",
                "run fusion-oci as root, or as the user whose rootless engine runs the "
                "services; or use hostServices",
            ) from exc
        # The pid was the container's when it was read: still so now, so the namespace
        # held is the container's and not a reused pid's.
        running, again, _ = await self._call("inspect", lambda: adapter.container_state(cid))
        if not running or again != pid:
            sockets.close()
            raise await self._failed(one, cid, "it exited as it started")
        return sockets

    async def _wait_ready(self, one: Started, cid: str, started: float) -> None:
        adapter = self._adapter
        assert adapter is not None and one.sockets is not None
        svc = one.service
        deadline = started + svc.ready_timeout_s
        probe = ready_argv(svc)
        last = "its port never accepted a connection"
        port_open = False
        while time.monotonic() < deadline:
            if not port_open:
                try:
                    sock = await one.sockets.connect(svc.port, 1.0)
                    sock.close()
                    port_open = True
                    last = f"`{svc.ready}` never exited 0"
                except (OSError, TimeoutError):
                    running, _, _ = await self._call(
                        "inspect", lambda: adapter.container_state(cid)
                    )
                    if not running:
                        raise await self._failed(
                            one, cid, "it exited before it was ready"
                        ) from None
                    await asyncio.sleep(POLL_S)
                    continue
            if probe is None:
                return
            code, output = await self._call(
                f"run `{svc.ready}` in {svc.name}", lambda: adapter.exec_status(cid, probe)
            )
            if code == 0:
                return
            last = f"`{svc.ready}` exited {code}: {output.decode(errors='replace').strip()[-200:]}"
            await asyncio.sleep(READY_POLL_S)
        raise await self._failed(one, cid, f"not ready within {svc.ready_timeout_s:g} s ({last})")

    async def _failed(self, one: Started, cid: str, why: str) -> SandboxSetupError:
        adapter = self._adapter
        assert adapter is not None
        logs = ""
        with contextlib.suppress(Exception):
            logs = await self._call("logs", lambda: adapter.logs_tail(cid), bound_s=10)
        tail = " | ".join(line for line in logs.strip().splitlines()[-5:] if line)
        return SandboxSetupError(
            f"service '{one.service.name}' ({one.image}) did not start",
            why + (f"; its last output: {tail}" if tail else ""),
            f"check sandbox.policy.services[{one.index}] (image, env, port, ready); "
            f"`{self._kind} logs` shows more while the task lives",
        )

    def write_hosts(self, hostname: str) -> str:
        """The task's ``/etc/hosts`` (its service names on its own 127.0.0.1), in a private
        scratch folder of the task's, removed by :meth:`stop`; its host path."""
        self._scratch = make_scratch("sidecars", self.task_id[:24])
        path = self._scratch / "hosts"
        path.write_text(hosts_text([s.name for s in self.services], hostname), encoding="utf-8")
        path.chmod(0o644)
        self._scratch.chmod(0o755)  # the sandbox's user (any uid of its namespace) reads it
        return str(path)

    def upstreams(self) -> dict[str, ContainerUpstream]:
        """Canonical endpoint (``127.0.0.1:PORT``) → where its relay connects."""
        out: dict[str, ContainerUpstream] = {}
        for one in self.started:
            if one.sockets is None:
                continue
            svc = one.service
            out[f"127.0.0.1:{svc.port}"] = ContainerUpstream(
                sockets=one.sockets,
                rule=f"policy.services[{one.index}] '{svc.name}'",
                target=f"{svc.name} (container {one.name}) 127.0.0.1:{svc.port}",
            )
        return out

    async def stop(self) -> None:
        """Remove every container (side by side) and let go of its namespace. Idempotent;
        each container is tried, and the ones that could not be removed are raised at the
        end (``gc`` removes them once this process has ended)."""
        adapter = self._adapter
        errors: list[str] = []

        async def remove(cid: str) -> None:
            assert adapter is not None
            try:
                await self._call(
                    f"remove service container {cid}", functools.partial(adapter.remove, cid)
                )
            except FusionOCIError as exc:
                errors.append(f"{cid}: {exc.why or exc.what}")

        doomed: list[str] = []
        for one in self.started:
            if one.sockets is not None:
                one.sockets.close()
                one.sockets = None
            if one.removed:
                continue
            one.removed = True
            # By name when the create's answer never came (cancelled, timed out): the
            # container may exist all the same. A name never created is a 404, ignored.
            cid = one.container or one.name
            if cid and adapter is not None:
                doomed.append(cid)
        await asyncio.gather(*(remove(cid) for cid in doomed))
        self._release()
        if errors:
            raise SandboxSetupError(
                "service containers could not all be removed",
                "; ".join(errors),
                "`fusion-oci gc` removes them once this process has ended",
            )

    def _release(self) -> None:
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        adapter, self._adapter = self._adapter, None
        if adapter is not None:
            with contextlib.suppress(Exception):
                adapter.close()
        service, self._service = self._service, None
        if service is not None:
            with contextlib.suppress(Exception):
                service.stop()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def hosts_text(names: list[str], hostname: str) -> str:
    """An ``/etc/hosts`` with the loopback names and each service's name on 127.0.0.1 (where
    its relay listens inside the sandbox). Pure."""
    return (
        f"127.0.0.1\tlocalhost {hostname}\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
        f"127.0.0.1\t{' '.join(names)}\n"
    )


def host_rlimits() -> dict[str, tuple[int, int]]:
    """``nofile`` and ``nproc`` for a podman service container: within the caller's hard
    limits (podman's defaults for root exceed them here), ``nproc`` also within pid_max
    (the engine's service caps itself there, as the task containers' do)."""
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = 32768
    out = {}
    for name, which, cap in (
        ("nofile", resource.RLIMIT_NOFILE, 1024 * 1024),
        ("nproc", resource.RLIMIT_NPROC, pid_max),
    ):
        _, hard = resource.getrlimit(which)
        limit = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
        out[name] = (min(limit, 65536), limit)
    return out


def _order(prefer: str | None) -> list[EngineKind]:
    return ["docker", "podman"] if prefer == "docker" else ["podman", "docker"]


def _endpoints(kind: EngineKind, settings: SandboxSettings, env: Mapping[str, str]) -> list:  # type: ignore[type-arg]
    if kind == "podman":
        return podman_endpoints(settings.podman.url, env, os.getuid())
    return docker_endpoints(settings.docker.url, env, os.getuid())


def open_services_engine(
    settings: SandboxSettings, env: Mapping[str, str], prefer: str | None = None
) -> tuple[EngineAdapter, EngineKind, PodmanService | None]:
    """The engine the task's service containers run on (module docstring)."""
    tried = []
    for kind in _order(prefer):
        try:
            adapter = connect(kind, _endpoints(kind, settings, env))
        except NotAnswering as exc:
            tried += exc.tried
            continue
        if _unreachable_namespaces(adapter, kind) is None:
            return adapter, kind, None
        adapter.close()

    if shutil.which("podman") is None:
        raise SandboxSetupError(
            "service containers need podman or docker",
            "no engine answers at " + ", ".join(f"{e.url} ({e.source})" for e in tried),
            "install podman (a service of its own is started per task) or start docker",
        )
    from fusion_oci.engines.service import PodmanService

    service = PodmanService(dict(env))
    podman_tried = [e for e in tried if "podman" in e.source or "podman" in e.url]
    return service.start(podman_tried or tried), "podman", service


SERVICES_PART = "services (per-task service containers)"


def services_missing(
    wanted: bool,
    isolates: bool,
    settings: SandboxSettings,
    env: Mapping[str, str],
    runtime_id: str | None = None,
) -> list[str]:
    """What keeps a runtime from giving a task its service containers here, as the
    unenforced parts ``check`` lists (empty: nothing, or no services ``wanted``)."""
    if not wanted:
        return []
    if not isolates:
        return [
            f"{SERVICES_PART}: not started: the command runs on the host's network, which has "
            "no loopback of the task's own to put them on"
        ]
    why = services_unavailable(settings, env, runtime_id)
    return [f"{SERVICES_PART}: {why}"] if why else []


def services_unavailable(
    settings: SandboxSettings, env: Mapping[str, str], prefer: str | None = None
) -> str | None:
    """Why service containers cannot run here, or None: they can (an engine answers, or
    podman is installed and a service of its own can be started). Starts nothing."""

    refused: list[str] = []
    for kind in _order(prefer):
        try:
            adapter = connect(kind, _endpoints(kind, settings, env))
        except NotAnswering:
            continue
        except FusionOCIError as exc:
            return f"{kind}: {exc.why or exc.what}"
        try:
            why = _unreachable_namespaces(adapter, kind)
        finally:
            adapter.close()
        if why is None:
            return None
        refused.append(why)
    if shutil.which("podman") is not None:
        return None  # a podman service of our own: rootless when we are not root
    return "; ".join(refused) or "neither podman nor docker is here to run them"


def _unreachable_namespaces(adapter: EngineAdapter, kind: EngineKind) -> str | None:
    """Why the relay could not make sockets in this engine's containers' network namespaces,
    or None. Root enters any; another user only the namespaces of its own rootless engine,
    whose user namespace it owns (services/netns.py's helper joins it first)."""
    if os.geteuid() == 0:
        return None
    try:
        if adapter.info().rootless:
            return None
    except FusionOCIError as exc:
        return f"{kind}: {exc.why or exc.what}"
    return (
        f"{kind} runs as root here: the relay cannot enter its containers' network "
        f"namespaces as uid {os.geteuid()} (run fusion-oci as root, use a rootless {kind}, "
        "or use hostServices)"
    )
