"""The labels on every object fusion-oci makes in an engine, and the owner they name.

Three parties meet on them: the container translation writes them (a task container, its
cache volumes), image provisioning writes them on the export container it makes, and
``gc`` reads them to find what a crashed or killed fusion-oci left behind. They live below
all three, with the engines, so none of them imports another for a label's spelling.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fusion_oci.host.scratch import boot_id, process_start
from fusion_oci.oci.model import ANN, ANN_TASK

LABEL_TASK = ANN_TASK
"""The task id (the spec's own annotation, copied to the container's labels)."""
LABEL_KIND = ANN + "kind"
"""``container`` or ``cache``: what gc looks for (every object we create carries it)."""
LABEL_MODE = ANN + "mode"
LABEL_OWNER_PID = ANN + "owner-pid"
LABEL_OWNER_START = ANN + "owner-start"
"""Start time of the owner pid (clock ticks since boot), so a reused pid is not "alive"."""
LABEL_OWNER_BOOT = ANN + "owner-boot"
LABEL_OWNER_HOST = ANN + "owner-host"
LABEL_CACHE = ANN + "cache"
LABEL_CACHE_SCOPE = ANN + "cache-scope"
"""``project`` (kept across tasks, gc keeps it unless asked) or ``task`` (removed with it)."""
LABEL_CACHE_KEY = ANN + "cache-key"
LABEL_CACHE_DIR = ANN + "cache-dir"
"""The host directory a cache volume is bound to; gc drops the volume once it is gone."""


@dataclass(frozen=True)
class Owner:
    """The fusion-oci process that owns a container (gc removes what no live owner holds)."""

    pid: int
    start: str
    boot: str
    host: str

    def labels(self) -> dict[str, str]:
        return {
            LABEL_OWNER_PID: str(self.pid),
            LABEL_OWNER_START: self.start,
            LABEL_OWNER_BOOT: self.boot,
            LABEL_OWNER_HOST: self.host,
        }


def current_owner() -> Owner:
    """This process. boot_id and process_start are fusion_oci.host.scratch's: one owner check for
    containers, volumes and scratch folders alike."""
    pid = os.getpid()
    return Owner(pid=pid, start=process_start(pid) or "0", boot=boot_id(), host=os.uname().nodename)
