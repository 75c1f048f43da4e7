"""One suspect at a time for a runtime's workload gap: the workload project's tests, type check
and build (installed once on the host) in prepared sandboxes of one runtime under different
networks, beside the raw tool, interleaved rounds, medians as ratios to the host.

    .venv/bin/python benchmarks/workload_suspects.py RUNTIME [--rounds 5] [--json PATH]

RUNTIME is ``oci-runsc``, ``bubblewrap`` or ``landlock``. Every case runs, in each round, a
trivial command (``true`` and ``node -e 0``, a few times each: the fixed cost of one command)
and then the three steps; the cases take turns round after round, starting one further along
each round, so load from other processes and the order fall on all of them alike.

- ``oci-runsc``: ours under ``egress`` (what bench_workload measures: each command's sandbox
  starts in a fresh network namespace with its slirp), ours under ``none`` (runsc's empty
  netstack), and raw ``runsc do`` per step.
- ``bubblewrap``: the host; the host with the environment our spawn frame gives the command
  (its HOME a fresh folder: the sandbox's is a tmpfs); ours under ``egress`` (as benchmarked)
  and ``none``; raw ``bwrap`` with exactly the sandbox argv the runtime planned for the
  ``none`` sandbox, the step in the agent's place (its environment, cwd and rlimits as the
  spawn frame says), once with our seccomp BPF on its fd and once without ``--seccomp``.
  Raw bwrap builds the sandbox for every command (ours does once, at prepare): its trivial
  command's time is that cost, to take off its steps.
- ``landlock``: the host; the host with our command's environment; ours under ``filtered``
  (as benchmarked: a spawn frame to the task's confined exec agent) and ``none``; the spawn
  frame's command under one reaper shim per command (as the runtime ran before its agent),
  with the task's launch file and benchmarks/landlock_unsupervised.py in the reaper's place,
  which skips the seccomp user-notify supervisor (every open, chmod and connect handed to the
  reaper), with and without the bundle's seccomp filter.

Not part of scripts/bench.sh (a diagnosis, not a table of the report).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_workload import LONG, WORK, linked_project, make_runtime
from benchmarks.workload_raw import raw_runsc_argv, timed
from fusion_oci.host.process import REAPER, reaper_argv
from fusion_oci.models import NetworkMode
from fusion_oci.runtimes.bubblewrap import BubblewrapRuntime, bwrap_spawn
from fusion_oci.runtimes.bubblewrap.argv import SECCOMP_FD
from fusion_oci.runtimes.landlock import (
    LandlockPlan,
    LandlockRuntime,
    host_abi,
    launch_config,
    launch_text,
)
from tests.contract.harness import Runtime, sandbox

TRIVIAL = (("true", "true"), ("node -e 0", "node -e 0"))
TRIVIAL_REPS = 5
UNSUPERVISED = Path(__file__).resolve().with_name("landlock_unsupervised.py")
SUPERVISED_ONLY = frozenset({"pnpm test"})
"""Steps that cannot run without the supervisor: vitest's workers never finish when their
reads of ``/proc/self/maps`` and ``/proc/self/cgroup`` (which only the supervisor can grant:
no Landlock rule covers a process's own ``/proc/<pid>``) are refused. Not timed there (nan)."""

Run = Callable[[str], Awaitable[float]]
"""Runs one command in a case, returns its seconds (fails on a non-zero status)."""
Case = Callable[[], contextlib.AbstractAsyncContextManager[Run]]


def _check(code: int | None, what: str, tail: str) -> None:
    assert code == 0, f"{what} fails (exit {code}): {tail[-300:]}"


def _run_host(argv: list[str], cwd: Path | str, env: dict[str, str], **kw: Any) -> float:
    start = time.monotonic()
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, check=False, **kw)
    took = time.monotonic() - start
    _check(out.returncode, argv[-1], (out.stdout + out.stderr).decode(errors="replace"))
    return took


# ---------------------------------------------------------------------------- the cases


def host_case(wt: Path) -> Case:
    """The command directly on the host (``CI=1``, as bench_workload's host)."""
    env = {**os.environ, "CI": "1"}

    @contextlib.asynccontextmanager
    async def case() -> AsyncIterator[Run]:
        async def run(command: str) -> float:
            return _run_host(["/bin/sh", "-c", command], wt, env)

        yield run

    return case


def ours_case(rt: Runtime, wt: Path, network: NetworkMode) -> Case:
    """A prepared sandbox of ours (prepare not timed), each command through ``Sandbox.run``."""

    @contextlib.asynccontextmanager
    async def case() -> AsyncIterator[Run]:
        async with sandbox(rt, wt, network=network) as box:

            async def run(command: str) -> float:
                start = time.monotonic()
                r = await box.run(command, LONG)
                took = time.monotonic() - start
                _check(r.exit_code, command, r.stderr or r.stdout)
                return took

            yield run

    return case


