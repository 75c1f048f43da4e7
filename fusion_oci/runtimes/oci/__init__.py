"""The ``oci`` runtime: any OCI runtime CLI (runc, crun, runsc, youki) run on the task's bundle.

* :mod:`.runtime` — the runtime class: probes, prepare, the task container, dispose.
* :mod:`.launch` — the one launch builder: task spec → the task container's bundle (the agent
  as init), argv, env, cwd (what plan shows and prepare starts), and a command's spawn frame.
* :mod:`.state` — per-task state directories, the runtime CLI's bookkeeping calls, gc.
* :mod:`.egress` — the egress rendezvous (FIFOs and slirp4netns) of the task's container.
* :mod:`.gvisor` — what differs for runsc.
* :mod:`.probe` — what this host allows: refusals with their fix, egress, the version.
"""

# The runtime and the parts callers and tests name from here.
from fusion_oci.oci.ops import EgressHook, with_init
from fusion_oci.runtimes.oci.launch import bundle_spec, egress_launch_argv, run_argv, runtime_flags
from fusion_oci.runtimes.oci.runtime import OciRuntime, exit_status, limit_counters
from fusion_oci.runtimes.oci.state import container_id, gc_oci, list_containers, state_base

__all__ = [
    "EgressHook",
    "OciRuntime",
    "bundle_spec",
    "container_id",
    "egress_launch_argv",
    "exit_status",
    "gc_oci",
    "limit_counters",
    "list_containers",
    "run_argv",
    "runtime_flags",
    "state_base",
    "with_init",
]
