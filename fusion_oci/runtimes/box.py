"""The box: a task's running sandbox as the runtimes whose commands go through its exec agent
hold it (bubblewrap, oci, landlock, native on Linux): prepare starts it, every command is a
spawn frame to its agent (:meth:`~fusion_oci.runtimes.skeleton.SpecRuntime.execute`), dispose
ends it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from fusion_oci.runtimes.linux.cgroups import CgroupEvents, read_events
from fusion_oci.runtimes.outcome import LimitCounters

if TYPE_CHECKING:
    from fusion_oci.agent.client import Agent
    from fusion_oci.host.process import ProcessOutcome
    from fusion_oci.runtimes.linux.cgroups import Cgroup

LaunchT = TypeVar("LaunchT")
LinkT = TypeVar("LinkT")


@dataclass(kw_only=True)
class Box(Generic[LaunchT, LinkT]):
    """The task's running sandbox: its agent, how it was launched, and what a runtime set up
    around it (its own cgroup, a network link)."""

    agent: Agent
    launch: LaunchT
    """Its planned launch, as each command's plan shows it (None: no launch of its own)."""
    group: Cgroup | None = None
    """The cgroup this runtime made for the sandbox (removed at dispose); None: none."""
    link: LinkT | None = None
    """The network link attached at prepare (slirp4netns for ``egress``); None: none."""
    cgroup: dict[str, str] = field(default_factory=dict)
    """The directories of the cgroup whose counters classify a command, by controller (the
    runtime's own group's, or one the OCI runtime made); {}: none is known."""
    events: CgroupEvents = field(default_factory=CgroupEvents)
    """The cgroup's counters after the last command that read them."""
    every_command: bool = True
    """Read the counters after every command (False: only after one that failed, the one a
    limit can have held: a success leaves the baseline where it was)."""

    def counters(self, outcome: ProcessOutcome) -> LimitCounters:
        """What the cgroup counted since the last command that read it (commands that run at
        once share it: a hit during both is given to both); zero without a cgroup."""
        failed = outcome.returncode != 0 or outcome.signal is not None
        if not self.cgroup or not (self.every_command or failed):
            return LimitCounters()
        after = read_events(self.cgroup)
        counters = LimitCounters(
            oom_kills=after.oom_kills - self.events.oom_kills,
            pids_max=after.pids_max - self.events.pids_max,
        )
        self.events = after
        return counters


def group_dirs(group: Cgroup | None) -> dict[str, str]:
    """A cgroup's directories as :attr:`Box.cgroup` holds them ({} for none)."""
    return {k: str(v) for k, v in group.dirs.items()} if group is not None else {}
