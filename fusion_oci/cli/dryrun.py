"""``fusion-oci plan``'s dry run: everything a run would compile, nothing created or started
(shared by ``plan`` and ``repro``'s report, so neither imports the other's command module)."""

from __future__ import annotations

from typing import Any


def dry_run(task: Any, command: str | list[str], environ: dict[str, str]) -> dict[str, Any]:
    """Compile everything a run would, create nothing, start nothing: the same resolve step
    and compiler as a run (fusion_oci.resolve.resolve_for), with ``create=False``."""
    from fusion_oci.oci.host import probe_host
    from fusion_oci.oci.model import config_json
    from fusion_oci.resolve import resolve_for
    from fusion_oci.runtimes.registry import create_runtime
    from fusion_oci.services.show import grant_summary, publish_summary
    from fusion_oci.sidecars import services_missing
    from fusion_oci.sidecars.show import service_summary

    settings = task.effective.settings
    host = probe_host()
    runtime = create_runtime(settings.backend, settings, environ, host=host)
    resolved = resolve_for(runtime, settings, task.ctx, host, env=environ, create=False)
    process = resolved.process(command, task.opts)
    avail = runtime.availability()
    missing = runtime.check(resolved)  # what the lifecycle refuses (or lists, for native)
    missing += services_missing(
        bool(resolved.spec.service_containers) and not runtime.runs_services,
        runtime.isolates,
        settings,
        environ,
        runtime.id,
    )
    if runtime.isolates:
        missing += resolved.unprotected()
    try:
        runtime.adopt(resolved)
        launch = runtime.plan(process).to_json()
    finally:
        runtime.close()  # a probed engine client is dropped now, not whenever it is collected
    return {
        "backend": runtime.id,
        "available": avail.available,
        "availability": avail.reason or None,
        "policy": task.ctx.policy.model_dump(mode="json", by_alias=True),
        "policyHash": task.ctx.policy.digest(),
        "unenforced": missing,
        "hostServices": grant_summary(task.ctx.policy),
        "services": service_summary(task.ctx.policy),
        "publishPorts": publish_summary(task.ctx.policy),
        "config": config_json(resolved.spec, process),
        "launch": launch,
    }
