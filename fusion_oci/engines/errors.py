"""The one mapping of SDK exceptions to fusion-oci errors.

:func:`describe` reads an exception by its type and the HTTP status of the engine's answer
(``docker.errors.APIError.status_code``, ``podman.errors.APIError.status_code``, and the
``cause`` of podman's error model, libpod's sentinel error; the ``OSError`` under a
``requests`` connection error), never by its message text, and names a :data:`FailureKind`.
Two boundaries turn that into errors callers can branch on:

- :func:`engine_errors` for containers, volumes and gc: unreachable or forbidden sockets are
  :class:`~fusion_oci.errors.RuntimeUnavailableError` (:class:`EngineUnreachableError`,
  :class:`EngineForbiddenError`), a missing image a :class:`~fusion_oci.errors.ProvisionError`,
  a container that is gone (404, or 409 / podman's "container state improper" on it)
  :class:`ContainerGoneError`, anything else a setup error (or an
  :class:`~fusion_oci.errors.EngineError` while a command runs).
- :func:`image_errors` for builds, pulls, loads and inspects: :class:`EngineOpError`, which also
  says whether a retry may help (registry failures reach us as the engine's text, so that one
  decision, :func:`classify`, reads it).

The engine's own words are kept in ``why``; for a few host problems an engine can only report
as text (crun on a cgroup v1 host, missing subuid ranges) a hint with the fix is added to the
error, which changes the hint, never the kind.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from fusion_oci.engines.endpoints import Endpoint
from fusion_oci.errors import (
    EngineError,
    FusionOCIError,
    ProvisionError,
    RuntimeUnavailableError,
    SandboxSetupError,
)

FailureKind = Literal[
    "unreachable",
    "forbidden",
    "reset",
    "timeout",
    "image-missing",
    "not-found",
    "conflict",
    "engine",
]


@dataclass(frozen=True)
class Failure:
    """What an SDK exception says, read from its type and status."""

    kind: FailureKind
    message: str
    status: int | None = None


class ContainerGoneError(EngineError):
    """The task container is not running (it exited, or was removed behind our back)."""


class EngineUnreachableError(RuntimeUnavailableError):
    """No engine service answers at the endpoint (missing socket, refused, reset)."""


class EngineForbiddenError(RuntimeUnavailableError):
    """The endpoint's socket exists but this user may not use it."""


class EngineOpError(ProvisionError):
    """An image operation failed; ``transient`` says whether trying again may help."""

    def __init__(
        self, what: str, message: str, *, transient: bool, status: int | None = None, hint: str = ""
    ) -> None:
        self.engine_message = message
        self.transient = transient
        self.status = status
        super().__init__(what, message, hint)


def set_why(exc: EngineOpError, why: str) -> None:
    """Replace the ``why`` of an error (and the message it renders)."""
    exc.why = why
    exc.args = (exc.render(),)


