"""The caller side that the CLI (``cli/``) and the server (``server/``) share.

- :mod:`~fusion_oci.caller.frontdoor`: the one front door, a task as a caller asks for it →
  the settings layers → the worktree check → the ``PrepareContext``.
- :mod:`~fusion_oci.caller.flags`: the CLI's task flags, resolved through the front door from
  a caller's cwd and environment (the resident server resolves a client's the same way).
- :mod:`~fusion_oci.caller.runrequest`: one CLI ``run`` request, run in this process or in the
  resident server, reported as the CLI does.
"""

from __future__ import annotations

# No `typing` import at run time, and the modules load on first use: `fusion_oci.cli.run`
# imports this face at start-up, and pydantic's models are not needed to parse an argv.
TYPE_CHECKING = False

__all__ = [
    "Control",
    "Entry",
    "RunIO",
    "RunParser",
    "RunRequest",
    "Task",
    "TaskFlags",
    "TaskRequest",
    "caller_env",
    "execute",
    "find_project_dir",
    "front_door",
    "host_path",
    "resolve_task",
]

_LAZY = {
    "Entry": "fusion_oci.caller.frontdoor",
    "TaskRequest": "fusion_oci.caller.frontdoor",
    "find_project_dir": "fusion_oci.caller.frontdoor",
    "front_door": "fusion_oci.caller.frontdoor",
    "Task": "fusion_oci.caller.flags",
    "TaskFlags": "fusion_oci.caller.flags",
    "caller_env": "fusion_oci.caller.flags",
    "host_path": "fusion_oci.caller.flags",
    "resolve_task": "fusion_oci.caller.flags",
    "Control": "fusion_oci.caller.runrequest",
    "RunIO": "fusion_oci.caller.runrequest",
    "RunParser": "fusion_oci.caller.runrequest",
    "RunRequest": "fusion_oci.caller.runrequest",
    "execute": "fusion_oci.caller.runrequest",
}

if TYPE_CHECKING:
    from typing import Any

    from fusion_oci.caller.flags import Task, TaskFlags, caller_env, host_path, resolve_task
    from fusion_oci.caller.frontdoor import Entry, TaskRequest, find_project_dir, front_door
    from fusion_oci.caller.runrequest import Control, RunIO, RunParser, RunRequest, execute


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fusion_oci.caller' has no attribute {name!r}")
