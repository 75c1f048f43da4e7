"""One small image API over the podman and docker SDKs, with SDK errors translated here.

Nothing outside this module sees ``podman.errors.*``, ``docker.errors.*`` or ``requests``
exceptions: every SDK call runs inside :func:`_sdk_call`, which turns them into
:class:`EngineOpError` (a :class:`~fusion_oci.errors.ProvisionError` that knows whether the
failure is worth a retry). Calls the high-level SDK methods do not offer (build secrets, a
streamed load, rootfs import on podman) go through the SDK's own low-level HTTP client with the
API's documented parameters, never through the CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fusion_oci.errors import ProvisionError
from fusion_oci.images.retry import classify

EngineKind = Literal["podman", "docker"]
EventSink = Callable[[dict[str, Any]], None]

LONG_TIMEOUT_S = 3600.0
"""Builds, pulls and loads can be silent for minutes (a long RUN step): no short read timeout."""
PING_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class EngineTarget:
    """An engine endpoint: ``name`` is podman, podman-rootless or docker; ``kind`` the SDK."""

    name: str
    kind: EngineKind
    url: str


def engine_targets(env: Mapping[str, str], uid: int | None = None) -> dict[str, EngineTarget]:
    """The engine endpoints this host is set up with (the same env names as the runtimes)."""
    rootless_uid = uid if uid is not None else os.getuid()
    rootful = env.get("FUSION_OCI_PODMAN_URL") or "unix:///run/podman/podman.sock"
    rootless = env.get("FUSION_OCI_ROOTLESS_PODMAN_URL") or (
        f"unix:///run/user/{rootless_uid}/podman/podman.sock")
    docker = env.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    return {
        "podman": EngineTarget("podman", "podman", rootful),
        "podman-rootless": EngineTarget("podman-rootless", "podman", rootless),
        "docker": EngineTarget("docker", "docker", docker),
    }


@dataclass(frozen=True)
class ImageInfo:
    """One image as an engine reports it. ``id`` is the image (config) digest ``sha256:…``."""

    engine: str
    id: str
    tags: list[str] = field(default_factory=list)
    repo_digests: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    size: int = 0
    created: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "id": self.id, "tags": self.tags,
                "repoDigests": self.repo_digests, "labels": self.labels, "size": self.size,
                "created": self.created}


class EngineOpError(ProvisionError):
    """An engine call failed; ``transient`` says whether trying again may help."""

    def __init__(self, what: str, message: str, *, transient: bool,
                 status: int | None = None, hint: str = "") -> None:
        self.engine_message = message
        self.transient = transient
        self.status = status
        super().__init__(what, message, hint)


def set_why(exc: EngineOpError, why: str) -> None:
    """Replace the ``why`` of an error (and the message it renders)."""
    exc.why = why
    exc.args = (exc.render(),)


def _sdk_errors() -> tuple[type[BaseException], ...]:
    import docker.errors
    import podman.errors
    import requests

    return (podman.errors.PodmanError, podman.errors.APIError, docker.errors.DockerException,
            requests.exceptions.RequestException)


@contextlib.contextmanager
def _sdk_call(what: str, engine: str, url: str) -> Iterator[None]:
    """Translate every SDK/HTTP exception into :class:`EngineOpError` (the boundary)."""
    import requests

    try:
        yield
    except EngineOpError:
        raise
    except requests.exceptions.ConnectionError as exc:
        # The engine's own socket: missing or refusing is a setup problem, not a blip.
        text = str(exc)
        reset = "reset" in text.lower() or "aborted" in text.lower()
        raise EngineOpError(
            what, f"cannot talk to {engine} at {url}: {text}", transient=reset,
            hint="" if reset else f"start the {engine} API service (see `fusion-oci doctor`)",
        ) from exc
    except requests.exceptions.Timeout as exc:
        raise EngineOpError(what, f"{engine} did not answer in time: {exc}",
                            transient=True) from exc
    except _sdk_errors() as exc:
        status = getattr(exc, "status_code", None)
        if status is None:
            response = getattr(exc, "response", None)
            status = getattr(response, "status_code", None)
        message = str(getattr(exc, "explanation", None) or exc)
        raise EngineOpError(what, message, transient=classify(message, status),
                            status=status) from exc


def _stream_error(what: str, event: Mapping[str, Any]) -> EngineOpError:
    detail = event.get("errorDetail")
    message = str(event.get("error") or (detail or {}).get("message") or event)
    return EngineOpError(what, message, transient=classify(message, None))


def _ref_parts(ref: str) -> tuple[str, str]:
    """``repo:tag`` → (repo, tag); ``repo@sha256:…`` → (repo@sha256:…, "")."""
    if "@" in ref:
        return ref, ""
    head, _, last = ref.rpartition("/")
    if ":" in last:
        name, _, tag = last.partition(":")
        return (f"{head}/{name}" if head else name), tag
    return ref, "latest"


_SECRET_MOUNT = re.compile(r"--mount=type=secret\S*\s*")


def strip_secret_mounts(containerfile: str) -> str:
    """Drop ``--mount=type=secret,…`` flags: what a build without the secret would see.

    For docker's classic builder (API 1.41 without a BuildKit session), which cannot parse
    ``RUN --mount`` at all. Secret mounts are optional by default in BuildKit and podman, so a
    RUN step written for a missing secret behaves the same. Pure.
    """
    return _SECRET_MOUNT.sub("", containerfile)


class EngineClient:
    """Image operations on one engine. Open with :func:`open_engine`; close when done."""

    kind: EngineKind

    def __init__(self, name: str, url: str, client: Any, *, owned: bool) -> None:
        self.name = name
        self.url = url
        self.client = client
        self._owned = owned

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owned:
            with contextlib.suppress(Exception):
                self.client.close()

    def call(self, what: str) -> contextlib.AbstractContextManager[None]:
        return _sdk_call(what, self.name, self.url)

    # -- provided by the two engines
    def ping(self) -> str:
        """The engine's version; raises :class:`EngineOpError` when it does not answer."""
        raise NotImplementedError

    def image(self, ref: str) -> ImageInfo | None:
        raise NotImplementedError

    def images(self, label: str | None = None) -> list[ImageInfo]:
        raise NotImplementedError

    def build(self, context_tar: Path, *, containerfile: str, tag: str,
              build_args: Mapping[str, str], labels: Mapping[str, str],
              secrets: Mapping[str, str], on_event: EventSink) -> str:
        """Build from an uploaded context tar; ``secrets``: secret id → file name in the tar."""
        raise NotImplementedError

    def pull(self, ref: str, *, tls_verify: bool, on_event: EventSink) -> str:
        raise NotImplementedError

    def save(self, ref: str, dest: Path) -> None:
        raise NotImplementedError

    def load(self, src: Path) -> list[str]:
        raise NotImplementedError

    def import_rootfs(self, src: Path, ref: str, changes: Sequence[str]) -> str:
        raise NotImplementedError

    def tag(self, image: str, ref: str) -> None:
        raise NotImplementedError

    def remove(self, image: str, *, force: bool = False) -> None:
        raise NotImplementedError

    @property
    def supports_build_secrets(self) -> bool:
        return False