def _root_oserror(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        for arg in getattr(cur, "args", ()):
            if isinstance(arg, BaseException):
                found = _root_oserror(arg)
                if found is not None:
                    return found
        cur = cur.__cause__ or cur.__context__
    return None


def engine_message(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    return str(explanation or exc).strip()


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    if status is None:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _sdk_types() -> tuple[
    tuple[type[BaseException], ...],
    tuple[type[BaseException], ...],
    tuple[type[BaseException], ...],
]:
    """(every SDK/transport error, image-not-found types, API-answer types)."""
    import requests

    every: tuple[type[BaseException], ...] = (requests.exceptions.RequestException,)
    missing: tuple[type[BaseException], ...] = ()
    api: tuple[type[BaseException], ...] = (requests.exceptions.HTTPError,)
    with contextlib.suppress(ImportError):
        import docker.errors

        every += (docker.errors.DockerException,)
        missing += (docker.errors.ImageNotFound,)
        api += (docker.errors.APIError,)
    with contextlib.suppress(ImportError):
        import podman.errors

        every += (podman.errors.APIError, podman.errors.PodmanError)
        missing += (podman.errors.ImageNotFound,)
        api += (podman.errors.APIError,)
    return every, missing, api


# podman's API error model is {"cause", "message", "response"}: ``cause`` names libpod's
# sentinel error (define.ErrCtrStateInvalid is "container state improper"), and podman 4.3
# sends several of them with a 500 where docker answers 409 or 404. The sentinel is the
# error's identity (the SDK raises with it as the exception's cause), not prose.
_PODMAN_CAUSES: dict[str, FailureKind] = {
    "container state improper": "conflict",
    "no such container": "not-found",
    "no such volume": "not-found",
    "no such image": "image-missing",
    "image not known": "image-missing",  # containers/storage's ErrImageUnknown
}


def _podman_cause(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    try:
        body = response.json() if response is not None else None
    except ValueError:
        return None
    cause = body.get("cause") if isinstance(body, dict) else None
    return cause if isinstance(cause, str) else None


def describe(exc: BaseException) -> Failure | None:
    """The failure an SDK, HTTP or socket exception stands for; None for anything else."""
    import requests

    every, missing, api = _sdk_types()
    if not isinstance(exc, (*every, OSError)):
        return None
    message = engine_message(exc)
    if isinstance(exc, missing):
        return Failure("image-missing", message, 404)
    status = _status(exc) if isinstance(exc, api) else None
    if status is not None:
        # The engine answered: its status (or podman's sentinel cause) says what it was.
        kind = _PODMAN_CAUSES.get(_podman_cause(exc) or "")
        if kind is not None:
            return Failure(kind, message, status)
        if status == 404:
            return Failure("not-found", message, status)
        if status == 409:
            return Failure("conflict", message, status)
        return Failure("engine", message, status)
    if isinstance(exc, requests.exceptions.Timeout):
        return Failure("timeout", message)
    err = _root_oserror(exc)
    if isinstance(err, PermissionError):
        return Failure("forbidden", message)
    if isinstance(err, ConnectionResetError | BrokenPipeError | ConnectionAbortedError):
        return Failure("reset", message)
    if isinstance(err, FileNotFoundError | ConnectionRefusedError) or isinstance(
        exc, requests.exceptions.ConnectionError
    ):
        return Failure("unreachable", message)
    if isinstance(err, TimeoutError):
        return Failure("timeout", message)
    return Failure("engine", message)


# Registry failures reach us as the engine's text (docker answers 500 for all of them), so the
# one retry decision reads it: connection resets, timeouts, 5xx and 429 are transient; an
# unknown image, a denied login, a bad reference or a broken Containerfile are permanent.
# Anything not recognised is permanent: a retry loop that hides a real error for minutes is
# worse than one failed task.
_PERMANENT = re.compile(
    r"manifest unknown|name unknown|not found|no such image|unauthorized|"
    r"authentication required|no basic auth credentials|access denied|permission denied|"
    r"\bdenied\b|forbidden|"
    r"invalid reference|repository name must|no such host|does not exist|"
    r"x509|certificate|unknown instruction|parse error|requires buildkit|"
    r"no such file or directory|is not a valid|unknown flag|short-name",
    re.IGNORECASE,
)
_TRANSIENT = re.compile(
    r"connection reset|reset by peer|connection refused|broken pipe|unexpected eof|"
    r"\beof\b|i/o timeout|timed? ?out|deadline exceeded|tls handshake timeout|"
    r"temporary failure|try again|too many requests|toomanyrequests|rate limit|"
    r"service unavailable|bad gateway|gateway timeout|internal server error|"
    r"server misbehaving|network is unreachable|econnreset|etimedout|eai_again|"
    r"econnrefused|socket hang up|"
    r"(status|code|http)[: ]+(5\d\d|429)\b|\b(5\d\d|429) (service|bad|gateway|internal|too)",
    re.IGNORECASE,
)


def classify(message: str, status: int | None = None) -> bool:
    """True when ``message`` (and the HTTP ``status`` of the engine's answer) is transient."""
    # docker answers 500 for every registry failure, so a bare 500 decides nothing; gateway
    # errors and rate limits do.
    if status in (429, 502, 503, 504) and not _PERMANENT.search(message):
        return True
    if _PERMANENT.search(message):
        return False
    return bool(_TRANSIENT.search(message))


# (pattern in the engine's text, why, hint): a hint only, for problems engines report as text.
_HINTS: tuple[tuple[str, str, str], ...] = (
    (
        r"cgroups? in hybrid mode not supported|crun.*cgroup",
        "crun refuses this cgroup v1/hybrid host",
        'use runc: put `[engine]` and `runtime = "runc"` in '
        "/etc/containers/containers.conf.d/50-runc.conf (or ~/.config/containers/containers.conf)",
    ),
    (
        r"no subuid ranges|no subgid ranges|/etc/subuid|/etc/subgid",
        "the user has no subordinate uid/gid range",
        "add one: usermod --add-subuids 100000-165535 --add-subgids 100000-165535 $USER, "
        "then `podman system migrate`",
    ),
    (
        r"newuidmap|newgidmap",
        "rootless podman needs newuidmap/newgidmap",
        "install them: apt-get install uidmap",
    ),
    (
        r"/dev/net/tun",
        "rootless networking (slirp4netns) cannot open /dev/net/tun",
        "make it accessible (chmod 0666 /dev/net/tun, or load the tun module), "
        "or use network: none",
    ),
    (
        r"setting rlimit|setrlimit",
        "the engine cannot apply a resource limit above its own hard limit",
        "lower the limit in the policy, or raise the engine service's hard limits (ulimit -H)",
    ),
)


def known_problem(message: str) -> tuple[str, str] | None:
    """(why, hint) for an engine message that names a known host problem."""
    for pattern, why, hint in _HINTS:
        if re.search(pattern, message, re.IGNORECASE):
            return why, hint
    return None


def _socket_hint(engine: str, kind: FailureKind) -> str:
    if kind == "forbidden":
        return (
            "add your user to the `docker` group (then log in again), or use rootless docker/podman"
            if engine == "docker"
            else "use your own rootless socket (unset CONTAINER_HOST / podman.url), "
            "or run as the socket's owner"
        )
    return (
        "start it: `systemctl start docker` (or dockerd), or set DOCKER_HOST or docker.url"
        if engine == "docker"
        else "start it: `systemctl --user start podman.socket` (rootless) or "
        "`podman system service --time=0 &`, or set CONTAINER_HOST or podman.url"
    )


def translate(
    exc: BaseException, engine: str, what: str, endpoint: Endpoint, *, setup: bool = True
) -> FusionOCIError | None:
    """The fusion-oci error for an SDK exception raised by a container/volume call."""
    failure = describe(exc)
    if failure is None:
        return None
    where = f"{endpoint.url} (from {endpoint.source})"
    message = failure.message
    if failure.kind == "forbidden":
        return EngineForbiddenError(
            engine,
            f"permission denied on the API socket {where}",
            _socket_hint(engine, failure.kind),
        )
    if failure.kind in ("unreachable", "reset"):
        return EngineUnreachableError(
            engine, f"no {engine} service answers at {where}", _socket_hint(engine, failure.kind)
        )
    if failure.kind == "image-missing":
        return ProvisionError(
            f"{what}: the image is missing from {engine}",
            message,
            "build it: `fusion-oci images build node` (or set sandbox.image to a local image)",
        )
    if failure.kind in ("not-found", "conflict"):
        return ContainerGoneError(
            f"{engine}: {what} failed",
            message[-500:],
            "the task container stopped; prepare the task again",
        )
    why, hint = message[-500:], f"check the {engine} service at {endpoint.url}"
    known = known_problem(message)
    if known is not None:
        why, hint = f"{known[0]} ({message[-300:]})", known[1]
    if setup:
        return SandboxSetupError(f"{engine}: {what} failed", why, hint)
    return EngineError(f"{engine}: {what} failed", why, hint)


@contextlib.contextmanager
def engine_errors(
    engine: str, what: str, endpoint: Endpoint, *, setup: bool = True
) -> Iterator[None]:
    """THE boundary for container calls: only fusion-oci errors come out.

    ``setup``: failures become :class:`SandboxSetupError` subclasses (the failure mode
    applies); otherwise (a running command's exec) :class:`EngineError`.
    """
    try:
        yield
    except FusionOCIError:
        raise
    except Exception as exc:
        translated = translate(exc, engine, what, endpoint, setup=setup)
        if translated is None:
            raise
        raise translated from exc


@contextlib.contextmanager
def image_errors(what: str, engine: str, url: str) -> Iterator[None]:
    """THE boundary for image calls: :class:`EngineOpError`, transient or not."""
    try:
        yield
    except FusionOCIError:
        raise
    except Exception as exc:
        failure = describe(exc)
        if failure is None:
            raise
        if failure.kind in ("unreachable", "forbidden", "reset"):
            # The engine's own socket: missing or refusing is a setup problem, not a blip.
            reset = failure.kind == "reset"
            raise EngineOpError(
                what,
                f"cannot talk to {engine} at {url}: {failure.message}",
                transient=reset,
                hint="" if reset else f"start the {engine} API service (see `fusion-oci doctor`)",
            ) from exc
        if failure.kind == "timeout":
            raise EngineOpError(
                what, f"{engine} did not answer in time: {failure.message}", transient=True
            ) from exc
        if failure.kind == "image-missing":
            raise EngineOpError(
                what,
                f"the image is not in {engine}: {failure.message}",
                transient=False,
                status=failure.status,
                hint="provision it first (`fusion-oci images build`, or a "
                "build, pull or load on this engine)",
            ) from exc
        transient = failure.kind == "engine" and classify(failure.message, failure.status)
        raise EngineOpError(
            what, failure.message, transient=transient, status=failure.status
        ) from exc
