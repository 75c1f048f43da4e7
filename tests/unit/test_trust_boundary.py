"""The trust boundary's pure parts: worktree rules, protected paths, /proc protections in the
bubblewrap argv, native's status-quo environment, the audit chain and the error kinds."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fusion_oci.audit import GENESIS, AuditLog, RunEvent, verify_chain
from fusion_oci.errors import (
    ERROR_KINDS,
    EngineError,
    FlagError,
    GateDeniedError,
    PolicyNotEnforceableError,
    RuntimeUnavailableError,
    SandboxSetupError,
    SettingsError,
)
from fusion_oci.models import DEFAULT_PROTECTED_PATHS, PrepareContext, SandboxPolicy
from fusion_oci.oci.spec import bind, task_mounts
from fusion_oci.policy.layout import (
    TaskLayout,
    ensure_project_dir,
    resolve_layout,
    resolve_protected,
)
from fusion_oci.policy.worktree import default_worktree, project_root, worktree_problem
from fusion_oci.runtimes.bubblewrap import BwrapHost, proc_protection_args
from fusion_oci.runtimes.native import status_quo_env
from tests.conftest import git_init

# --- worktrees ------------------------------------------------------------------------------


def test_worktree_rules(tmp_path: Path) -> None:
    home = tmp_path / "home"
    repo = git_init(home / "code" / "repo")
    (repo / "src").mkdir()
    plain = tmp_path / "plain"
    plain.mkdir()
    env = {"HOME": str(home)}
    assert worktree_problem(repo, env) is None
    assert "root of the host" in (worktree_problem(Path("/"), env) or ("", ""))[0]
    assert "home folder" in (worktree_problem(home, env) or ("", ""))[0]
    assert "home folder" in (worktree_problem(tmp_path, env) or ("", ""))[0]  # holds $HOME
    assert "not inside a git work tree" in (worktree_problem(plain, env) or ("", ""))[0]
    why, hint = worktree_problem(repo / "src", env) or ("", "")
    assert "sub-folder" in why and str(repo) in hint
    assert default_worktree(repo / "src") == repo
    assert default_worktree(plain) == plain


def test_project_of_a_linked_worktree_is_its_main_repository(tmp_path: Path) -> None:
    from tests.conftest import git

    repo = git_init(tmp_path / "repo")
    git(repo, "commit", "-q", "--allow-empty", "-m", "i")
    wt = tmp_path / "wt"
    git(repo, "worktree", "add", "-q", str(wt))
    (wt / ".fusion").mkdir()  # planted: never a reason to pick the worktree
    assert project_root(wt) == repo
    assert project_root(repo) == repo


def test_the_layout_carries_the_project_a_runtime_protects(tmp_path: Path) -> None:
    """Landlock finds the project's .fusion/ in the layout, not the caller's context: the
    project folder named, else the worktree's main repository."""
    from tests.conftest import git

    repo = git_init(tmp_path / "repo")
    git(repo, "commit", "-q", "--allow-empty", "-m", "i")
    wt = tmp_path / "wt"
    git(repo, "worktree", "add", "-q", str(wt))
    cache = tmp_path / "cache"

    def layout(**kw: str) -> TaskLayout:
        ctx = PrepareContext(task_id="t", run_id="r", worktree_path=str(wt), **kw)
        return resolve_layout(ctx, cache_root=cache, ca_bundle=None, create=False)

    assert layout().project == str(repo.resolve())
    assert layout().fusion_dir() == str(repo.resolve() / ".fusion")
    named = tmp_path / "elsewhere"
    assert layout(project_dir=str(named)).fusion_dir() == str(named.resolve() / ".fusion")
    # A layout made by hand finds the worktree's own project on disk.
    assert TaskLayout(str(wt), None, (), None).fusion_dir() == str(repo.resolve() / ".fusion")


# --- protected paths ------------------------------------------------------------------------


