"""Per-task service containers (``sandbox.policy.services``): a database or a cache a task's
tests need, started at prepare and removed at dispose, reached only by that task.

::

    plan.py   a service container as an engine creates it (pure: name, labels, SDK kwargs)
    run.py    TaskServices: engine, images (the usual provisioning), start, ready, stop
    show.py   what ``settings show``, ``plan`` and ``doctor`` say about them

How a task reaches its service (docs/security.md, "Service containers"): the container has
no network but its own loopback (``network_mode: none``); the task's relay for
``127.0.0.1:PORT`` (:mod:`fusion_oci.services`, the machinery of host services) makes its
upstream sockets inside the container's network namespace. So the service is on the task's
own 127.0.0.1:PORT on every runtime that serves host services, and on nothing else.
"""

from fusion_oci.sidecars.run import (
    SERVICES_PART,
    TaskServices,
    open_services_engine,
    services_missing,
    services_unavailable,
)

__all__ = [
    "SERVICES_PART",
    "TaskServices",
    "open_services_engine",
    "services_missing",
    "services_unavailable",
]
