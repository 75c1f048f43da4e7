"""Runs a container-runtime scenario through the library as the unprivileged CI user.

    runuser -u fusionci -- PYTHON -m tests.integration.rootless_driver SCENARIO JSON-ARGS

Prints one JSON object on the last line of stdout. The runtime finds the user's rootless
podman socket by itself ($XDG_RUNTIME_DIR), as a user's setup would. Every scenario takes the
caller's settings when the args carry them (``settings``): the docker backend on the user's
rootless dockerd (tests/integration/test_docker.py, the contract and security suites).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fusion_oci.models import CacheMode, NetworkMode, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.policy.settings import GateSettings, SandboxSettings
from fusion_oci.runtimes.registry import create_runtime
from fusion_oci.sandbox import Sandbox

LONG = RunOptions(timeout_ms=300_000)


def settings(**extra: Any) -> SandboxSettings:
    return SandboxSettings(backend="podman", gates=GateSettings(sandbox_provision="allow"), **extra)


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


def procs(result_stdout: str) -> list[str]:
    return [line for line in result_stdout.splitlines() if line.strip()]


def given_settings(args: dict[str, Any]) -> SandboxSettings:
    """The caller's settings (``settings`` in the args: docker-rootless passes the docker
    backend and its socket; the scenarios' gate stays open), else rootless podman's."""
    if "settings" in args:
        return SandboxSettings.model_validate(args["settings"])
    return settings()


async def availability(args: dict[str, Any]) -> dict[str, Any]:
    chosen = given_settings(args)
    avail = create_runtime(chosen.backend, chosen, os.environ).availability()
    return {
        "available": avail.available,
        "reason": avail.reason,
        "details": avail.details,
        "rootless": avail.rootless,
    }


def make_repo(base: Path, project: Path) -> tuple[Path, Path]:
    """A repository with a linked worktree holding the pnpm project, made as this user."""
    repo, wt = base / "repo", base / "wt"
    repo.mkdir()
    os.environ.update(
        {
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@example.invalid",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.invalid",
        }
    )
    git(repo, "init", "-q", "-b", "main")
    (repo / "README").write_text("hello\n")
    git(repo, "add", "README")
    git(repo, "commit", "-qm", "init")
    git(repo, "worktree", "add", "-q", "-b", "task", str(wt))
    for item in project.iterdir():
        (wt / item.name).write_bytes(item.read_bytes())
    return repo, wt


async def pnpm(args: dict[str, Any]) -> dict[str, Any]:
    base = Path(args["dir"])
    repo, wt = make_repo(base, Path(args["project"]))
    out: dict[str, Any] = {}
    policy = SandboxPolicy(network=NetworkMode.EGRESS)
    async with Sandbox(given_settings(args), cache_root=base / "cache") as sb:
        await sb.prepare(
            PrepareContext(
                task_id="rl-pnpm",
                run_id="r1",
                worktree_path=str(wt),
                image=args["image"],
                policy=policy,
                project_dir=str(repo),
            )
        )
        for name, cmd in (
            ("install", "pnpm install --frozen-lockfile"),
            ("test", "pnpm test"),
            ("build", "pnpm build"),
            (
                "commit",
                "git add -A && git -c user.name=t -c user.email=t@example.invalid "
                "commit -qm 'from the rootless sandbox'",
            ),
            ("hooks", f"echo evil > {repo}/.git/hooks/post-commit"),
            ("id", "id -u"),
        ):
            r = await sb.run(cmd, LONG)
            out[name] = {"exit": r.exit_code, "stderr": r.stderr[-500:], "stdout": r.stdout}
    out["log"] = git(repo, "log", "--oneline", "-1", "task")
    me = os.getuid()
    files = [p for p in wt.rglob("*") if ".pnpm" not in p.parts][:300]
    out["files"] = len(files)
    out["not_mine"] = [str(p) for p in files if p.lstat().st_uid != me][:5]
    out["uid"] = me
    return out


async def timeout(args: dict[str, Any]) -> dict[str, Any]:
    wt = Path(args["dir"]) / "wt"
    wt.mkdir()
    git(wt, "init", "-q")  # a task worktree is the top of a git work tree
    async with Sandbox(given_settings(args), cache_root=Path(args["dir"]) / "cache") as sb:
        await sb.prepare(
            PrepareContext(
                task_id="rl-timeout",
                run_id="r1",
                worktree_path=str(wt),
                image=args["image"],
                cache_mode=CacheMode.OFF,
                policy=SandboxPolicy(allow_network=False),
            )
        )
        start = time.monotonic()
        r = await sb.run(
            "setsid sleep 300 & (sleep 301 &); echo started; sleep 302", RunOptions(timeout_ms=1500)
        )
        took = time.monotonic() - start
        after = await sb.run("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done")
        touch = await sb.run("touch made-here && stat -c %u made-here")
    return {
        "timed_out": r.timed_out,
        "reason": r.reason,
        "took": took,
        "procs": procs(after.stdout),
        "uid_inside": touch.stdout.strip(),
        "owner": (wt / "made-here").stat().st_uid,
        "me": os.getuid(),
    }


async def network(args: dict[str, Any]) -> dict[str, Any]:
    wt = Path(args["dir"]) / "wt"
    wt.mkdir()
    git(wt, "init", "-q")  # a task worktree is the top of a git work tree
    port = int(args["port"])
    js = (
        "const net=require('net');const [h,p]=process.argv.slice(1);"
        "const s=net.connect({host:h,port:+p,timeout:2000},()=>{console.log('open');s.end()});"
        "s.on('error',e=>console.log('closed '+e.code));"
        "s.on('timeout',()=>{console.log('closed timeout');s.destroy()});"
    )
    out: dict[str, Any] = {}
    for mode in (NetworkMode.NONE, NetworkMode.EGRESS):
        async with Sandbox(given_settings(args), cache_root=Path(args["dir"]) / "cache") as sb:
            await sb.prepare(
                PrepareContext(
                    task_id=f"rl-net-{mode.value}",
                    run_id="r1",
                    worktree_path=str(wt),
                    image=args["image"],
                    cache_mode=CacheMode.OFF,
                    policy=SandboxPolicy(network=mode),
                )
            )
            row = {}
            for host in ("127.0.0.1", "10.0.2.2"):
                r = await sb.run(["node", "-e", js, host, str(port)], RunOptions(timeout_ms=15_000))
                row[host] = (r.stdout.strip() or r.stderr.strip())[:80]
            out[mode.value] = row
    return out


async def agent(args: dict[str, Any]) -> dict[str, Any]:
    """The exec agent under rootless podman: its socket is gone and the folder read-only
    (the user's own uid inside, keep-id), its /proc is closed, and 20 commands leave no
    conmon behind."""
    wt = Path(args["dir"]) / "wt"
    wt.mkdir()
    git(wt, "init", "-q")
    js = (
        "const s=require('net').connect(process.argv[1]);"
        "s.on('connect',()=>{console.log('open');process.exit(0)});"
        "s.on('error',e=>{console.log('closed '+e.code);process.exit(0)})"
    )
    out: dict[str, Any] = {}
    async with Sandbox(given_settings(args), cache_root=Path(args["dir"]) / "cache") as sb:
        await sb.prepare(
            PrepareContext(
                task_id="rl-agent",
                run_id="r1",
                worktree_path=str(wt),
                image=args["image"],
                cache_mode=CacheMode.OFF,
                policy=SandboxPolicy(allow_network=False),
            )
        )
        r = await sb.run(["node", "-e", js, "/.fusion-oci/run/agent.sock"])
        out["connect"] = r.stdout.strip()
        tamper = {
            "replace": "cp /bin/sh /.fusion-oci/agent",
            "file": "touch /.fusion-oci/run/x",
            "environ": "cat /proc/1/environ",
            "fd": "readlink /proc/1/fd/0",
        }
        out["tamper"] = {k: (await sb.run(v)).exit_code for k, v in tamper.items()}
        cid = sb.runtime._container  # type: ignore[union-attr]

        def monitors() -> int:
            return sum(
                1 for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).count(cid)
            )

        before = monitors()
        outputs = [(await sb.run(f"echo {i}")).stdout for i in range(20)]
        out["monitors"] = [before, monitors()]
        out["outputs_ok"] = outputs == [f"{i}\n" for i in range(20)]
    return out


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


async def leftovers(args: dict[str, Any]) -> dict[str, Any]:
    chosen = given_settings(args)
    runtime: Any = create_runtime(chosen.backend, chosen, os.environ)
    try:
        adapter = runtime._connect()
        names = [
            f.name
            for f in adapter.list_labelled("io.fusion-oci.kind")
            if f.labels.get("io.fusion-oci.task-id", "").startswith("rl-")
        ]
    finally:
        runtime.close()
    return {"left": names}


async def collect(args: dict[str, Any]) -> dict[str, Any]:
    """gc as this user (its cache directories are gone by now: their volumes go too)."""
    from fusion_oci.gc import gc

    chosen = given_settings(args)
    report = gc(settings=chosen, engines=[chosen.backend])
    return {"removed": report.removed, "errors": report.errors}


async def probe(args: dict[str, Any]) -> dict[str, Any]:
    """One command of a security probe (tests/security): the caller's settings, context, run
    options and environment, as that suite runs them in-process for the other backends.

    A policy the lifecycle refuses comes back as ``refused`` (the parts it cannot enforce),
    so that the caller can raise the same error; any other error propagates (non-zero exit).
    """
    from fusion_oci.errors import PolicyNotEnforceableError
    from tests.security.egress_world import resolving

    sandbox_settings = SandboxSettings.model_validate(args["settings"])
    ctx = PrepareContext.model_validate(args["ctx"])
    opts = RunOptions.model_validate(args["opts"])
    try:
        # egressNames: what the task's proxy resolves (the egress probes' test names).
        with resolving(args.get("egressNames")):
            async with Sandbox(
                sandbox_settings, env=args["env"], cache_root=Path(args["cacheRoot"])
            ) as sb:
                await sb.prepare(ctx)
                result = await sb.run(args["command"], opts)
    except PolicyNotEnforceableError as exc:
        return {"refused": exc.unenforced, "message": exc.render()}
    return {"result": result.model_dump(mode="json", by_alias=True)}


async def session(args: dict[str, Any]) -> dict[str, Any]:
    """One sandbox, many commands (tests/contract): prepare with the caller's settings and
    context, answer ``{"ready": true}`` (or ``{"refused": [...]}``), then for each JSON line
    ``{"id", "command", "opts"}`` on stdin one line ``{"id", "result"}`` when it ends; the
    commands run side by side, as an executor's may. A line ``{"abort": true}`` aborts what
    runs (Sandbox.abort); dispose once the input ended and every command did."""
    from fusion_oci.errors import PolicyNotEnforceableError

    sandbox_settings = SandboxSettings.model_validate(args["settings"])
    ctx = PrepareContext.model_validate(args["ctx"])
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 * 1024 * 1024)  # a line carries a command's stdin
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with Sandbox(sandbox_settings, env=args["env"], cache_root=Path(args["cacheRoot"])) as sb:
        try:
            await sb.prepare(ctx)
        except PolicyNotEnforceableError as exc:
            return {"refused": exc.unenforced, "message": exc.render()}
        print(json.dumps({"ready": True}), flush=True)

        async def one(rid: object, command: str | list[str], opts: RunOptions) -> None:
            result = await sb.run(command, opts)
            answer = {"id": rid, "result": result.model_dump(mode="json", by_alias=True)}
            print(json.dumps(answer), flush=True)

        running: set[asyncio.Future[None]] = set()
        while line := await reader.readline():
            ask = json.loads(line)
            if ask.get("abort"):
                sb.abort()  # none running: nothing happens
            elif "command" in ask:
                opts = RunOptions.model_validate(ask["opts"])
                run = asyncio.ensure_future(one(ask.get("id"), ask["command"], opts))
                running.add(run)
                run.add_done_callback(running.discard)
        if running:
            await asyncio.gather(*running)
    return {"done": True}


async def publish(args: dict[str, Any]) -> dict[str, Any]:
    """``policy.publishPorts`` as this user (tests/security/test_published_ports.py): prepare
    with the caller's settings and context, start ``command`` (the dev servers) beside, reach
    each published port from here (the host's network, as this user) until the first answers,
    read the command's ``hijack.txt`` verdict, abort, dispose, and look again."""
    import socket
    import urllib.request

    from fusion_oci.errors import PolicyNotEnforceableError

    def get(port: int) -> str:
        url = f"http://127.0.0.1:{port}/"
        with urllib.request.urlopen(url, timeout=2) as r:
            return str(r.read().decode())

    def refused(port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.settimeout(2)
                return s.recv(1) == b""
        except OSError:
            return True

    sandbox_settings = SandboxSettings.model_validate(args["settings"])
    ctx = PrepareContext.model_validate(args["ctx"])
    wt = Path(ctx.worktree_path)
    seen: dict[str, Any] = {}
    async with Sandbox(sandbox_settings, env=args["env"], cache_root=Path(args["cacheRoot"])) as sb:
        try:
            await sb.prepare(ctx)
        except PolicyNotEnforceableError as exc:
            return {"refused": exc.unenforced, "message": exc.render()}
        seen["published"] = sb.published()
        run = asyncio.ensure_future(sb.run(args["command"], RunOptions(timeout_ms=120_000)))
        ports = [int(p["hostPort"]) for p in seen["published"]]
        try:
            for _ in range(300):
                try:
                    seen["answers"] = [await asyncio.to_thread(get, p) for p in ports]
                    break
                except OSError:
                    if run.done():
                        break
                    await asyncio.sleep(0.1)
            for _ in range(50):
                if (wt / "hijack.txt").exists():
                    break
                await asyncio.sleep(0.1)
            seen["hijack"] = (
                (wt / "hijack.txt").read_text() if (wt / "hijack.txt").exists() else None
            )
        finally:
            ended_early = run.done()
            sb.abort()
            await asyncio.wait({run})
        if ended_early and not run.cancelled() and run.exception() is None:
            result = run.result()  # what the servers said when they ended on their own
            seen["ended"] = {"exit": result.exit_code, "stderr": result.stderr[-2000:]}
    seen["closedAfter"] = [refused(p) for p in ports]
    return seen


SCENARIOS = {
    "publish": publish,
    "availability": availability,
    "pnpm": pnpm,
    "timeout": timeout,
    "network": network,
    "agent": agent,
    "leftovers": leftovers,
    "gc": collect,
    "probe": probe,
    "session": session,
}


def main() -> None:
    scenario, raw = sys.argv[1], sys.argv[2]
    result = asyncio.run(SCENARIOS[scenario](json.loads(raw)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
