"""Adversarial probes, written once and run against every backend in ``BACKENDS``.

Each probe does something a malicious or buggy command would do and then checks the effect on
the HOST (a canary's content in the output, a file on disk, a connection accepted by a server
the test owns, a process the test started still alive). ``EXPECT`` says per backend whether the
probe must be blocked or must leak: native isolates nothing, so there a probe is asserted to
leak, which proves that the probe can see a leak at all. A container runtime joins by adding
its id to ``BACKENDS`` (and any deviations to ``EXPECT``).

``podman-rootless`` is the podman runtime driven as the unprivileged CI user, and
``docker-rootless`` the docker runtime driven as that user against its rootless dockerd: each
command goes through ``tests.integration.rootless_driver probe`` under ``runuser``, while the
host-side checks stay here (as root). Everything a probe targets (the fake $HOME, the worktree, the
"outside" files) belongs to that user on the host, so a leak is stopped by the sandbox or not
at all, never by host permissions; the processes a probe attacks run as that user too.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from fusion_oci.errors import PolicyNotEnforceableError
from fusion_oci.models import CacheMode, PrepareContext, RunOptions, RunResult, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox
from tests.backends import backend_settings, require, require_runtime

BACKENDS = [
    "native",
    "bubblewrap",
    "landlock",
    "oci",
    "oci-runsc",
    "podman",
    "docker",
    "podman-rootless",
    "docker-rootless",
    "kubernetes",
]
ROOTLESS = "podman-rootless"
DOCKERLESS = "docker-rootless"
ROOTLESS_BACKENDS = {ROOTLESS: "rootless_user", DOCKERLESS: "dockerless_user"}
"""The backends driven as the unprivileged CI user, and the session fixture of each."""
ROOTLESS_USER = os.environ.get("FUSION_OCI_ROOTLESS_USER", "fusionci")


def _rootless_xdg() -> str | None:
    try:
        return f"/run/user/{pwd.getpwnam(ROOTLESS_USER).pw_uid}"
    except KeyError:
        return None


def engine_env(backend: str) -> dict[str, str]:
    """How a container backend finds its engine: the env a user would have (the CI's sockets)."""
    if backend == "docker" and os.environ.get("DOCKER_HOST"):
        return {"DOCKER_HOST": os.environ["DOCKER_HOST"]}
    if backend == "podman" and os.environ.get("FUSION_OCI_PODMAN_URL"):
        return {"CONTAINER_HOST": os.environ["FUSION_OCI_PODMAN_URL"]}
    if backend in ROOTLESS_BACKENDS and (xdg := _rootless_xdg()):
        # The user's own socket, found through its runtime dir as podman itself finds it;
        # a rootless dockerd's user exports DOCKER_HOST (Docker's rootless setup says so).
        if backend == DOCKERLESS:
            return {"XDG_RUNTIME_DIR": xdg, "DOCKER_HOST": f"unix://{xdg}/docker.sock"}
        return {"XDG_RUNTIME_DIR": xdg}
    return {}


Expect = Literal["blocked", "leaks", "unenforced"]
"""blocked: the host is untouched. leaks: the probe gets through (asserted, to prove the probe
works). unenforced: the backend cannot enforce it and says so (native: in
RunResult.unenforced; a sandbox backend: it refuses the policy, PolicyNotEnforceableError); the
harmful command is not run (a fork bomb on the bare host would harm the machine)."""

EGRESS_PROBES = (
    "egress-denied-host",
    "egress-direct-connect",
    "egress-raw-udp",
    "egress-outside-dns",
    "egress-host-loopback",
    "egress-metadata",
    "egress-rebind-loopback",
    "egress-ignores-proxy",
)
"""test_egress.py's probes (one sandboxed program, egress_world.PROBE_JS, judged per probe)."""
CREDENTIAL_PROBES = (
    "credential-push-disallowed-ref",
    "credential-sentinel-other-header",
    "credential-sentinel-in-url",
    "credential-sentinel-in-body",
    "credential-sentinel-wrong-host",
    "credential-sentinel-uncredentialed-host",
    "credential-echoed-value",
    "credential-value-in-output",
    "credential-value-in-sandbox",
    "credential-value-elsewhere",
    # issue #31: the origin, the scope, encoded echoes, plain HTTP request by request
    "credential-sentinel-host-mismatch",
    "credential-sentinel-absolute-form",
    "credential-out-of-scope-echo",
    "credential-echo-encoded",
    "credential-plain-body",
    "credential-plain-pipelined",
)
"""test_credentials_probes.py's probes (one sandboxed command, judged per probe)."""
SERVICE_PROBES = (
    "service-ungranted-port",
    "service-through-relay",
    "service-unix-path",
    "service-socket-handover",
    "service-handed-socket",
)
"""test_host_services.py's probes (policy.hostServices)."""

EXPECT: dict[tuple[str, str], Expect] = {
    ("home-canary", "native"): "leaks",
    ("resident-server", "native"): "leaks",  # test_resident.py: the fast CLI's server socket
    ("write-outside", "native"): "leaks",
    ("symlink-escape", "native"): "leaks",
    ("tcp-host-loopback", "native"): "leaks",
    ("kill-host-process", "native"): "leaks",
    ("git-hooks-write", "native"): "leaks",
    ("fork-bomb", "native"): "unenforced",
    ("memory-hog", "native"): "unenforced",
    ("timeout-leftovers", "native"): "blocked",  # the reaper shim ends the whole tree
    # test_threats.py
    ("cloud-credentials", "native"): "leaks",
    ("other-worktrees", "native"): "leaks",
    ("hard-link-escape", "native"): "leaks",
    ("chmod-outside", "native"): "leaks",
    ("persistence", "native"): "leaks",
    ("git-hooks-plain-repo", "native"): "leaks",
    ("udp-dns-none", "native"): "leaks",
    ("dashboard-4040", "native"): "leaks",
    ("proc-leak", "native"): "leaks",
    ("devices", "native"): "leaks",
    ("privileged-syscalls", "native"): "leaks",
    ("engine-sockets", "native"): "leaks",
    ("term-ignoring-daemon", "native"): "blocked",  # the reaper shim ends the whole tree
    ("disk-fill-tmp", "native"): "unenforced",  # /tmp is the host's own directory
    # test_trust.py: native runs as the caller (root here) on the host itself.
    ("sysctl-write", "native"): "leaks",
    ("masked-proc-read", "native"): "leaks",
    ("self-downgrade-main", "native"): "leaks",
    ("self-downgrade-linked", "native"): "leaks",
    ("audit-forgery", "native"): "leaks",
    # landlock: no namespace and no cgroup. Memory, pids and tmpSizeMb are refused; egress
    # without host loopback cannot be enforced (Landlock's TCP rules know ports, not
    # addresses), so the egress cases are refused. Read-only paths inside the writable
    # worktree (.git/hooks, .git/config, .fusion/, a linked worktree's .git file) cannot be
    # expressed in Landlock: they are put back after each command, which is what the
    # host-side probes observe (and listed as not read-only during it).
    ("fork-bomb", "landlock"): "unenforced",
    # The main worktree as the project: its .fusion/ would be writable under Landlock, so the
    # landlock runtime refuses that layout (test_trust.py).
    ("self-downgrade-main", "landlock"): "unenforced",
    ("audit-forgery", "landlock"): "unenforced",
    ("memory-hog", "landlock"): "unenforced",
    ("disk-fill-tmp", "landlock"): "unenforced",
    ("dashboard-4040", "landlock"): "unenforced",
    ("tcp-host-loopback-egress", "landlock"): "unenforced",
    # gVisor's processes are tasks of its userspace kernel: a host pids cgroup would count
    # the sandbox's threads instead, so pidsLimit is refused (memory is enforced: oom).
    ("fork-bomb", "oci-runsc"): "unenforced",
    ("disk-fill-tmp", "oci-runsc"): "unenforced",  # gVisor's tmpfs ignores size=
    # Rootless podman and a rootless dockerd get no cgroup of their own on a cgroup v1 host:
    # the lifecycle refuses memory, pids and CPU-quota limits there
    # (PolicyNotEnforceableError) rather than let the engine ignore them. Where the user's
    # engine reports cgroup v2 they are enforced, and expected() turns these back into
    # "blocked".
    ("fork-bomb", ROOTLESS): "unenforced",
    ("memory-hog", ROOTLESS): "unenforced",
    ("fork-bomb", DOCKERLESS): "unenforced",
    ("memory-hog", DOCKERLESS): "unenforced",
    # network filtered (test_egress.py): native lists it unenforced (it has no network
    # namespace); landlock enforces it with Landlock's TCP rules and the connect supervisor,
    # oci (runc, runsc) with the container's empty netns and the agent's forwarder.
    **{(probe, "native"): "unenforced" for probe in EGRESS_PROBES},
    # test_policy_inputs.py: filtered, so native lists it unenforced like the egress probes.
    ("profile-widening", "native"): "unenforced",
    ("prepare-input-planted", "native"): "unenforced",
    # test_host_git.py: native runs as the caller on the host; nothing stands between.
    ("git-nested-repo", "native"): "leaks",
    ("git-submodule-rewrite", "native"): "leaks",
    **{(probe, "native"): "unenforced" for probe in CREDENTIAL_PROBES},
    # test_host_services.py (issue #35): native serves no grant and closes nothing, so the
    # same program reaches every host service there (it lists hostServices unenforced).
    **{(probe, "native"): "leaks" for probe in SERVICE_PROBES},
    # test_host_processes.py (issue #31): native runs as the caller on the host, so its
    # commands change the caller's other processes (the owner too) as any process may.
    ("host-process-limits", "native"): "leaks",
    ("host-process-limits-unprivileged", "native"): "leaks",
    # kubernetes: the sandbox is a pod on a cluster node. A Pod cannot set its pids limit;
    # unix socket host-service grants and service containers are not carried to a pod: each
    # is refused (PolicyNotEnforceableError), never run weaker. Filtered egress, credentials
    # and TCP host-service grants are enforced: the pod's NetworkPolicy denies all egress and
    # the relay carries its 127.0.0.1:3128, and each grant's address on the pod's loopback,
    # back over the agent's stream to the executor (the task's proxy, the grant's relay).
    ("fork-bomb", "kubernetes"): "unenforced",
}
REMOTE = {"kubernetes"}
"""Backends whose sandbox runs on another machine: no host package store is shared with it
(each pod installs its own), and a project's caches are not carried there."""

CGROUP_LIMIT_PROBES = {"fork-bomb", "memory-hog"}
HOST_VIEW = {"landlock"}
"""Backends that run on the host's filesystem view, confined by access checks: what exists is
visible to stat (Landlock does not govern it), so probes judge them by what can be opened."""

# What each rootless engine said about itself (availability details), once per session.
ROOTLESS_ENGINES: dict[str, dict[str, str]] = {}


def expected(probe: str, backend: str) -> Expect:
    if (
        backend in ROOTLESS_BACKENDS
        and probe in CGROUP_LIMIT_PROBES
        and ROOTLESS_ENGINES.get(backend, {}).get("cgroup", "v1") != "v1"
    ):
        return "blocked"
    return EXPECT.get((probe, backend), "blocked")


# What each probe saw on each backend in this session, for the matrix printed at the end
# (and written to $FUSION_OCI_SECURITY_REPORT as JSON when that is set).
RESULTS: dict[tuple[str, str], str] = {}


def record(probe: str, backend: str, outcome: str) -> None:
    previous = RESULTS.get((probe, backend))
    # A parametrised probe counts as leaking on a backend if any of its cases leaked.
    if previous != "leaks":
        RESULTS[(probe, backend)] = outcome


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS:
        return
    import json

    probes = sorted({p for p, _ in RESULTS})
    backends = [b for b in BACKENDS if any(k[1] == b for k in RESULTS)]
    width = max(len(p) for p in probes) + 2
    terminalreporter.section("security matrix (probe x backend)")
    terminalreporter.write_line("".ljust(width) + "".join(b.ljust(16) for b in backends))
    for probe in probes:
        cells = [RESULTS.get((probe, b), "-") for b in backends]
        terminalreporter.write_line(probe.ljust(width) + "".join(c.ljust(16) for c in cells))
    out = os.environ.get("FUSION_OCI_SECURITY_REPORT")
    if out:
        rows = [{"probe": p, "backend": b, "outcome": o} for (p, b), o in sorted(RESULTS.items())]
        Path(out).write_text(json.dumps(rows, indent=2) + "\n")


MARKS = {
    "native": pytest.mark.native,
    "bubblewrap": pytest.mark.bubblewrap,
    "landlock": pytest.mark.landlock,
    "oci": pytest.mark.oci,
    "oci-runsc": pytest.mark.runsc,
    "podman": pytest.mark.podman,
    "docker": pytest.mark.docker,
    ROOTLESS: pytest.mark.podman_rootless,
    DOCKERLESS: pytest.mark.docker_rootless,
    "kubernetes": pytest.mark.kubernetes,
}


@dataclass(frozen=True)
class RootlessUser:
    """The unprivileged user whose rootless engine the ``podman-rootless`` (or
    ``docker-rootless``) probes use."""

    name: str
    uid: int
    gid: int
    home: str
    xdg: str
    python: list[str]
    """``env PYTHONPATH=... PYTHON`` the user can run (container_cases.rootless_python)."""
    image: str = ""
    """The node image's reference in the user's engine's storage."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The engine's own settings (docker-rootless: ``docker.url``, the user's socket)."""

    def drive(self, scenario: str, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run a rootless_driver scenario as the user; its JSON answer."""
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
        out = subprocess.run(
            [
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
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/",
        )
        assert out.returncode == 0, f"rootless driver '{scenario}' failed:\n{out.stderr[-3000:]}"
        answer: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
        return answer

    def hand_over(self, tree: Path) -> None:
        """Make everything under ``tree`` the user's: what the probe's command may reach on
        the host natively, so that only the sandbox stands between it and a leak."""
        os.lchown(tree, self.uid, self.gid)
        for parent, dirs, files in os.walk(tree):
            for name in dirs + files:
                path = os.path.join(parent, name)
                # Only what root made: a blob belongs to the user's subordinate uid
                # (fusion_oci/store/namespace.py), and must stay so.
                if os.lstat(path).st_uid == 0:
                    os.lchown(path, self.uid, self.gid)


@dataclass
class Prober:
    """Runs one command under ``backend`` with a policy, in a worktree, as a task would."""

    backend: str
    tmp: Path
    worktree: Path
    home: Path
    env: dict[str, str] = field(default_factory=dict)
    rootless: RootlessUser | None = None
    """Set for the rootless backends: commands run as this user, through the rootless
    driver."""
    egress_names: dict[str, list[str]] | None = None
    """What the task's egress proxy resolves names to (egress_world.resolving); None: the
    host's resolver."""

    def run(
        self,
        command: str | list[str],
        policy: SandboxPolicy | None = None,
        *,
        timeout_ms: int = 20_000,
        worktree: Path | None = None,
        max_buffer: int | None = None,
        cache_mode: CacheMode = CacheMode.OFF,
        project_dir: Path | None = None,
        task_id: str = "probe",
    ) -> RunResult:
        """Prepare, run ``command`` once, dispose. A policy the backend cannot enforce raises
        :class:`PolicyNotEnforceableError` (native runs it and lists it in ``unenforced``)."""
        policy = policy or SandboxPolicy(allow_network=False)
        if project_dir is None and worktree is None and self.backend == "landlock":
            # Landlock refuses a project whose .fusion/ lies in the writable worktree (it cannot
            # make it read-only there): the executor's layout, a project outside the worktree.
            project_dir = self.tmp / "project"
            project_dir.mkdir(exist_ok=True)
        ctx = PrepareContext(
            task_id=task_id,
            run_id="run",
            policy=policy,
            worktree_path=str(worktree or self.worktree),
            cache_mode=cache_mode,
            project_dir=str(project_dir) if project_dir else None,
        )
        extra = {"max_buffer": max_buffer} if max_buffer else {}
        opts = RunOptions(timeout_ms=timeout_ms, env=self.env, **extra)
        if self.rootless is not None:
            return self._run_rootless(self.rootless, command, policy, ctx, opts)
        settings = backend_settings(self.backend, policy=policy)
        from tests.security.egress_world import resolving

        with (
            resolving(self.egress_names),
            SyncSandbox(settings, env=self.env, cache_root=self.tmp / "cache") as sb,
        ):
            sb.prepare(ctx)
            return sb.run(command, opts)

    def _run_rootless(
        self,
        user: RootlessUser,
        command: str | list[str],
        policy: SandboxPolicy,
        ctx: PrepareContext,
        opts: RunOptions,
    ) -> RunResult:
        if self.backend == ROOTLESS:
            settings = SandboxSettings(backend="podman", policy=policy, image=user.image)
        elif self.backend == DOCKERLESS:
            settings = SandboxSettings(
                backend="docker", policy=policy, image=user.image, **user.settings
            )
        else:  # a host-process runtime run by the unprivileged caller
            settings = SandboxSettings(backend=self.backend, policy=policy)  # type: ignore[arg-type]
        user.hand_over(self.tmp)  # whatever the test put there since the last run
        answer = user.drive(
            "probe",
            {
                "settings": settings.model_dump(mode="json", by_alias=True),
                "ctx": ctx.model_dump(mode="json", by_alias=True),
                "opts": opts.model_dump(mode="json", by_alias=True),
                "env": self.env,
                "cacheRoot": str(self.tmp / "cache"),
                "command": command,
                "egressNames": self.egress_names,
            },
            timeout=opts.timeout_ms / 1000 + 120,
        )
        if "refused" in answer:
            raise PolicyNotEnforceableError(settings.backend, answer["refused"])
        return RunResult.model_validate(answer["result"])

    @property
    def store_owner(self) -> int:
        """The owner (host view) of the blobs this prober's tasks are linked: the nobody uid
        as root, the user's store namespace's subordinate uid when rootless."""
        from fusion_oci.store.blobs import STORE_UID
        from fusion_oci.store.namespace import SUBGID, SUBUID, store_namespace

        if self.rootless is None:
            return STORE_UID
        ns, why = store_namespace(
            self.rootless.uid,
            self.rootless.gid,
            self.rootless.name,
            SUBUID.read_text(),
            SUBGID.read_text(),
            ("newuidmap", "newgidmap"),
        )
        assert ns is not None, why
        return ns.subuid

    @property
    def host_python(self) -> str:
        """A python that the owner of host_process() processes can run."""
        return self.rootless.python[-1] if self.rootless else sys.executable

    def host_process(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """A host process for a probe to attack (signal, ptrace, read). Rootless: the
        sandbox user's own, which that user could reach natively; else this test's."""
        if self.rootless is None:
            return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return subprocess.Popen(
            argv,
            user=self.rootless.uid,
            group=self.rootless.gid,
            extra_groups=[],
            cwd=self.tmp,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def _rootless_session(
    backend: str, socket: str, engine: str, settings: dict[str, Any]
) -> Iterator[RootlessUser]:
    """The user that drives ``backend``, checked once (its engine's ``socket`` under its
    runtime dir answers and is rootless; a missing setup fails where CI requires it), with
    the node image in that engine; at the end, gc as the user."""
    from tests.integration.container_cases import checked_rootless_user, rootless_python
    from tests.integration.images_fixture import ensure_node_image

    user, xdg = checked_rootless_user(
        backend, socket, "the rootless probes switch user with runuser"
    )
    rl = RootlessUser(
        user.pw_name,
        user.pw_uid,
        user.pw_gid,
        user.pw_dir,
        xdg,
        rootless_python(),
        settings=settings,
    )
    chosen = SandboxSettings(backend=engine, **settings)  # type: ignore[arg-type]
    ask = {"settings": chosen.model_dump(mode="json", by_alias=True)}
    avail = rl.drive("availability", ask, timeout=120)
    require(backend, bool(avail["available"]), str(avail["reason"]))
    require(backend, bool(avail["rootless"]), f"the {engine} at {xdg} is not rootless")
    ROOTLESS_ENGINES[backend] = {k: str(v) for k, v in (avail["details"] or {}).items()}
    rl = RootlessUser(
        rl.name,
        rl.uid,
        rl.gid,
        rl.home,
        rl.xdg,
        rl.python,
        ensure_node_image(backend).ref,
        settings,
    )
    yield rl
    # Shared-mode cache volumes outlive their task by design; their directories are gone
    # by now, so gc (as the user) removes them.
    report = rl.drive("gc", ask, timeout=300)
    assert report["errors"] == [], report


@pytest.fixture(scope="session")
def rootless_user() -> Iterator[RootlessUser]:
    """The rootless podman user, checked once."""
    yield from _rootless_session(ROOTLESS, "podman/podman.sock", "podman", {})


@pytest.fixture(scope="session")
def dockerless_user() -> Iterator[RootlessUser]:
    """The same user with its rootless dockerd, reached as the docker backend on its socket."""
    url = f"unix://{_rootless_xdg()}/docker.sock"
    yield from _rootless_session(DOCKERLESS, "docker.sock", "docker", {"docker": {"url": url}})


@pytest.fixture(params=[pytest.param(b, marks=MARKS[b]) for b in BACKENDS])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if name in ROOTLESS_BACKENDS:
        request.getfixturevalue(ROOTLESS_BACKENDS[name])
    elif engine_env(name):
        from fusion_oci.runtimes.registry import create_runtime
        from tests.backends import require

        avail = create_runtime(
            name,
            SandboxSettings(backend=name),  # type: ignore[arg-type]
            {**os.environ, **engine_env(name)},
        ).availability()
        require(name, avail.available, f"{avail.reason} {avail.hint}".strip())
    else:
        require_runtime(name)
    return name


@pytest.fixture
def prober(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Prober]:
    """A caller with its own $HOME (holding secrets) and a task worktree beside it."""
    rootless: RootlessUser | None = None
    base = tmp_path
    if backend in ROOTLESS_BACKENDS:
        rootless = request.getfixturevalue(ROOTLESS_BACKENDS[backend])
        # pytest's tmp_path sits under root-only (0700) directories the user cannot enter.
        base = Path(tempfile.mkdtemp(prefix="fusion-oci-probe-"))
        base.chmod(0o755)
    home = base / "home"
    (home / ".ssh").mkdir(parents=True)
    from tests.conftest import git_init

    worktree = git_init(base / "wt")  # a task worktree is the top of a git work tree
    env = {
        "HOME": str(home),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        **engine_env(backend),
    }
    try:
        yield Prober(backend, base, worktree, home, env, rootless)
    finally:
        if base != tmp_path:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def linked_worktree(prober: Prober) -> tuple[Path, Path]:
    """(main repository, linked worktree) beside the prober's worktree (tests/conftest.py's
    fixture, placed where the rootless user can reach it)."""
    from tests.conftest import git

    repo = prober.tmp / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "README").write_text("hello\n")
    git(repo, "add", "README")
    git(repo, "commit", "-qm", "init")
    wt = prober.tmp / "wt-task"
    git(repo, "worktree", "add", "-q", "-b", "task", str(wt))
    return repo, wt
