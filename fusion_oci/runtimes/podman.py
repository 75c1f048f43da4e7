"""The podman runtime: the task container through the ``podman`` Python SDK.

Rootful or rootless, whichever socket answers: ``sandbox.podmanUrl``, ``CONTAINER_HOST``, then
podman's own default for this user (``/run/podman/podman.sock`` for root,
``$XDG_RUNTIME_DIR/podman/podman.sock`` otherwise). Rootless containers use ``keep-id``
user-namespace semantics, so the caller's uid is the same number inside and the worktree's
files stay the caller's.

When no socket answers and podman is installed, the runtime starts ``podman system service``
itself at prepare (never to answer ``availability()``: probing starts nothing), on a private
socket in an owner-stamped scratch folder, under :mod:`fusion_oci.watchdog`: the service ends
and its folder goes when the runtime closes it or when the owning process dies, ``kill -9``
included (podman is daemonless: this is what `podman` itself does per command, kept alive for
the task). A user who runs the socket unit (``systemctl --user enable --now podman.socket``)
never gets one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fusion_oci.errors import RuntimeUnavailableError
from fusion_oci.runtimes.containers import (
    CacheVolume,
    ContainerPlan,
    Engine,
    ExecPlan,
)
from fusion_oci.runtimes.engine import (
    PING_TIMEOUT_S,
    ContainerRuntime,
    Endpoint,
    EngineAdapter,
    EngineInfo,
    ExecStream,
    Found,
    engine_errors,
    podman_endpoints,
    preflight,
)
from fusion_oci.scratch import make_scratch, process_start

API_TIMEOUT_S = 120
WATCHDOG = Path(__file__).resolve().parent.parent / "watchdog.py"
SERVICE_START_S = 20.0


class _FrameStream:
    """Demuxed frames of an exec's attach stream; :meth:`close` unblocks a blocked reader."""

    def __init__(self, response: Any) -> None:
        from podman.api import stream_frames

        self.response = response
        self._frames: Any = stream_frames(response, demux=True)

    def __iter__(self) -> _FrameStream:
        return self

    def __next__(self) -> tuple[bytes | None, bytes | None]:
        out, err = next(self._frames)
        return out, err

    def close(self) -> None:
        with contextlib.suppress(Exception):
            raw = self.response.raw
            sock = raw._fp.fp.raw._sock
            sock.shutdown(2)
        with contextlib.suppress(Exception):
            self.response.close()


class PodmanAdapter:
    engine: Engine = "podman"

    def __init__(self, endpoint: Endpoint) -> None:
        import podman

        self.endpoint = endpoint
        self.client: Any = podman.PodmanClient(base_url=endpoint.url, timeout=API_TIMEOUT_S)
        self.api: Any = self.client.api

    def ping(self) -> None:
        import podman

        with podman.PodmanClient(base_url=self.endpoint.url, timeout=PING_TIMEOUT_S) as quick:
            quick.ping()

    def info(self) -> EngineInfo:
        info = self.client.info()
        host = info.get("host", {})
        return EngineInfo(
            version=str(info.get("version", {}).get("Version", "?")),
            rootless=bool(host.get("security", {}).get("rootless")),
            cgroup_version=str(host.get("cgroupVersion", "v2")),
            runtime=str(host.get("ociRuntime", {}).get("name", "")),
        )

    def image_exists(self, ref: str) -> bool:
        return bool(self.client.images.exists(ref))

    def create(self, plan: ContainerPlan) -> str:
        container = self.client.containers.create(**plan.create)
        return str(container.id)

    def start(self, container_id: str) -> None:
        self.api.post(f"/containers/{container_id}/start").raise_for_status()

    def remove(self, container_id: str) -> None:
        response = self.api.delete(f"/containers/{container_id}",
                                   params={"force": True, "v": False})
        if response.status_code != 404:
            response.raise_for_status()

    def exec_start(self, container_id: str, plan: ExecPlan) -> tuple[str, ExecStream]:
        body = {
            "AttachStdout": True, "AttachStderr": True, "AttachStdin": False, "Tty": False,
            "Cmd": plan.cmd, "Env": [f"{k}={v}" for k, v in plan.environment.items()],
            "WorkingDir": plan.workdir, "User": plan.user,
        }
        response = self.api.post(f"/containers/{container_id}/exec", data=json.dumps(body))
        response.raise_for_status()
        exec_id = str(response.json()["Id"])
        started = self.api.post(f"/exec/{exec_id}/start",
                                data=json.dumps({"Detach": False, "Tty": False}), stream=True)
        started.raise_for_status()
        return exec_id, _FrameStream(started)

    def exec_exit_code(self, exec_id: str) -> int | None:
        deadline = time.monotonic() + 5.0
        while True:
            response = self.api.get(f"/exec/{exec_id}/json")
            response.raise_for_status()
            state = response.json()
            if not state.get("Running") or time.monotonic() > deadline:
                code = state.get("ExitCode")
                return None if code is None else int(code)
            time.sleep(0.01)

    def close_stream(self, stream: ExecStream) -> None:
        if isinstance(stream, _FrameStream):
            stream.close()

    def ensure_volume(self, volume: CacheVolume) -> None:
        import podman.errors

        if self.client.volumes.exists(volume.name):
            return
        try:
            self.client.volumes.create(volume.name, driver="local",
                                       driver_opts=volume.driver_opts, labels=volume.labels)
        except podman.errors.APIError:
            # Another task of the same project created it a moment ago.
            if not self.client.volumes.exists(volume.name):
                raise

    def remove_volume(self, name: str) -> None:
        import podman.errors

        with contextlib.suppress(podman.errors.NotFound):
            self.client.volumes.remove(name, force=True)

    def list_labelled(self, label: str, value: str | None = None) -> list[Found]:
        selector = label if value is None else f"{label}={value}"
        found = [Found(str(c.id), str(c.name), dict(c.labels or {}), "container")
                 for c in self.client.containers.list(all=True, filters={"label": selector})]
        found += [Found(str(v.name), str(v.name), dict(v.attrs.get("Labels") or {}), "volume")
                  for v in self.client.volumes.list(filters={"label": selector})]
        return found

    def sdk_client(self) -> Any:
        return self.client

    def close(self) -> None:
        self.client.close()


