"""The ``oci`` runtime's parts (the class itself is :mod:`fusion_oci.runtimes.oci`).

* :mod:`.launch` — the one launch builder: task spec → the task container's bundle (the agent
  as init), argv, env, cwd (what plan shows and prepare starts), and a command's spawn frame.
* :mod:`.state` — per-task state directories, the runtime CLI's bookkeeping calls, gc.
* :mod:`.egress` — the egress rendezvous (FIFOs and slirp4netns) of the task's container.
* :mod:`.gvisor` — what differs for runsc.
* :mod:`.probe` — what this host allows: refusals with their fix, egress, the version.
"""