def _set_rlimits(limits: list[tuple[str, int, int]]) -> Callable[[], None]:
    inf = resource.RLIM_INFINITY

    def apply() -> None:
        for name, soft, hard in limits:
            resource.setrlimit(
                getattr(resource, name), (inf if soft < 0 else soft, inf if hard < 0 else hard)
            )

    return apply


def raw_bwrap_argv(runtime: BubblewrapRuntime, command: str, seccomp_fd: int | None) -> list[str]:
    """The sandbox argv the runtime planned (and ran), the spawn frame's command in the agent's
    place: the same namespaces, mounts, uid, capabilities, seccomp (or none), with the frame's
    environment and cwd. The launch hooks' fds (cgroup, slirp) are dropped: nothing waits on
    them (the ``none`` sandbox this is taken from has no limits: none are planned)."""
    planned = list(runtime.sandbox_launch().argv or [])
    spawn = bwrap_spawn(runtime.process(command, LONG))
    tail = planned.index("--clearenv", len(planned) - 10)
    head = planned[:tail]
    out: list[str] = []
    skip = 0
    for i, arg in enumerate(head):
        if skip:
            skip -= 1
            continue
        if arg in ("--info-fd", "--block-fd"):
            skip = 1
            continue
        if arg == "--seccomp" and head[i + 1] == SECCOMP_FD:
            skip = 1
            if seccomp_fd is not None:
                out += ["--seccomp", str(seccomp_fd)]
            continue
        out.append(arg)
    out.append("--clearenv")
    for key, value in spawn.env.items():
        out += ["--setenv", key, value]
    return [*out, "--chdir", spawn.cwd or "/", "--", *spawn.argv]


def raw_bwrap_case(rt: Runtime, wt: Path, seccomp: bool) -> Case:
    """Raw bwrap per command with our planned sandbox argv (taken from a prepared ``none``
    sandbox of ours, alive while the case runs: its scratch files are in the argv)."""

    @contextlib.asynccontextmanager
    async def case() -> AsyncIterator[Run]:
        async with sandbox(rt, wt, network=NetworkMode.NONE) as box:
            runtime = box.runtime  # type: ignore[attr-defined]
            assert isinstance(runtime, BubblewrapRuntime)
            program = runtime.seccomp_bpf
            assert program is not None

            async def run(command: str) -> float:
                spawn = bwrap_spawn(runtime.process(command, LONG))
                r, w = os.pipe()
                try:
                    if seccomp:
                        os.write(w, program)  # 736 bytes: within the pipe's buffer
                    os.close(w)
                    argv = raw_bwrap_argv(runtime, command, r if seccomp else None)
                    return _run_host(
                        argv,
                        "/",
                        runtime.sandbox_launch().env or {},
                        pass_fds=(r,),
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        preexec_fn=_set_rlimits(list(spawn.rlimits)),
                    )
                finally:
                    os.close(r)

            yield run

    return case


def own_dirs(env: dict[str, str], tmp: Path) -> None:
    """HOME and TMPDIR of ``env`` in folders of their own under ``tmp`` (the sandbox's are
    tmpfs mounts), the sandbox's CA bundle path the host's."""
    for key, sub in (("HOME", "home"), ("TMPDIR", "tmp")):
        if key in env:
            (tmp / sub).mkdir()
            env[key] = str(tmp / sub)
    for key, value in env.items():
        if value.startswith("/etc/fusion-oci/"):
            env[key] = "/etc/ssl/certs/ca-certificates.crt"


def write_text(path: Path | str, text: str | None) -> None:
    """``text`` into ``path``, or ``path`` removed (None)."""
    if text is None:
        Path(path).unlink(missing_ok=True)
    else:
        Path(path).write_text(text, encoding="utf-8")


def ours_env_case(rt: Runtime, wt: Path) -> Case:
    """The host running the command with the environment ours gives it (bubblewrap: the spawn
    frame's, HOME and TMPDIR a fresh folder of their own; landlock: the plan's), in ``wt``."""

    @contextlib.asynccontextmanager
    async def case() -> AsyncIterator[Run]:
        with tempfile.TemporaryDirectory(prefix="fusion-oci-suspects-env-") as tmp:
            async with sandbox(rt, wt, network=NetworkMode.NONE) as box:
                runtime = box.runtime  # type: ignore[attr-defined]
                if isinstance(runtime, BubblewrapRuntime):
                    env = dict(bwrap_spawn(runtime.process("true", LONG)).env)
                    own_dirs(env, Path(tmp))
                else:
                    plan = runtime.plan(runtime.process("true", LONG))
                    assert isinstance(plan, LandlockPlan)
                    env = dict(plan.spawn.env)

                async def run(command: str) -> float:
                    return _run_host(["/bin/sh", "-c", command], wt, env)

                yield run

    return case


