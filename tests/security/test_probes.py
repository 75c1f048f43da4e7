"""Security probes; see conftest.py for the per-backend expectations."""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

import pytest

from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import SandboxPolicy
from tests.hostside import pids_with, tcp_server
from tests.security.conftest import Prober, expected, record


def check(probe: str, backend: str, leaked: bool, detail: str = "") -> None:
    want = expected(probe, backend)
    record(probe, backend, "leaks" if leaked else "blocked")
    if want == "leaks":
        assert leaked, (
            f"{probe}: expected a leak on {backend} (the probe must be able to see "
            f"one) but saw none. {detail}"
        )
    else:
        assert not leaked, f"{probe}: LEAK on {backend}. {detail}"


def assert_unenforced(probe: str, prober: Prober, policy: SandboxPolicy, part: str) -> None:
    """The backend says it cannot enforce ``part``: native runs the command and lists the
    part in the result; a sandbox backend refuses the policy before anything runs."""
    if prober.backend == "native":
        result = prober.run("true", policy)
        assert part in result.unenforced, result
    else:
        with pytest.raises(PolicyNotEnforceableError) as refused:
            prober.run("true", policy)
        assert part in refused.value.unenforced, refused.value.render()
    record(probe, prober.backend, "unenforced")


def test_home_canary_is_unreadable(prober: Prober) -> None:
    canary = "CANARY-" + secrets.token_hex(8)
    key = prober.home / ".ssh" / "id_ed25519"
    key.write_text(canary + "\n")
    (prober.home / ".bashrc").write_text(f"export TOKEN={canary}\n")
    result = prober.run(
        f"cat {key}; cat {prober.home}/.bashrc; ls -la {prober.home}; cat ~/.ssh/id_ed25519"
    )
    check(
        "home-canary", prober.backend, canary in result.stdout + result.stderr, result.stderr[-300:]
    )


def test_write_outside_worktree_leaves_nothing_on_host(prober: Prober) -> None:
    outside = prober.tmp / "outside"
    outside.mkdir()
    tag = secrets.token_hex(6)
    targets = [
        outside / "pwned",
        prober.home / ".bashrc-pwned",
        Path(f"/tmp/fusion-probe-{tag}"),
        prober.tmp / f"sibling-{tag}",
    ]
    cmd = "; ".join(f"echo pwn > {t}" for t in targets)
    cmd += f"; mkdir -p {prober.home}/.config/autostart-{tag}"
    result = prober.run(cmd + "; echo ok > inside.txt")
    try:
        created = [str(t) for t in targets if t.exists()]
        created += [d for d in [f"{prober.home}/.config/autostart-{tag}"] if Path(d).exists()]
        check("write-outside", prober.backend, bool(created), f"created on host: {created}")
        # ...while the worktree itself stays writable
        assert (prober.worktree / "inside.txt").read_text() == "ok\n", result.stderr
    finally:
        Path(f"/tmp/fusion-probe-{tag}").unlink(missing_ok=True)


def test_symlink_in_worktree_gives_no_read_or_write_outside(prober: Prober) -> None:
    outside = prober.tmp / "outside"
    outside.mkdir()
    secret = "SECRET-" + secrets.token_hex(8)
    (outside / "secret.txt").write_text(secret)
    wt = prober.worktree
    (wt / "read-link").symlink_to(outside / "secret.txt")
    (wt / "write-link").symlink_to(outside / "created.txt")
    (wt / "dir-link").symlink_to(outside)
    result = prober.run(
        "cat read-link; echo pwn > write-link; echo pwn > dir-link/new.txt;"
        " cat dir-link/secret.txt; ls dir-link"
    )
    wrote = (outside / "created.txt").exists() or (outside / "new.txt").exists()
    read = secret in result.stdout + result.stderr
    check("symlink-escape", prober.backend, read or wrote, f"read={read} wrote={wrote}")


