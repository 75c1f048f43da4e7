"""The shims: small programs that fusion-oci starts by path between itself and a command.

- ``reaper.py``: the child subreaper that ends a command's whole tree (sandbox-exec, native off
  Linux) and, for the landlock runtime, the seccomp supervisor outside the sandbox
  (``supervisor.py``, ``connects.py``) whose child confines itself (``confine.py``) and execs
  the task's exec agent; ``seccomp_notify.py`` is what those two sides agree on;
- ``watchdog.py``: runs a helper service (a ``podman system service`` of our own) for exactly
  as long as its owner lives;
- ``nssockets.py``: makes sockets in a rootless engine's container network namespace for an
  owner that is not root (it joins the namespace's user namespace first, which a process
  with threads cannot): the relay of a task's service containers.

They run as ``python -S -E -s PATH ...``: no site-packages, no environment, so the start-up
is the interpreter's alone and nothing of the caller's (a ``PYTHONPATH``, the installed
fusion_oci) leaks in. Hence the rule of this folder, which tests/unit/test_shims.py checks:
its modules import the standard library and one another only, never the rest of fusion_oci.
Run by path, a script finds its siblings on ``sys.path[0]`` (its own folder) and imports
them by bare name; imported as ``fusion_oci.shims.X`` (the host's own uses: the /proc walk
of :mod:`fusion_oci.shims.proctree`, the Landlock ABI probe, the tests), a module takes them
from its package, so each import of a sibling reads::

    if __package__:
        from . import proctree
    else:  # run by path
        import proctree

This file is never read when a script runs by path.
"""

from __future__ import annotations

from pathlib import Path

REAPER = Path(__file__).with_name("reaper.py")
"""The subreaper shim (:func:`fusion_oci.host.process.reaper_argv` wraps a command in it)."""
WATCHDOG = Path(__file__).with_name("watchdog.py")
"""The watchdog that keeps a service of ours alive only as long as its owner."""
NSSOCKETS = Path(__file__).with_name("nssockets.py")
"""Sockets in a rootless engine's container network namespace (services/netns.py)."""
