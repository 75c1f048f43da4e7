"""What `fusion-oci doctor` and the server's ``doctor`` method report: every known backend,
whether it works here, and the fix when it does not."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusion_oci.policy.settings import SandboxSettings


def backend_rows(env: Mapping[str, str], base: SandboxSettings | None = None
                 ) -> list[dict[str, Any]]:
    """One camelCase row per backend id (the JSON both report). ``base``: the effective
    settings (engine URLs, OCI runtime) each backend is probed with; None: the defaults."""
    from fusion_oci.models import BACKEND_IDS
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.runtimes.registry import create_runtime

    rows: list[dict[str, Any]] = []
    for backend in BACKEND_IDS:
        settings = (base.model_copy(update={"backend": backend}) if base is not None
                    else SandboxSettings.model_validate({"backend": backend}))
        runtime = create_runtime(backend, settings, env)
        avail = runtime.availability()
        close = getattr(runtime, "close", None)
        if callable(close):
            close()  # probing starts nothing that outlives it
        rows.append({
            "backend": backend,
            "available": avail.available,
            "version": avail.version,
            "rootless": avail.rootless,
            "reason": avail.reason or None,
            "hint": avail.hint or None,
            "enforces": sorted(r.value for r in runtime.enforces()) if avail.available else [],
            "capabilities": runtime.capabilities().model_dump(by_alias=True),
            "details": {_camel(k): v for k, v in avail.details.items()} or None,
        })
    return rows


def _camel(key: str) -> str:
    """'socket source' / 'socket_source' -> 'socketSource': one JSON spelling for every key."""
    words = key.replace("_", " ").replace("-", " ").split()
    return words[0] + "".join(w.capitalize() for w in words[1:]) if words else key
