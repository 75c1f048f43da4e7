"""What an engine adapter offers: one SDK client, synchronous, for containers and images.

:class:`EngineAdapter` is the one interface the podman and docker runtimes, image
provisioning (:mod:`fusion_oci.images`) and ``gc`` use; ``docker.py`` and ``podman.py`` are its
two implementations, each owning its SDK client. Container and volume calls are made inside
:func:`~fusion_oci.engines.errors.engine_errors` by the caller; image operations translate
their own errors (:meth:`EngineAdapter.call`), since each knows what it is doing.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from fusion_oci.engines.endpoints import Endpoint, EngineKind
from fusion_oci.engines.errors import EngineOpError, classify, image_errors

EventSink = Callable[[dict[str, Any]], None]

PING_TIMEOUT_S = 3.0
API_TIMEOUT_S = 120
"""Container calls: a hung engine surfaces within two minutes."""
LONG_TIMEOUT_S = 3600.0
"""Image calls: builds, pulls and loads can be silent for minutes (a long RUN step)."""


@dataclass(frozen=True)
class EngineInfo:
    version: str
    rootless: bool
    cgroup_version: str = "v2"
    runtime: str = ""


@dataclass(frozen=True)
class Found:
    """A container or volume that carries our labels."""

    id: str
    name: str
    labels: dict[str, str]
    kind: str
    """``container`` or ``volume``."""


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
        return {
            "engine": self.engine,
            "id": self.id,
            "tags": self.tags,
            "repoDigests": self.repo_digests,
            "labels": self.labels,
            "size": self.size,
            "created": self.created,
        }


@dataclass(frozen=True)
class CacheVolume:
    """A named volume that replaces a cache bind mount of the spec.

    It is a local-driver volume bound to the spec's host cache directory (``o=bind``): a
    named, labelled object per project (or per task) that ``volume ls`` and gc see, whose
    files are the caller's on the host like the worktree's, and which the native and
    bubblewrap runtimes share. A plain engine-managed volume would be root-owned and need a
    privileged chown container before a non-root sandbox user could write to it.
    """

    name: str
    destination: str
    device: str
    labels: dict[str, str]
    scope: Literal["project", "task"]

    @property
    def driver_opts(self) -> dict[str, str]:
        return {"type": "none", "o": "bind", "device": self.device}


@dataclass(frozen=True)
class ContainerPlan:
    """A task container as an adapter creates it (:meth:`EngineAdapter.create`); the
    container translation (``runtimes/engine/containers.py``) makes it. Here, with the adapter that
    takes it, so the engines layer needs no runtime for its own argument types."""

    name: str
    image: str
    create: dict[str, Any]
    """Keyword arguments of ``client.containers.create(**create)`` for the target's SDK."""
    volumes: tuple[CacheVolume, ...] = ()
    notes: list[str] = field(default_factory=list)


