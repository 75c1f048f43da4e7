"""What the podman and docker runtimes share beyond the pure translation: finding the engine's
socket, the one boundary where SDK exceptions become fusion-oci errors, and the lifecycle of
a warm (or one-shot) task container.

The engine-specific part is an :class:`EngineAdapter` (``podman.py``, ``docker.py``): a thin,
synchronous layer over one SDK client. :class:`ContainerRuntime` drives it from asyncio
through a small thread pool of its own, so that one task's blocked exec stream can never
starve another task's calls (parallel prepares of many tasks share nothing but the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from fusion_oci.agent.client import Agent, agent_binary, listen_socket
from fusion_oci.errors import (
    EngineError,
    FusionOCIError,
    ProvisionError,
    RuntimeUnavailableError,
    SandboxSetupError,
)
from fusion_oci.models import PrepareContext, RunOptions, RunResult, SandboxCapabilities
from fusion_oci.oci.spec import Spec
from fusion_oci.runtimes.base import (
    Availability,
    LaunchPlan,
    LimitCounters,
    Requirement,
    SpecRuntime,
    classify,
    status_from_code,
)
from fusion_oci.runtimes.containers import (
    AGENT_PATH,
    AGENT_SOCKET,
    AgentMounts,
    CacheVolume,
    ContainerMode,
    ContainerPlan,
    Engine,
    ExecPlan,
    Owner,
    Target,
    container_name,
    limit_reason,
    parse_limit_counters,
    plan_container,
    plan_exec,
    plan_limit_probe,
    sandbox_user,
)
from fusion_oci.scratch import boot_id, make_scratch, process_start

T = TypeVar("T")

PING_TIMEOUT_S = 3.0
DEFAULT_IMAGE = "node"
"""The task image when neither the prepare context nor sandbox.image names one: the
product's own ``images/node`` (provisioned, behind the sandbox_provision gate, if missing)."""
AGENT_CONNECT_S = 30.0
"""How long a started container's agent may take to connect (a busy host's runc)."""

# --------------------------------------------------------------------------- endpoints


@dataclass(frozen=True)
class Endpoint:
    """An engine API address and where it came from (for ``doctor`` and error messages)."""

    url: str
    source: str
    explicit: bool = False
    """Named by the user (settings or env): never silently replaced by another socket."""


def podman_endpoints(settings_url: str | None, env: Mapping[str, str], uid: int
                     ) -> list[Endpoint]:
    """Where podman's API is looked for, in order: settings, CONTAINER_HOST, then podman's
    own default socket for this user (``$XDG_RUNTIME_DIR/podman/podman.sock`` when not root,
    ``/run/podman/podman.sock`` for root). Pure."""
    if settings_url:
        return [Endpoint(settings_url, "settings sandbox.podmanUrl", True)]
    if env.get("CONTAINER_HOST"):
        return [Endpoint(env["CONTAINER_HOST"], "CONTAINER_HOST", True)]
    if uid == 0:
        return [Endpoint("unix:///run/podman/podman.sock", "podman's default socket for root")]
    xdg = env.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
    return [Endpoint(f"unix://{xdg}/podman/podman.sock",
                     "podman's default rootless socket ($XDG_RUNTIME_DIR)")]


def docker_endpoints(settings_url: str | None, env: Mapping[str, str], uid: int
                     ) -> list[Endpoint]:
    """settings, DOCKER_HOST, the system socket, then a rootless dockerd's. Pure."""
    if settings_url:
        return [Endpoint(settings_url, "settings sandbox.dockerUrl", True)]
    if env.get("DOCKER_HOST"):
        return [Endpoint(env["DOCKER_HOST"], "DOCKER_HOST", True)]
    out = [Endpoint("unix:///var/run/docker.sock", "docker's default socket")]
    if uid != 0:
        xdg = env.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
        out.append(Endpoint(f"unix://{xdg}/docker.sock", "rootless dockerd's socket"))
    return out


def socket_path(url: str) -> str | None:
    for prefix in ("unix://", "http+unix://"):
        if url.startswith(prefix):
            return "/" + url.removeprefix(prefix).lstrip("/")
    return None


