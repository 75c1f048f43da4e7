"""What a task asks a runtime to enforce, read once from its typed spec.

A task's requirements are a pure function of its :class:`~fusion_oci.oci.model.TaskSpec` and
the rlimits its commands run under (:attr:`fusion_oci.resolve.ResolvedTask.rlimits`): the spec
is the contract, so nothing is computed again from the policy it was compiled from.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import TYPE_CHECKING

from fusion_oci.models import NetworkMode

if TYPE_CHECKING:
    from fusion_oci.oci.model import Rlimit, TaskSpec
    from fusion_oci.resolve import ResolvedTask


class Requirement(StrEnum):
    """A part of a task spec that some runtime must enforce."""

    FILESYSTEM = "filesystem isolation"
    PROC_PATHS = "maskedPaths/readonlyPaths"
    """The bundle's /proc and /sys protections (a writable /proc/sys is a root escape)."""
    HOST_PROCESSES = "host processes (signals, rlimits, priorities)"
    """No command signals, or changes the rlimits, scheduling or I/O priority of, a process
    outside the sandbox: hidden by a pid namespace, or refused (Landlock signal scoping, ABI
    6+, and the landlock runtime's seccomp rules). The task's owner holds the egress proxy and
    the credential broker (issue #31)."""
    NETWORK_NONE = "network none"
    NETWORK_EGRESS = "network egress without host loopback"
    NETWORK_FILTERED = "network filtered (egress only through the task's proxy)"
    MEMORY = "memoryLimitMb"
    CPU_QUOTA = "cpuLimit.maxCores"
    CPU_TIME = "cpuLimit.maxMs"
    PIDS = "pidsLimit"
    ENV = "envAllowlist"
    TMP_SIZE = "tmpSizeMb"
    FILE_SIZE = "fileSizeLimitMb"
    HOST_SERVICES = "hostServices (granted host services only, through the task's relays)"
    """Each granted host service where programs expect it inside, and nothing else of the
    host's loopback (fusion_oci.services)."""
    PUBLISHED_PORTS = "publishPorts (the named ports inside, on the host's loopback)"
    """Each published port of the sandbox's own loopback reachable on the host at its host
    port, and nothing else inside (fusion_oci.services.publish)."""


SANDBOXED = frozenset(
    {
        Requirement.FILESYSTEM,
        Requirement.PROC_PATHS,
        Requirement.ENV,
        Requirement.HOST_PROCESSES,
        Requirement.NETWORK_NONE,
        Requirement.NETWORK_FILTERED,
        Requirement.HOST_SERVICES,
        Requirement.TMP_SIZE,
        Requirement.CPU_TIME,
        Requirement.FILE_SIZE,
    }
)
"""What every runtime that gives the task a sandbox of its own namespaces, with the exec agent
inside, enforces (bubblewrap, oci, podman, docker): its mount, pid and network namespaces (an
empty one for ``filtered``, the agent forwarding to the task's proxy), the spec's environment,
/proc masks and tmpfs sizes, and the agent's setrlimit for each command. Each adds what its
host allows (egress, cgroup limits, published ports)."""

NETWORK_REQUIREMENT = {
    NetworkMode.NONE: Requirement.NETWORK_NONE,
    NetworkMode.EGRESS: Requirement.NETWORK_EGRESS,
    NetworkMode.FILTERED: Requirement.NETWORK_FILTERED,
}


def spec_requirements(spec: TaskSpec, rlimits: Iterable[Rlimit] = ()) -> frozenset[Requirement]:
    """What enforcing ``spec`` takes (with the rlimits its commands get), read from its OCI
    fields (the network annotation only for egress/filtered versus none). Pure."""
    need = {
        Requirement.FILESYSTEM,
        Requirement.PROC_PATHS,
        Requirement.ENV,
        Requirement.HOST_PROCESSES,
    }
    network = NETWORK_REQUIREMENT.get(spec.network)
    if network is not None:
        need.add(network)
    resources = spec.resources
    for present, req in (
        (resources.memory, Requirement.MEMORY),
        (resources.pids, Requirement.PIDS),
        (resources.cpu, Requirement.CPU_QUOTA),
    ):
        if present is not None:
            need.add(req)
    kinds = {r.type for r in rlimits}
    if "RLIMIT_CPU" in kinds:
        need.add(Requirement.CPU_TIME)
    if "RLIMIT_FSIZE" in kinds:
        need.add(Requirement.FILE_SIZE)
    if spec.tmpfs_sizes():
        need.add(Requirement.TMP_SIZE)
    if spec.host_services:
        need.add(Requirement.HOST_SERVICES)
    if spec.published_ports:
        need.add(Requirement.PUBLISHED_PORTS)
    return frozenset(need)


def task_requirements(task: ResolvedTask) -> frozenset[Requirement]:
    """What enforcing a resolved task takes: its spec and its commands' rlimits. Pure."""
    return spec_requirements(task.spec, task.rlimits)


def unenforced(need: frozenset[Requirement], enforced: frozenset[Requirement]) -> list[str]:
    """The parts of ``need`` outside ``enforced``, sorted: what :meth:`Runtime.check` says."""
    return sorted(r.value for r in need - enforced)
