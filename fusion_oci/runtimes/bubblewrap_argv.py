"""The bubblewrap translation: a spec (and a few host facts in :class:`BwrapHost`) to the
``bwrap`` command line, pure and golden-tested per policy (see :mod:`.bubblewrap` for the
runtime around it).

The spec's mounts are replayed in order, because order is meaning: the git ``hooks/`` and
``config`` of a linked worktree's common directory are bound read-only *after* the read-write
parents they sit in.

:func:`bwrap_argv` is the whole command. At launch its options travel on ``--args FD``
(:func:`args_launch`): bwrap reads them before it does anything else, so the spec's rlimits can
be set on the waiting bwrap with prlimit(2) and are inherited by the command, without an extra
``prlimit`` exec; and the ``--setenv`` values stay out of the host's ``/proc/PID/cmdline``.
"""

from __future__ import annotations

import re
import resource
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fusion_oci.errors import BundleError, SandboxSetupError
from fusion_oci.models import NetworkMode
from fusion_oci.oci.seccomp import LIBSECCOMP_HINT, OCI_ARCHES, compile_bpf
from fusion_oci.oci.spec import (
    ANN_HOST_ROOTFS,
    ANN_IMAGE,
    Spec,
    spec_capabilities,
    spec_env,
    spec_network,
)
from fusion_oci.process import ProcessOutcome
from fusion_oci.runtimes.base import status_from_code
from fusion_oci.runtimes.linux import cgroups
from fusion_oci.runtimes.linux.cgroups import CgroupLimits

INFO_FD = "<info-fd>"
BLOCK_FD = "<block-fd>"
SECCOMP_FD = "<seccomp-fd>"
STATUS_FD = "<status-fd>"
EXEC_STATUS_HELPER = "<fusion-oci-agent>"
EXEC_STATUS_IN_SANDBOX = "/dev/fusion-oci-exec-status"
"""Where the static agent binary is bound, read-only, to run the command with --exec-status:
bwrap reports a signal as 128+N, so only a process inside can tell `exit 130` from SIGINT."""
RESOLV_PLACEHOLDER = "<egress-resolv.conf>"

# The spec's rlimits bubblewrap applies (prlimit(2) on bwrap before it forks; inherited).
RLIMITS = {
    "RLIMIT_CPU": resource.RLIMIT_CPU,
    "RLIMIT_NOFILE": resource.RLIMIT_NOFILE,
    "RLIMIT_NPROC": resource.RLIMIT_NPROC,
    "RLIMIT_CORE": resource.RLIMIT_CORE,
    "RLIMIT_AS": resource.RLIMIT_AS,
    "RLIMIT_FSIZE": resource.RLIMIT_FSIZE,
}

# /dev sub-mounts of the OCI default that bwrap's --dev already provides (pts, shm).
_COVERED_BY_DEV = ("/dev/pts", "/dev/shm")


@dataclass(frozen=True)
class BwrapHost:
    """The host facts the translation needs: tool paths and what this host supports."""

    bwrap: str = "bwrap"
    disable_userns: bool = True
    """bwrap >= 0.8: forbid nested user namespaces inside the sandbox."""
    cgroup_mode: cgroups.Mode = "v1"
    systemd_run: str | None = None
    egress_resolv_conf: str = RESOLV_PLACEHOLDER
    """Host file bound over /etc/resolv.conf in egress mode (slirp's DNS)."""
    path_kinds: tuple[tuple[str, str], ...] | None = None
    """``(path, "file" | "dir")`` for each of the spec's maskedPaths/readonlyPaths that exists
    on this host (bwrap cannot mount over a path that does not exist). None: assume every one
    exists with its usual kind (plans and goldens stay independent of the host)."""
    exec_status: str = EXEC_STATUS_HELPER
    """The host path of the agent binary (fusion_oci.agent), run as ``--exec-status``."""


@dataclass(frozen=True)
class LaunchFds:
    """The pipe ends bwrap gets: it writes its child pid to ``info``, waits on ``block`` and
    reads the compiled seccomp filter from ``seccomp``."""

    info: int | str = INFO_FD
    block: int | str = BLOCK_FD
    seccomp: int | str = SECCOMP_FD
    status: int | str = STATUS_FD
    """Where the command's wait status is written (``exit N`` / ``signal N``)."""


def _opt(options: Sequence[str], key: str) -> str | None:
    for item in options:
        if item.startswith(key + "="):
            return item.split("=", 1)[1]
    return None


