"""The contract suite's harness: which runtimes it runs on, and a prepared sandbox on one of
them, in-process or (``podman-rootless``, ``docker-rootless``) as the unprivileged CI user
through one ``rootless_driver session`` per sandbox under ``runuser``.

A runtime joins by adding its name to ``RUNTIMES`` (and its fixture case in conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import CacheMode, PrepareContext, RunOptions, RunResult, SandboxPolicy
from fusion_oci.policy.kubernetes import KubernetesSettings
from fusion_oci.policy.settings import DockerSettings, GateSettings, SandboxSettings
from fusion_oci.sandbox import Sandbox
from tests.backends import backend_settings, require_runtime

ROOTLESS = "podman-rootless"
DOCKERLESS = "docker-rootless"
"""The docker runtime driven as the CI user against that user's rootless dockerd."""
RUNTIMES = [
    "native",
    "bubblewrap",
    "landlock",
    "oci",
    "oci-runsc",
    "podman",
    ROOTLESS,
    "docker",
    DOCKERLESS,
    "kubernetes",
    "plugin",
]
MARKS = {
    "native": pytest.mark.native,
    "bubblewrap": pytest.mark.bubblewrap,
    "landlock": pytest.mark.landlock,
    "oci": pytest.mark.oci,
    "oci-runsc": pytest.mark.runsc,
    "podman": pytest.mark.podman,
    ROOTLESS: pytest.mark.podman_rootless,
    "docker": pytest.mark.docker,
    DOCKERLESS: pytest.mark.docker_rootless,
    "kubernetes": pytest.mark.kubernetes,
    "plugin": pytest.mark.native,
}  # the test plugin runs its commands natively
NO_CGROUP_V1 = {ROOTLESS, DOCKERLESS}
"""Rootless engines: no cgroup of their own on a cgroup v1 host (limits refused there)."""
ENGINES = {"podman", "docker"}
ROOTLESS_USER = os.environ.get("FUSION_OCI_ROOTLESS_USER", "fusionci")


@dataclass(frozen=True)
class RootlessUser:
    name: str
    uid: int
    gid: int
    home: str
    xdg: str
    python: list[str]
    """``env PYTHONPATH=... PYTHON`` the user can run (container_cases.rootless_python)."""

    def argv(self, scenario: str, args: dict[str, Any]) -> list[str]:
        env = [
            "env",
            "-i",
            f"HOME={self.home}",
            f"USER={self.name}",
            f"XDG_RUNTIME_DIR={self.xdg}",
            "PATH=/usr/local/bin:/usr/bin:/bin",
            "LANG=C.UTF-8",
            *self.python[1:-1],
        ]
        return [
            "runuser",
            "-u",
            self.name,
            "--",
            *env,
            self.python[-1],
            "-m",
            "tests.integration.rootless_driver",
            scenario,
            json.dumps(args),
        ]

    def hand_over(self, tree: Path) -> None:
        os.lchown(tree, self.uid, self.gid)
        for parent, dirs, files in os.walk(tree):
            for name in dirs + files:
                path = os.path.join(parent, name)
                # Only what root made: a blob belongs to the user's subordinate uid
                # (fusion_oci/store/namespace.py), and must stay so.
                if os.lstat(path).st_uid == 0:
                    os.lchown(path, self.uid, self.gid)


@dataclass(frozen=True)
class Runtime:
    name: str
    settings: SandboxSettings
    image: str | None
    """The engines run an image (the node image the integration tests provision)."""
    user: RootlessUser | None = None
    """podman-rootless, docker-rootless: the unprivileged user that drives it."""


SOCKETS = {ROOTLESS: "podman/podman.sock", DOCKERLESS: "docker.sock"}
"""Each rootless runtime's engine socket, under its user's runtime dir."""


