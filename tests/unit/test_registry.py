"""The runtime registry: every brief id is known, and plugins come in through entry points
and get the lifecycle's services (audit log, gate callback) like a built-in runtime."""

from __future__ import annotations

import os
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.errors import GateDeniedError
from fusion_oci.images.gates import GateRequest
from fusion_oci.models import BACKEND_IDS, PrepareContext, SandboxCapabilities, SandboxPolicy
from fusion_oci.policy.settings import GateSettings, SandboxSettings
from fusion_oci.runtimes import registry
from fusion_oci.runtimes.native import NativeRuntime
from fusion_oci.runtimes.protocol import Runtime
from fusion_oci.runtimes.requirements import Requirement
from fusion_oci.runtimes.skeleton import SpecRuntime, UnavailableRuntime
from fusion_oci.sandbox import Sandbox, SyncSandbox
from tests import plugin_runtime


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
    cls = registry.runtime_class(backend, settings)
    if backend == "custom":  # known, and unavailable until a plugin is named
        assert isinstance(cls, UnavailableRuntime)
    else:  # known: a class is built in for it, not a stand-in saying "not built"
        assert not isinstance(cls, UnavailableRuntime), cls.availability().reason
    runtime = registry.create_runtime(backend, settings, os.environ)
    assert isinstance(runtime, Runtime)
    assert runtime.id == backend
    avail = runtime.availability()
    if not avail.available:  # says why, and what to do about it
        assert avail.reason.strip() and avail.hint.strip(), avail
    assert isinstance(runtime.capabilities(), SandboxCapabilities)


def test_custom_runtime_from_an_entry_point(plugin_installed: None, worktree: Path) -> None:
    settings = SandboxSettings.model_validate({"backend": "custom", "customRuntime": "acme"})
    assert "custom:acme" in registry.known_backends()
    with SyncSandbox(settings, env=dict(os.environ)) as sb:
        sb.prepare(PrepareContext(task_id="t", run_id="r", worktree_path=str(worktree)))
        result = sb.run("echo from plugin")
    assert result.stdout == "from plugin\n"
    assert result.backend == "custom"


def test_custom_runtime_not_installed_is_unavailable_with_the_fix(plugin_installed: None) -> None:
    settings: Any = SandboxSettings.model_validate(
        {"backend": "custom", "customRuntime": "missing"}
    )
    runtime = registry.create_runtime("custom", settings, os.environ)
    avail = runtime.availability()
    assert not avail.available
    assert "missing" in avail.reason and "fusion_oci.runtimes" in avail.hint


async def test_a_protocol_only_plugin_gets_the_audit_log_and_the_gate_callback(
    monkeypatch: pytest.MonkeyPatch, worktree: Path
) -> None:
    plugin_runtime.install(monkeypatch)
    settings = SandboxSettings(
        backend="custom",
        custom_runtime=plugin_runtime.NAME,
        gates=GateSettings(sandbox_provision="ask"),
    )
    asked: list[GateRequest] = []

    def ask(request: GateRequest) -> bool:
        asked.append(request)
        return True

    events: list[AuditEvent] = []
    audit = AuditLog(key=b"")
    audit.subscribe(events.append)
    ctx = PrepareContext(
        task_id="t",
        run_id="r",
        worktree_path=str(worktree),
        image="localhost/plugin-image:1",
        policy=SandboxPolicy(allow_network=False),
    )
    async with Sandbox(settings, audit=audit, ask=ask) as sb:
        await sb.prepare(ctx)
        assert not isinstance(sb.runtime, SpecRuntime), "the plugin derives from nothing"
        result = await sb.run("echo ran")
    assert result.stdout == "ran\n"
    assert [(r.gate, r.target) for r in asked] == [
        ("sandbox_provision", "localhost/plugin-image:1")
    ]
    gates = [e for e in events if e.type == "sandbox:gate"]
    assert len(gates) == 1 and (gates[0].details or {}).get("decided_by") == "callback"
    assert gates[0].backend == "custom"

    # Without a callback the `ask` gate denies: the plugin got None, not a default.
    async with Sandbox(settings, audit=audit) as sb:
        with pytest.raises(GateDeniedError):
            await sb.prepare(ctx)


def test_the_builtins_are_entry_points_of_the_distribution() -> None:
    """Built-ins are found the way a plugin is: every backend id but ``custom`` is an entry
    point of the built-in group in pyproject.toml (so a wheel carries them), and the
    installed metadata agrees."""
    import tomllib
    from pathlib import Path

    from fusion_oci.models import BACKEND_IDS
    from fusion_oci.runtimes.registry import BUILTIN_GROUP, builtin_entry_points

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    declared = project["project"]["entry-points"][BUILTIN_GROUP]
    assert set(declared) == set(BACKEND_IDS) - {"custom"}
    assert {n: ep.value for n, ep in builtin_entry_points().items()} == declared