def test_protected_paths_resolve_to_existing_paths_inside_writable_ones(tmp_path: Path) -> None:
    wt = git_init(tmp_path / "wt")
    (wt / ".vscode").mkdir()
    (wt / ".envrc").write_text("export X=1\n")
    (wt / ".idea").symlink_to(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    patterns = [*DEFAULT_PROTECTED_PATHS, str(outside), "docs/*.md"]
    protected, missing = resolve_protected(str(wt), patterns, [str(wt)])
    assert set(protected) == {
        f"{wt}/.git/hooks",
        f"{wt}/.git/config",
        f"{wt}/.envrc",
        f"{wt}/.vscode",
    }
    # Outside anything writable: not bound (binding would make it visible).
    assert str(outside) not in protected
    joined = " | ".join(missing)
    assert ".mcp.json (absent at prepare)" in joined and ".idea/" in joined and "symlink" in joined
    assert "docs/*.md (no match at prepare)" in joined


def test_dot_git_paths_of_a_linked_worktree_are_not_listed_as_missing(tmp_path: Path) -> None:
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / ".git").write_text("gitdir: /elsewhere\n")
    protected, missing = resolve_protected(str(wt), [".git/hooks", ".git/config"], [str(wt)])
    assert protected == () and missing == ()


def test_protected_paths_come_after_the_worktree_and_writable_paths_inside_them_stay_writable(
    tmp_path: Path,
) -> None:
    wt = str(tmp_path / "wt")
    db = f"{wt}/.fusion/fusion.db"
    policy = SandboxPolicy(writable_paths=[db])
    layout = TaskLayout(wt, None, (), None, protected=(f"{wt}/.fusion", f"{wt}/.envrc"))
    from fusion_oci.oci.host import probe_host

    mounts = task_mounts(layout, policy, probe_host())
    order = [m.destination for m in mounts]
    assert order.index(wt) < order.index(f"{wt}/.fusion") < len(order) - 1
    assert mounts[-1] == bind(db, db, writable=True)
    assert bind(f"{wt}/.fusion", f"{wt}/.fusion", writable=False) in mounts


def test_a_created_fusion_folder_is_excluded_not_committed(tmp_path: Path) -> None:
    repo = git_init(tmp_path / "repo")
    ensure_project_dir(repo)
    assert (repo / ".fusion").is_dir()
    assert "/.fusion/" in (repo / ".git/info/exclude").read_text().splitlines()
    ensure_project_dir(repo)  # once only
    assert (repo / ".git/info/exclude").read_text().count("/.fusion/") == 1
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout
    assert status == ""


# --- /proc protections on bubblewrap --------------------------------------------------------


def test_bwrap_masks_and_readonly_binds_follow_the_host() -> None:
    from fusion_oci.oci.model import TaskSpec

    spec = TaskSpec.model_validate(
        {
            "ociVersion": "1.0.2",
            "root": {"path": "rootfs"},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {
                "maskedPaths": ["/proc/kcore", "/proc/acpi", "/proc/absent", "/sys/firmware"],
                "readonlyPaths": ["/proc/sys"],
            },
        }
    )
    host = BwrapHost(
        path_kinds=(("/proc/kcore", "file"), ("/proc/acpi", "dir"), ("/proc/sys", "dir"))
    )
    args, notes = proc_protection_args(spec, host)
    assert args == [
        "--ro-bind",
        "/dev/null",
        "/proc/kcore",
        "--perms",
        "0555",
        "--tmpfs",
        "/proc/acpi",
        "--remount-ro",
        "/proc/acpi",
        "--ro-bind",
        "/proc/sys",
        "/proc/sys",
    ]
    assert any("/proc/absent: absent" in n for n in notes)
    assert any("/sys/firmware: hidden" in n for n in notes)


# --- native ---------------------------------------------------------------------------------


def test_native_env_is_the_callers_unless_an_allowlist_is_set() -> None:
    caller = {"PATH": "/opt/bin:/usr/bin", "HOME": "/home/me", "GITHUB_TOKEN": "t", "CI": "1"}
    assert status_quo_env((), caller) == caller
    narrowed = status_quo_env(["C*"], caller)
    assert narrowed == {"PATH": "/opt/bin:/usr/bin", "HOME": "/home/me", "CI": "1"}


