"""Adversarial probes, written once and run against every backend in ``BACKENDS``.

Each probe does something a malicious or buggy command would do and then checks the effect on
the HOST (a canary's content in the output, a file on disk, a connection accepted by a server
the test owns, a process the test started still alive). ``EXPECT`` says per backend whether the
probe must be blocked or must leak: native isolates nothing, so there a probe is asserted to
leak, which proves that the probe can see a leak at all. A container runtime joins by adding
its id to ``BACKENDS`` (and any deviations to ``EXPECT``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from fusion_oci.models import CacheMode, PrepareContext, RunOptions, RunResult, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import SyncSandbox
from tests.backends import require_runtime

BACKENDS = ["native", "bubblewrap", "oci", "podman", "docker"]


def engine_env(backend: str) -> dict[str, str]:
    """How a container backend finds its engine: the env a user would have (the CI's sockets)."""
    if backend == "docker" and os.environ.get("DOCKER_HOST"):
        return {"DOCKER_HOST": os.environ["DOCKER_HOST"]}
    if backend == "podman" and os.environ.get("FUSION_OCI_PODMAN_URL"):
        return {"CONTAINER_HOST": os.environ["FUSION_OCI_PODMAN_URL"]}
    return {}

Expect = Literal["blocked", "leaks", "unenforced"]
"""blocked: the host is untouched. leaks: the probe gets through (asserted, to prove the probe
works). unenforced: the backend cannot enforce it and says so in RunResult.unenforced; the
harmful command is not run (a fork bomb on the bare host would harm the machine)."""

EXPECT: dict[tuple[str, str], Expect] = {
    ("home-canary", "native"): "leaks",
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
    ("persistence", "native"): "leaks",
    ("git-hooks-plain-repo", "native"): "leaks",
    ("udp-dns-none", "native"): "leaks",
    ("dashboard-4040", "native"): "leaks",
    ("proc-leak", "native"): "leaks",
    ("devices", "native"): "leaks",
    ("privileged-syscalls", "native"): "leaks",
    ("engine-sockets", "native"): "leaks",
    ("term-ignoring-daemon", "native"): "blocked",  # the reaper shim ends the whole tree
}


def expected(probe: str, backend: str) -> Expect:
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


MARKS = {"native": pytest.mark.native, "bubblewrap": pytest.mark.bubblewrap,
         "oci": pytest.mark.oci, "podman": pytest.mark.podman, "docker": pytest.mark.docker}


@dataclass
class Prober:
    """Runs one command under ``backend`` with a policy, in a worktree, as a task would."""

    backend: str
    tmp: Path
    worktree: Path
    home: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, command: str, policy: SandboxPolicy | None = None, *,
            timeout_ms: int = 20_000, worktree: Path | None = None) -> RunResult:
        policy = policy or SandboxPolicy(allow_network=False)
        settings = SandboxSettings(backend=self.backend, policy=policy)  # type: ignore[arg-type]
        ctx = PrepareContext(task_id="probe", run_id="run", policy=policy,
                             worktree_path=str(worktree or self.worktree),
                             cache_mode=CacheMode.OFF)
        with SyncSandbox(settings, env=self.env, cache_root=self.tmp / "cache") as sb:
            sb.prepare(ctx)
            return sb.run(command, RunOptions(timeout_ms=timeout_ms, env=self.env))


@pytest.fixture(params=[pytest.param(b, marks=MARKS[b]) for b in BACKENDS])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if engine_env(name):
        from fusion_oci.runtimes.registry import create_runtime
        from tests.backends import require

        avail = create_runtime(name, SandboxSettings(backend=name),  # type: ignore[arg-type]
                               {**os.environ, **engine_env(name)}).availability()
        require(name, avail.available, f"{avail.reason} {avail.hint}".strip())
    else:
        require_runtime(name)
    return name


@pytest.fixture
def prober(backend: str, tmp_path: Path) -> Iterator[Prober]:
    """A caller with its own $HOME (holding secrets) and a task worktree beside it."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    worktree = tmp_path / "wt"
    worktree.mkdir()
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "LANG": "C.UTF-8", **engine_env(backend)}
    yield Prober(backend, tmp_path, worktree, home, env)
