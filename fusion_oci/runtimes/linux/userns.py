"""User-namespace availability: the sysctls that switch it off, and what a failed probe means.

bwrap needs to create a user namespace (or be setuid). Hosts disable that in three common ways,
each with a different one-line fix; a container host whose seccomp profile filters
``unshare``/``clone`` flags looks the same from inside, so a real ``bwrap`` probe settles it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fusion_oci.host.process import probe

PROC_SYS = Path("/proc/sys")

SYSCTL_FILES = {
    "kernel.unprivileged_userns_clone": "kernel/unprivileged_userns_clone",
    "user.max_user_namespaces": "user/max_user_namespaces",
    "kernel.apparmor_restrict_unprivileged_userns": "kernel/apparmor_restrict_unprivileged_userns",
}


@dataclass(frozen=True)
class Problem:
    """Why namespaces are unusable here, and the smallest change that fixes it."""

    reason: str
    hint: str


def read_sysctls(proc_sys: Path = PROC_SYS) -> dict[str, int]:
    """The userns-related sysctls that exist on this kernel (absent ones are left out)."""
    out: dict[str, int] = {}
    for name, rel in SYSCTL_FILES.items():
        try:
            out[name] = int((proc_sys / rel).read_text().strip())
        except (OSError, ValueError):
            continue
    return out


def diagnose_sysctls(sysctls: dict[str, int], *, uid: int) -> Problem | None:
    """A problem the sysctls already prove, or None. Pure.

    ``max_user_namespaces=0`` stops everyone, root included; the other two only stop
    unprivileged callers (root creates namespaces without a user namespace).
    """
    if sysctls.get("user.max_user_namespaces") == 0:
        return Problem(
            "user namespaces are disabled (sysctl user.max_user_namespaces=0)",
            "sysctl -w user.max_user_namespaces=15000 (persist it in /etc/sysctl.d/)",
        )
    if uid == 0:
        return None
    if sysctls.get("kernel.unprivileged_userns_clone") == 0:
        return Problem(
            "unprivileged user namespaces are disabled (sysctl kernel.unprivileged_userns_clone=0)",
            "sysctl -w kernel.unprivileged_userns_clone=1 (persist it in /etc/sysctl.d/)",
        )
    if sysctls.get("kernel.apparmor_restrict_unprivileged_userns") == 1:
        return Problem(
            "AppArmor restricts unprivileged user namespaces "
            "(kernel.apparmor_restrict_unprivileged_userns=1, Ubuntu 23.10+)",
            "allow bwrap with an AppArmor profile granting 'userns,' "
            "(e.g. /etc/apparmor.d/bwrap, then `apparmor_parser -r` it), or "
            "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0",
        )
    return None


def classify_probe_failure(stderr: str, sysctls: dict[str, int], *, uid: int) -> Problem:
    """Explain a failed ``bwrap --unshare-all ... true``. Pure."""
    known = diagnose_sysctls(sysctls, uid=uid)
    if known is not None:
        return known
    text = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
    lowered = stderr.lower()
    if "setting up uid map" in lowered or "uid_map" in lowered:
        return Problem(
            f"bwrap cannot map its user id ({text})",
            "an LSM (AppArmor/SELinux) denies user namespaces to bwrap: allow 'userns' for "
            "/usr/bin/bwrap in its profile",
        )
    if "operation not permitted" in lowered or "permission denied" in lowered:
        return Problem(
            f"the kernel refuses new namespaces to bwrap ({text}); this is typical of a "
            "container whose seccomp profile filters unshare/clone/mount",
            "run the outer container with a seccomp profile that allows namespaces "
            "(docker/podman: --security-opt seccomp=unconfined, or --privileged), or choose "
            "the podman/docker backend on the host instead",
        )
    return Problem(
        f"bwrap cannot create its namespaces ({text})",
        "run `bwrap --unshare-all --ro-bind / / true` to see the full error",
    )


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    problem: Problem | None = None


def probe_bwrap(
    bwrap: str,
    *,
    uid: int,
    disable_userns: bool,
    timeout_s: float = 10.0,
    proc_sys: Path = PROC_SYS,
) -> ProbeResult:
    """Run the smallest sandbox with every namespace the runtime uses; explain a failure."""
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
    ]
    if disable_userns:
        argv.append("--disable-userns")
    argv += ["--ro-bind", "/", "/", "--proc", "/proc", "--", "true"]
    done = probe(argv, timeout_s=timeout_s, env={"PATH": "/usr/bin:/bin"})
    if done.returncode is None:
        return ProbeResult(
            False, Problem(f"bwrap could not be run ({done.error})", "check the bwrap installation")
        )
    if done.ok:
        return ProbeResult(True)
    stderr = done.text("stderr")
    return ProbeResult(False, classify_probe_failure(stderr, read_sysctls(proc_sys), uid=uid))
