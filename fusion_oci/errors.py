"""The one exception tree of fusion-oci.

::

    FusionOCIError                      every error carries what failed, why, and a hint
    ├── SettingsError (ValueError)      a settings file, prompt override or flag is wrong  (CLI 2)
    ├── SandboxSetupError               the sandbox could not be set up                   (CLI 125)
    │   ├── RuntimeUnavailableError     backend missing or unusable on this host
    │   ├── PolicyNotEnforceableError   the runtime cannot enforce part of the policy
    │   ├── BundleError                 a bundle could not be compiled or written
    │   └── ProvisionError              an image could not be built or pulled
    │       └── GateDeniedError (PermissionError)  a gate said no
    ├── CommandTimeoutError (TimeoutError)   raised only by callers who ask for it   (CLI 124)
    └── EngineError                      a container engine/SDK call failed at run time

SDK exceptions (``docker.errors.*``, ``podman.errors.*``) never reach callers: runtimes translate
them with :func:`engine_errors`-style context managers into :class:`EngineError` or a setup error.
"""

from __future__ import annotations


class FusionOCIError(Exception):
    """Root of every error fusion-oci raises on purpose.

    ``what`` names what failed, ``why`` the cause, ``hint`` what the user can do about it.
    """

    exit_code: int = 1

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


class SettingsError(FusionOCIError, ValueError):
    """Bad settings: a file, a key path, a value, and what would be accepted."""

    exit_code = 2


class SandboxSetupError(FusionOCIError):
    """The sandbox could not be set up; nothing ran."""

    exit_code = 125


class RuntimeUnavailableError(SandboxSetupError):
    """The chosen runtime is missing or cannot work on this host."""

    def __init__(self, backend: str, why: str, hint: str = "") -> None:
        self.backend = backend
        super().__init__(f"sandbox backend '{backend}' is unavailable", why, hint)


class PolicyNotEnforceableError(SandboxSetupError):
    """The runtime cannot enforce some of the policy, and we never weaken a policy silently."""

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


class EngineError(FusionOCIError):
    """A container engine call failed at run time."""


class CommandTimeoutError(FusionOCIError, TimeoutError):
    """The command ran past its timeout (only raised by callers that want an exception)."""

    exit_code = 124
