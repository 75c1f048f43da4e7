"""Docker Engine through the ``docker`` SDK (API 1.41, docker 20.10's, which every newer
daemon still serves): containers, volumes and images."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fusion_oci.engines.base import (
    LONG_TIMEOUT_S,
    PING_TIMEOUT_S,
    CacheVolume,
    ContainerPlan,
    EngineAdapter,
    EngineInfo,
    EventSink,
    Found,
    ImageInfo,
    image_info,
    ref_parts,
    stream_error,
)
from fusion_oci.engines.endpoints import Endpoint, EngineKind
from fusion_oci.engines.errors import EngineOpError

API_VERSION = "1.41"
"""Pinned: "auto" costs a round trip per client."""


def _tls(endpoint: Endpoint) -> Any:
    if endpoint.tls is None:
        return None
    import docker.tls

    cert = (endpoint.tls.cert, endpoint.tls.key) if endpoint.tls.cert and endpoint.tls.key else None
    return docker.tls.TLSConfig(
        client_cert=cert, ca_cert=endpoint.tls.ca, verify=endpoint.tls.verify
    )


class DockerAdapter(EngineAdapter):
    kind: EngineKind = "docker"

    @classmethod
    def open(
        cls, endpoint: Endpoint, *, name: str = "docker", timeout: float = LONG_TIMEOUT_S
    ) -> DockerAdapter:
        import docker

        client = docker.DockerClient(
            base_url=endpoint.url, version=API_VERSION, timeout=int(timeout), tls=_tls(endpoint)
        )
        return cls(name, endpoint.url, client, owned=True, endpoint=endpoint)

    @property
    def api(self) -> Any:
        return self.client.api

    # -- containers and volumes ------------------------------------------------------------

    def probe(self) -> str:
        import docker

        quick = docker.APIClient(
            base_url=self.endpoint.url,
            version=API_VERSION,
            timeout=PING_TIMEOUT_S,
            tls=_tls(self.endpoint),
        )
        try:
            return str(quick.version(api_version=False).get("Version", "?"))
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

    def create(self, plan: ContainerPlan) -> str:
        container = self.client.containers.create(**plan.create)
        return str(container.id)

    def start(self, container_id: str) -> None:
        self.api.start(container_id)

    def remove(self, container_id: str) -> None:
        import docker.errors

        try:
            self.api.remove_container(container_id, force=True)
        except docker.errors.APIError as exc:
            # 404: gone already; 409: "removal already in progress" (another remove won).
            if exc.status_code not in (404, 409):
                raise

    def ensure_volume(self, volume: CacheVolume) -> None:
        import docker.errors

        try:
            self.api.inspect_volume(volume.name)
            return
        except docker.errors.NotFound:
            pass
        self.api.create_volume(
            volume.name, driver="local", driver_opts=volume.driver_opts, labels=volume.labels
        )

    def remove_volume(self, name: str) -> None:
        import docker.errors

        with contextlib.suppress(docker.errors.NotFound):
            self.api.remove_volume(name, force=True)

    def list_labelled(self, label: str, value: str | None = None) -> list[Found]:
        selector = label if value is None else f"{label}={value}"
        found = [
            Found(
                str(c["Id"]),
                str((c.get("Names") or ["?"])[0]).lstrip("/"),
                dict(c.get("Labels") or {}),
                "container",
            )
            for c in self.api.containers(all=True, filters={"label": selector})
        ]
        volumes = self.api.volumes(filters={"label": selector}).get("Volumes") or []
        found += [
            Found(str(v["Name"]), str(v["Name"]), dict(v.get("Labels") or {}), "volume")
            for v in volumes
        ]
        return found

    # -- images ----------------------------------------------------------------------------

    def image(self, ref: str) -> ImageInfo | None:
        import docker.errors

        with self.call(f"inspect image {ref}"):
            try:
                return image_info(self.name, self.api.inspect_image(ref))
            except docker.errors.NotFound:
                return None

    def images(self, label: str | None = None) -> list[ImageInfo]:
        with self.call("list images"):
            found = self.api.images(filters={"label": label} if label else None)
            return [image_info(self.name, d) for d in found]

    def build(
        self,
        context_tar: Path,
        *,
        containerfile: str,
        tag: str,
        build_args: Mapping[str, str],
        labels: Mapping[str, str],
        secrets: Mapping[str, str],
        on_event: EventSink,
    ) -> str:
        if secrets:
            # Docker 20.10 takes build secrets only over a BuildKit session (a gRPC stream the
            # docker CLI serves); the SDK has no session, and BuildKit without one answers "no
            # active sessions". Callers build on podman and load the image instead.
            raise EngineOpError(
                f"build {tag} on {self.name}",
                "the docker SDK cannot pass build secrets",
                transient=False,
                hint="build on podman and load the image (the default when podman is up)",
            )
        what = f"build {tag} on {self.name}"
        image_id = ""
        with self.call(what), context_tar.open("rb") as body:
            stream = self.api.build(
                fileobj=body,
                custom_context=True,
                dockerfile=containerfile,
                tag=tag,
                buildargs=dict(build_args),
                labels=dict(labels),
                rm=True,
                forcerm=True,
                decode=True,
                timeout=LONG_TIMEOUT_S,
            )
            for event in stream:
                if "error" in event or "errorDetail" in event:
                    raise stream_error(what, event)
                on_event(event)
                aux = event.get("aux")
                if isinstance(aux, dict) and aux.get("ID"):
                    image_id = str(aux["ID"])
        if not image_id:
            info = self.image(tag)
            if info is None:
                raise EngineOpError(what, "the build ended without an image", transient=False)
            return info.id
        return image_id

    def pull(self, ref: str, *, tls_verify: bool, on_event: EventSink) -> str:
        # Docker decides TLS per registry from its daemon config (127.0.0.0/8 is insecure by
        # default); there is no per-pull switch.
        del tls_verify
        what = f"pull {ref} on {self.name}"
        repo, tag = ref_parts(ref)
        with self.call(what):
            for event in self.api.pull(repo, tag=tag or None, stream=True, decode=True):
                if event.get("error"):
                    raise stream_error(what, event)
                on_event(event)
        info = self.image(ref)
        if info is None:
            raise EngineOpError(what, "the pull ended without an image", transient=True)
        return info.id

    def save(self, ref: str, dest: Path) -> None:
        with self.call(f"save {ref} from {self.name}"), dest.open("wb") as out:
            for chunk in self.api.get_image(ref, chunk_size=1 << 20):
                out.write(chunk)

    def load(self, src: Path) -> list[str]:
        names: list[str] = []
        what = f"load into {self.name}"
        with self.call(what), src.open("rb") as body:
            for event in self.api.load_image(body, quiet=True):
                if event.get("error"):
                    raise stream_error(what, event)
                text = str(event.get("stream", ""))
                for prefix in ("Loaded image: ", "Loaded image ID: "):
                    if text.startswith(prefix):
                        names.append(text[len(prefix) :].strip())
        return names

    def import_rootfs(self, src: Path, ref: str, changes: Sequence[str]) -> str:
        repo, tag = ref_parts(ref)
        with self.call(f"import {ref} into {self.name}"), src.open("rb") as body:
            out = self.api.import_image_from_data(
                body, repository=repo, tag=tag, changes=list(changes)
            )
        try:
            return str(json.loads(out).get("status", ""))
        except (ValueError, AttributeError):
            return str(out)

    def tag(self, image: str, ref: str) -> None:
        repo, tag = ref_parts(ref)
        with self.call(f"tag {image} as {ref} on {self.name}"):
            self.api.tag(image, repo, tag or None)

    def create_stopped(self, image: str, labels: dict[str, str]) -> str:
        # The command never runs; an image without CMD (a debootstrap import) needs one.
        return str(self.api.create_container(image, command=["true"], labels=labels)["Id"])

    def export_container(self, container_id: str) -> Iterator[bytes]:
        yield from self.api.export(container_id, chunk_size=1 << 20)

    def remove_image(self, image: str, *, force: bool = False) -> None:
        import docker.errors

        with self.call(f"remove {image} from {self.name}"):
            try:
                self.api.remove_image(image, force=force)
            except docker.errors.NotFound:
                return