def _size_bytes(value: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)", value.lower())
    if not m:
        raise BundleError(f"tmpfs size '{value}' is not understood", "expected N, Nk, Nm or Ng",
                          "fix the spec's tmpfs options")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[m.group(2)]


def mount_args(mount: Mapping[str, Any]) -> tuple[list[str], str | None]:
    """One spec mount as bwrap options, or a note saying why it is skipped. Pure."""
    dest, kind = mount["destination"], mount.get("type", "bind")
    opts = list(mount.get("options", []))
    if kind == "proc":
        return ["--proc", dest], None
    if dest == "/dev" and kind == "tmpfs":
        return ["--dev", "/dev"], None
    if dest in _COVERED_BY_DEV:
        return [], None
    if kind == "mqueue":
        return ["--mqueue", dest], None
    if kind == "sysfs":
        return [], f"{dest}: not mounted (bwrap cannot mount a fresh sysfs; the host's stays out)"
    if kind == "tmpfs":
        args: list[str] = []
        mode = _opt(opts, "mode")
        if mode:
            args += ["--perms", mode.rjust(4, "0")]
        size = _opt(opts, "size")
        if size:
            args += ["--size", str(_size_bytes(size))]
        return [*args, "--tmpfs", dest], None
    if kind == "bind" or "bind" in opts or "rbind" in opts:
        flag = "--ro-bind" if "ro" in opts else "--bind"
        return [flag, mount["source"], dest], None
    raise BundleError(f"mount type '{kind}' at {dest} is not supported by bubblewrap",
                      "bwrap can bind, tmpfs, proc, dev and mqueue",
                      "use a container backend for this spec")


def _rootfs_args(spec: Spec) -> list[str]:
    ann = spec.get("annotations", {})
    if ann.get(ANN_HOST_ROOTFS) == "true":
        return []  # the system directories come as ordinary read-only binds
    image = ann.get(ANN_IMAGE) or spec["root"]["path"]
    if not image.startswith("/"):
        raise BundleError(
            f"bubblewrap cannot use image '{image}'",
            "it needs the host's system directories or an unpacked rootfs directory",
            "leave sandbox.image unset for bubblewrap, or set it to an absolute rootfs path",
        )
    return ["--ro-bind", image, "/"]


def spec_rlimits(spec: Spec) -> list[tuple[str, int, int, int]]:
    """``(name, resource, soft, hard)`` for each of the spec's rlimits. Pure."""
    out = []
    for item in spec["process"].get("rlimits", []):
        res = RLIMITS.get(item["type"])
        if res is None:
            raise BundleError(f"rlimit {item['type']} is not supported by bubblewrap",
                              f"supported: {', '.join(RLIMITS)}", "drop it from the spec")
        out.append((item["type"], res, int(item["soft"]), int(item["hard"])))
    return out


# The usual kind of the OCI default maskedPaths/readonlyPaths (see oci/spec.py).
USUAL_KINDS = {
    "/proc/kcore": "file", "/proc/keys": "file", "/proc/latency_stats": "file",
    "/proc/timer_list": "file", "/proc/timer_stats": "file", "/proc/sched_debug": "file",
    "/proc/sysrq-trigger": "file",
}


def protected_proc_paths(spec: Spec) -> tuple[str, ...]:
    """Every maskedPaths/readonlyPaths entry of the spec, in order."""
    linux = spec.get("linux", {})
    return (*linux.get("maskedPaths", []), *linux.get("readonlyPaths", []))


def proc_protection_args(spec: Spec, host: BwrapHost) -> tuple[list[str], list[str]]:
    """The spec's maskedPaths and readonlyPaths as bwrap options, and notes. Pure.

    Dropping them is not an option: as root, uid 0 passes /proc/sys's permission checks
    without any capability, so a writable /proc/sys/kernel/core_pattern is a host root escape.
    readonly: the path bound read-only over itself. masked: a file gets /dev/null, a directory
    an empty read-only tmpfs (what runc does). /sys is not mounted by bwrap at all, so its
    entries are hidden by absence.
    """
    linux = spec.get("linux", {})
    masked, readonly = linux.get("maskedPaths", []), linux.get("readonlyPaths", [])
    kinds = (dict(host.path_kinds) if host.path_kinds is not None
             else {p: USUAL_KINDS.get(p, "dir") for p in (*masked, *readonly)})
    # What bwrap really mounts (not sysfs: it cannot mount a fresh one, the host's stays out).
    mounted = {m["destination"] for m in spec["mounts"] if mount_args(m)[0]}
    args: list[str] = []
    notes: list[str] = []
    for path in [*masked, *readonly]:
        if not any(path == d or path.startswith(d.rstrip("/") + "/") for d in mounted):
            notes.append(f"{path}: hidden (bwrap mounts nothing there)")
            continue
        kind = kinds.get(path)
        if kind is None:
            notes.append(f"{path}: absent on this host, nothing to protect")
        elif path in readonly:
            args += ["--ro-bind", path, path]
        elif kind == "file":
            args += ["--ro-bind", "/dev/null", path]
        else:
            args += ["--perms", "0555", "--tmpfs", path, "--remount-ro", path]
    return args, notes


