"""What ``settings show``, ``plan`` and ``doctor`` say about a task's service containers."""

from __future__ import annotations

from fusion_oci.models import SandboxPolicy

KEY = "sandbox.policy.services"


def service_summary(policy: SandboxPolicy) -> list[dict[str, object]]:
    """One entry a service: ``name``, ``image``, ``port``, ``reachedAt`` (inside the
    sandbox), ``ready``, ``envNames`` (values are never shown). Pure."""
    return [
        {
            "name": svc.name,
            "image": svc.image,
            "port": svc.port,
            "reachedAt": [f"127.0.0.1:{svc.port}", f"{svc.name}:{svc.port}"],
            "ready": svc.ready,
            "envNames": sorted(svc.env),
        }
        for svc in policy.services
    ]


def service_lines(summary: list[dict[str, object]]) -> list[str]:
    """One line a service of :func:`service_summary`, for the plan and doctor. Pure."""
    return [
        f"services {entry['name']}: image {entry['image']}, reached by the task only at "
        f"127.0.0.1:{entry['port']} and {entry['name']}:{entry['port']} (by name on every "
        "runtime but landlock, which keeps the host's /etc/hosts); the container has no "
        "network of its own"
        for entry in summary
    ]


def service_rows(policy: SandboxPolicy) -> list[dict[str, object]]:
    """Rows ``{"key", "value", "source"}`` (the settings table's shape), one a service."""
    rows: list[dict[str, object]] = []
    for i, entry in enumerate(service_summary(policy)):
        env = entry["envNames"]
        source = f"{KEY}[{i}]: port {entry['port']}, ready: {entry['ready'] or 'port open'}"
        if env:
            source += f", env {', '.join(env)}"  # type: ignore[arg-type]
        rows.append(
            {
                "key": f"services.container[{i}]",
                "value": f"{entry['name']}={entry['image']}",
                "source": source,
            }
        )
    return rows
