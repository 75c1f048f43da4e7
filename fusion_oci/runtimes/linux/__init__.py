"""Linux host plumbing shared by the namespace runtimes (bubblewrap now, the OCI runtime later).

* :mod:`.userns`  — can this host create user namespaces, and if not, what is the minimal fix.
* :mod:`.cgroups` — one leaf cgroup per command: limits in, typed events out, a clean remove.
* :mod:`.egress`  — slirp4netns attached to a fresh network namespace with host loopback closed.

Each module keeps its decisions in pure functions (unit-tested) and its side effects in a few
small calls.
"""
