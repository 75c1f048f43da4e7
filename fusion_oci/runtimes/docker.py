"""The docker runtime: the task container through the ``docker`` Python SDK.

Thin: the translation is :mod:`fusion_oci.runtimes.containers`, the lifecycle
:class:`~fusion_oci.runtimes.engine.ContainerRuntime`; this module is the SDK client.
The daemon is found through ``sandbox.dockerUrl``, ``DOCKER_HOST``, the system socket, then a
rootless dockerd's socket; fusion-oci never starts dockerd itself (it needs root and owns
the host's iptables), it says how to start it instead.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from fusion_oci.runtimes.containers import CacheVolume, ContainerPlan, Engine, ExecPlan
from fusion_oci.runtimes.engine import (
    PING_TIMEOUT_S,
    ContainerRuntime,
    Endpoint,
    EngineAdapter,
    EngineInfo,
    ExecStream,
    Found,
    docker_endpoints,
)

API_TIMEOUT_S = 120


class DockerAdapter:
    engine: Engine = "docker"

    def __init__(self, endpoint: Endpoint) -> None:
        import docker

        self.endpoint = endpoint
        # version pinned: "auto" costs a round trip per client; 1.41 is docker 20.10's API,
        # which every newer daemon still serves.
        self.client: Any = docker.DockerClient(base_url=endpoint.url, version="1.41",
                                               timeout=API_TIMEOUT_S)
        self.api: Any = self.client.api

    def ping(self) -> None:
        import docker

        quick = docker.APIClient(base_url=self.endpoint.url, version="1.41",
                                 timeout=PING_TIMEOUT_S)
        try:
            quick.ping()
        finally:
            quick.close()

    def info(self) -> EngineInfo:
        info = self.api.info()
        security = " ".join(info.get("SecurityOptions") or [])
        return EngineInfo(
            version=str(info.get("ServerVersion", "?")),
            rootless="rootless" in security,
            cgroup_version="v" + str(info.get("CgroupVersion") or "1"),
            runtime=str(info.get("DefaultRuntime", "")),
        )

    def image_exists(self, ref: str) -> bool:
        import docker.errors

        try:
            self.api.inspect_image(ref)
        except docker.errors.ImageNotFound:
            return False
        return True

    def create(self, plan: ContainerPlan) -> str:
        container = self.client.containers.create(**plan.create)
        return str(container.id)

    def start(self, container_id: str) -> None:
        self.api.start(container_id)

    def remove(self, container_id: str) -> None:
        import docker.errors

        try:
            self.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            if "already in progress" not in str(exc):
                raise

    def exec_start(self, container_id: str, plan: ExecPlan) -> tuple[str, ExecStream]:
        created = self.api.exec_create(
            container_id, plan.cmd, stdout=True, stderr=True, stdin=False,
            environment=plan.environment, workdir=plan.workdir, user=plan.user,
        )
        exec_id = str(created["Id"])
        stream = self.api.exec_start(exec_id, stream=True, demux=True)
        return exec_id, stream

    def exec_exit_code(self, exec_id: str) -> int | None:
        # The stream can end a moment before the daemon records the exit.
        deadline = time.monotonic() + 5.0
        while True:
            state = self.api.exec_inspect(exec_id)
            if not state.get("Running") or time.monotonic() > deadline:
                code = state.get("ExitCode")
                return None if code is None else int(code)
            time.sleep(0.01)

    def close_stream(self, stream: ExecStream) -> None:
        # CancellableStream.close() shuts the socket down (unblocking a reader thread); the
        # response's own close then drops the file object that still holds the socket open.
        for close in (getattr(stream, "close", None),
                      getattr(getattr(stream, "_response", None), "close", None)):
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    def ensure_volume(self, volume: CacheVolume) -> None:
        import docker.errors

        try:
            self.api.inspect_volume(volume.name)
            return
        except docker.errors.NotFound:
            pass
        self.api.create_volume(volume.name, driver="local", driver_opts=volume.driver_opts,
                               labels=volume.labels)

    def remove_volume(self, name: str) -> None:
        import docker.errors

        with contextlib.suppress(docker.errors.NotFound):
            self.api.remove_volume(name, force=True)

    def list_labelled(self, label: str, value: str | None = None) -> list[Found]:
        selector = label if value is None else f"{label}={value}"
        found = [
            Found(str(c["Id"]), str((c.get("Names") or ["?"])[0]).lstrip("/"),
                  dict(c.get("Labels") or {}), "container")
            for c in self.api.containers(all=True, filters={"label": selector})
        ]
        volumes = self.api.volumes(filters={"label": selector}).get("Volumes") or []
        found += [Found(str(v["Name"]), str(v["Name"]), dict(v.get("Labels") or {}), "volume")
                  for v in volumes]
        return found

    def sdk_client(self) -> Any:
        return self.client

    def close(self) -> None:
        self.client.close()


class DockerRuntime(ContainerRuntime):
    id = "docker"
    engine = "docker"

    def endpoints(self) -> list[Endpoint]:
        return docker_endpoints(self.settings.docker_url, self.env, self.host.uid)

    def connect(self, endpoint: Endpoint) -> EngineAdapter:
        return DockerAdapter(endpoint)
