"""The runtime contract: one suite, run against every runtime this machine has.

Whatever isolates it, a runtime must give a task's command the same observable behaviour:
its own exit status (126 and 127 as a shell reports them), stdin, the working directory, only
the allow-listed environment, output as UTF-8 text (bytes that are not UTF-8 replaced, never an
error), the maxBuffer cut, and a timeout that ends the whole tree, setsid'd and double-forked
descendants included. A runtime joins by adding its name to ``RUNTIMES``; a missing one skips,
or fails where CI requires it (tests/backends.py).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fusion_oci.models import CacheMode, PrepareContext, RunOptions, RunResult, SandboxPolicy
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.sandbox import Sandbox
from tests.backends import backend_settings, require_runtime
from tests.hostside import pids_with

RUNTIMES = ["native", "bubblewrap", "landlock", "oci", "oci-runsc", "podman", "docker"]
MARKS = {"native": pytest.mark.native, "bubblewrap": pytest.mark.bubblewrap,
         "landlock": pytest.mark.landlock, "oci": pytest.mark.oci,
         "oci-runsc": pytest.mark.runsc, "podman": pytest.mark.podman,
         "docker": pytest.mark.docker}
ENGINES = {"podman", "docker"}


@dataclass(frozen=True)
class Runtime:
    name: str
    settings: SandboxSettings
    image: str | None
    """The engines run an image (the node image the integration tests provision)."""


@pytest.fixture(params=[pytest.param(n, marks=MARKS[n]) for n in RUNTIMES])
def runtime(request: pytest.FixtureRequest) -> Runtime:
    name: str = request.param
    if name in ENGINES:
        from tests.integration.container_cases import image, require_engine

        return Runtime(name, require_engine(name), image(name))
    settings = backend_settings(name)
    require_runtime(name, settings)
    return Runtime(name, settings, None)


@contextlib.asynccontextmanager
async def sandbox(rt: Runtime, worktree: Path, tmp_path: Path,
                  **policy: object) -> AsyncIterator[Sandbox]:
    policy.setdefault("allow_network", False)
    project = tmp_path / "project"  # outside the worktree, as an executor's is
    project.mkdir(exist_ok=True)
    async with Sandbox(rt.settings, cache_root=tmp_path / "cache") as sb:
        await sb.prepare(PrepareContext(
            task_id=f"contract-{rt.name}", run_id="r1", worktree_path=str(worktree),
            policy=SandboxPolicy(**policy), image=rt.image,  # type: ignore[arg-type]
            cache_mode=CacheMode.OFF, project_dir=str(project)))
        yield sb


async def test_exit_statuses(runtime: Runtime, worktree: Path, tmp_path: Path) -> None:
    async with sandbox(runtime, worktree, tmp_path) as sb:
        got = {code: (await sb.run(f"exit {code}")).exit_code for code in (0, 1, 255)}
        assert got == {0: 0, 1: 1, 255: 255}
        by_shell = await sb.run("nosuchcommand-contract")
        assert by_shell.exit_code == 127


async def test_death_by_signal_is_reported_as_the_signal(
        runtime: Runtime, worktree: Path, tmp_path: Path) -> None:
    async with sandbox(runtime, worktree, tmp_path) as sb:
        killed = await sb.run("kill -TERM $$")
        assert (killed.exit_code, killed.signal) == (None, "SIGTERM"), killed


async def test_exec_failures_as_a_shell_reports_them(runtime: Runtime, worktree: Path,
                                                     tmp_path: Path) -> None:
    async with sandbox(runtime, worktree, tmp_path) as sb:
        missing = await sb.run(["nosuchcommand-contract"])
        assert (missing.exit_code, missing.signal) == (127, None), missing
        not_executable = await sb.run(["/etc/passwd"])
        assert (not_executable.exit_code, not_executable.signal) == (126, None), not_executable


async def test_stdin_cwd_and_env_allowlist(runtime: Runtime, worktree: Path,
                                           tmp_path: Path) -> None:
    (worktree / "sub").mkdir()
    env = {"ALLOWED": "yes", "SECRET_TOKEN": "nope", "OTHER": "no", "PATH": "/usr/bin:/bin"}
    async with sandbox(runtime, worktree, tmp_path, env_allowlist=["ALLOWED"]) as sb:
        r = await sb.run("pwd; echo $ALLOWED ${SECRET_TOKEN:-unset} ${OTHER:-unset}; cat",
                         RunOptions(cwd="sub", env=env, stdin=b"from stdin\n"))
        assert r.exit_code == 0, r.stderr
        assert r.stdout.splitlines() == [str(worktree / "sub"), "yes unset unset",
                                         "from stdin"]
        closed = await sb.run("cat; echo done")
        assert closed.stdout == "done\n", "stdin is closed unless given"
        later = await sb.run("echo ${ALLOWED:-gone}", RunOptions(env={}))
        assert later.stdout == "gone\n", "one run's env does not leak into the next"


async def test_utf8_and_binary_output(runtime: Runtime, worktree: Path,
                                      tmp_path: Path) -> None:
    async with sandbox(runtime, worktree, tmp_path) as sb:
        text = await sb.run("printf 'h\\303\\251llo \\342\\234\\223\\n'; "
                            "printf '\\342\\234\\227 err\\n' >&2")
        assert (text.stdout, text.stderr) == ("héllo ✓\n", "✗ err\n")
        binary = await sb.run("printf '\\377\\376\\000ok'")
        assert binary.exit_code == 0
        assert binary.stdout == "\ufffd\ufffd\x00ok"


async def test_max_buffer_cuts_the_output_and_ends_the_command(
        runtime: Runtime, worktree: Path, tmp_path: Path) -> None:
    async with sandbox(runtime, worktree, tmp_path) as sb:
        r = await sb.run("head -c 1000000 /dev/zero | tr '\\0' x; sleep 30",
                         RunOptions(max_buffer=4096, timeout_ms=60_000))
        assert r.truncated and r.reason == "max-buffer", r.model_dump(exclude={"stdout"})
        assert r.stdout == "x" * 4096
        assert r.duration_ms < 25_000, "the command was ended, not waited for"


async def test_timeout_ends_a_setsid_double_forked_tree(runtime: Runtime, worktree: Path,
                                                        tmp_path: Path) -> None:
    marker = f"{700 + secrets.randbelow(99)}.{secrets.randbelow(10**6)}"
    daemon = f"trap '' TERM HUP; sleep {marker}"
    async with sandbox(runtime, worktree, tmp_path) as sb:
        start = time.monotonic()
        r: RunResult = await sb.run(
            f"( ( setsid sh -c \"{daemon}\" >/dev/null 2>&1 & ) & ); sleep {marker}",
            RunOptions(timeout_ms=1500))
        assert r.timed_out and r.reason == "timeout", r
        assert time.monotonic() - start < 20
    assert left_after(marker, 5.0) == [], "a descendant outlived the timeout"


def left_after(marker: str, within_s: float) -> list[int]:
    """Host pids with ``marker`` still there after ``within_s`` (exits take a moment)."""
    deadline = time.monotonic() + within_s
    while pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids_with(marker)
