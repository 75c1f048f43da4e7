"""Pull an image with retries of transient failures, trying optional mirrors in order."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from fusion_oci.engines import EngineAdapter, EngineOpError
from fusion_oci.engines.errors import set_why
from fusion_oci.images.gates import AuditContext
from fusion_oci.images.progress import NullReporter, Reporter
from fusion_oci.images.retry import RetryPolicy, audit_attempt, is_transient_error, run_attempts
from fusion_oci.images.spec import is_loopback_registry, with_mirror


def pull_sources(ref: str, mirrors: Sequence[str]) -> list[str]:
    """Where to pull ``ref`` from, in order: each mirror, then the reference itself. Pure."""
    return [with_mirror(ref, m) for m in mirrors] + [ref]


def pull_image(
    engine: EngineAdapter,
    ref: str,
    *,
    ctx: AuditContext,
    mirrors: Sequence[str] = (),
    reporter: Reporter | None = None,
    policy: RetryPolicy | None = None,
    sleep: Callable[[float], None] | None = None,
) -> str:
    """Pull ``ref`` (or the same image from a mirror, then tagged as ``ref``); returns its id.

    Each source gets the full retry budget for transient errors; a permanent error on a mirror
    (it may simply not carry the image) moves on to the next source; the last source's error is
    raised, with what the others said.
    """
    rep = reporter or NullReporter()
    policy = policy or RetryPolicy()
    failures: list[str] = []
    sources = pull_sources(ref, mirrors)
    for index, source in enumerate(sources):

        def attempt(number: int, source: str = source) -> str:
            rep.start(
                f"pull {source} on {engine.name}" + (f", attempt {number}" if number > 1 else "")
            )
            return engine.pull(
                source, tls_verify=not is_loopback_registry(source), on_event=rep.event
            )

        def on_attempt(
            number: int,
            outcome: str,
            exc: BaseException | None,
            seconds: float,
            wait: float | None,
            source: str = source,
        ) -> None:
            audit_attempt(
                ctx,
                "pull",
                ref,
                engine.name,
                number,
                policy.attempts,
                outcome,
                exc,
                seconds,
                wait,
                source=source if source != ref else None,
            )

        t0 = time.monotonic()
        try:
            image_id: str = run_attempts(
                attempt,
                action="pull",
                target=source,
                policy=policy,
                is_transient=is_transient_error,
                on_attempt=on_attempt,
                sleep=sleep,
            )
        except EngineOpError as exc:
            failures.append(f"{source}: {exc.engine_message.splitlines()[0]}")
            if index == len(sources) - 1:
                if len(failures) > 1:
                    set_why(
                        exc,
                        exc.engine_message
                        + "\n"
                        + "\n".join(f"  also tried {f}" for f in failures[:-1]),
                    )
                raise
            rep.note(f"{source} failed; trying {sources[index + 1]}")
            continue
        if source != ref:
            engine.tag(image_id, ref)
        rep.finish(
            f"pulled {ref} on {engine.name} in {time.monotonic() - t0:.1f}s"
            + (f" (from {source})" if source != ref else "")
        )
        return image_id
    raise AssertionError("unreachable")  # pragma: no cover