def preflight(endpoint: Endpoint) -> None:
    """A missing or forbidden unix socket, told apart before any HTTP is attempted."""
    path = socket_path(endpoint.url)
    if path is None:
        return
    os.stat(path)  # noqa: PTH116 - FileNotFoundError, or PermissionError on a parent dir
    if not os.access(path, os.R_OK | os.W_OK):
        raise PermissionError(13, "Permission denied", path)


# --------------------------------------------------------------------------- errors

_HINTS: tuple[tuple[str, str, str], ...] = (
    # (pattern in the engine's message, why, hint)
    (r"cgroups? in hybrid mode not supported|crun.*cgroup",
     "crun refuses this cgroup v1/hybrid host",
     'use runc: put `[engine]` and `runtime = "runc"` in '
     "/etc/containers/containers.conf.d/50-runc.conf (or ~/.config/containers/containers.conf)"),
    (r"no subuid ranges|no subgid ranges|/etc/subuid|/etc/subgid",
     "the user has no subordinate uid/gid range",
     "add one: usermod --add-subuids 100000-165535 --add-subgids 100000-165535 $USER, "
     "then `podman system migrate`"),
    (r"newuidmap|newgidmap",
     "rootless podman needs newuidmap/newgidmap",
     "install them: apt-get install uidmap"),
    (r"/dev/net/tun",
     "rootless networking (slirp4netns) cannot open /dev/net/tun",
     "make it accessible (chmod 0666 /dev/net/tun, or load the tun module), "
     "or use network: none"),
    (r"setting rlimit|setrlimit",
     "the engine cannot apply a resource limit above its own hard limit",
     "lower the limit in the policy, or raise the engine service's hard limits (ulimit -H)"),
)


class ContainerGoneError(EngineError):
    """The task container is not running (it exited, or was removed behind our back)."""


_GONE = re.compile(r"is not running|container state improper|no such container", re.I)

# Seen on busy hosts: runc loses a race right after another container's removal and the new
# container fails to start, or its init cannot find the command in a rootfs that is fine the
# next time. Starting again is safe: nothing ran yet.
START_ATTEMPTS = 3


def _hint_for(message: str) -> tuple[str, str] | None:
    for pattern, why, hint in _HINTS:
        if re.search(pattern, message, re.IGNORECASE):
            return why, hint
    return None


