"""The ``native`` runtime: the command runs on the host as the caller (the status quo).

- :mod:`.runtime` — the runtime, and :func:`status_quo_env` (pure): the caller's environment,
  narrowed only by an ``envAllowlist``
"""

from fusion_oci.runtimes.native.runtime import (
    NativeRuntime,
    status_quo_env,
)

__all__ = [
    "NativeRuntime",
    "status_quo_env",
]
