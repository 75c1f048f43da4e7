"""fusion-oci: run coding-agent executor commands in a sandbox around the task's worktree.

Settings → :class:`SandboxPolicy` → an OCI bundle → a runtime (native, bubblewrap, oci,
podman, docker, sandbox-exec, custom) → :class:`RunResult` plus audit events.
"""

from __future__ import annotations

# No `typing` import: the CLI's fast front end (fusion_oci.cli.fast) imports this package and
# typing alone costs more than its start-up budget.
TYPE_CHECKING = False

__version__ = "0.1.0"

__all__ = [
    "AuditEvent",
    "AuditLog",
    "CpuLimit",
    "FlagError",
    "FusionOCIError",
    "NetworkMode",
    "OutputChunk",
    "PolicyNotEnforceableError",
    "PrepareContext",
    "RunOptions",
    "RunResult",
    "RuntimeUnavailableError",
    "Sandbox",
    "SandboxCapabilities",
    "SandboxPolicy",
    "SandboxSettings",
    "SandboxSetupError",
    "SettingsError",
    "SyncSandbox",
    "load_settings",
    "stream_run",
]

_LAZY = {
    "AuditEvent": "fusion_oci.audit",
    "AuditLog": "fusion_oci.audit",
    "CpuLimit": "fusion_oci.models",
    "NetworkMode": "fusion_oci.models",
    "OutputChunk": "fusion_oci.streaming",
    "stream_run": "fusion_oci.streaming",
    "PrepareContext": "fusion_oci.models",
    "RunOptions": "fusion_oci.models",
    "RunResult": "fusion_oci.models",
    "SandboxCapabilities": "fusion_oci.models",
    "SandboxPolicy": "fusion_oci.models",
    "FlagError": "fusion_oci.errors",
    "FusionOCIError": "fusion_oci.errors",
    "PolicyNotEnforceableError": "fusion_oci.errors",
    "RuntimeUnavailableError": "fusion_oci.errors",
    "SandboxSetupError": "fusion_oci.errors",
    "SettingsError": "fusion_oci.errors",
    "Sandbox": "fusion_oci.sandbox",
    "SyncSandbox": "fusion_oci.sandbox",
    "SandboxSettings": "fusion_oci.policy.settings",
    "load_settings": "fusion_oci.policy.settings",
}

if TYPE_CHECKING:
    from typing import Any

    from fusion_oci.audit import AuditEvent, AuditLog
    from fusion_oci.errors import (
        FlagError,
        FusionOCIError,
        PolicyNotEnforceableError,
        RuntimeUnavailableError,
        SandboxSetupError,
        SettingsError,
    )
    from fusion_oci.models import (
        CpuLimit,
        NetworkMode,
        PrepareContext,
        RunOptions,
        RunResult,
        SandboxCapabilities,
        SandboxPolicy,
    )
    from fusion_oci.policy.settings import SandboxSettings, load_settings
    from fusion_oci.sandbox import Sandbox, SyncSandbox
    from fusion_oci.streaming import OutputChunk, stream_run


def __getattr__(name: str) -> Any:
    # Lazy: `import fusion_oci` stays cheap for the CLI's start-up.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fusion_oci' has no attribute {name!r}")
