"""The contract suite's fixtures: ``runtime`` (one case per name in harness.RUNTIMES; a
missing runtime skips, or fails where CI requires it: tests/backends.py), and a worktree where
that runtime's caller can reach it (the rootless runtimes' user included)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion_oci.policy.settings import SandboxSettings
from tests import plugin_runtime
from tests.conftest import git_init
from tests.contract.harness import (
    DOCKERLESS,
    MARKS,
    ROOTLESS,
    RUNTIMES,
    RootlessUser,
    Runtime,
    rootless_user_for,
    runtime_for,
)


@pytest.fixture(scope="session")
def rootless_user() -> RootlessUser:
    return rootless_user_for(ROOTLESS)


@pytest.fixture(scope="session")
def dockerless_user() -> RootlessUser:
    return rootless_user_for(DOCKERLESS)


@pytest.fixture(params=[pytest.param(n, marks=MARKS[n]) for n in RUNTIMES])
def runtime(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Runtime:
    name: str = request.param
    if name == "plugin":
        plugin_runtime.install(monkeypatch)
        return Runtime(
            name, SandboxSettings(backend="custom", custom_runtime=plugin_runtime.NAME), None
        )
    user = {ROOTLESS: "rootless_user", DOCKERLESS: "dockerless_user"}.get(name)
    return runtime_for(name, request.getfixturevalue(user) if user else None)


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
