"""The one exception tree of fusion-oci.

::

    FusionOCIError                    what failed, why, a hint           kind (CLI exit)
    ├── SettingsError (ValueError)    a settings file or prompt is wrong   bad-settings (2)
    │   └── FlagError                 a flag or API argument is wrong      bad-flags (2)
    ├── SandboxSetupError             the sandbox could not be set up      setup-failed (125)
    │   ├── RuntimeUnavailableError   backend missing or unusable here     backend-unavailable
    │   ├── PolicyNotEnforceableError the runtime cannot enforce a part    policy-unenforceable
    │   ├── BundleError               a bundle could not be compiled       setup-failed
    │   ├── ProvisionError            an image could not be built/pulled   setup-failed
    │   │   └── GateDeniedError (PermissionError)  a gate said no          gate-denied
    │   └── AgentLostError            the sandbox's exec agent is gone     agent-lost
    ├── CommandTimeoutError (TimeoutError)  only for callers who ask       timeout (124)
    └── EngineError                   a container engine/SDK call failed   engine-error (125)

``kind`` is the machine-readable name a caller branches on (``--json`` prints
``{"error": {"kind", "what", "why", "hint", "unenforced"}}``, see :meth:`FusionOCIError.to_json`).

SDK exceptions (``docker.errors.*``, ``podman.errors.*``) never reach callers: the engines layer
(:mod:`fusion_oci.engines.errors`) translates them, by type and status, into these.
"""

from __future__ import annotations

from collections.abc import Iterable


class FusionOCIError(Exception):
    """Root of every error fusion-oci raises on purpose.

    ``what`` names what failed, ``why`` the cause, ``hint`` what the user can do about it.
    """

    exit_code: int = 1
    kind: str = "setup-failed"
    """Machine-readable error kind (one of :data:`ERROR_KINDS`)."""

    def __init__(self, what: str, why: str = "", hint: str = "") -> None:
        self.what = what
        self.why = why
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        text = self.what
        if self.why:
            text += f": {self.why}"
        if self.hint:
            text += f"\nhint: {self.hint}"
        return text

    def to_json(self) -> dict[str, object]:
        """``{"error": {...}}``: what ``--json`` prints and the server sends for this error."""
        return {
            "error": error_body(
                self.kind, self.what, self.why, self.hint, getattr(self, "unenforced", None) or ()
            )
        }


def error_body(
    kind: str, what: str, why: str = "", hint: str = "", unenforced: Iterable[str] = ()
) -> dict[str, object]:
    """The one error object: ``{kind, what, why, hint, unenforced}``, what ``--json`` prints
    under ``"error"`` and what the server sends as a JSON-RPC error's ``data``."""
    return {"kind": kind, "what": what, "why": why, "hint": hint, "unenforced": list(unenforced)}


def error_json(exc: BaseException) -> dict[str, object]:
    """``{"error": ...}`` for any exception: a FusionOCIError's own, else ``setup-failed``
    with the exception's text (what the CLI prints with ``--json``)."""
    if isinstance(exc, FusionOCIError):
        return exc.to_json()
    return {"error": error_body("setup-failed", str(exc))}


ERROR_KINDS = (
    "bad-settings",
    "bad-flags",
    "backend-unavailable",
    "policy-unenforceable",
    "gate-denied",
    "engine-error",
    "setup-failed",
    "timeout",
    "agent-lost",
)


class SettingsError(FusionOCIError, ValueError):
    """Bad settings: a file, a key path, a value, and what would be accepted."""

    exit_code = 2
    kind = "bad-settings"


class FlagError(SettingsError):
    """A command-line flag (or an API argument) is wrong: the flag, the value, what is accepted."""

    kind = "bad-flags"


class SandboxSetupError(FusionOCIError):
    """The sandbox could not be set up; nothing ran."""

    exit_code = 125


class RuntimeUnavailableError(SandboxSetupError):
    """The chosen runtime is missing or cannot work on this host."""

    kind = "backend-unavailable"

    def __init__(self, backend: str, why: str, hint: str = "") -> None:
        self.backend = backend
        super().__init__(f"sandbox backend '{backend}' is unavailable", why, hint)


class PolicyNotEnforceableError(SandboxSetupError):
    """The runtime cannot enforce some of the policy, and we never weaken a policy silently."""

    kind = "policy-unenforceable"

    def __init__(self, backend: str, unenforced: list[str], hint: str = "") -> None:
        self.backend = backend
        self.unenforced = unenforced
        super().__init__(
            f"sandbox backend '{backend}' cannot enforce the policy",
            "unenforceable here: " + ", ".join(unenforced),
            hint
            or "choose a backend that enforces these (see `fusion-oci doctor`), "
            "or drop the limits from the policy",
        )


class BundleError(SandboxSetupError):
    """An OCI bundle could not be compiled or written."""


class ProvisionError(SandboxSetupError):
    """An image or helper could not be provisioned."""


class GateDeniedError(ProvisionError, PermissionError):
    """An action gate (e.g. ``sandbox_provision``) denied the action."""

    kind = "gate-denied"


class EngineError(FusionOCIError):
    """A container engine call failed at run time."""

    exit_code = 125
    kind = "engine-error"


class CommandTimeoutError(FusionOCIError, TimeoutError):
    """The command ran past its timeout (only raised by callers that want an exception)."""

    exit_code = 124
    kind = "timeout"


class AgentLostError(SandboxSetupError):
    """The sandbox's exec agent died or its connection broke: the run in flight and every
    later run of that sandbox fail with this, never hang. Dispose and prepare again."""

    kind = "agent-lost"
