"""The owner's own hardening: no core dump and no memory reading of a process that holds
secrets (issue #31).

A ``fusion-oci run``, a ``serve`` and a :class:`fusion_oci.Sandbox` that starts an egress proxy
or a credential broker hold the brokered tokens, the per-task CA key and the caller's whole
environment in memory. A core file of such a process put all of them on disk, in its working
directory (with ``core_pattern = core``: the worktree a later command reads); and any process
of the same uid may read a dumpable process's ``/proc/PID/mem`` and ``environ``.
:func:`harden_owner` closes both for the rest of the process's life:

- ``RLIMIT_CORE`` soft and hard 0: no core, whatever kills the process; raising a hard limit
  takes ``CAP_SYS_RESOURCE``, which no sandboxed command has (``prlimit`` from outside cannot
  undo it);
- ``PR_SET_DUMPABLE`` 0: no core even where ``suid_dumpable`` is 0 and the limit were raised
  (by root), ``/proc/PID/`` entries owned by root, and ``ptrace``/``process_vm_readv`` of it
  refused to every process of the uid without ``CAP_SYS_PTRACE``.

What children inherit: the hard ``RLIMIT_CORE`` 0 (so commands run by this process cannot dump
core either; docker and podman commands are started by their daemon and keep its limits). The
non-dumpable flag does not pass an ``execve``: every program this process starts (the reaper,
bwrap, runc, the exec agent) is dumpable again, as before. The process's own ``/proc/self``
reads are unchanged (the kernel lets a process read its own entries whatever their owner).
"""

from __future__ import annotations

import ctypes
import resource
import sys

PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3


def harden_owner() -> None:
    """No core file, and no ``/proc/PID/mem`` or ``ptrace`` of this process by its uid's other
    processes, from now on. Idempotent; irreversible by design (an unprivileged process cannot
    raise its hard limit again). OSError when the kernel refuses (never expected)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_DUMPABLE, 0): {err}")


def dumpable() -> bool:
    """Whether this process may dump core (and be read through /proc by its uid): Linux's
    ``PR_GET_DUMPABLE``; elsewhere whether the core limit allows a core."""
    if sys.platform.startswith("linux"):
        return bool(ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0))
    return resource.getrlimit(resource.RLIMIT_CORE)[1] != 0