class EngineAdapter:
    """One engine through its SDK. Open one with :func:`fusion_oci.engines.open_adapter`.

    ``name`` is what users see (podman, podman-rootless, docker), ``kind`` the SDK.
    """

    kind: EngineKind = "docker"

    def __init__(
        self,
        name: str,
        url: str,
        client: Any,
        *,
        owned: bool = True,
        endpoint: Endpoint | None = None,
    ) -> None:
        self.name = name
        self.url = url
        self.client = client
        self._owned = owned
        self.endpoint = endpoint or Endpoint(url, name)

    @property
    def engine(self) -> EngineKind:
        return self.kind

    def __enter__(self) -> EngineAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owned and self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()

    def borrowed(self) -> EngineAdapter:
        """The same adapter for a caller that closes what it is given: its close() is a no-op
        (the owner closes the client)."""
        view = copy.copy(self)
        view._owned = False
        return view

    def call(self, what: str) -> contextlib.AbstractContextManager[None]:
        """The error boundary of one image operation."""
        return image_errors(what, self.name, self.url)

    # -- containers and volumes (the runtimes, gc) -----------------------------------------
    def probe(self) -> str:
        """One quick round trip: the engine's version. SDK errors come out raw (the caller
        is inside :func:`~fusion_oci.engines.errors.engine_errors`)."""
        raise NotImplementedError

    def ping(self) -> str:
        """The engine's version; :class:`EngineOpError` when it does not answer."""
        with self.call(f"ping {self.name}"):
            return self.probe()

    def info(self) -> EngineInfo:
        raise NotImplementedError

    def create(self, plan: ContainerPlan) -> str:
        raise NotImplementedError

    def start(self, container_id: str) -> None:
        raise NotImplementedError

    def remove(self, container_id: str) -> None:
        """Force-remove; a container that is already gone is not an error."""
        raise NotImplementedError

    def ensure_volume(self, volume: CacheVolume) -> None:
        raise NotImplementedError

    # Both SDKs offer the same high-level calls for these (docker-py's API, which podman-py
    # follows): one implementation, for the service containers (fusion_oci.sidecars).
    def container_state(self, container_id: str) -> tuple[bool, int, int | None]:
        """(running, pid of its process on the host (0: none), exit code once exited)."""
        state = self.client.containers.get(container_id).attrs.get("State") or {}
        code = state.get("ExitCode")
        return bool(state.get("Running")), int(state.get("Pid") or 0), code

    def exec_status(self, container_id: str, argv: Sequence[str]) -> tuple[int, bytes]:
        """Run ``argv`` in the running container; its exit code and (merged) output."""
        code, output = self.client.containers.get(container_id).exec_run(list(argv))
        return int(code if code is not None else -1), bytes(output or b"")

    def logs_tail(self, container_id: str, lines: int = 20) -> str:
        """The last ``lines`` of the container's output."""
        raw = self.client.containers.get(container_id).logs(tail=lines)
        if not isinstance(raw, bytes | bytearray):
            raw = b"".join(raw)
        return bytes(raw).decode("utf-8", errors="replace")

    def remove_volume(self, name: str) -> None:
        raise NotImplementedError

    def list_labelled(self, label: str, value: str | None = None) -> list[Found]:
        raise NotImplementedError

    # -- images (provisioning, `fusion-oci images`) ----------------------------------------
    def image_exists(self, ref: str) -> bool:
        return self.image(ref) is not None

    def image(self, ref: str) -> ImageInfo | None:
        raise NotImplementedError

    def images(self, label: str | None = None) -> list[ImageInfo]:
        raise NotImplementedError

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

    def export_rootfs(
        self, ref: str, out: IO[bytes], *, labels: Mapping[str, str] | None = None
    ) -> str:
        """Write the image's root filesystem to ``out`` as a tar, laid out by the engine itself
        (layers applied, whiteouts resolved): the export of a container created from it and
        never started, removed afterwards. ``labels`` go on that container (owner labels,
        so ``gc`` finds it after a crash). Returns the image id (``sha256:…``)."""
        what = f"export the root filesystem of {ref} from {self.name}"
        info = self.image(ref)
        if info is None:
            raise EngineOpError(
                what,
                f"image '{ref}' is not in {self.name}",
                transient=False,
                hint="provision it first (`fusion-oci images build`, a build "
                "or a load on this engine)",
            )
        with self.call(what):
            container = self.create_stopped(info.id, dict(labels or {}))
            try:
                for chunk in self.export_container(container):
                    out.write(chunk)
            finally:
                self.remove(container)
        return info.id

    def create_stopped(self, image: str, labels: dict[str, str]) -> str:
        """A container of ``image`` that is never started (for its filesystem)."""
        raise NotImplementedError

    def export_container(self, container_id: str) -> Iterator[bytes]:
        raise NotImplementedError

    def remove_image(self, image: str, *, force: bool = False) -> None:
        raise NotImplementedError

    @property
    def supports_build_secrets(self) -> bool:
        return False


# --------------------------------------------------------------------------- shared parsing


def image_info(engine: str, data: Mapping[str, Any]) -> ImageInfo:
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
        engine=engine,
        id=image_id,
        tags=[t for t in (data.get("RepoTags") or []) if t and t != "<none>:<none>"],
        repo_digests=list(data.get("RepoDigests") or []),
        labels=dict(labels or {}),
        size=int(data.get("Size") or 0),
        created=str(created),
    )


def json_lines(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
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


def stream_error(what: str, event: Mapping[str, Any]) -> EngineOpError:
    detail = event.get("errorDetail")
    message = str(event.get("error") or (detail or {}).get("message") or event)
    return EngineOpError(what, message, transient=classify(message, None))


def ref_parts(ref: str) -> tuple[str, str]:
    """``repo:tag`` → (repo, tag); ``repo@sha256:…`` → (repo@sha256:…, "")."""
    if "@" in ref:
        return ref, ""
    head, _, last = ref.rpartition("/")
    if ":" in last:
        name, _, tag = last.partition(":")
        return (f"{head}/{name}" if head else name), tag
    return ref, "latest"
