"""The node task image in any engine, for every container test (import or list as a plugin).

    from tests.integration.images_fixture import node_image  # noqa: F401  (fixture)

    def test_something(node_image):
        image = node_image("podman")        # or "podman-rootless", "docker", "docker-rootless"
        ... image.ref, image.digest ...

The image is the one a project that declares nothing gets (the current Node.js LTS and pnpm from
the npm registry, see fusion_oci/images/recipe.py). From nothing (CI) it costs about 2½ minutes
once per machine: ``bootstrap-base`` on rootful podman (~40 s), the node build there (~51 s,
the tarballs fetched and verified on the host in under a second when cached), then
``save → load`` into docker (~18 s), rootless podman (~21 s) and rootless docker (~20-45 s),
which beats building in each (rootless vfs build: ~104 s). ``docker-rootless`` is the CI user's
rootless dockerd (``FUSION_OCI_ROOTLESS_DOCKER_URL``, from ``scripts/services.sh env``): its own
image store,
provisioned through the same ``ensure_image`` on its socket. When the
image is present the cost is one image inspect. A missing engine fails in CI and skips locally
(tests/backends.require). The offline base is used on purpose: it needs no registry, and it
makes the tag the same on every machine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import os
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from fusion_oci.audit import AuditLog
from fusion_oci.engines import Endpoint, EngineAdapter, EngineTarget, engine_targets, open_target
from fusion_oci.errors import ProvisionError
from fusion_oci.images.bootstrap import bootstrap_base
from fusion_oci.images.gates import AuditContext
from fusion_oci.images.progress import PlainReporter
from fusion_oci.images.provision import (
    ProvisionedImage,
    ProvisionOptions,
    candidate_specs,
    default_registry,
    ensure_image,
    toolchain_for,
    transfer_image,
)
from fusion_oci.images.spec import BASE_REF
from fusion_oci.policy.settings import GateSettings, SandboxSettings
from tests.backends import require

T = TypeVar("T")
ENGINES = ("podman", "podman-rootless", "docker", "docker-rootless")
LOCK_PATH = Path("/tmp/fusion-oci-test-node-image.lock")
_cache: dict[str, ProvisionedImage] = {}
_guard = threading.Lock()


def _settings() -> SandboxSettings:
    return SandboxSettings(gates=GateSettings(sandbox_provision="allow", network_api="allow"))


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    """Test processes running side by side build once, not once each."""
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _run_sync(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """asyncio.run, also from inside a running loop (an async test calling node_image)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def target_of(name: str) -> EngineTarget:
    """The image target of a test engine: the product's (engine_targets), or for
    ``docker-rootless`` the CI user's rootless dockerd, which fusion-oci reaches as any docker
    (a socket; its name only labels audit events)."""
    if name != "docker-rootless":
        return engine_targets(os.environ)[name]
    url = os.environ.get("FUSION_OCI_ROOTLESS_DOCKER_URL")
    source = "FUSION_OCI_ROOTLESS_DOCKER_URL"
    if not url:
        import pwd

        user = os.environ.get("FUSION_OCI_ROOTLESS_USER", "fusionci")
        try:
            url = f"unix:///run/user/{pwd.getpwnam(user).pw_uid}/docker.sock"
        except KeyError:
            url = "unix:///nonexistent/docker.sock"
        source = f"{user}'s rootless dockerd socket"
    return EngineTarget(name, "docker", url, Endpoint(url, source, True))


def _reachable(name: str) -> tuple[EngineAdapter | None, str]:
    target = target_of(name)
    try:
        client = open_target(target)
        client.ping()
    except ProvisionError as exc:
        return None, f"{target.url}: {exc.why or exc}"
    return client, ""


def ensure_node_image(engine: str) -> ProvisionedImage:
    """The node image (built on the offline base) present in ``engine``; cached per process."""
    assert engine in ENGINES, engine
    with _guard:
        if engine in _cache:
            return _cache[engine]
        client, why = _reachable(engine)
        require(engine, client is not None, why)
        assert client is not None
        with client:
            # The default recipe (no project files): the current LTS and pnpm. Its releases
            # come from the registry's metadata, cached on disk, so a present image still
            # costs one inspect and no request.
            toolchain = toolchain_for("node", ProvisionOptions(), default_registry(os.environ))
            spec = candidate_specs("node", None, BASE_REF, toolchain)[0]
            info = client.image(spec.ref)
            if info is not None:
                _cache[engine] = ProvisionedImage(spec.ref, info.id, "present")
                return _cache[engine]
        with _machine_lock():
            _cache[engine] = _run_sync(lambda: provision(engine, "node"))
        return _cache[engine]


async def provision(engine: str, name: str) -> ProvisionedImage:
    """``images/NAME`` built on the offline base into ``engine`` (the node image, or a service
    image: tests/integration/service_images.py)."""
    audit = AuditLog()
    reporter = PlainReporter(sys.stderr)
    # The base goes where the build happens: rootful podman when it answers (it builds for
    # docker and rootless podman too), else the engine itself.
    builder, _ = _reachable("podman")
    if builder is None:
        builder, _ = _reachable(engine)
    assert builder is not None
    with builder:
        ctx = AuditContext(audit, "tests", f"{name}-image", "images")
        await bootstrap_base([builder], ctx=ctx, reporter=reporter)
    target = target_of(engine)
    return await ensure_image(
        target.kind,
        target.url,
        name,
        _settings(),
        audit,
        "tests",
        f"{name}-image",
        options=ProvisionOptions(
            engine_name=engine, base=BASE_REF, env=dict(os.environ), reporter=reporter
        ),
    )


@pytest.fixture(scope="session")
def node_image() -> Callable[[str], ProvisionedImage]:
    """``node_image(engine)`` → the node image in that engine (built or loaded once)."""
    return ensure_node_image


def ensure_base(engine: str) -> str:
    """The offline base present in ``engine`` (debootstrapped once per machine, on rootful
    podman when it answers, and copied from there: ~5 s instead of another ~35 s); its id."""
    client, why = _reachable(engine)
    require(engine, client is not None, why)
    assert client is not None
    with client:
        info = client.image(BASE_REF)
        if info is not None:
            return info.id
        source, _ = _reachable("podman") if engine != "podman" else (None, "")
        with _machine_lock():
            if source is not None:
                with source:
                    if source.image(BASE_REF) is None:
                        _run_sync(
                            lambda: bootstrap_base(
                                [source], ctx=_ctx(), reporter=PlainReporter(sys.stderr)
                            )
                        )
                    return transfer_image(source, client, BASE_REF, ctx=_ctx())
            result = _run_sync(
                lambda: bootstrap_base([client], ctx=_ctx(), reporter=PlainReporter(sys.stderr))
            )
        return result.ids[engine]


def _ctx() -> AuditContext:
    return AuditContext(AuditLog(), "tests", "base", "images")