def _info(engine: str, data: Mapping[str, Any]) -> ImageInfo:
    labels = data.get("Labels")
    if labels is None:
        labels = (data.get("Config") or {}).get("Labels")
    image_id = str(data.get("Id") or data.get("ID") or "")
    if image_id and not image_id.startswith("sha256:"):
        image_id = f"sha256:{image_id}"
    created: Any = data.get("Created", "")
    if isinstance(created, int | float) or str(created).isdigit():
        from datetime import UTC, datetime

        # docker's list answers epoch seconds, inspect and podman RFC 3339: say it one way
        created = datetime.fromtimestamp(int(created), UTC).isoformat()
    return ImageInfo(
        engine=engine, id=image_id,
        tags=[t for t in (data.get("RepoTags") or []) if t and t != "<none>:<none>"],
        repo_digests=list(data.get("RepoDigests") or []),
        labels=dict(labels or {}), size=int(data.get("Size") or 0),
        created=str(created),
    )


def _json_lines(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    for raw in lines:
        if not raw.strip():
            continue
        try:
            event = json.loads(raw)
        except ValueError:
            yield {"stream": raw.decode("utf-8", errors="replace")}
            continue
        if isinstance(event, dict):
            yield event


class PodmanEngine(EngineClient):
    """podman (rootful or rootless) through the ``podman`` SDK's API client."""

    kind: EngineKind = "podman"

    @property
    def supports_build_secrets(self) -> bool:
        return True

    def ping(self) -> str:
        with self.call(f"ping {self.name}"):
            data = self.client.api.get("/version", timeout=PING_TIMEOUT_S)
            data.raise_for_status()
            return str(data.json().get("Version", "?"))

    def image(self, ref: str) -> ImageInfo | None:
        from urllib.parse import quote

        with self.call(f"inspect image {ref}"):
            response = self.client.api.get(f"/images/{quote(ref, safe='')}/json")
            if response.status_code == 404:
                return None
            response.raise_for_status()
            return _info(self.name, response.json())

    def images(self, label: str | None = None) -> list[ImageInfo]:
        params = {"filters": json.dumps({"label": [label]})} if label else None
        with self.call("list images"):
            response = self.client.api.get("/images/json", params=params)
            response.raise_for_status()
            return [_info(self.name, d) for d in response.json() or []]

    def build(self, context_tar: Path, *, containerfile: str, tag: str,
              build_args: Mapping[str, str], labels: Mapping[str, str],
              secrets: Mapping[str, str], on_event: EventSink) -> str:
        # The SDK's images.build() takes `secrets` but reads the whole stream before it
        # returns; the same documented /build parameters through its API client let us show
        # progress while it runs.
        params: dict[str, Any] = {
            "dockerfile": containerfile, "t": tag, "layers": True, "rm": True,
            "buildargs": json.dumps(dict(build_args)), "labels": json.dumps(dict(labels)),
        }
        if secrets:
            params["secrets"] = json.dumps([f"id={sid},src={name}"
                                            for sid, name in secrets.items()])
        what = f"build {tag} on {self.name}"
        image_id = ""
        with self.call(what), context_tar.open("rb") as body:
            response = self.client.api.post(
                "/build", params=params, data=body, stream=True, timeout=LONG_TIMEOUT_S,
                headers={"Content-Type": "application/x-tar"})
            response.raise_for_status()
            for event in _json_lines(response.iter_lines()):
                if "error" in event or "errorDetail" in event:
                    raise _stream_error(what, event)
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
            response = self.client.api.post(
                "/images/pull", stream=True, timeout=LONG_TIMEOUT_S,
                params={"reference": ref, "tlsVerify": tls_verify, "policy": "always"})
            response.raise_for_status()
            for event in _json_lines(response.iter_lines()):
                if event.get("error"):
                    raise _stream_error(what, event)
                on_event(event)
                if event.get("id"):
                    image_id = str(event["id"])
        if not image_id:
            raise EngineOpError(what, "the pull ended without an image", transient=True)
        return image_id if image_id.startswith("sha256:") else f"sha256:{image_id}"

    def save(self, ref: str, dest: Path) -> None:
        from urllib.parse import quote

        with self.call(f"save {ref} from {self.name}"), dest.open("wb") as out:
            response = self.client.api.get(
                f"/images/{quote(ref, safe='')}/get", params={"format": "docker-archive"},
                stream=True, timeout=LONG_TIMEOUT_S)
            response.raise_for_status()
            for chunk in response.iter_content(chunk_size=1 << 20):
                out.write(chunk)

    def load(self, src: Path) -> list[str]:
        # images.load() reads the whole archive into memory; streaming the file is the same
        # documented endpoint.
        with self.call(f"load into {self.name}"), src.open("rb") as body:
            response = self.client.api.post(
                "/images/load", data=body, timeout=LONG_TIMEOUT_S,
                headers={"Content-Type": "application/x-tar"})
            response.raise_for_status()
            return [str(n) for n in response.json().get("Names") or []]

    def import_rootfs(self, src: Path, ref: str, changes: Sequence[str]) -> str:
        with self.call(f"import {ref} into {self.name}"), src.open("rb") as body:
            response = self.client.api.post(
                "/images/import", data=body, timeout=LONG_TIMEOUT_S,
                params={"reference": ref, "changes": list(changes)},
                headers={"Content-Type": "application/x-tar"})
            response.raise_for_status()
            return str(response.json().get("Id", ""))

    def tag(self, image: str, ref: str) -> None:
        from urllib.parse import quote

        repo, tag = _ref_parts(ref)
        with self.call(f"tag {image} as {ref} on {self.name}"):
            self.client.api.post(f"/images/{quote(image, safe='')}/tag",
                                 params={"repo": repo, "tag": tag}).raise_for_status()

    def remove(self, image: str, *, force: bool = False) -> None:
        from urllib.parse import quote

        with self.call(f"remove {image} from {self.name}"):
            response = self.client.api.delete(f"/images/{quote(image, safe='')}",
                                              params={"force": force})
            if response.status_code != 404:
                response.raise_for_status()


class DockerEngine(EngineClient):
    """Docker Engine through the ``docker`` SDK (API 1.41 on docker 20.10)."""

    kind: EngineKind = "docker"

    def ping(self) -> str:
        with self.call(f"ping {self.name}"):
            return str(self.client.api.version(api_version=False).get("Version", "?"))

    def image(self, ref: str) -> ImageInfo | None:
        import docker.errors

        with self.call(f"inspect image {ref}"):
            try:
                return _info(self.name, self.client.api.inspect_image(ref))
            except docker.errors.NotFound:
                return None

    def images(self, label: str | None = None) -> list[ImageInfo]:
        with self.call("list images"):
            found = self.client.api.images(filters={"label": label} if label else None)
            return [_info(self.name, d) for d in found]

    def build(self, context_tar: Path, *, containerfile: str, tag: str,
              build_args: Mapping[str, str], labels: Mapping[str, str],
              secrets: Mapping[str, str], on_event: EventSink) -> str:
        if secrets:
            # Docker 20.10 takes build secrets only over a BuildKit session (a gRPC stream the
            # docker CLI serves); the SDK has no session, and BuildKit without one answers "no
            # active sessions". Callers build on podman and load the image instead.
            raise EngineOpError(
                f"build {tag} on {self.name}", "the docker SDK cannot pass build secrets",
                transient=False,
                hint="build on podman and load the image (the default when podman is up)")
        what = f"build {tag} on {self.name}"
        image_id = ""
        with self.call(what), context_tar.open("rb") as body:
            stream = self.client.api.build(
                fileobj=body, custom_context=True, dockerfile=containerfile, tag=tag,
                buildargs=dict(build_args), labels=dict(labels), rm=True, decode=True,
                timeout=LONG_TIMEOUT_S)
            for event in stream:
                if "error" in event or "errorDetail" in event:
                    raise _stream_error(what, event)
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
        repo, tag = _ref_parts(ref)
        with self.call(what):
            for event in self.client.api.pull(repo, tag=tag or None, stream=True, decode=True):
                if event.get("error"):
                    raise _stream_error(what, event)
                on_event(event)
        info = self.image(ref)
        if info is None:
            raise EngineOpError(what, "the pull ended without an image", transient=True)
        return info.id

    def save(self, ref: str, dest: Path) -> None:
        with self.call(f"save {ref} from {self.name}"), dest.open("wb") as out:
            for chunk in self.client.api.get_image(ref, chunk_size=1 << 20):
                out.write(chunk)

    def load(self, src: Path) -> list[str]:
        names: list[str] = []
        what = f"load into {self.name}"
        with self.call(what), src.open("rb") as body:
            for event in self.client.api.load_image(body, quiet=True):
                if event.get("error"):
                    raise _stream_error(what, event)
                text = str(event.get("stream", ""))
                for prefix in ("Loaded image: ", "Loaded image ID: "):
                    if text.startswith(prefix):
                        names.append(text[len(prefix):].strip())
        return names

    def import_rootfs(self, src: Path, ref: str, changes: Sequence[str]) -> str:
        repo, tag = _ref_parts(ref)
        with self.call(f"import {ref} into {self.name}"), src.open("rb") as body:
            out = self.client.api.import_image_from_data(body, repository=repo, tag=tag,
                                                         changes=list(changes))
        try:
            return str(json.loads(out).get("status", ""))
        except (ValueError, AttributeError):
            return str(out)

    def tag(self, image: str, ref: str) -> None:
        repo, tag = _ref_parts(ref)
        with self.call(f"tag {image} as {ref} on {self.name}"):
            self.client.api.tag(image, repo, tag or None)

    def remove(self, image: str, *, force: bool = False) -> None:
        import docker.errors

        with self.call(f"remove {image} from {self.name}"):
            try:
                self.client.api.remove_image(image, force=force)
            except docker.errors.NotFound:
                return


def open_engine(kind: EngineKind, client_or_url: Any, *, name: str | None = None
                ) -> EngineClient:
    """Wrap an SDK client, or open one for a ``unix://`` / ``tcp://`` URL (closed on close())."""
    label = name or kind
    if isinstance(client_or_url, EngineClient):
        return client_or_url
    if isinstance(client_or_url, str):
        url = client_or_url
        with _sdk_call(f"connect to {label}", label, url):
            if kind == "podman":
                import podman

                client = podman.PodmanClient(base_url=url, timeout=LONG_TIMEOUT_S)
            else:
                import docker

                client = docker.DockerClient(base_url=url, timeout=int(LONG_TIMEOUT_S))
        return _wrap(kind, label, url, client, owned=True)
    return _wrap(kind, label, _client_url(client_or_url), client_or_url, owned=False)


def _client_url(client: Any) -> str:
    """The socket URL of an SDK client (podman keeps it percent-encoded in a ParseResult)."""
    from urllib.parse import unquote

    base: Any = getattr(getattr(client, "api", None), "base_url", "")
    if hasattr(base, "netloc"):
        if str(base.scheme).endswith("unix"):
            return "unix://" + unquote(base.netloc)
        return str(base.geturl())
    return str(base or "")


def _wrap(kind: EngineKind, name: str, url: str, client: Any, *, owned: bool) -> EngineClient:
    if kind == "podman":
        return PodmanEngine(name, url, client, owned=owned)
    return DockerEngine(name, url, client, owned=owned)


def open_target(target: EngineTarget) -> EngineClient:
    return open_engine(target.kind, target.url, name=target.name)
