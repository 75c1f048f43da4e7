"""The engines layer against the real docker and podman services: the errors each engine really
answers map to the right fusion-oci errors by their status, and the resolver finds the services
the way their own CLIs do."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion_oci.engines import (
    ContainerGoneError,
    EngineAdapter,
    connect,
    docker_endpoints,
    engine_errors,
    engine_targets,
    open_target,
    podman_endpoints,
)
from fusion_oci.errors import ProvisionError
from tests.backends import require

LABEL = "io.fusion-oci.test"


@pytest.fixture(params=["podman", "docker"])
def adapter(request: pytest.FixtureRequest) -> Iterator[EngineAdapter]:
    target = engine_targets(os.environ)[request.param]
    try:
        client = open_target(target)
        client.ping()
    except ProvisionError as exc:
        require(request.param, False, exc.render())
        raise
    with client:
        yield client


def _local_image(adapter: EngineAdapter) -> str:
    tags = [t for info in adapter.images() for t in info.tags]
    base = [t for t in tags if "fusion-oci/base" in t] or [t for t in tags if "fusion-oci" in t]
    assert base, f"no fusion-oci image in {adapter.name}: run `fusion-oci images bootstrap-base`"
    return base[0]


def test_real_engine_errors_map_by_status(adapter: EngineAdapter) -> None:
    image = _local_image(adapter)
    name = f"fusion-oci-engines-{secrets.token_hex(4)}"
    container = adapter.client.containers.create(
        image=image, command=["sleep", "60"], name=name, labels={LABEL: "1"}
    )
    cid = str(container.id)
    try:
        # created, never started: docker says 409 "is not running", podman 409 "container
        # state improper"; both are the same ContainerGoneError.
        with (
            pytest.raises(ContainerGoneError),
            engine_errors(adapter.kind, "exec", adapter.endpoint, setup=False),
        ):
            adapter.client.containers.get(cid).exec_run(["true"])
    finally:
        with engine_errors(adapter.kind, "remove", adapter.endpoint):
            adapter.remove(cid)
    # gone: 404, the same error again
    with (
        pytest.raises(ContainerGoneError),
        engine_errors(adapter.kind, "exec", adapter.endpoint, setup=False),
    ):
        adapter.client.containers.get(cid).exec_run(["true"])
    with engine_errors(adapter.kind, "remove", adapter.endpoint):
        adapter.remove(cid)  # already gone: not an error
        adapter.remove_volume(f"fusion-oci-missing-{secrets.token_hex(4)}")
    missing = f"localhost/fusion-oci/missing:{secrets.token_hex(4)}"
    assert adapter.image(missing) is None
    assert not adapter.image_exists(missing)
    with (
        pytest.raises(ProvisionError, match="image is missing"),
        engine_errors(adapter.kind, "container create", adapter.endpoint),
    ):
        adapter.client.containers.create(image=missing, command=["true"])


def test_connect_finds_the_services_by_their_own_conventions(tmp_path: Path) -> None:
    """DOCKER_HOST and a Docker context; CONTAINER_HOST and a podman system connection:
    each reaches the real service."""
    docker_url = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    podman_url = os.environ.get("FUSION_OCI_PODMAN_URL", "unix:///run/podman/podman.sock")
    home = tmp_path / "home"
    # a Docker context, as `docker context create ci --docker host=...` writes it
    import hashlib

    meta = home / ".docker" / "contexts" / "meta" / hashlib.sha256(b"ci").hexdigest()
    meta.mkdir(parents=True)
    (meta / "meta.json").write_text(
        json.dumps({"Name": "ci", "Metadata": {}, "Endpoints": {"docker": {"Host": docker_url}}})
    )
    (home / ".docker" / "config.json").write_text(json.dumps({"currentContext": "ci"}))
    # a podman connection, as `podman system connection add ci unix://...` (podman 5) writes it
    conf = home / ".config" / "containers"
    conf.mkdir(parents=True)
    (conf / "podman-connections.json").write_text(
        json.dumps({"Connection": {"Default": "ci", "Connections": {"ci": {"URI": podman_url}}}})
    )
    env = {"HOME": str(home)}
    cases = [
        ("docker", docker_endpoints(None, {"DOCKER_HOST": docker_url}, 0, home=home)),
        ("docker", docker_endpoints(None, env, 0, home=home)),
        ("podman", podman_endpoints(None, {"CONTAINER_HOST": podman_url}, 0, home=home)),
        ("podman", podman_endpoints(None, env, 1000, home=home)),
    ]
    for kind, endpoints in cases:
        with connect(kind, endpoints) as found:  # type: ignore[arg-type]
            assert found.endpoint == endpoints[0]
            assert found.info().version


def test_export_rootfs_is_the_engines_own_layout(adapter: EngineAdapter, tmp_path: Path) -> None:
    """The root filesystem as the engine lays it out (for the oci runtime's bundles), through a
    container that is created, exported and removed; nothing is left behind."""
    import tarfile

    image = _local_image(adapter)
    tag = secrets.token_hex(4)
    dest = tmp_path / "rootfs.tar"
    with dest.open("wb") as out:
        image_id = adapter.export_rootfs(image, out, labels={LABEL: tag})
    assert image_id.startswith("sha256:")
    with tarfile.open(dest) as tar:
        names = set(tar.getnames())
    assert {"etc/os-release", "usr/bin/env"} <= {n.lstrip("./") for n in names}
    assert not any(".wh." in n for n in names), "whiteouts are the engine's business"
    with engine_errors(adapter.kind, "list", adapter.endpoint):
        assert adapter.list_labelled(LABEL, tag) == []
    with pytest.raises(ProvisionError, match="not in"), dest.open("wb") as out:
        adapter.export_rootfs(f"localhost/fusion-oci/missing:{tag}", out)
