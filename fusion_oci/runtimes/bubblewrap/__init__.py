"""The ``bubblewrap`` runtime: one bwrap sandbox per task, its commands through the exec agent.

- :mod:`.argv` — the pure translation: task spec → the sandbox's bwrap argv, process spec → a
  command's spawn frame (golden-tested per policy)
- :mod:`.runtime` — the runtime around it: host probes, prepare, launch, clean-up
"""

# The translation and the runtime: callers and tests name them from here.
from fusion_oci.runtimes.bubblewrap.argv import (
    AGENT_FD,
    BLOCK_FD,
    INFO_FD,
    RESOLV_PLACEHOLDER,
    RLIMITS,
    SECCOMP_FD,
    USUAL_KINDS,
    BwrapHost,
    LaunchFds,
    agent_rlimits,
    args_launch,
    bwrap_argv,
    bwrap_spawn,
    mount_args,
    needs_launch_hooks,
    plan_notes,
    proc_protection_args,
    protected_proc_paths,
    seccomp_program,
    with_fds,
)
from fusion_oci.runtimes.bubblewrap.runtime import (
    BubblewrapRuntime,
    HostProbe,
    check_spec,
    host_path_kinds,
    make_task_scratch,
    probe_host_support,
)

__all__ = [
    "AGENT_FD",
    "BLOCK_FD",
    "INFO_FD",
    "RESOLV_PLACEHOLDER",
    "RLIMITS",
    "SECCOMP_FD",
    "USUAL_KINDS",
    "BubblewrapRuntime",
    "BwrapHost",
    "HostProbe",
    "LaunchFds",
    "agent_rlimits",
    "args_launch",
    "bwrap_argv",
    "bwrap_spawn",
    "check_spec",
    "host_path_kinds",
    "make_task_scratch",
    "mount_args",
    "needs_launch_hooks",
    "plan_notes",
    "probe_host_support",
    "proc_protection_args",
    "protected_proc_paths",
    "seccomp_program",
    "with_fds",
]