def needs_launch_hooks(spec: Spec, host: BwrapHost) -> bool:
    """Whether bwrap must pause for us (cgroup move, slirp4netns) before the command runs."""
    direct_cgroup = host.cgroup_mode in ("v1", "v2")
    return spec_network(spec) is NetworkMode.EGRESS or (
        direct_cgroup and bool(CgroupLimits.from_spec(spec).controllers()))


def bwrap_argv(spec: Spec, host: BwrapHost, fds: LaunchFds | None = None) -> list[str]:
    """The whole launch command for a spec. Pure: same spec and host, same argv."""
    proc = spec["process"]
    network = spec_network(spec)
    argv: list[str] = []
    limits = CgroupLimits.from_spec(spec)
    if host.cgroup_mode == "systemd-run" and host.systemd_run and limits.controllers():
        unit = "fusion-oci-" + spec.get("annotations", {}).get("io.fusion-oci.run-id", "run")
        argv += cgroups.systemd_run_prefix(host.systemd_run, unit, limits)
    argv += [host.bwrap, "--unshare-all", "--unshare-user"]
    if network is NetworkMode.HOST:
        argv.append("--share-net")
    argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for cap in spec_capabilities(spec):  # the spec's bounding set (empty in our bundles)
        argv += ["--cap-add", cap]
    if host.disable_userns:
        argv.append("--disable-userns")
    user = proc.get("user", {})
    argv += ["--uid", str(user.get("uid", 0)), "--gid", str(user.get("gid", 0))]
    if spec.get("hostname"):
        argv += ["--hostname", spec["hostname"]]
    argv += _rootfs_args(spec)
    for mount in spec["mounts"]:
        argv += mount_args(mount)[0]
    argv += ["--ro-bind", host.exec_status, EXEC_STATUS_IN_SANDBOX]
    argv += proc_protection_args(spec, host)[0]
    if network is NetworkMode.EGRESS:
        argv += ["--ro-bind", host.egress_resolv_conf, "/etc/resolv.conf"]
    if spec["root"].get("readonly", True):
        # Last: mount points above were created in bwrap's tmpfs root; now nothing new can be.
        argv += ["--remount-ro", "/"]
    fds = fds or LaunchFds()
    if needs_launch_hooks(spec, host):
        argv += ["--info-fd", str(fds.info), "--block-fd", str(fds.block)]
    if spec.get("linux", {}).get("seccomp"):
        # Applied by bwrap right before exec, after its own mounts and namespace setup.
        argv += ["--seccomp", str(fds.seccomp)]
    argv.append("--clearenv")
    for key, value in spec_env(spec).items():
        argv += ["--setenv", key, value]
    argv += ["--chdir", proc.get("cwd", "/"), "--", *sandbox_command(spec, fds.status)]
    return argv


def sandbox_command(spec: Spec, status: int | str = STATUS_FD) -> list[str]:
    """What bwrap execs: the spec's args under the status helper. Pure."""
    return [EXEC_STATUS_IN_SANDBOX, "--exec-status", str(status), "--", *spec["process"]["args"]]


def with_fds(argv: Sequence[str], spec: Spec, fds: LaunchFds) -> list[str]:
    """:func:`bwrap_argv`'s command (made with the placeholder :class:`LaunchFds`) with the
    launch's own pipe ends in place of the placeholders. Pure.

    By position, not by value: the fd options sit right before ``--clearenv``, whose place is
    counted from the end (``--setenv`` triples, ``--chdir DIR``, ``--``, the args), so an
    environment value or argument that reads like a placeholder is never touched.
    """
    out = list(argv)
    command = sandbox_command(spec)
    end = len(out) - len(command) - 1  # bwrap's own "--"
    if end < 0 or out[end + 1:end + 5] != command[:4]:
        raise ValueError("the bwrap command line does not match its spec")
    out[end + 3] = str(fds.status)
    clear = end - 2 - 3 * len(spec_env(spec)) - 1
    if clear < 0 or out[clear] != "--clearenv":
        raise ValueError("the bwrap command line does not match its spec")
    at = clear
    if at >= 2 and out[at - 2] == "--seccomp" and out[at - 1] == SECCOMP_FD:
        out[at - 1] = str(fds.seccomp)
        at -= 2
    if at >= 4 and out[at - 4] == "--info-fd" and out[at - 3] == INFO_FD \
            and out[at - 2] == "--block-fd" and out[at - 1] == BLOCK_FD:
        out[at - 3], out[at - 1] = str(fds.info), str(fds.block)
    return out