def raw_landlock_case(rt: Runtime, wt: Path, network: NetworkMode, seccomp: bool) -> Case:
    """The landlock runtime's own plan (the spawn frame's argv, environment, cwd and rlimits,
    the task's launch file) run from here as one shim per command (what the runtime did before
    its exec agent) with benchmarks/landlock_unsupervised.py as the shim: no supervisor, and
    with or without the bundle's seccomp filter."""

    @contextlib.asynccontextmanager
    async def case() -> AsyncIterator[Run]:
        async with sandbox(rt, wt, network=network) as box:
            runtime = box.runtime  # type: ignore[attr-defined]
            assert isinstance(runtime, LandlockRuntime)

            async def run(command: str) -> float:
                if any(step in command for step in SUPERVISED_ONLY):
                    return math.nan
                plan = runtime.plan(runtime.process(command, LONG))
                assert isinstance(plan, LandlockPlan) and plan.scratch is not None
                config = launch_config(plan.rules, host_abi(), platform.machine())
                launch_file = f"{plan.scratch}/launch-raw"
                write_text(launch_file, launch_text(config))
                argv = reaper_argv(plan.spawn.argv, plan.spawn.rlimits)
                argv.insert(argv.index("--"), f"SANDBOX={launch_file}")
                at = argv.index(str(REAPER))
                argv[at : at + 1] = [
                    str(UNSUPERVISED),
                    *([] if seccomp else ["--no-seccomp"]),
                ]
                try:
                    return _run_host(
                        argv,
                        plan.spawn.cwd or str(wt),
                        dict(plan.spawn.env),
                        stdin=subprocess.DEVNULL,
                    )
                finally:
                    write_text(launch_file, None)

            yield run

    return case


def raw_runsc_case(wt: Path) -> Case:
    @contextlib.asynccontextmanager
    async def case() -> AsyncIterator[Run]:
        async def run(command: str) -> float:
            took, code, tail = timed(raw_runsc_argv(wt, f"export CI=1 && {command}"))
            _check(code, command, tail)
            return took

        yield run

    return case


def cases_for(name: str, rt: Runtime, wt: Path) -> dict[str, Case]:
    if name == "oci-runsc":
        return {
            "host": host_case(wt),
            "ours, egress": ours_case(rt, wt, NetworkMode.EGRESS),
            "ours, none": ours_case(rt, wt, NetworkMode.NONE),
            "raw runsc do": raw_runsc_case(wt),
        }
    if name == "bubblewrap":
        return {
            "host": host_case(wt),
            "host, ours' env": ours_env_case(rt, wt),
            "ours, egress": ours_case(rt, wt, NetworkMode.EGRESS),
            "ours, none": ours_case(rt, wt, NetworkMode.NONE),
            "raw bwrap + our BPF": raw_bwrap_case(rt, wt, seccomp=True),
            "raw bwrap, no seccomp": raw_bwrap_case(rt, wt, seccomp=False),
        }
    return {
        "host": host_case(wt),
        "host, ours' env": ours_env_case(rt, wt),
        "ours, filtered": ours_case(rt, wt, NetworkMode.FILTERED),
        "ours, none": ours_case(rt, wt, NetworkMode.NONE),
        "no supervisor": raw_landlock_case(rt, wt, NetworkMode.FILTERED, seccomp=True),
        "no supervisor, no seccomp": raw_landlock_case(rt, wt, NetworkMode.FILTERED, seccomp=False),
    }


# ---------------------------------------------------------------------------- the rounds


def install(wt: Path) -> None:
    subprocess.run(
        ["pnpm", "install", "--frozen-lockfile"],
        cwd=wt,
        check=True,
        capture_output=True,
        env={**os.environ, "CI": "1"},
    )


STEP_COLUMNS = [*(label for label, _ in WORK), "check + build", "steps"]
COLUMNS = [
    *(label for label, _ in TRIVIAL),
    *STEP_COLUMNS,
    *(f"cpu: {c}" for c in STEP_COLUMNS),
]


