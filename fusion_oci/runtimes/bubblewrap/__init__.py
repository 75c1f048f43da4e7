"""The ``bubblewrap`` runtime: one bwrap sandbox per task, its commands through the exec agent.

- :mod:`.argv` — the pure translation: task spec → the sandbox's bwrap argv, process spec → a
  command's spawn frame (golden-tested per policy)
- :mod:`.runtime` — the runtime around it: host probes, prepare, launch, clean-up
"""

from fusion_oci.runtimes.bubblewrap.runtime import (
    AGENT_FD,
    BLOCK_FD,
    INFO_FD,
    RESOLV_PLACEHOLDER,
    RLIMITS,
    SECCOMP_FD,
    USUAL_KINDS,
    BubblewrapRuntime,
    BwrapHost,
    HostProbe,
    LaunchFds,
    agent_rlimits,
    args_launch,
    bwrap_argv,
    bwrap_spawn,
    check_spec,
    host_path_kinds,
    make_task_scratch,
    mount_args,
    needs_launch_hooks,
    plan_notes,
    probe_host_support,
    proc_protection_args,
    protected_proc_paths,
    seccomp_program,
    with_fds,
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
