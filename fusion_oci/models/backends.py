"""The backend ids: the one list the settings, the CLI's ``--backend`` choices, the task
prompt's ``**Sandbox:** X`` line, the runtime registry and the TypeScript client
(``SandboxBackendId``, checked by tests/unit/test_backend_ids.py) are read from. Adding a
backend is a name here, its row of :data:`CAPABILITIES`, its runtime folder and its entry point
(pyproject.toml). Stdlib
only: the CLI's fast path reads it before anything else is imported."""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

BackendId = Literal[
    "native",
    "bubblewrap",
    "landlock",
    "oci",
    "podman",
    "docker",
    "kubernetes",
    "sandbox-exec",
    "custom",
]
"""Every backend id of the brief (plus ``oci``: any OCI runtime CLI run on the bundle, and
``landlock``: where user namespaces are forbidden), in the order ``--help`` lists them."""

BACKEND_IDS: tuple[str, ...] = get_args(BackendId)


class Offers(NamedTuple):
    """What a backend offers (the brief's SandboxCapabilities, field for field): the best it
    gives where its host allows; a runtime lowers or raises only what its host decides
    (:meth:`fusion_oci.runtimes.skeleton.SpecRuntime.capabilities`)."""

    filesystem_isolation: Literal["none", "basic", "strong"]
    network_policy: Literal["none", "coarse", "fine"]
    """``coarse``: on/off; a runtime that enforces ``network: filtered`` here says ``fine``."""
    resource_limits: Literal["none", "basic", "advanced"]
    requires_install: bool
    supports_mac: bool
    supports_linux: bool
    supports_windows: bool


NOTHING = Offers("none", "none", "none", True, False, False, False)
"""What a backend that cannot be used here offers (and a plugin that claims nothing)."""

CAPABILITIES: dict[str, Offers] = {
    "native": Offers("none", "none", "basic", False, True, True, False),
    "bubblewrap": Offers("strong", "coarse", "advanced", True, False, True, False),
    "landlock": Offers("strong", "coarse", "basic", False, False, True, False),
    "oci": Offers("strong", "coarse", "advanced", True, False, True, False),
    "podman": Offers("strong", "coarse", "advanced", True, True, True, True),
    "docker": Offers("strong", "coarse", "advanced", True, True, True, True),
    "kubernetes": Offers("strong", "coarse", "advanced", True, True, True, False),
    "sandbox-exec": Offers("basic", "coarse", "basic", False, True, False, False),
    "custom": NOTHING,
}
"""Every backend's capabilities, as data: what the runtimes report before their host refines
them, and what the TypeScript client's ``CAPABILITIES`` table copies (checked by
tests/unit/test_backend_ids.py). ``custom``: a plugin claims nothing until it says otherwise,
as a backend that is unavailable here."""