def _root_oserror(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        for arg in getattr(cur, "args", ()):
            if isinstance(arg, BaseException):
                found = _root_oserror(arg)
                if found is not None:
                    return found
        cur = cur.__cause__ or cur.__context__
    return None


def _socket_error(engine: Engine, endpoint: Endpoint, exc: BaseException
                  ) -> SandboxSetupError | None:
    err = _root_oserror(exc)
    text = str(exc)
    where = f"{endpoint.url} (from {endpoint.source})"
    if isinstance(err, PermissionError) or "Permission denied" in text:
        hint = ("add your user to the `docker` group (then log in again), or use rootless "
                "docker/podman" if engine == "docker" else
                "use your own rootless socket (unset CONTAINER_HOST / sandbox.podmanUrl), "
                "or run as the socket's owner")
        return RuntimeUnavailableError(engine, f"permission denied on the API socket {where}",
                                       hint)
    if isinstance(err, FileNotFoundError | ConnectionRefusedError) or any(
        s in text for s in ("No such file", "Connection refused", "Connection aborted",
                            "Failed to establish")
    ):
        hint = ("start it: `systemctl start docker` (or dockerd), or set DOCKER_HOST"
                if engine == "docker" else
                "start it: `systemctl --user start podman.socket` (rootless) or "
                "`podman system service --time=0 &`, or set CONTAINER_HOST")
        return RuntimeUnavailableError(engine, f"no {engine} service answers at {where}", hint)
    return None


def _engine_message(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    return str(explanation or exc).strip()


@contextlib.contextmanager
def engine_errors(engine: Engine, what: str, endpoint: Endpoint, *,
                  setup: bool = True) -> Iterator[None]:
    """THE boundary: every SDK call goes through here, and only fusion-oci errors come out.

    ``setup``: failures become :class:`SandboxSetupError` subclasses (the failure mode
    applies); otherwise (a running command's exec) :class:`EngineError`.
    """
    import requests

    sdk_errors: tuple[type[BaseException], ...] = (requests.exceptions.RequestException,)
    not_found: tuple[type[BaseException], ...] = ()
    api_errors: tuple[type[BaseException], ...] = ()
    with contextlib.suppress(ImportError):
        import docker.errors

        sdk_errors += (docker.errors.DockerException,)
        not_found += (docker.errors.ImageNotFound,)
        api_errors += (docker.errors.APIError,)
    with contextlib.suppress(ImportError):
        import podman.errors

        sdk_errors += (podman.errors.APIError, podman.errors.PodmanError)
        not_found += (podman.errors.ImageNotFound,)
        api_errors += (podman.errors.APIError,)
    try:
        yield
    except FusionOCIError:
        raise
    except not_found as exc:
        raise ProvisionError(
            f"{what}: the image is missing from {engine}", _engine_message(exc),
            "build it: `fusion-oci images build node` (or set sandbox.image to a local image)",
        ) from exc
    except (*sdk_errors, OSError) as exc:  # type: ignore[misc]  # a built tuple of classes
        # An API error is the engine's answer; only the others can be about the socket.
        api = isinstance(exc, api_errors)
        translated = None if api else _socket_error(engine, endpoint, exc)
        if translated is not None:
            raise translated from exc
        message = _engine_message(exc)
        known = _hint_for(message)
        if known is not None:
            raise RuntimeUnavailableError(engine, f"{known[0]} ({message[-300:]})",
                                          known[1]) from exc
        if _GONE.search(message):
            raise ContainerGoneError(f"{engine}: {what} failed", message[-500:],
                                     "the task container stopped; prepare the task again") from exc
        if setup:
            raise SandboxSetupError(f"{engine}: {what} failed", message[-500:],
                                    f"check the {engine} service at {endpoint.url}") from exc
        raise EngineError(f"{engine}: {what} failed", message[-500:],
                          f"check the {engine} service at {endpoint.url}") from exc


# --------------------------------------------------------------------------- adapters


@dataclass(frozen=True)
class EngineInfo:
    version: str
    rootless: bool
    cgroup_version: str = "v2"
    runtime: str = ""


class _NotStarted(Exception):
    """No endpoint answered and the caller did not allow starting a service."""

    def __init__(self, tried: list[Endpoint]) -> None:
        super().__init__("no endpoint answered")
        self.tried = tried


@dataclass(frozen=True)
class Found:
    """A container or volume that carries our labels."""

    id: str
    name: str
    labels: dict[str, str]
    kind: str
    """``container`` or ``volume``."""


ExecStream = Iterator[tuple[bytes | None, bytes | None]]


class EngineAdapter(Protocol):
    """One SDK client, synchronous. Every method is called inside :func:`engine_errors`."""

    engine: Engine
    endpoint: Endpoint

    def ping(self) -> None: ...

    def info(self) -> EngineInfo: ...

    def image_exists(self, ref: str) -> bool: ...

    def create(self, plan: ContainerPlan) -> str: ...

    def start(self, container_id: str) -> None: ...

    def remove(self, container_id: str) -> None:
        """Force-remove; a container that is already gone is not an error."""
        ...

    def exec_start(self, container_id: str, plan: ExecPlan) -> tuple[str, ExecStream]: ...

    def exec_exit_code(self, exec_id: str) -> int | None: ...

    def close_stream(self, stream: ExecStream) -> None:
        """Close the stream's connection; unblocks a reader blocked on it."""
        ...

    def ensure_volume(self, volume: CacheVolume) -> None: ...

    def remove_volume(self, name: str) -> None: ...

    def list_labelled(self, label: str, value: str | None = None) -> list[Found]: ...

    def sdk_client(self) -> Any: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- owner


# boot_id and process_start live in fusion_oci.scratch (imported above): one owner check for
# containers, volumes and scratch folders alike.


def current_owner() -> Owner:
    pid = os.getpid()
    return Owner(pid=pid, start=process_start(pid) or "0", boot=boot_id(),
                 host=os.uname().nodename)


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


# --------------------------------------------------------------------------- runtime

_ENGINE_INFO: dict[tuple[str, str], EngineInfo] = {}
"""What each engine socket said it is, once per process: podman's /info walks its storage
(0.5-1 s on a busy host) and was most of every prepare; version, rootless and cgroup mode of
the service behind one socket do not change while we run."""



class ContainerRuntime(SpecRuntime):
    """The lifecycle shared by the podman and docker runtimes (see containers.py for the
    layout of a task container and why a timeout kills exactly what the command started)."""

    default_image = DEFAULT_IMAGE

    engine: Engine = "docker"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mode: ContainerMode = self.settings.container_mode
        self._adapter: EngineAdapter | None = None
        self._info: EngineInfo | None = None
        self._probe_error: SandboxSetupError | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = asyncio.Lock()
        self._container: str | None = None
        self._task_volumes: list[str] = []
        self._owner = current_owner()
        self._seccomp: str | None = None
        self._counters: dict[str, dict[str, int]] = {}
        self._agents: dict[str, Agent] = {}
        """The exec agent of each running container (the warm one, or a one-shot's)."""
        self._scratch: Path | None = None
        """The sandbox's 0700 host folder: one subfolder per container for the agent's
        socket until it has connected; removed at dispose."""
        self.image_ref: str | None = None
        self._image_id: str | None = None

    # -- engine-specific hooks ------------------------------------------------------------

    def endpoints(self) -> list[Endpoint]:
        raise NotImplementedError

    def connect(self, endpoint: Endpoint) -> EngineAdapter:
        raise NotImplementedError

    def no_endpoint(self, tried: Sequence[Endpoint]) -> EngineAdapter:
        """Called when no listed socket answers; may start a service (podman) or raise."""
        raise RuntimeUnavailableError(
            self.engine,
            "no engine answers at " + ", ".join(f"{e.url} ({e.source})" for e in tried),
            "start the engine, or point sandbox.dockerUrl / DOCKER_HOST at it",
        )

    def release_endpoint(self) -> None:
        """Undo what :meth:`no_endpoint` started."""

    def offline_info(self) -> EngineInfo | None:
        """What the engine would be when no socket answers but prepare can start one (podman);
        None: no socket means unavailable."""
        return None

    def seccomp_profile(self) -> str | None:
        """A seccomp profile file for the engine, made at prepare; None: the engine's own."""
        return None

    # -- probing --------------------------------------------------------------------------

    def _connect(self, *, start: bool = True) -> EngineAdapter:
        """The first endpoint that answers; when none does, :meth:`no_endpoint` (which may
        start a service) only with ``start``, else RuntimeUnavailableError."""
        if self._adapter is not None:
            return self._adapter
        tried: list[Endpoint] = []
        last: SandboxSetupError | None = None
        for endpoint in self.endpoints():
            tried.append(endpoint)
            try:
                with engine_errors(self.engine, "connect", endpoint):
                    preflight(endpoint)
                    adapter = self.connect(endpoint)
                    adapter.ping()
            except SandboxSetupError as exc:
                last = exc
                if endpoint.explicit:
                    raise
                continue
            self._adapter = adapter
            return adapter
        if last is not None and "permission denied" in last.why:
            raise last
        if not start:
            raise _NotStarted(tried)
        self._adapter = self.no_endpoint(tried)
        return self._adapter

    def _probe(self, *, start: bool = True) -> tuple[EngineAdapter | None, EngineInfo]:
        """Connect and ask the engine what it is. ``start=False`` (availability, enforces,
        doctor, plan) never starts a service: with none answering, :meth:`offline_info`."""
        try:
            adapter = self._connect(start=start)
        except _NotStarted as exc:
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

    def target(self) -> Target:
        info = self._info
        rootless = bool(info and info.rootless)
        return Target(self.engine, rootless, nproc_limit(self.host.rlimits),
                      cgroup_limits=not (rootless and info is not None
                                         and info.cgroup_version == "v1"),
                      seccomp_profile=self._seccomp)

    def capabilities(self) -> SandboxCapabilities:
        return SandboxCapabilities(
            filesystem_isolation="strong", network_policy="coarse",
            resource_limits="advanced", requires_install=True, supports_mac=True,
            supports_linux=True, supports_windows=True,
        )

    def availability(self) -> Availability:
        try:
            adapter, info = self._probe(start=False)
        except SandboxSetupError as exc:
            return Availability(False, exc.why or exc.what, exc.hint)
        details = {
            "socket": adapter.endpoint.url if adapter else "none answers yet",
            "socket source": adapter.endpoint.source if adapter else
            f"`{self.engine} system service` is started for the task at prepare",
            "rootless": "yes" if info.rootless else "no",
            "cgroup": info.cgroup_version,
            "mode": self.mode,
        }
        if info.runtime:
            details["oci runtime"] = info.runtime
        return Availability(True, version=info.version, rootless=info.rootless, details=details)

    def enforces(self) -> frozenset[Requirement]:
        need = {Requirement.FILESYSTEM, Requirement.PROC_PATHS,
                Requirement.ENV, Requirement.NETWORK_NONE,
                Requirement.NETWORK_EGRESS, Requirement.CPU_TIME, Requirement.TMP_SIZE,
                Requirement.FILE_SIZE}
        try:
            _, info = self._probe(start=False)
        except SandboxSetupError:
            return frozenset(need)
        rootless_v1 = info.rootless and info.cgroup_version == "v1"
        if not rootless_v1:
            # Rootless containers on a cgroup v1 host get no cgroup of their own: podman
            # ignores the limits there, so they are not claimed (the policy is refused).
            need |= {Requirement.MEMORY, Requirement.CPU_QUOTA, Requirement.PIDS}
        return frozenset(need)

    def _plan(self, spec: Spec, name: str, agent: AgentMounts | None = None) -> ContainerPlan:
        return plan_container(spec, self.target(), name=name, owner=self._owner,
                              mode=self.mode, isolated_caches=self._isolated(),
                              agent=agent or AgentMounts())

    def _isolated(self) -> bool:
        from fusion_oci.models import CacheMode

        return bool(self.ctx and self.ctx.cache_mode is CacheMode.ISOLATED)

    def plan(self, spec: Spec) -> LaunchPlan:
        plan = self._plan(spec, container_name(str(spec["annotations"].get(
            "io.fusion-oci.task-id", "task")), "<nonce>"))
        command = plan_exec(spec)
        return LaunchPlan(
            backend=self.id,
            sdk_call="containers.create",
            sdk_kwargs=plan.create,
            env=command.env,
            cwd=command.cwd,
            argv=command.argv,
            notes=[*plan.notes, *(f"volume {v.name} -> {v.destination} ({v.scope})"
                                  for v in plan.volumes)],
        )

    # -- async plumbing -------------------------------------------------------------------

    async def _call(self, what: str, fn: Callable[[], T], *, setup: bool = True) -> T:
        adapter = self._adapter
        assert adapter is not None

        def guarded() -> T:
            with engine_errors(self.engine, what, adapter.endpoint, setup=setup):
                return fn()

        return await asyncio.get_running_loop().run_in_executor(self._executor(), guarded)

    def _executor(self) -> ThreadPoolExecutor:
        # Per runtime: a task's blocked exec reader never waits for another task's thread.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix=f"fusion-{self.id}")
        return self._pool

    # -- lifecycle ------------------------------------------------------------------------

    async def prepare(self, ctx: PrepareContext) -> None:
        await self._call_probe()
        await super().prepare(ctx)
        image = ctx.image or self.settings.image or self.default_image or DEFAULT_IMAGE
        self.image_ref = await self._provision(image, ctx)
        self.ctx = ctx.model_copy(update={"image": self.image_ref})
        self._seccomp = self.seccomp_profile()
        await self._collect_own_garbage(ctx.task_id)
        if self.mode == "warm":
            self._container = await self._start_container()

    async def image_digest(self) -> str | None:
        """The id (``sha256:...``) of the image this task's containers run (None before
        prepare): the audit pins it so a replay runs that very image."""
        adapter, ref = self._adapter, self.image_ref
        if adapter is None or ref is None:
            return None
        if self._image_id is None:
            raw = await self._call("image inspect",
                                   lambda: str(adapter.sdk_client().images.get(ref).id))
            self._image_id = raw if raw.startswith("sha256:") else f"sha256:{raw}"
        return self._image_id

    async def _call_probe(self) -> None:
        def probe() -> None:
            self._probe()

        await asyncio.get_running_loop().run_in_executor(self._executor(), probe)

    async def _provision(self, image: str, ctx: PrepareContext) -> str:
        adapter = self._adapter
        assert adapter is not None
        if await self._call("image lookup", lambda: adapter.image_exists(image)):
            return image
        return await provision_image(self, image, ctx)

    async def _collect_own_garbage(self, task_id: str) -> None:
        from fusion_oci.gc import collect

        adapter = self._adapter
        assert adapter is not None
        await self._call("gc", lambda: collect(adapter, task_id=task_id))

    async def _start_container(self) -> str:
        """Create and start a task container whose init is the exec agent, and take the
        agent's one connection (see containers.py for the layout)."""
        adapter = self._adapter
        assert adapter is not None and self.ctx is not None
        binary = str(agent_binary())
        spec = self.compile([AGENT_PATH], RunOptions())
        for attempt in range(1, START_ATTEMPTS + 1):
            nonce = secrets.token_hex(4)
            run_dir, listener = self._agent_listener(spec, nonce)
            plan = self._plan(spec, container_name(self.ctx.task_id, nonce),
                              AgentMounts(binary, str(run_dir)))
            cid: str | None = None
            try:
                for volume in plan.volumes:
                    await self._call("volume create",
                                     functools.partial(adapter.ensure_volume, volume))
                    if volume.scope == "task" and volume.name not in self._task_volumes:
                        self._task_volumes.append(volume.name)
                cid = await self._call("container create", functools.partial(adapter.create,
                                                                             plan))
                try:
                    await self._call("container start", functools.partial(adapter.start, cid))
                except RuntimeUnavailableError:
                    raise
                except SandboxSetupError:
                    if attempt == START_ATTEMPTS:
                        raise
                    await asyncio.shield(self._remove(cid))
                    await asyncio.sleep(0.2 * attempt)  # the race is with a busy host's runc
                    continue
                pid = await self._call("container inspect",
                                       functools.partial(_init_pid, adapter, cid))
                self._agents[cid] = await Agent.accept(listener, expect_pid=pid,
                                                       timeout_s=AGENT_CONNECT_S)
                return cid
            except BaseException:
                if cid is not None:
                    await asyncio.shield(self._remove(cid))
                raise
            finally:
                listener.close()  # accept closed it already; before that, nothing may connect
                shutil.rmtree(run_dir, ignore_errors=True)
        raise AssertionError("unreachable")

    def _agent_listener(self, spec: Spec, nonce: str) -> tuple[Path, socket.socket]:
        """A 0700 folder in the sandbox's scratch with the socket the agent connects to.

        Owned by the sandbox user (so the container's user can reach it: the same uid inside
        with keep-id, rootless, or a non-root caller of a rootful engine); only this one
        container has it mounted, and accept() removes the socket once the agent is in.
        """
        if self._scratch is None:
            assert self.ctx is not None
            self._scratch = make_scratch(self.id, self.ctx.task_id)
        run_dir = self._scratch / f"agent-{nonce}"
        run_dir.mkdir(mode=0o700)
        listener = listen_socket(run_dir / AGENT_SOCKET, mode=0o600)
        uid, gid = sandbox_user(spec)
        if (uid, gid) != (os.geteuid(), os.getegid()) and os.geteuid() == 0:
            for path in (run_dir, run_dir / AGENT_SOCKET):
                os.chown(path, uid, gid)
        return run_dir, listener

    async def _remove(self, cid: str) -> None:
        agent = self._agents.pop(cid, None)
        if agent is not None:
            await agent.close()  # the agent ends what runs and exits
        self._counters.pop(cid, None)
        adapter = self._adapter
        if adapter is None:
            return
        with contextlib.suppress(FusionOCIError):
            await self._call("container remove", lambda: adapter.remove(cid))

    async def execute(self, spec: Spec, opts: RunOptions) -> RunResult:
        async with self._lock:
            if self.mode == "warm":
                if self._container is None:
                    raise SandboxSetupError(f"runtime '{self.id}' was not prepared",
                                            "run() came before prepare()",
                                            "call prepare(ctx) first")
                # An agent that is gone fails this run and every later one (AgentLostError),
                # never silently replaced: what the task's earlier commands left is gone too.
                return await self._exec(self._container, spec, opts)
            cid = await self._start_container()
            try:
                return await self._exec(cid, spec, opts)
            finally:
                await asyncio.shield(self._remove(cid))

    async def _exec(self, cid: str, spec: Spec, opts: RunOptions) -> RunResult:
        """One command through the container's agent: the host's pipes, timeout, maxBuffer,
        stdin and the whole-tree kill are the agent client's (Agent.run)."""
        agent = self._agents[cid]
        command = plan_exec(spec)
        outcome = await agent.run(
            command.argv, env=command.env, cwd=command.cwd, rlimits=command.rlimits,
            stdin=opts.stdin, timeout_s=opts.timeout_ms / 1000, max_buffer=opts.max_buffer,
            on_output=opts.on_output, keep_output=opts.keep_output,
        )
        # The one 128+N rule (as every runtime reads a launcher's status): the shell of
        # `sh -c CMD` reports a CMD the OOM killer took as 137, which is SIGKILL.
        code, sig = status_from_code(outcome.returncode, outcome.signal)
        outcome = dataclasses.replace(outcome, returncode=code, signal=sig)
        counters = LimitCounters()
        if outcome.returncode != 0 and not outcome.truncated:
            counters = await self._limit_counters(cid, spec)
        return self.result(outcome, spec, classify(outcome, spec, counters))

    async def _limit_counters(self, cid: str, spec: Spec) -> LimitCounters:
        """After a failed command: did the container's pids or memory limit hold it?

        The container's own cgroup counters, read through the agent as the sandbox user (one
        more spawn, paid only on failure); those of a new container start at zero.
        """
        probe = plan_limit_probe(spec)
        try:
            outcome = await self._agents[cid].run(probe.argv, env=probe.env, cwd=probe.cwd,
                                                  timeout_s=10.0, max_buffer=65536)
        except FusionOCIError:
            return LimitCounters()  # unknown: no claim either way
        after = parse_limit_counters(outcome.stdout.decode(errors="replace"))
        before = self._counters.get(cid, {})
        self._counters[cid] = after
        return limit_reason(before, after)

    async def dispose(self) -> None:
        adapter = self._adapter
        try:
            if self._container is not None:
                cid, self._container = self._container, None
                await self._remove(cid)
            for cid in list(self._agents):
                await self._remove(cid)
            if adapter is not None:
                for name in self._task_volumes:
                    with contextlib.suppress(FusionOCIError):
                        await self._call("volume remove",
                                         functools.partial(adapter.remove_volume, name))
                self._task_volumes = []
        finally:
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None
            await super().dispose()
            self.close()

    def close(self) -> None:
        """Drop the client and anything the runtime started (a podman service)."""
        if self._adapter is not None:
            with contextlib.suppress(Exception):
                self._adapter.close()
            self._adapter = None
        self._info = None
        self.release_endpoint()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _init_pid(adapter: EngineAdapter, cid: str) -> int | None:
    """The container's init (the agent) as this host sees it: the peer the agent's one
    connection must come from. Both SDKs: ``State.Pid`` of the inspect."""
    pid = adapter.sdk_client().containers.get(cid).attrs.get("State", {}).get("Pid")
    return int(pid) if pid else None


async def provision_image(runtime: ContainerRuntime, image: str, ctx: PrepareContext) -> str:
    """The image is not in the engine: provision it (gates, retries, audit; issue 5)."""
    from fusion_oci.audit import AuditLog
    from fusion_oci.images.provision import ensure_image

    adapter = runtime._adapter
    assert adapter is not None
    provisioned = await ensure_image(runtime.engine, adapter.sdk_client(), image,
                                     runtime.settings, runtime.audit or AuditLog(),
                                     ctx.task_id, ctx.run_id, ask=runtime.ask)
    return provisioned.ref
