"""``fusion-oci images bootstrap-base``: an offline base image for machines without a registry.

``debootstrap --variant=minbase bookworm`` (Debian's archive is reachable where no registry is)
into a temporary directory, trimmed of apt caches, packed as one tar and imported through the
SDKs into every engine that lacks it as ``localhost/fusion-oci/base:bookworm``. Idempotent: an
engine that already has the base is left alone, and nothing is fetched when all have it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fusion_oci.engines import EngineAdapter, EngineOpError
from fusion_oci.engines.errors import classify
from fusion_oci.errors import ProvisionError
from fusion_oci.images.gates import AuditContext, GateRequest, ProvisionGate
from fusion_oci.images.progress import NullReporter, Reporter
from fusion_oci.images.retry import RetryPolicy, audit_attempt, is_transient_error, run_attempts
from fusion_oci.images.spec import BASE_REF, LABEL_MANAGED, LABEL_NAME

DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEBOOTSTRAP_TIMEOUT_S = 20 * 60
IMPORT_CHANGES = (
    'CMD ["/bin/bash"]',
    "ENV LANG=C.UTF-8",
    f"LABEL {LABEL_MANAGED}=true",
    f"LABEL {LABEL_NAME}=base",
)


@dataclass
class BootstrapResult:
    ref: str
    actions: dict[str, str] = field(default_factory=dict)
    """Engine name → present | imported."""
    ids: dict[str, str] = field(default_factory=dict)
    debootstrap_s: float = 0.0
    import_s: dict[str, float] = field(default_factory=dict)


def debootstrap_argv(
    rootfs: Path, suite: str = DEFAULT_SUITE, mirror: str = DEFAULT_MIRROR
) -> list[str]:
    """The debootstrap command. Pure."""
    return ["debootstrap", "--variant=minbase", suite, str(rootfs), mirror]


def tar_argv(rootfs: Path, dest: Path) -> list[str]:
    """Pack the root filesystem for import. Device nodes, /proc and /sys stay out: runtimes
    provide them, and rootless engines cannot create device nodes. Pure."""
    return [
        "tar",
        "--numeric-owner",
        "-C",
        str(rootfs),
        "--exclude=./dev/*",
        "--exclude=./proc/*",
        "--exclude=./sys/*",
        "-cf",
        str(dest),
        ".",
    ]


def sources_list(suite: str, mirror: str) -> str:
    """Debian's own layout (as in the public image): main, updates and security. Pure."""
    security = mirror.rstrip("/").removesuffix("/debian") + "/debian-security"
    return (
        f"deb {mirror} {suite} main\n"
        f"deb {mirror} {suite}-updates main\n"
        f"deb {security} {suite}-security main\n"
    )


def _trim(rootfs: Path, suite: str, mirror: str) -> None:
    """Drop what a later ``apt-get update`` recreates anyway (about 80 MB)."""
    for pattern in ("var/cache/apt/*.bin", "var/cache/apt/archives/*.deb", "var/lib/apt/lists/*"):
        for path in rootfs.glob(pattern):
            if path.is_file() and not path.is_symlink():
                path.unlink()
    (rootfs / "etc/apt/sources.list").write_text(sources_list(suite, mirror), encoding="utf-8")