class PodmanRuntime(ContainerRuntime):
    id = "podman"
    engine = "podman"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._service: subprocess.Popen[bytes] | None = None
        self._service_dir: str | None = None

    def endpoints(self) -> list[Endpoint]:
        return podman_endpoints(self.settings.podman_url, self.env, self.host.uid)

    def connect(self, endpoint: Endpoint) -> EngineAdapter:
        return PodmanAdapter(endpoint)

    def no_endpoint(self, tried: Sequence[Endpoint]) -> EngineAdapter:
        where = ", ".join(f"{e.url} ({e.source})" for e in tried)
        podman_bin = shutil.which("podman", path=self.env.get("PATH"))
        if podman_bin is None:
            raise RuntimeUnavailableError(
                "podman", f"podman is not installed and no API socket answers at {where}",
                "install podman (apt-get install podman), or set sandbox.podmanUrl")
        folder = make_scratch("podman", "service")
        self._service_dir = str(folder)
        url = f"unix://{folder}/podman.sock"
        log = folder / "service.log"
        pid = os.getpid()
        with log.open("wb") as out:
            # Under the watchdog, in its own session: a Ctrl-C of the caller's group does not
            # hit it (dispose still needs it), close() or the owner's death ends its group.
            self._service = subprocess.Popen(
                [sys.executable, "-S", "-E", str(WATCHDOG), str(pid),
                 process_start(pid) or "0", str(folder), "--",
                 podman_bin, "system", "service", "--time=0", url],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True,
            )
        endpoint = Endpoint(url, f"`podman system service` started by fusion-oci "
                                 f"(pid {self._service.pid}; no socket answered at {where})")
        deadline = time.monotonic() + SERVICE_START_S
        adapter = PodmanAdapter(endpoint)
        while True:
            try:
                with engine_errors("podman", "ping", endpoint):
                    preflight(endpoint)  # no HTTP (and no half-open socket) before it exists
                    adapter.ping()
                return adapter
            except RuntimeUnavailableError:
                if self._service.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace")[-400:]
                    self.release_endpoint()
                    raise RuntimeUnavailableError(
                        "podman", f"`podman system service` did not come up: {tail}",
                        "run `podman info` to see what is wrong with podman here") from None
                time.sleep(0.1)

    def offline_info(self) -> EngineInfo | None:
        """No socket answers yet, but podman is installed: prepare starts a service, so the
        runtime is available; what it enforces follows from this host (rootless on cgroup v1
        cannot hold limits)."""
        if shutil.which("podman", path=self.env.get("PATH")) is None:
            return None
        cgroup = "v2" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else "v1"
        return EngineInfo(version="not running", rootless=self.host.uid != 0,
                          cgroup_version=cgroup)

    def release_endpoint(self) -> None:
        service, self._service = self._service, None
        if service is not None and service.poll() is None:
            # The watchdog ends the service's group and removes the folder, then exits.
            with contextlib.suppress(ProcessLookupError):
                service.send_signal(signal.SIGTERM)
            try:
                service.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(service.pid, signal.SIGKILL)
                service.wait()
        if self._service_dir is not None:
            shutil.rmtree(self._service_dir, ignore_errors=True)
            self._service_dir = None
