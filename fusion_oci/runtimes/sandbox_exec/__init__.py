"""The ``sandbox-exec`` runtime (macOS): Seatbelt around the command, on the host.

- :mod:`.seatbelt` — the pure translation: task spec → the Seatbelt profile and its ``-D``
  parameters (paths never pasted into the profile)
- :mod:`.runtime` — the runtime around it: availability, the launch under the reaper shim
"""

from fusion_oci.runtimes.sandbox_exec.runtime import SandboxExecRuntime, mac_env

__all__ = ["SandboxExecRuntime", "mac_env"]