async def bootstrap_base(
    engines: Sequence[EngineAdapter],
    *,
    ctx: AuditContext,
    gate: ProvisionGate | None = None,
    ref: str = BASE_REF,
    suite: str = DEFAULT_SUITE,
    mirror: str = DEFAULT_MIRROR,
    force: bool = False,
    reporter: Reporter | None = None,
    work_dir: Path | None = None,
    policy: RetryPolicy | None = None,
    sleep: Callable[[float], None] | None = None,
) -> BootstrapResult:
    """Make ``ref`` present in every engine of ``engines`` (skipping those that have it)."""
    import asyncio

    rep = reporter or NullReporter()
    result = BootstrapResult(ref)
    missing: list[EngineAdapter] = []
    for engine in engines:
        info = None if force else await asyncio.to_thread(engine.image, ref)
        if info is not None:
            result.actions[engine.name] = "present"
            result.ids[engine.name] = info.id
            ctx.emit(
                "sandbox:provision",
                f"{ref} present on {engine.name}",
                action="present",
                outcome="ok",
                ref=ref,
                engine=engine.name,
                digest=info.id,
            )
        else:
            missing.append(engine)
    if not missing:
        return result
    names = ", ".join(e.name for e in missing)
    if gate is not None:
        for name in ("sandbox_provision", "network_api"):
            await gate.check(
                GateRequest(
                    name,
                    "bootstrap",
                    ref,
                    names,
                    f"debootstrap {suite} from {mirror}",
                    "fusion-oci images bootstrap-base",
                )
            )
    if os.geteuid() != 0:
        raise ProvisionError(
            f"cannot bootstrap {ref}",
            "debootstrap needs root",
            "run `sudo fusion-oci images bootstrap-base`",
        )
    if shutil.which("debootstrap") is None:
        raise ProvisionError(
            f"cannot bootstrap {ref}", "debootstrap is not installed", "apt-get install debootstrap"
        )
    tmp = Path(tempfile.mkdtemp(prefix="fusion-oci-base-", dir=work_dir or "/var/tmp"))
    try:
        rootfs = tmp / "rootfs"
        archive = tmp / "rootfs.tar"
        t0 = time.monotonic()
        await _debootstrap(rootfs, suite, mirror, ctx, rep, policy or RetryPolicy(), sleep)
        result.debootstrap_s = time.monotonic() - t0
        _trim(rootfs, suite, mirror)
        await _run(tar_argv(rootfs, archive), "pack the root filesystem", 600)
        shutil.rmtree(rootfs, ignore_errors=True)
        for engine in missing:
            t1 = time.monotonic()
            rep.start(f"import {ref} into {engine.name}")
            image_id = await asyncio.to_thread(engine.import_rootfs, archive, ref, IMPORT_CHANGES)
            info = await asyncio.to_thread(engine.image, ref)
            seconds = time.monotonic() - t1
            result.actions[engine.name] = "imported"
            result.ids[engine.name] = info.id if info else image_id
            result.import_s[engine.name] = seconds
            ctx.emit(
                "sandbox:provision",
                f"{ref} imported into {engine.name}",
                duration_ms=int(seconds * 1000),
                action="import",
                outcome="ok",
                ref=ref,
                engine=engine.name,
                digest=result.ids[engine.name],
                bytes=archive.stat().st_size,
            )
            rep.finish(f"imported {ref} into {engine.name} in {seconds:.1f}s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


async def _run(argv: list[str], what: str, timeout_s: float) -> str:
    from fusion_oci.host.process import run_process

    outcome = await run_process(argv, timeout_s=timeout_s, max_buffer=4 << 20)
    text = (outcome.stdout + outcome.stderr).decode("utf-8", errors="replace")
    if outcome.timed_out or outcome.returncode != 0:
        status = "timed out" if outcome.timed_out else f"exit status {outcome.returncode}"
        tail = "\n".join(text.splitlines()[-15:])
        raise EngineOpError(
            f"cannot {what}",
            f"`{' '.join(argv)}` failed ({status})\n{tail}",
            transient=outcome.timed_out or classify(tail),
        )
    return text


async def _debootstrap(
    rootfs: Path,
    suite: str,
    mirror: str,
    ctx: AuditContext,
    rep: Reporter,
    policy: RetryPolicy,
    sleep: Callable[[float], None] | None,
) -> None:
    import asyncio

    argv = debootstrap_argv(rootfs, suite, mirror)

    def attempt(number: int) -> None:
        # debootstrap leaves a half-made tree behind on failure; start each attempt clean.
        shutil.rmtree(rootfs, ignore_errors=True)
        rep.start(f"debootstrap {suite}" + (f", attempt {number}" if number > 1 else ""))
        asyncio.run(_run(argv, f"debootstrap {suite}", DEBOOTSTRAP_TIMEOUT_S))
        rep.finish(f"debootstrap {suite} done")

    def on_attempt(
        number: int, outcome: str, exc: BaseException | None, seconds: float, wait: float | None
    ) -> None:
        audit_attempt(
            ctx,
            "bootstrap",
            BASE_REF,
            "host",
            number,
            policy.attempts,
            outcome,
            exc,
            seconds,
            wait,
            command=" ".join(argv),
        )

    await asyncio.to_thread(
        run_attempts,
        attempt,
        action="bootstrap",
        target=suite,
        policy=policy,
        is_transient=is_transient_error,
        on_attempt=on_attempt,
        sleep=sleep,
    )