# --- audit chain ----------------------------------------------------------------------------


def _log(tmp_path: Path, n: int, key: bytes = b"k" * 32) -> tuple[Path, list[str]]:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, key=key)
    for i in range(n):
        log.emit(RunEvent(task_id="t", run_id=f"r{i}", backend="native", exit_code=i))
    return path, path.read_text().splitlines()


def test_chain_links_every_line_to_the_one_before(tmp_path: Path) -> None:
    path, lines = _log(tmp_path, 3)
    assert json.loads(lines[0])["prev"] == GENESIS
    assert verify_chain(path, b"k" * 32).ok and verify_chain(path).ok


@pytest.mark.parametrize(
    "tamper,bad_line",
    [("edit", 2), ("remove", 2), ("forge", 4), ("garbage", 3), ("strip-chain", 2)],
)
def test_chain_names_the_first_bad_line(tmp_path: Path, tamper: str, bad_line: int) -> None:
    path, lines = _log(tmp_path, 3)
    if tamper == "edit":
        lines[1] = lines[1].replace('"exitCode":1', '"exitCode":0')
    elif tamper == "remove":
        del lines[1]
    elif tamper == "forge":
        lines.append(lines[-1].replace('"r2"', '"r9"'))
    elif tamper == "garbage":
        lines[2] = "not json"
    else:
        data = json.loads(lines[1])
        del data["prev"]
        lines[1] = json.dumps(data)
    path.write_text("\n".join(lines) + "\n")
    report = verify_chain(path, b"k" * 32)
    assert not report.ok and report.first_bad_line == bad_line, report


def test_lines_from_before_the_chain_are_accepted_only_at_the_start(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    legacy = json.dumps({"type": "sandbox:run", "taskId": "old", "runId": "r", "backend": "native"})
    path.write_text(legacy + "\n")
    AuditLog(path, key=b"k").emit(RunEvent(task_id="t", run_id="r", backend="native"))
    assert verify_chain(path, b"k").ok
    path.write_text(path.read_text() + legacy + "\n")
    assert verify_chain(path, b"k").first_bad_line == 3


# --- error kinds ----------------------------------------------------------------------------


def test_every_error_has_a_kind_and_a_json_form() -> None:
    errors = [
        SettingsError("s"),
        FlagError("f"),
        SandboxSetupError("x"),
        RuntimeUnavailableError("podman", "gone"),
        PolicyNotEnforceableError("oci", ["memoryLimitMb"]),
        GateDeniedError("g"),
        EngineError("e"),
    ]
    kinds = [e.kind for e in errors]
    assert kinds == [
        "bad-settings",
        "bad-flags",
        "setup-failed",
        "backend-unavailable",
        "policy-unenforceable",
        "gate-denied",
        "engine-error",
    ]
    assert set(kinds) <= set(ERROR_KINDS)
    body = errors[4].to_json()["error"]
    assert body == {
        "kind": "policy-unenforceable",
        "what": errors[4].what,
        "why": errors[4].why,
        "hint": errors[4].hint,
        "unenforced": ["memoryLimitMb"],
    }
    assert [e.exit_code for e in errors] == [2, 2, 125, 125, 125, 125, 125]


def test_scratch_gc_removes_only_folders_of_dead_owners(tmp_path: Path) -> None:
    import os

    from fusion_oci.host.scratch import OWNER_FILE, gc_scratch, owner_stamp

    dead = subprocess.Popen(["true"])
    dead.wait()
    mine, gone, foreign = (tmp_path / f"fusion-oci-bwrap-t-{n}" for n in ("a", "b", "c"))
    for folder in (mine, gone, foreign):
        folder.mkdir()
    (mine / OWNER_FILE).write_text(owner_stamp())
    (gone / OWNER_FILE).write_text(
        owner_stamp(os.getpid()).replace(str(os.getpid()), str(dead.pid), 1)
    )
    assert gc_scratch(tmp_path) == [str(gone)]
    assert mine.exists() and foreign.exists() and not gone.exists()