@pytest.mark.parametrize("network", ["none", "egress"])
def test_tcp_server_on_host_loopback_sees_no_connection(prober: Prober, network: str) -> None:
    if expected(f"tcp-host-loopback-{network}", prober.backend) == "unenforced":
        # Refused before anything runs; the matrix cell keeps the `none` case's outcome.
        with pytest.raises(PolicyNotEnforceableError) as refused:
            prober.run("true", SandboxPolicy(network=network))  # type: ignore[arg-type]
        assert "network egress without host loopback" in refused.value.unenforced
        return
    with tcp_server() as (port, seen):
        hosts = ["127.0.0.1", "localhost", "10.0.2.2"]  # 10.0.2.2: slirp's host gateway
        cmd = "; ".join(
            f"timeout 3 bash -c 'echo probe > /dev/tcp/{h}/{port}' 2>/dev/null && echo reached {h}"
            for h in hosts
        )
        result = prober.run(cmd, SandboxPolicy(network=network))  # type: ignore[arg-type]
        time.sleep(0.3)  # let the accept loop record a late connection
    check(
        "tcp-host-loopback",
        prober.backend,
        bool(seen),
        f"server saw {seen}; sandbox said {result.stdout.strip()!r}",
    )


def test_kill_of_a_host_process_fails(prober: Prober) -> None:
    victim = prober.host_process(["sleep", "60"])
    try:
        prober.run(f"kill -9 {victim.pid}; kill -TERM {victim.pid}")
        time.sleep(0.1)
        check(
            "kill-host-process",
            prober.backend,
            victim.poll() is not None,
            f"victim status {victim.poll()}",
        )
    finally:
        victim.kill()
        victim.wait()


def test_git_hooks_and_config_of_common_dir_are_read_only(
    prober: Prober, linked_worktree: tuple[Path, Path]
) -> None:
    repo, wt = linked_worktree
    common = repo / ".git"
    config_before = (common / "config").read_text()
    hook = common / "hooks" / "post-checkout"
    cmd = (
        f"printf '#!/bin/sh\\necho owned\\n' > {hook}; chmod +x {hook}; "
        "git config core.hooksPath /tmp/evil-hooks; git config core.fsmonitor 'touch /tmp/x';"
        f" echo '[core] hooksPath = /tmp/evil' >> {common}/config"
    )
    prober.run(cmd, worktree=wt)
    try:
        changed = hook.exists() or (common / "config").read_text() != config_before
        check("git-hooks-write", prober.backend, changed, f"hook planted: {hook.exists()}")
    finally:
        hook.unlink(missing_ok=True)


def _host_unharmed() -> None:
    done = subprocess.run(
        ["sh", "-c", "echo alive"], capture_output=True, text=True, timeout=10, check=True
    )
    assert done.stdout == "alive\n"


def test_fork_bomb_under_pids_limit(prober: Prober) -> None:
    policy = SandboxPolicy(allow_network=False, pids_limit=64)
    if expected("fork-bomb", prober.backend) == "unenforced":
        assert_unenforced("fork-bomb", prober, policy, "pidsLimit")
        return
    # A bomb that never gives up: it is held at the limit until the timeout ends it, and the
    # reason names the limit that held it.
    bomb = "bomb() { bomb | bomb & }; bomb; while :; do sleep 5 & done"
    result = prober.run(bomb, policy, timeout_ms=3000)
    record("fork-bomb", prober.backend, "blocked" if result.reason == "pids" else "leaks")
    assert result.reason == "pids", result
    _host_unharmed()


def test_memory_hog_under_memory_limit(prober: Prober) -> None:
    policy = SandboxPolicy(allow_network=False, memory_limit_mb=64)
    if expected("memory-hog", prober.backend) == "unenforced":
        assert_unenforced("memory-hog", prober, policy, "memoryLimitMb")
        return
    hog = "python3 -c 'b = []\nwhile True: b.append(bytearray(8 << 20))'"
    result = prober.run(hog, policy, timeout_ms=30_000)
    record("memory-hog", prober.backend, "blocked" if result.reason == "oom" else "leaks")
    assert result.reason == "oom", result
    assert result.shell_status == 137, result  # SIGKILL, as the command's shell saw it
    _host_unharmed()


def test_timeout_leaves_no_process_behind(prober: Prober) -> None:
    marker = f"{900 + secrets.randbelow(99)}.{secrets.randbelow(10**6)}"
    cmd = (
        f"setsid sleep {marker} & (sleep {marker} &); nohup sleep {marker} >/dev/null 2>&1 &"
        f" sleep {marker}"
    )
    result = prober.run(cmd, timeout_ms=1500)
    assert result.timed_out and result.reason == "timeout", result
    deadline = time.monotonic() + 3
    while pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = pids_with(marker)
    check("timeout-leftovers", prober.backend, bool(left), f"left running: {left}")