def seccomp_program(spec: Spec) -> bytes | None:
    """The spec's seccomp profile as the classic BPF bwrap reads from ``--seccomp``, compiled
    by libseccomp (deterministic: same profile, same program)."""
    profile = spec.get("linux", {}).get("seccomp")
    if not profile:
        return None
    arches = [a for a, names in OCI_ARCHES.items()
              if set(names) & set(profile.get("architectures", []))]
    if not arches:
        raise BundleError("the seccomp profile cannot be compiled for bubblewrap",
                          f"no supported architecture in {profile.get('architectures')}",
                          f"list one of {', '.join(n for v in OCI_ARCHES.values() for n in v)}")
    try:
        return compile_bpf(profile, arches[0])
    except ValueError as exc:
        raise BundleError("the seccomp profile cannot be compiled for bubblewrap", str(exc),
                          "use a container backend for this seccomp profile") from exc
    except RuntimeError as exc:
        raise SandboxSetupError("the seccomp profile cannot be compiled here", str(exc),
                                LIBSECCOMP_HINT) from exc


def plan_notes(spec: Spec, host: BwrapHost) -> list[str]:
    notes = [n for m in spec["mounts"] if (n := mount_args(m)[1])]
    notes += proc_protection_args(spec, host)[1]
    if spec.get("linux", {}).get("seccomp"):
        notes.append("seccomp: the spec's profile compiled to classic BPF, read by bwrap from "
                     "the seccomp fd")
    network = spec_network(spec)
    if network is NetworkMode.EGRESS:
        notes.append("egress: slirp4netns --configure --disable-host-loopback on the child's "
                     "network namespace before the command starts")
    limits = CgroupLimits.from_spec(spec)
    if limits.controllers():
        notes.append(f"cgroup ({host.cgroup_mode}): " + ", ".join(sorted(limits.controllers())))
    if rlimits := spec_rlimits(spec):
        notes.append("rlimits, set with prlimit(2) on bwrap while it waits for its options on "
                     "--args (inherited by the command): "
                     + ", ".join(f"{name}={soft}:{hard}" for name, _, soft, hard in rlimits))
    return notes


def split_status(outcome: ProcessOutcome) -> tuple[int | None, str | None]:
    """bwrap's status read back as the command's: 127/126 when bwrap could not exec it, else
    the one 128+N rule (:func:`~fusion_oci.runtimes.base.status_from_code`)."""
    code = outcome.returncode
    if code == 1 and (failed := exec_failure(outcome.stderr)) is not None:
        return failed, None
    return status_from_code(code, outcome.signal)


def exec_failure(stderr: bytes) -> int | None:
    """The shell's status for a command bwrap could not exec (it exits 1 itself and says
    ``bwrap: execvp NAME: REASON`` as its last line): 127 when not found, else 126. Pure."""
    last = stderr.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    if not last.startswith(b"bwrap: execvp "):
        return None
    return 127 if last.endswith(b"No such file or directory") else 126


def args_launch(argv: Sequence[str], spec: Spec, host: BwrapHost, fd: int | str,
                status: int | str = STATUS_FD) -> tuple[list[str], bytes]:
    """:func:`bwrap_argv`'s command as launched: ``[prefix...] bwrap --args FD -- COMMAND``,
    and the options bwrap reads from FD (NUL-separated). Pure.

    Split by position, not by looking for ``--``: a ``--setenv`` value may be ``--``.
    """
    start = list(argv).index(host.bwrap)
    command = sandbox_command(spec, status)
    end = len(argv) - len(command) - 1
    if end <= start or argv[end] != "--" or list(argv[end + 1:]) != command:
        raise ValueError("the bwrap command line does not end with -- and the spec's command")
    payload = b"".join(a.encode() + b"\0" for a in argv[start + 1:end])
    return [*argv[:start + 1], "--args", str(fd), "--", *command], payload
