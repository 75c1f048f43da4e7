"""podman (rootful or rootless) through the ``podman`` SDK: containers, volumes and images.

Calls the high-level SDK methods do not offer (build secrets, a streamed load, rootfs import,
an exec whose stream can be closed from another thread) go through the SDK's own low-level
HTTP client with the API's documented parameters, never through the CLI.
"""

from __future__ import annotations

import contextlib
import json
import re
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
    json_lines,
    ref_parts,
    stream_error,
)
from fusion_oci.engines.endpoints import Endpoint, EngineKind
from fusion_oci.engines.errors import EngineOpError


class PodmanAdapter(EngineAdapter):
    kind: EngineKind = "podman"

    @classmethod
    def open(
        cls, endpoint: Endpoint, *, name: str = "podman", timeout: float = LONG_TIMEOUT_S
    ) -> PodmanAdapter:
        import podman

        kwargs: dict[str, Any] = {"identity": endpoint.identity} if endpoint.identity else {}
        client = podman.PodmanClient(base_url=endpoint.url, timeout=timeout, **kwargs)
        return cls(name, endpoint.url, client, owned=True, endpoint=endpoint)

    @property
    def api(self) -> Any:
        return self.client.api

    # -- containers and volumes ------------------------------------------------------------

    def probe(self) -> str:
        # /_ping answers in a few ms and names the version in a header; /version gathers
        # host information first (0.5 s on a busy host), which was most of every prepare.
        data = self.api.get("/_ping", timeout=PING_TIMEOUT_S)
        data.raise_for_status()
        return str(data.headers.get("Libpod-API-Version", "?"))

    def info(self) -> EngineInfo:
        info = self.client.info()
        host = info.get("host", {})
        return EngineInfo(
            version=str(info.get("version", {}).get("Version", "?")),
            rootless=bool(host.get("security", {}).get("rootless")),
            cgroup_version=str(host.get("cgroupVersion", "v2")),
            runtime=str(host.get("ociRuntime", {}).get("name", "")),
        )

    def create(self, plan: ContainerPlan) -> str:
        container = self.client.containers.create(**plan.create)
        return str(container.id)

    def start(self, container_id: str) -> None:
        self.api.post(f"/containers/{container_id}/start").raise_for_status()

    def remove(self, container_id: str) -> None:
        response = self.api.delete(
            f"/containers/{container_id}", params={"force": True, "v": False}
        )
        if response.status_code != 404:
            response.raise_for_status()

    def ensure_volume(self, volume: CacheVolume) -> None:
        import podman.errors

        if self.client.volumes.exists(volume.name):
            return
        try:
            self.client.volumes.create(
                volume.name, driver="local", driver_opts=volume.driver_opts, labels=volume.labels
            )
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
        found = [
            Found(str(c.id), str(c.name), dict(c.labels or {}), "container")
            for c in self.client.containers.list(all=True, filters={"label": selector})
        ]
        found += [
            Found(str(v.name), str(v.name), dict(v.attrs.get("Labels") or {}), "volume")
            for v in self.client.volumes.list(filters={"label": selector})
        ]
        return found

    # -- images ----------------------------------------------------------------------------

    @property
    def supports_build_secrets(self) -> bool:
        return True

    def image(self, ref: str) -> ImageInfo | None:
        from urllib.parse import quote

        with self.call(f"inspect image {ref}"):
            response = self.api.get(f"/images/{quote(ref, safe='')}/json")
            if response.status_code == 404:
                return None
            response.raise_for_status()
            return image_info(self.name, response.json())

    def images(self, label: str | None = None) -> list[ImageInfo]:
        params = {"filters": json.dumps({"label": [label]})} if label else None
        with self.call("list images"):
            response = self.api.get("/images/json", params=params)
            response.raise_for_status()
            return [image_info(self.name, d) for d in response.json() or []]

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
        # The SDK's images.build() takes `secrets` but reads the whole stream before it
        # returns; the same documented /build parameters through its API client let us show
        # progress while it runs.
        params: dict[str, Any] = {
            # forcerm: the build's containers go even when a step fails (rm alone keeps a
            # failed one, its rootfs mounted on the host, one per failed build).
            "dockerfile": containerfile,
            "t": tag,
            "layers": True,
            "rm": True,
            "forcerm": True,
            "buildargs": json.dumps(dict(build_args)),
            "labels": json.dumps(dict(labels)),
        }
        if secrets:
            params["secrets"] = json.dumps(
                [f"id={sid},src={name}" for sid, name in secrets.items()]
            )
        what = f"build {tag} on {self.name}"
        image_id = ""
        with self.call(what), context_tar.open("rb") as body:
            response = self.api.post(
                "/build",
                params=params,
                data=body,
                stream=True,
                timeout=LONG_TIMEOUT_S,
                headers={"Content-Type": "application/x-tar"},
            )
            response.raise_for_status()
            for event in json_lines(response.iter_lines()):
                if "error" in event or "errorDetail" in event:
                    raise stream_error(what, event)
                on_event(event)
                line = str(event.get("stream", "")).strip()
                if re.fullmatch(r"[0-9a-f]{64}", line):
                    image_id = line
        if not image_id:
            info = self.image(tag)
            if info is None:
                raise EngineOpError(what, "the build ended without an image", transient=False)
            return info.id
        return f"sha256:{image_id}"

    def pull(self, ref: str, *, tls_verify: bool, on_event: EventSink) -> str:
        what = f"pull {ref} on {self.name}"
        image_id = ""
        with self.call(what):
            response = self.api.post(
                "/images/pull",
                stream=True,
                timeout=LONG_TIMEOUT_S,
                params={"reference": ref, "tlsVerify": tls_verify, "policy": "always"},
            )
            response.raise_for_status()
            for event in json_lines(response.iter_lines()):
                if event.get("error"):
                    raise stream_error(what, event)
                on_event(event)
                if event.get("id"):
                    image_id = str(event["id"])
        if not image_id:
            raise EngineOpError(what, "the pull ended without an image", transient=True)
        return image_id if image_id.startswith("sha256:") else f"sha256:{image_id}"

    def save(self, ref: str, dest: Path) -> None:
        from urllib.parse import quote

        with self.call(f"save {ref} from {self.name}"), dest.open("wb") as out:
            response = self.api.get(
                f"/images/{quote(ref, safe='')}/get",
                params={"format": "docker-archive"},
                stream=True,
                timeout=LONG_TIMEOUT_S,
            )
            response.raise_for_status()
            for chunk in response.iter_content(chunk_size=1 << 20):
                out.write(chunk)

    def load(self, src: Path) -> list[str]:
        # images.load() reads the whole archive into memory; streaming the file is the same
        # documented endpoint.
        with self.call(f"load into {self.name}"), src.open("rb") as body:
            response = self.api.post(
                "/images/load",
                data=body,
                timeout=LONG_TIMEOUT_S,
                headers={"Content-Type": "application/x-tar"},
            )
            response.raise_for_status()
            return [str(n) for n in response.json().get("Names") or []]

    def import_rootfs(self, src: Path, ref: str, changes: Sequence[str]) -> str:
        with self.call(f"import {ref} into {self.name}"), src.open("rb") as body:
            response = self.api.post(
                "/images/import",
                data=body,
                timeout=LONG_TIMEOUT_S,
                params={"reference": ref, "changes": list(changes)},
                headers={"Content-Type": "application/x-tar"},
            )
            response.raise_for_status()
            return str(response.json().get("Id", ""))

    def tag(self, image: str, ref: str) -> None:
        from urllib.parse import quote

        repo, tag = ref_parts(ref)
        with self.call(f"tag {image} as {ref} on {self.name}"):
            self.api.post(
                f"/images/{quote(image, safe='')}/tag", params={"repo": repo, "tag": tag}
            ).raise_for_status()

    def create_stopped(self, image: str, labels: dict[str, str]) -> str:
        # The command never runs; an image without CMD (a debootstrap import) needs one.
        return str(self.client.containers.create(image=image, command=["true"], labels=labels).id)

    def export_container(self, container_id: str) -> Iterator[bytes]:
        response = self.api.get(
            f"/containers/{container_id}/export", stream=True, timeout=LONG_TIMEOUT_S
        )
        response.raise_for_status()
        yield from response.iter_content(chunk_size=1 << 20)

    def remove_image(self, image: str, *, force: bool = False) -> None:
        from urllib.parse import quote

        with self.call(f"remove {image} from {self.name}"):
            response = self.api.delete(f"/images/{quote(image, safe='')}", params={"force": force})
            if response.status_code != 404:
                response.raise_for_status()