def rootless_user_for(backend: str) -> RootlessUser:
    """The CI user that drives ``backend``, checked: its engine's socket (under its runtime
    dir) must be there (a missing setup fails where CI requires it)."""
    from tests.integration.container_cases import checked_rootless_user, rootless_python

    user, xdg = checked_rootless_user(
        backend, SOCKETS[backend], "the rootless runs switch user with runuser"
    )
    return RootlessUser(user.pw_name, user.pw_uid, user.pw_gid, user.pw_dir, xdg, rootless_python())


def runtime_for(name: str, user: RootlessUser | None = None) -> Runtime:
    """The runtime ``name`` of RUNTIMES but ``plugin`` (its registry entry is patched in per
    test), checked available; ``user`` drives the rootless ones (rootless_user_for). The
    engines run the node task image, provisioned when missing."""
    if name in (ROOTLESS, DOCKERLESS):
        from tests.integration.images_fixture import ensure_node_image

        assert user is not None, f"{name} needs its user"
        ref = ensure_node_image(name).ref
        engine: dict[str, Any] = (
            {"backend": "podman"}
            if name == ROOTLESS
            else {
                "backend": "docker",
                "docker": DockerSettings(url=f"unix://{user.xdg}/docker.sock"),
            }
        )
        settings = SandboxSettings(
            **engine, image=ref, gates=GateSettings(sandbox_provision="allow")
        )
        return Runtime(name, settings, ref, user)
    if name == "kubernetes":
        return kubernetes_runtime()
    if name in ENGINES:
        from tests.integration.container_cases import image, require_engine

        return Runtime(name, require_engine(name), image(name))
    settings = backend_settings(name)
    require_runtime(name, settings)
    return Runtime(name, settings, None)


CONTRACT_NAMESPACE = "fusion-oci-contract"
_KUBE: list[Runtime] = []


def kubernetes_runtime() -> Runtime:
    """The test cluster (scripts/cluster.sh, started by scripts/test.sh) in a namespace of
    the suite's, with the node task image imported into both nodes; made once a session."""
    if _KUBE:
        return _KUBE[0]

    from tests.backends import require
    from tests.cluster.kube import Kube, cluster_env, load_image
    from tests.integration.images_fixture import ensure_node_image

    env = cluster_env()
    if not env.get("FUSION_OCI_K8S_BIN") or not env.get("KUBECONFIG"):
        require("kubernetes", False, "the cluster is not running: scripts/cluster.sh start")
    kube = Kube.from_env(env)
    ref = ensure_node_image("podman").ref
    load_image(ref)
    if kube.run("get", "namespace", CONTRACT_NAMESPACE, check=False).returncode != 0:
        kube.run("create", "namespace", CONTRACT_NAMESPACE, check=False)
        kube.run("-n", CONTRACT_NAMESPACE, "wait", "--for=create", "serviceaccount/default",
                 "--timeout=60s")  # fmt: skip
    # every task pod of the contract, workload and security suites is admitted under Pod
    # Security Admission's `restricted` level (issue #34)
    kube.run("label", "--overwrite", "namespace", CONTRACT_NAMESPACE,
             "pod-security.kubernetes.io/enforce=restricted",
             "pod-security.kubernetes.io/enforce-version=latest")  # fmt: skip
    settings = SandboxSettings(
        backend="kubernetes",
        image=ref,
        kubernetes=KubernetesSettings(
            kubeconfig=env["KUBECONFIG"],
            namespace=CONTRACT_NAMESPACE,
            # every test has a worktree folder of its own, so a shape of its own: plain pods
            # (sandbox mode, warm pools and claims: tests/cluster/test_kube_runtime.py)
            mode="pods",
            # the profile scripts/cluster.sh puts on each node, and the nodes' network
            seccomp_profile="fusion-oci/task.json",
            node_networks=["10.231.0.0/16"],
        ),
    )
    _KUBE.append(Runtime("kubernetes", settings, ref))
    return _KUBE[0]


class Box(Protocol):
    async def run(self, command: str | list[str], opts: RunOptions | None = None) -> RunResult: ...

    def abort(self) -> None: ...


