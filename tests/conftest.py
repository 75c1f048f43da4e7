from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# sandbox-exec exists only on macOS: elsewhere its real-Mac tests are not collected at all
# (its profile generation is unit-tested on every platform).
collect_ignore = [] if sys.platform == "darwin" else ["integration/test_sandbox_exec_macos.py"]

SCHEMA_DIR = Path(
    os.environ.get(
        "FUSION_OCI_OCI_SCHEMA_DIR",
        "/usr/share/gocode/src/github.com/opencontainers/runtime-spec/schema",
    )
)


def git(cwd: Path, *args: str) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.invalid",
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(cwd),
    }
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout


def git_init(path: Path) -> Path:
    """Make ``path`` (created when missing) the top of a git work tree: the lifecycle refuses
    any other folder as a worktree."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", str(path)], check=True, capture_output=True)
    return path


@pytest.fixture
def worktree(tmp_path: Path) -> Path:
    """A fresh git work tree (no commits) used as a task worktree."""
    return git_init(tmp_path / "wt")


@pytest.fixture
def linked_worktree(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(main repository, linked worktree made with `git worktree add`)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "README").write_text("hello\n")
    git(repo, "add", "README")
    git(repo, "commit", "-qm", "init")
    wt = tmp_path / "wt-task"
    git(repo, "worktree", "add", "-q", "-b", "task", str(wt))
    yield repo, wt


@pytest.fixture(scope="session")
def oci_validator() -> Any:
    """A validator for config.json built from the official runtime-spec JSON schemas."""
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT4

    from tests.backends import require

    require(
        "oci-schema",
        (SCHEMA_DIR / "config-schema.json").is_file(),
        f"no schemas in {SCHEMA_DIR}: apt-get install golang-github-opencontainers-specs-dev",
    )
    registry: Registry[Any] = Registry().with_resources(
        (
            path.resolve().as_uri(),
            Resource.from_contents(json.loads(path.read_text()), default_specification=DRAFT4),
        )
        for path in SCHEMA_DIR.glob("*.json")
    )
    schema = json.loads((SCHEMA_DIR / "config-schema.json").read_text())
    schema["id"] = (SCHEMA_DIR / "config-schema.json").resolve().as_uri()
    return jsonschema.Draft4Validator(schema, registry=registry)
