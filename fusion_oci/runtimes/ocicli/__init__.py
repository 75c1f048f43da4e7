"""The ``oci`` runtime's parts (the class itself is :mod:`fusion_oci.runtimes.oci`).

* :mod:`.launch` — the one launch builder: spec → bundle, argv, env, cwd (what plan shows and
  execute runs), exit statuses.
* :mod:`.state` — per-task state directories, the runtime CLI's bookkeeping calls, gc.
* :mod:`.egress` — the egress rendezvous (FIFOs and slirp4netns) of one container.
* :mod:`.gvisor` — what differs for runsc.
* :mod:`.probe` — what this host allows: refusals with their fix, egress, the version.
"""