class _Session:
    """A sandbox run by the rootless user: one driver process, one JSON line per command
    and one per result, matched by id (commands may run side by side)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[RunResult | None]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ended = ""

    async def run(self, command: str | list[str], opts: RunOptions | None = None) -> RunResult:
        assert self.proc.stdin is not None
        rid = next(self._ids)
        got: asyncio.Future[RunResult | None] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = got
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())
        ask = {
            "id": rid,
            "command": command,
            "opts": (opts or RunOptions()).model_dump(mode="json", by_alias=True),
        }
        self.proc.stdin.write((json.dumps(ask) + "\n").encode())
        await self.proc.stdin.drain()
        result = await got
        if result is None:
            pytest.fail(f"rootless driver ended:\n{self._ended}")
        return result

    async def _read(self) -> None:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        while line := await self.proc.stdout.readline():
            answer = json.loads(line)
            waiting = self._waiting.pop(answer.get("id", -1), None)
            if waiting is not None and not waiting.done():
                waiting.set_result(RunResult.model_validate(answer["result"]))
        self._ended = (await self.proc.stderr.read()).decode()[-3000:]
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_result(None)

    def abort(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b'{"abort": true}\n')

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


@contextlib.asynccontextmanager
async def sandbox(
    rt: Runtime,
    worktree: Path,
    *,
    cache_mode: CacheMode = CacheMode.OFF,
    cache_root: Path | None = None,
    project_dir: Path | None = None,
    **policy: Any,
) -> AsyncIterator[Box]:
    """A prepared sandbox on ``rt`` (PolicyNotEnforceableError when it refuses the policy).

    Package caches are off unless ``cache_mode`` says otherwise; they live under
    ``cache_root`` (default: beside the worktree), keyed by ``project_dir`` (default: a
    folder beside the worktree): the same pair gives another sandbox the same warm store."""
    if "network" not in policy:
        policy.setdefault("allow_network", False)
    site = worktree.parent
    project = project_dir or site / "project"  # outside the worktree, as an executor's is
    project.mkdir(exist_ok=True)
    ctx = PrepareContext(
        task_id=f"contract-{rt.name}",
        run_id="r1",
        worktree_path=str(worktree),
        policy=SandboxPolicy(**policy),
        image=rt.image,
        cache_mode=cache_mode,
        project_dir=str(project),
    )
    cache = cache_root or site / "cache"
    if rt.user is not None:
        async with _rootless(rt, rt.user, ctx, cache) as box:
            yield box
        return
    async with Sandbox(rt.settings, cache_root=cache) as sb:
        await sb.prepare(ctx)
        yield sb


@contextlib.asynccontextmanager
async def _rootless(
    rt: Runtime, user: RootlessUser, ctx: PrepareContext, cache: Path
) -> AsyncIterator[Box]:
    user.hand_over(Path(ctx.worktree_path).parent)
    env = {
        "HOME": user.home,
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "XDG_RUNTIME_DIR": user.xdg,
    }
    args = {
        "settings": rt.settings.model_dump(mode="json", by_alias=True),
        "ctx": ctx.model_dump(mode="json", by_alias=True),
        "env": env,
        "cacheRoot": str(cache),
    }
    proc = await asyncio.create_subprocess_exec(
        *user.argv("session", args),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd="/",
        limit=64 * 1024 * 1024,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        first = await asyncio.wait_for(proc.stdout.readline(), 300)
        if not first:
            err = await proc.stderr.read()
            pytest.fail(f"rootless driver failed:\n{err.decode()[-3000:]}")
        answer = json.loads(first)
        if "refused" in answer:
            raise PolicyNotEnforceableError(rt.settings.backend, answer["refused"])
        session = _Session(proc)
        try:
            yield session
        finally:
            await session.close()
    finally:
        if proc.returncode is None:
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 120)
            except TimeoutError:
                proc.kill()
                await proc.wait()
