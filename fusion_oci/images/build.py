"""Build an image from a folder under ``images/`` through an engine's SDK.

The host CA bundle goes in as the build secret ``hostca`` (``RUN --mount=type=secret,id=hostca``)
and never into a layer:

- podman (4.3 API, rootful and rootless): the ``secrets`` parameter of ``/build``; the file
  travels inside the uploaded context under a random name and podman moves it out of the
  context directory before the first step, so ``COPY .`` cannot pick it up.
- docker (20.10, API 1.41): secrets exist only over a BuildKit session, which the SDK cannot
  serve. Provisioning therefore builds docker's images on podman and loads them (measured faster
  than building twice anyway). Only on a host without podman does docker build itself, with the
  classic builder and the secret mounts removed; the audit then records ``caSecret: false``.
"""

from __future__ import annotations

import secrets as _secrets
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from fusion_oci.engines import EngineAdapter, EngineOpError
from fusion_oci.engines.errors import set_why
from fusion_oci.errors import ProvisionError
from fusion_oci.images.context import write_context_tar
from fusion_oci.images.engine import strip_secret_mounts
from fusion_oci.images.gates import AuditContext
from fusion_oci.images.progress import NullReporter, Reporter
from fusion_oci.images.retry import (
    RetryPolicy,
    audit_attempt,
    classify_build,
    is_transient_error,
    run_attempts,
)
from fusion_oci.images.spec import ImageSpec

CA_SECRET_ID = "hostca"  # noqa: S105 (the secret's id, not its value)


def host_ca_for_build(setting: str) -> Path | None:
    """The CA bundle to pass as the build secret (settings ``hostCa``: auto, off or a path)."""
    from fusion_oci.oci.host import CA_BUNDLES
    from fusion_oci.policy.layout import resolve_ca

    found = next((c for c in CA_BUNDLES if Path(c).is_file()), None)
    path = resolve_ca(setting, found)
    return Path(path) if path else None


def build_image(
    engine: EngineAdapter,
    spec: ImageSpec,
    *,
    ca: Path | None,
    ctx: AuditContext,
    reporter: Reporter | None = None,
    policy: RetryPolicy | None = None,
    sleep: Callable[[float], None] | None = None,
    extra: Mapping[str, Path] | None = None,
) -> str:
    """Build ``spec`` on ``engine`` (retrying transient failures); returns the image id.

    ``extra``: files added to the context (tar name → path), the verified toolchain tarballs.
    """
    if spec.kind != "build" or spec.context is None:
        raise ProvisionError(
            f"image {spec.ref} is not built from a folder", "it is a reference", "pull it instead"
        )
    rep = reporter or NullReporter()
    policy = policy or RetryPolicy()
    use_secret = ca is not None and engine.supports_build_secrets
    replace: dict[str, bytes] = {}
    if not engine.supports_build_secrets:
        text = (spec.context / spec.containerfile).read_text(encoding="utf-8")
        replace[spec.containerfile] = strip_secret_mounts(text).encode()
    secret_name = f".fusion-oci-secret-{_secrets.token_hex(8)}"

    with tempfile.TemporaryDirectory(prefix="fusion-oci-build-") as tmp:
        tar = Path(tmp) / "context.tar"
        with tar.open("wb") as out:
            write_context_tar(
                spec.context,
                out,
                secrets={secret_name: ca} if use_secret and ca else None,
                replace=replace,
                containerfile=spec.containerfile,
                extra=extra,
            )

        def attempt(number: int) -> str:
            rep.start(
                f"build {spec.name} ({spec.ref}) on {engine.name}"
                + (f", attempt {number}" if number > 1 else "")
            )
            try:
                return engine.build(
                    tar,
                    containerfile=spec.containerfile,
                    tag=spec.ref,
                    build_args=spec.build_args,
                    labels=spec.labels,
                    secrets={CA_SECRET_ID: secret_name} if use_secret else {},
                    on_event=rep.event,
                )
            except EngineOpError as exc:
                # A RUN step that failed on a network blip deserves another try; the step's
                # output (not the engine's "exit status 100") says which it was.
                exc.transient = classify_build(exc.engine_message, rep.tail())
                if not exc.transient:
                    set_why(exc, f"{exc.engine_message}\n{_indent(rep.tail())}")
                raise

        def on_attempt(
            number: int, outcome: str, exc: BaseException | None, seconds: float, wait: float | None
        ) -> None:
            audit_attempt(
                ctx,
                "build",
                spec.ref,
                engine.name,
                number,
                policy.attempts,
                outcome,
                exc,
                seconds,
                wait,
                ca_secret=use_secret,
            )

        t0 = time.monotonic()
        image_id: str = run_attempts(
            attempt,
            action="build",
            target=spec.ref,
            policy=policy,
            is_transient=is_transient_error,
            on_attempt=on_attempt,
            sleep=sleep,
        )
        rep.finish(f"built {spec.ref} on {engine.name} in {time.monotonic() - t0:.1f}s")
        return image_id


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines()[-15:])
