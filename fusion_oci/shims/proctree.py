"""Who descends from a process: one walk of ``/proc`` (``ps`` off Linux), for the reaper shim,
which ends what its command left running, and for the exec agent's client
(:mod:`fusion_oci.agent.client`), which looks for a run's leftovers. Standard library only
(see :mod:`fusion_oci.shims`): the reaper imports it by path, at every start.
"""

import os
import sys

LINUX = sys.platform.startswith("linux")


def parent_map() -> dict[int, list[int]]:
    """Every process's children by parent pid, read once (a snapshot: pids come and go)."""
    children: dict[int, list[int]] = {}
    if not LINUX:
        # No subreaper here: orphans re-parent to launchd, but they keep our process group,
        # so group members count as ours too.
        me, group = os.getpid(), os.getpgid(0)
        out = os.popen("ps -axo pid=,ppid=,pgid=").read()  # noqa: S605 - fixed argv, no input
        for line in out.splitlines():
            fields = line.split()
            if len(fields) == 3 and all(f.isdigit() for f in fields):
                pid, ppid, pgid = (int(f) for f in fields)
                parent = me if pgid == group and pid != me else ppid
                children.setdefault(parent, []).append(pid)
        return children
    for name in os.listdir("/proc"):  # noqa: PTH208 - pathlib costs start-up time here
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        after_comm = stat.rsplit(b")", 1)[-1].split()
        if len(after_comm) > 2:
            children.setdefault(int(after_comm[1]), []).append(int(name))
    return children


def descendants(root: int) -> list[int]:
    """The pids below ``root``: children, theirs, and so on (none when it has none)."""
    children = parent_map()
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out
