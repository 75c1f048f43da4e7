"""The contract suite's fixtures: ``runtime`` (one case per name in harness.RUNTIMES; a
missing runtime skips, or fails where CI requires it: tests/backends.py), and a worktree where
that runtime's caller can reach it (the rootless runtimes' user included)."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion_oci.policy.settings import DockerSettings, GateSettings, SandboxSettings
from tests import plugin_runtime
from tests.backends import backend_settings, require, require_runtime
from tests.conftest import git_init
from tests.contract.harness import (
    DOCKERLESS,
    ENGINES,
    MARKS,
    ROOTLESS,
    ROOTLESS_USER,
    RUNTIMES,
    RootlessUser,
    Runtime,
)


def _rootless_user(backend: str, socket: str) -> RootlessUser:
    """The CI user that drives ``backend``, checked: its engine's ``socket`` (under its
    runtime dir) must be there (a missing setup fails where CI requires it)."""
    from tests.integration.container_cases import rootless_python

    try:
        user = pwd.getpwnam(ROOTLESS_USER)
    except KeyError:
        require(backend, False, f"user {ROOTLESS_USER} does not exist")
        raise
    require(backend, os.getuid() == 0, "the rootless runs switch user with runuser")
    xdg = f"/run/user/{user.pw_uid}"
    require(backend, Path(xdg, socket).exists(),
            f"no {backend} socket in {xdg} (scripts/services.sh start {backend})")
    return RootlessUser(user.pw_name, user.pw_uid, user.pw_gid, user.pw_dir, xdg,
                        rootless_python())


@pytest.fixture(scope="session")
def rootless_user() -> RootlessUser:
    return _rootless_user(ROOTLESS, "podman/podman.sock")


@pytest.fixture(scope="session")
def dockerless_user() -> RootlessUser:
    return _rootless_user(DOCKERLESS, "docker.sock")


@pytest.fixture(params=[pytest.param(n, marks=MARKS[n]) for n in RUNTIMES])
def runtime(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Runtime:
    name: str = request.param
    if name == ROOTLESS:
        from tests.integration.images_fixture import ensure_node_image

        user = request.getfixturevalue("rootless_user")
        ref = ensure_node_image(ROOTLESS).ref
        settings = SandboxSettings(backend="podman", image=ref,
                                   gates=GateSettings(sandbox_provision="allow"))
        return Runtime(name, settings, ref, user)
    if name == DOCKERLESS:
        from tests.integration.images_fixture import ensure_node_image

        user = request.getfixturevalue("dockerless_user")
        ref = ensure_node_image(DOCKERLESS).ref
        settings = SandboxSettings(backend="docker", image=ref,
                                   docker=DockerSettings(url=f"unix://{user.xdg}/docker.sock"),
                                   gates=GateSettings(sandbox_provision="allow"))
        return Runtime(name, settings, ref, user)
    if name in ENGINES:
        from tests.integration.container_cases import image, require_engine

        return Runtime(name, require_engine(name), image(name))
    if name == "plugin":
        plugin_runtime.install(monkeypatch)
        return Runtime(name, SandboxSettings(backend="custom",
                                             custom_runtime=plugin_runtime.NAME), None)
    settings = backend_settings(name)
    require_runtime(name, settings)
    return Runtime(name, settings, None)


@pytest.fixture
def site(runtime: Runtime, tmp_path: Path) -> Iterator[Path]:
    """Where the test's files go: tmp_path, or (rootless) a folder the user can enter
    (pytest's tmp_path sits under root-only directories)."""
    if runtime.user is None:
        yield tmp_path
        return
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-contract-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def worktree(site: Path) -> Path:
    return git_init(site / "wt")
