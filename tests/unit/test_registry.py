"""The runtime registry: every brief id is known, and plugins come in through entry points."""

from __future__ import annotations

import os
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.models import BACKEND_IDS, PrepareContext
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes import registry
from fusion_oci.runtimes.base import Requirement, Runtime
from fusion_oci.runtimes.native import NativeRuntime
from fusion_oci.sandbox import SyncSandbox


class PluginRuntime(NativeRuntime):
    """A third party's runtime (native underneath; it claims everything, for the registry test:
    the lifecycle's refusal of unenforced policy is tested elsewhere)."""

    id = "custom"

    def enforces(self) -> frozenset[Requirement]:
        return frozenset(Requirement)


PLUGIN = EntryPoint(name="acme", value=f"{__name__}:PluginRuntime", group="fusion_oci.runtimes")


@pytest.fixture
def plugin_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        return [PLUGIN] if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)


@pytest.mark.parametrize("backend", BACKEND_IDS)
def test_every_backend_id_is_known_and_says_why_when_unavailable(backend: str) -> None:
    settings = SandboxSettings.model_validate({"backend": backend})
    runtime = registry.create_runtime(backend, settings, os.environ)
    assert isinstance(runtime, Runtime)
    avail = runtime.availability()
    assert avail.available or avail.reason
    runtime.capabilities()  # always answers


def test_custom_runtime_from_an_entry_point(plugin_installed: None, worktree: Path) -> None:
    settings = SandboxSettings.model_validate({"backend": "custom", "customRuntime": "acme"})
    assert "custom:acme" in registry.known_backends()
    with SyncSandbox(settings, env=dict(os.environ)) as sb:
        sb.prepare(PrepareContext(task_id="t", run_id="r", worktree_path=str(worktree)))
        result = sb.run("echo from plugin")
    assert result.stdout == "from plugin\n"
    assert result.backend == "custom"


def test_custom_runtime_not_installed_is_unavailable_with_the_fix(plugin_installed: None) -> None:
    settings: Any = SandboxSettings.model_validate({"backend": "custom",
                                                    "customRuntime": "missing"})
    runtime = registry.create_runtime("custom", settings, os.environ)
    avail = runtime.availability()
    assert not avail.available
    assert "missing" in avail.reason and "fusion_oci.runtimes" in avail.hint
