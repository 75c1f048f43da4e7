"""What `fusion-oci doctor` and the server's ``doctor`` method report: every known backend,
whether it works here, and the fix when it does not."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusion_oci.policy.settings import SandboxSettings


def backend_rows(
    env: Mapping[str, str], base: SandboxSettings | None = None, *, oci_variants: bool = False
) -> list[dict[str, Any]]:
    """One camelCase row per backend id (the JSON both report). ``base``: the effective
    settings (engine URLs, OCI runtime) each backend is probed with; None: the defaults.
    ``oci_variants`` (the CLI's table): after them, an ``oci`` row (with ``ociRuntime``) for
    each other OCI runtime installed, such as gVisor's runsc."""
    import shutil

    from fusion_oci.models import BACKEND_IDS
    from fusion_oci.policy.settings import OciSettings, SandboxSettings
    from fusion_oci.runtimes.registry import create_runtime

    rows: list[dict[str, Any]] = []
    variants: list[tuple[str, dict[str, Any]]] = [(b, {"backend": b}) for b in BACKEND_IDS]
    # The oci backend once more per other OCI runtime installed: gVisor's runsc enforces
    # differently from runc, and `oci: {runtime: runsc}` is how it is chosen.
    default_oci = base.oci.runtime if base is not None else "runc"
    if oci_variants:
        variants += [
            ("oci", {"backend": "oci", "oci": OciSettings(runtime=name)})
            for name in ("runsc", "crun")
            if name != default_oci and shutil.which(name, path=env.get("PATH"))
        ]
    for backend, fields in variants:
        settings = base.model_copy(update=fields) if base is not None else SandboxSettings(**fields)
        runtime = create_runtime(backend, settings, env)
        avail = runtime.availability()
        runtime.close()  # probing starts nothing that outlives it
        rows.append(
            {
                "backend": backend,
                **({"ociRuntime": settings.oci.runtime} if backend == "oci" else {}),
                "available": avail.available,
                "version": avail.version,
                "rootless": avail.rootless,
                "reason": avail.reason or None,
                "hint": avail.hint or None,
                "enforces": sorted(r.value for r in runtime.enforces()) if avail.available else [],
                "capabilities": runtime.capabilities().model_dump(by_alias=True),
                "details": {_camel(k): v for k, v in avail.details.items()} or None,
            }
        )
    return rows


def _camel(key: str) -> str:
    """'socket source' / 'socket_source' -> 'socketSource': one JSON spelling for every key."""
    words = key.replace("_", " ").replace("-", " ").split()
    return words[0] + "".join(w.capitalize() for w in words[1:]) if words else key


def kubernetes_facts(
    env: Mapping[str, str], settings: SandboxSettings, *, probe_network: bool
) -> dict[str, Any]:
    """The cluster the ``kubernetes:`` settings point at (found as kubectl finds it): reachable,
    the mode a task would use, agent-sandbox's APIs, the executor's missing permissions, and,
    when ``probe_network``, whether NetworkPolicy is enforced (a short-lived probe pod made
    with ``sandbox.image``; see :mod:`fusion_oci.runtimes.kubernetes.facts`)."""
    from fusion_oci.runtimes.kubernetes.facts import cluster_facts

    facts = cluster_facts(
        settings.kubernetes, env, probe_image=settings.image if probe_network else None
    )
    if not probe_network and "networkPolicy" in facts:
        facts["networkPolicy"] = {
            "enforced": None,
            "how": "not probed: doctor makes a probe pod only when the settings have a "
            "kubernetes: section (and sandbox.image, an image the nodes have)",
        }
    return facts
