"""The backend ids: the one list the settings, the CLI's ``--backend`` choices, the task
prompt's ``**Sandbox:** X`` line, the runtime registry and the TypeScript client
(``SandboxBackendId``, checked by tests/unit/test_backend_ids.py) are read from. Adding a
backend is a name here plus its runtime folder and its entry point (pyproject.toml). Stdlib
only: the CLI's fast path reads it before anything else is imported."""

from __future__ import annotations

from typing import Literal, get_args

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
