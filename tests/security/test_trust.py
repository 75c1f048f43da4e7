"""The trust boundary: what the host trusts later must be out of the command's reach.

Host sysctls (``kernel.core_pattern`` is a root escape: the kernel runs its pipe target as
root), masked ``/proc`` files, the project's settings (a command that rewrites them switches
the sandbox off for every later command of its task) and the audit log. Every probe observes
the host: the sysctl values, what the host's settings resolution reads, the audit file.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import SandboxPolicy
from fusion_oci.oci.spec import MASKED_PATHS
from tests.conftest import git_init
from tests.security.conftest import Prober, RootlessUser, expected, record
from tests.security.test_probes import check

DOWNGRADE = (
    'mkdir -p .fusion; printf "sandbox:\\n  backend: native\\n  policy:\\n'
    '    network: host\\n" > .fusion/settings.yaml'
)


def _sysctl(name: str) -> str:
    return Path("/proc/sys", name).read_text().strip()


def _write_sysctl(name: str, value: str) -> None:
    Path("/proc/sys", name).write_text(value + "\n")


def test_host_sysctls_cannot_be_written(prober: Prober) -> None:
    """As root without capabilities uid 0 still passes /proc/sys's permission checks: only a
    read-only /proc/sys (the bundle's readonlyPaths) stops it. Podman-rootless runs it as the
    unprivileged caller."""
    tag = secrets.token_hex(4)
    writes = {
        # Harmless values, restored below: a plain-file core pattern, one more map.
        "kernel/core_pattern": f"core.fusion-probe-{tag}",
        "vm/max_map_count": str(int(_sysctl("vm/max_map_count")) + 7),
    }
    if prober.backend != "native":
        # Natively this would rename the shared host for a moment; the two above already
        # show the leak there. In a sandbox the hostname is the UTS namespace's own.
        writes["kernel/hostname"] = f"probe-{tag}"
    before = {name: _sysctl(name) for name in writes}
    cmd = "; ".join(f"echo '{value}' > /proc/sys/{name}" for name, value in writes.items())
    try:
        prober.run(cmd)
    finally:
        after = {name: _sysctl(name) for name in writes}
        for name, value in before.items():
            if after[name] != value:
                _write_sysctl(name, value)
    changed = [name for name in writes if after[name] != before[name]]
    check("sysctl-write", prober.backend, bool(changed), f"host sysctls changed: {changed}")


def test_masked_proc_paths_are_unreadable(prober: Prober) -> None:
    """Each of the bundle's maskedPaths that holds something on this host reads empty."""
    readable = []
    for path in MASKED_PATHS:
        p = Path(path)
        try:
            if (p.is_dir() and any(p.iterdir())) or (p.is_file() and p.read_bytes()[:64]):
                readable.append(path)
        except OSError:
            continue
    assert readable, "nothing to probe: no masked path has content on this host"
    cmd = "; ".join(
        f"echo '== {p}'; if [ -d {p} ]; then ls -A {p}; else head -c 200 {p}; fi "
        f"2>/dev/null | head -c 200; echo"
        for p in readable
    )
    result = prober.run(cmd)
    sections = result.stdout.split("== ")[1:]
    leaked = [s.splitlines()[0] for s in sections if "".join(s.splitlines()[1:]).strip()]
    check("masked-proc-read", prober.backend, bool(leaked), f"readable inside: {leaked}")


def _refused(probe: str, prober: Prober, command: str, project: Path) -> bool:
    """Where the backend cannot protect a main worktree's own .fusion/ (landlock), it must
    refuse the layout, and nothing runs."""
    if expected(probe, prober.backend) != "unenforced":
        return False
    with pytest.raises(PolicyNotEnforceableError) as refused:
        prober.run(command, project_dir=project)
    assert any(".fusion" in part for part in refused.value.unenforced), refused.value.render()
    record(probe, prober.backend, "unenforced")
    return True


def _host_settings(worktree: Path) -> tuple[str, str | None]:
    """What the host resolves for this worktree next time, as `fusion-oci run` would."""
    from fusion_oci.caller import TaskFlags, resolve_task

    task = resolve_task(TaskFlags(worktree=worktree), dict(os.environ))
    settings = task.effective.settings
    network = settings.policy.network.value if settings.policy.network else None
    return settings.backend, network


@pytest.mark.parametrize("present", [True, False], ids=["fusion-present", "fusion-absent"])
def test_self_downgrade_in_a_main_worktree(prober: Prober, present: bool) -> None:
    wt = prober.worktree
    if present:
        (wt / ".fusion").mkdir()
        (wt / ".fusion" / "settings.yaml").write_text("sandbox:\n  backend: bubblewrap\n")
    before = _host_settings(wt)
    if _refused("self-downgrade-main", prober, DOWNGRADE, wt):
        return
    prober.run(DOWNGRADE, SandboxPolicy(allow_network=False), project_dir=wt)
    after = _host_settings(wt)
    check(
        "self-downgrade-main",
        prober.backend,
        after != before and after[0] == "native",
        f"host settings went from {before} to {after}",
    )


@pytest.mark.parametrize("present", [True, False], ids=["fusion-present", "fusion-absent"])
def test_self_downgrade_in_a_linked_worktree(
    prober: Prober, linked_worktree: tuple[Path, Path], present: bool
) -> None:
    repo, wt = linked_worktree
    (repo / ".fusion").mkdir()
    (repo / ".fusion" / "settings.yaml").write_text("sandbox:\n  backend: bubblewrap\n")
    if present:
        (wt / ".fusion").mkdir()
    # Natively a linked worktree's own .fusion is never read either: what leaks there is the
    # main repository's settings, reachable through the worktree's paths.
    cmd = DOWNGRADE + f"; {DOWNGRADE.replace('.fusion', f'{repo}/.fusion')}"
    before = _host_settings(wt)
    prober.run(cmd, SandboxPolicy(allow_network=False), worktree=wt)
    after = _host_settings(wt)
    check(
        "self-downgrade-linked",
        prober.backend,
        after != before,
        f"host settings went from {before} to {after}",
    )


def test_audit_log_cannot_be_forged_or_edited(prober: Prober) -> None:
    from fusion_oci.audit import AuditLog, RunEvent, default_audit_path, verify_chain

    wt = prober.worktree
    path = default_audit_path(wt)
    log = AuditLog(path, key=b"probe-key-" + secrets.token_bytes(8))
    log.emit(RunEvent(task_id="earlier", run_id="r0", backend="bubblewrap", exit_code=1))
    if prober.rootless is not None:
        prober.rootless.hand_over(path.parent)
    original = path.read_bytes()
    token = secrets.token_hex(6)
    forged = (
        '{"type":"sandbox:run","taskId":"forged-' + token + '","runId":"r",'
        '"backend":"native","exitCode":0}'
    )
    cmd = (
        f"echo '{forged}' >> {path}; sed -i 's/\"exitCode\":1/\"exitCode\":0/' {path}; "
        f"cp {path} /tmp/x && cat /tmp/x > {path}.new && mv {path}.new {path}"
    )
    if _refused("audit-forgery", prober, cmd, wt):
        return
    prober.run(cmd, project_dir=wt)
    now = path.read_bytes()
    # The host's own events of this run may follow the original lines; nothing else may.
    tampered = not now.startswith(original) or token.encode() in now
    check("audit-forgery", prober.backend, tampered, f"audit log now: {now[-300:]!r}")
    if not tampered:
        assert verify_chain(path).ok


UNPRIVILEGED = ["native", "bubblewrap", "landlock", "oci"]
"""Runtimes whose command runs with the caller's own uid, run again as an unprivileged
caller (podman-rootless is one already; rootful podman and docker run as their daemon)."""


@pytest.mark.parametrize("name", UNPRIVILEGED)
def test_host_sysctls_as_an_unprivileged_caller(name: str, rootless_user: RootlessUser) -> None:
    import shutil
    import tempfile

    from tests.backends import require_runtime

    require_runtime(name)
    base = Path(tempfile.mkdtemp(prefix="fusion-oci-probe-"))
    base.chmod(0o755)
    try:
        home, wt = base / "home", base / "wt"
        home.mkdir()
        git_init(wt)
        env = {
            "HOME": str(home),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
        }
        prober = Prober(name, base, wt, home, env, rootless_user)
        tag = secrets.token_hex(4)
        before = _sysctl("kernel/core_pattern")
        try:
            prober.run(f"echo 'core.fusion-probe-{tag}' > /proc/sys/kernel/core_pattern; id -u")
        finally:
            after = _sysctl("kernel/core_pattern")
            if after != before:
                _write_sysctl("kernel/core_pattern", before)
        check("sysctl-write-unprivileged", name, after != before)
    finally:
        shutil.rmtree(base, ignore_errors=True)
