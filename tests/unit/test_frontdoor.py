"""The one front door (fusion_oci.caller.frontdoor): the CLI's flags and the server's prepare
params come in through the same function, and for the same inputs leave with the same
PrepareContext and settings; each settings file is read once, the worktree checked once."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.caller import TaskFlags, frontdoor, resolve_task
from fusion_oci.errors import FlagError
from fusion_oci.policy import worktree as worktree_rules
from fusion_oci.server.methods import Session


class _Stop(Exception):
    """Raised after the front door: what comes next (a sandbox) is not this test's."""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def task(tmp_path: Path) -> dict[str, Any]:
    home = tmp_path / "home"
    wt = tmp_path / "wt"
    (wt / ".git").mkdir(parents=True)  # the top of a work tree, for the worktree rules
    shared = tmp_path / "shared"
    extra = tmp_path / "extra"
    shared.mkdir()
    extra.mkdir()
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "PATH": "/usr/bin"}
    files = [
        _write(
            home / ".config/fusion/settings.yaml",
            # `backend` at the top level is ignored, with a warning both callers get
            f"backend: docker\nsandbox:\n  policy:\n    allowedPaths: [{shared}]\n",
        ),
        _write(wt / ".fusion/settings.yaml", "sandbox:\n  cacheMode: isolated\n"),
    ]
    return {"env": env, "wt": wt, "shared": shared, "extra": extra, "files": files}


def _spy(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], Counter[Path], list[Path]]:
    """Every front door entry, every file read and every worktree check, from now on."""
    entries: list[Any] = []
    reads: Counter[Path] = Counter()
    checks: list[Path] = []
    real_door, real_check, real_read = (
        frontdoor.front_door,
        frontdoor.check_worktree,
        Path.read_text,
    )

    def door(request: frontdoor.TaskRequest) -> frontdoor.Entry:
        entries.append(real_door(request))
        raise _Stop

    def check(path: Path, *args: Any, **kwargs: Any) -> None:
        checks.append(path)
        real_check(path, *args, **kwargs)

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        reads[self] += 1
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(frontdoor, "front_door", door)
    monkeypatch.setattr(frontdoor, "check_worktree", check)
    monkeypatch.setattr(Path, "read_text", read_text)
    return entries, reads, checks


def test_the_cli_and_the_server_build_the_same_context(
    task: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    entries, reads, checks = _spy(monkeypatch)
    flags = TaskFlags(
        worktree=task["wt"],
        backend="bubblewrap",
        network="none",
        allow_path=[str(task["extra"])],
        memory_mb=512,
        task_id="t1",
        run_id="r1",
    )
    with pytest.raises(_Stop):
        resolve_task(flags, task["env"], cwd=task["wt"])
    cli_reads, cli_checks = Counter(reads), list(checks)
    reads.clear()
    checks.clear()
    params = {
        "context": {
            "taskId": "t1",
            "runId": "r1",
            "worktreePath": str(task["wt"]),
            # the context's policy replaces lists: the files' path is named again
            "policy": {
                "network": "none",
                "allowNetwork": False,
                "allowedPaths": [str(task["shared"]), str(task["extra"])],
                "memoryLimitMb": 512,
            },
        },
        "backend": "bubblewrap",
    }
    with pytest.raises(_Stop):
        asyncio.run(Session(task["env"]).prepare(params, 1))
    cli, server = entries
    assert cli.ctx == server.ctx
    assert cli.ctx.worktree_checked and server.ctx.worktree_checked
    assert cli.effective.settings == server.effective.settings
    assert cli.effective.warnings == server.effective.warnings
    (warning,) = cli.effective.warnings
    assert "backend at the top level" in warning
    assert cli.project_dir == server.project_dir == task["wt"]
    assert cli.ctx.policy.allowed_paths == [str(task["shared"]), str(task["extra"])]
    assert cli.effective.settings.cache_mode.value == "isolated"
    # Each settings file read once (a flag given too), the worktree checked once.
    for seen in (cli_reads, reads):
        assert {p: seen[p] for p in task["files"]} == dict.fromkeys(task["files"], 1)
    assert cli_checks == checks == [task["wt"]]


def test_prepare_does_not_check_a_checked_worktree_again(
    task: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    entries, _, _ = _spy(monkeypatch)
    with pytest.raises(_Stop):
        resolve_task(TaskFlags(worktree=task["wt"]), task["env"])
    ctx = entries[0].ctx
    again: list[Path] = []
    monkeypatch.setattr(worktree_rules, "check_worktree", lambda p, *a, **k: again.append(p))
    worktree_rules.check_inputs(ctx, "auto", task["env"])
    assert again == []
    # A context the front door did not check (another worktree, or unsafe now) is checked.
    other = ctx.model_copy(update={"worktree_path": str(task["extra"])})
    unsafe = ctx.model_copy(update={"unsafe_worktree": True})
    for unchecked in (other, unsafe, type(ctx).model_validate(ctx.model_dump())):
        assert not unchecked.worktree_checked
        worktree_rules.check_inputs(unchecked, "auto", task["env"])
    assert again == [task["extra"], task["wt"], task["wt"]]


def test_each_caller_names_the_refused_worktree_its_way(
    task: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = task["extra"]  # no work tree
    with pytest.raises(FlagError) as cli:
        resolve_task(TaskFlags(worktree=plain), task["env"])
    assert str(cli.value).startswith(f"--worktree {plain} is refused as a worktree")
    with pytest.raises(FlagError) as default:
        resolve_task(TaskFlags(), task["env"], cwd=plain)
    assert "worktree (current directory; pass --worktree DIR)" in str(default.value)
    params = {"context": {"taskId": "t1", "runId": "r1", "worktreePath": str(plain)}}
    with pytest.raises(FlagError) as server:
        asyncio.run(Session(task["env"]).prepare(params, 1))
    assert str(server.value).startswith(f"worktreePath {plain} is refused as a worktree")
    params["context"]["taskId"] = "bad id"
    params["context"]["worktreePath"] = str(task["wt"])
    with pytest.raises(FlagError) as bad_id:
        asyncio.run(Session(task["env"]).prepare(params, 1))
    assert str(bad_id.value).startswith("prepare context")
    with pytest.raises(FlagError) as bad_flag:
        resolve_task(TaskFlags(worktree=task["wt"], task_id="bad id"), task["env"])
    assert str(bad_flag.value).startswith("--task-id 'bad id'")