def cpu_seconds(path: Path) -> float:
    """user + system seconds that ``/usr/bin/time -o PATH -f '%U %S'`` wrote (nan: none)."""
    try:
        user, system = path.read_text().split()[-2:]
        path.unlink()
    except (OSError, ValueError):
        return math.nan
    return float(user) + float(system)


async def one_case(case: Case, wt: Path) -> dict[str, float]:
    """This round's figures of one case: the median of each trivial command's reps, each
    step's seconds, and the steps' sum; and each step's CPU time (user + system of its
    whole waited-for tree, by /usr/bin/time in the sandbox: less moved by other jobs' load
    than the wall clock; a landlock supervisor's own time is the reaper's, not in it)."""
    got: dict[str, float] = {}
    mark = wt / ".suspects-cpu"
    async with case() as run:
        await run("true")  # the first command of a sandbox may pay one-off costs
        for label, command in TRIVIAL:
            got[label] = statistics.median([await run(command) for _ in range(TRIVIAL_REPS)])
        for label, command in WORK:
            timed_command = f"/usr/bin/time -o {mark} -f '%U %S' /bin/sh -c '{command}'"
            got[label] = await run(timed_command)
            got[f"cpu: {label}"] = cpu_seconds(mark) if not math.isnan(got[label]) else math.nan
    for prefix in ("", "cpu: "):
        got[f"{prefix}check + build"] = got[f"{prefix}type check"] + got[f"{prefix}build"]
        got[f"{prefix}steps"] = sum(got[f"{prefix}{label}"] for label, _ in WORK)
    return got


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _median(values: list[float]) -> float:
    return math.nan if any(math.isnan(v) for v in values) else statistics.median(values)


def report(rounds: list[dict[str, dict[str, float]]]) -> str:
    names = list(rounds[0])
    med = {n: {c: _median([r[n][c] for r in rounds]) for c in COLUMNS} for n in names}
    lines = [
        f"median of {len(rounds)} rounds; first row: the host's seconds (trivial: ms), the "
        "others as a ratio to it",
        "| case | "
        + " | ".join(COLUMNS)
        + " | steps (or check + build) ratio per round, min-max |",
        "|---|" + "---:|" * (len(COLUMNS) + 1),
    ]
    host = med["host"]
    cells = [
        f"{host[c] * 1000:.0f} ms" if c in dict(TRIVIAL) else f"{host[c]:.2f} s" for c in COLUMNS
    ]
    lines.append("| host | " + " | ".join(cells) + " | |")
    for n in names[1:]:
        key = "check + build" if math.isnan(med[n]["steps"]) else "steps"
        ratios = [r[n][key] / r["host"][key] for r in rounds]
        cells = ["-" if math.isnan(med[n][c]) else f"{med[n][c] / host[c]:.2f}x" for c in COLUMNS]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {min(ratios):.2f}-{max(ratios):.2f}x |")
    extra = [
        f"{n}: trivial above the host: true {1000 * (med[n]['true'] - host['true']):+.0f} ms, "
        f"node -e 0 {1000 * (med[n]['node -e 0'] - host['node -e 0']):+.0f} ms"
        for n in names[1:]
    ]
    return "\n".join([*lines, "", *extra])


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runtime", choices=["oci-runsc", "bubblewrap", "landlock"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", help="semicolon-separated case names (host is always run)")
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args()
    rt = make_runtime(args.runtime)
    assert isinstance(rt, Runtime), rt
    with tempfile.TemporaryDirectory(prefix="fusion-oci-suspects-") as tmp:
        wt = linked_project(Path(tmp))
        install(wt)
        cases = cases_for(args.runtime, rt, wt)
        if args.only:
            keep = {"host", *args.only.split(";")}
            cases = {k: v for k, v in cases.items() if k in keep}
        names = list(cases)
        rounds: list[dict[str, dict[str, float]]] = []
        loads = [loadavg()]
        for i in range(args.rounds):
            order = names[i % len(names) :] + names[: i % len(names)]
            got = {}
            for n in order:
                got[n] = await one_case(cases[n], wt)
                print(f"  {n}: done", file=sys.stderr, flush=True)
            rounds.append({n: got[n] for n in names})
            loads.append(loadavg())
            for n in names:
                print(
                    f"round {i + 1} {n:<26} " + " ".join(f"{c}={got[n][c]:.3f}" for c in COLUMNS),
                    flush=True,
                )
        print(f"\n{args.runtime}: load average (1, 5, 15 min) before and after each round:")
        print("; ".join(loads))
        print(report(rounds))
        if args.json:
            write_text(
                args.json,
                json.dumps({"runtime": args.runtime, "loads": loads, "rounds": rounds}, indent=1),
            )


if __name__ == "__main__":
    asyncio.run(main())
