"""The `fusion-oci` command, run as a user would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.models import BACKEND_IDS

pytestmark = pytest.mark.native


def cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    full_env = {
        **os.environ,
        "HOME": str(cwd.parent / "home"),
        "XDG_CONFIG_HOME": str(cwd.parent / "home/.config"),
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "fusion_oci.cli.main", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_run_passes_output_and_status(worktree: Path) -> None:
    p = cli("run", "--", "echo out; echo err >&2; exit 3", cwd=worktree)
    assert (p.returncode, p.stdout) == (3, "out\n")
    note, err = p.stderr.splitlines()
    assert note.startswith("fusion-oci: note: the native backend isolates nothing")
    assert err == "err"


def test_run_argv_form(worktree: Path) -> None:
    p = cli("run", "--", "printf", "%s-%s", "a b", "c", cwd=worktree)
    assert (p.returncode, p.stdout) == (0, "a b-c")


def test_run_timeout_is_124(worktree: Path) -> None:
    p = cli("run", "--timeout-ms", "300", "--", "sleep 30", cwd=worktree)
    assert p.returncode == 124
    assert "timed out" in p.stderr


def test_run_json(worktree: Path) -> None:
    p = cli("run", "--json", "--max-buffer", "100", "--", "yes", cwd=worktree)
    result = json.loads(p.stdout)
    assert result["truncated"] is True
    assert result["reason"] == "max-buffer"
    assert {
        "stdout",
        "stderr",
        "exitCode",
        "signal",
        "timedOut",
        "durationMs",
        "backend",
        "fellBack",
    } <= set(result)


def test_unavailable_backend_is_125_then_fallback_runs(worktree: Path) -> None:
    p = cli("run", "--backend", "custom", "--", "echo hi", cwd=worktree)
    assert p.returncode == 125
    assert "unavailable" in p.stderr and "hint:" in p.stderr
    assert "Traceback" not in p.stderr
    p = cli(
        "run",
        "--backend",
        "custom",
        "--failure-mode",
        "fallback-native",
        "--",
        "echo hi",
        cwd=worktree,
    )
    assert (p.returncode, p.stdout) == (0, "hi\n")
    assert "fell back" in p.stderr
    audit = [
        json.loads(line)
        for line in (worktree / ".fusion/sandbox-audit.jsonl").read_text().splitlines()
    ]
    assert [e["type"] for e in audit][-5:] == [
        "sandbox:failure",
        "sandbox:fallback",
        "sandbox:prepare",
        "sandbox:run",
        "sandbox:dispose",
    ]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("sandbox:\n  backend: lxc\n", "sandbox.backend"),
        ("sandbox:\n  policy: {memoryLimitMb: -1}\n", "sandbox.policy.memoryLimitMb"),
        ("sandbox: [\n", "not valid YAML"),
    ],
)
def test_bad_settings_exit_2_nothing_run(worktree: Path, content: str, needle: str) -> None:
    (worktree / ".fusion").mkdir()
    (worktree / ".fusion/settings.yaml").write_text(content)
    p = cli("run", "--", "touch ran", cwd=worktree)
    assert p.returncode == 2
    assert needle in p.stderr
    assert "settings.yaml" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (worktree / "ran").exists()


def test_bad_flag_value_exit_2(worktree: Path) -> None:
    p = cli("run", "--memory-mb", "-3", "--", "true", cwd=worktree)
    assert p.returncode == 2
    assert "memoryLimitMb" in p.stderr
    p = cli("run", "--network", "sideways", "--", "true", cwd=worktree)
    assert p.returncode == 2
    assert "egress" in p.stderr


def test_task_prompt_override(worktree: Path, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.md"
    prompt.write_text("# Task\n**Sandbox:** custom\n")
    p = cli("run", "--task-prompt", str(prompt), "--", "true", cwd=worktree)
    assert p.returncode == 125
    assert "'custom'" in p.stderr


@pytest.mark.parametrize("backend", BACKEND_IDS)
def test_plan_is_pure_for_every_backend(worktree: Path, backend: str, oci_validator: Any) -> None:
    before = sorted(worktree.parent.rglob("*"))
    p = cli(
        "plan",
        "--json",
        "--backend",
        backend,
        "--network",
        "none",
        "--memory-mb",
        "256",
        "--",
        "pnpm test",
        cwd=worktree,
    )
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    oci_validator.validate(data["config"])
    assert data["backend"] == backend
    assert data["config"]["process"]["args"] == ["/bin/sh", "-c", "pnpm test"]
    assert "launch" in data
    assert sorted(worktree.parent.rglob("*")) == before  # created nothing


def test_bundle_create(worktree: Path, tmp_path: Path, oci_validator: Any) -> None:
    out = tmp_path / "bundle"
    p = cli("bundle", "create", "-o", str(out), "--pids", "64", "--", "make", "test", cwd=worktree)
    assert p.returncode == 0, p.stderr
    config = json.loads((out / "config.json").read_text())
    oci_validator.validate(config)
    assert config["linux"]["resources"]["pids"] == {"limit": 64}
    assert (out / "rootfs").is_dir()
    p = cli("bundle", "create", "-o", str(out), "--", "true", cwd=worktree)
    assert p.returncode == 2  # a usage error: the flag's value
    assert "not an empty directory" in p.stderr


def test_settings_show_provenance(worktree: Path) -> None:
    home = worktree.parent / "home/.config/fusion"
    home.mkdir(parents=True)
    (home / "settings.yaml").write_text("sandbox:\n  failureMode: fallback-native\n")
    (worktree / ".fusion").mkdir()
    (worktree / ".fusion/settings.yaml").write_text("sandbox:\n  backend: bubblewrap\n")
    p = cli("settings", "show", "--json", cwd=worktree)
    assert p.returncode == 0, p.stderr
    rows = {r["key"]: r for r in json.loads(p.stdout)}
    assert rows["backend"]["value"] == "bubblewrap"
    assert rows["backend"]["source"].endswith(".fusion/settings.yaml")
    assert rows["failureMode"]["source"].endswith("home/.config/fusion/settings.yaml")
    assert rows["policy.allowNetwork"]["source"] == "default"
    p = cli("settings", "validate", cwd=worktree)
    assert p.returncode == 0 and "settings OK" in p.stdout


def test_audit_table_and_filter(worktree: Path) -> None:
    cli("run", "--task-id", "alpha", "--", "true", cwd=worktree)
    cli("run", "--task-id", "beta", "--", "false", cwd=worktree)
    p = cli("audit", "--json", "--task", "beta", cwd=worktree)
    events = [json.loads(line) for line in p.stdout.splitlines()]
    assert {e["taskId"] for e in events} == {"beta"}
    run_event = next(e for e in events if e["type"] == "sandbox:run")
    assert run_event["exitCode"] == 1
    p = cli("audit", cwd=worktree)
    assert p.returncode == 0 and "alpha" in p.stdout


def test_doctor_lists_every_backend(worktree: Path) -> None:
    p = cli("doctor", "--json", cwd=worktree)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["configured"] == {
        "backend": "native",
        "source": "default",
        "failureMode": "fail-hard",
        "available": True,
        "hostServices": [],  # the grants, with what each gives away (none configured)
        "services": [],  # the service containers, and where the task reaches each (none)
        "publishPorts": [],  # the ports published on the host, and what each gives (none)
    }
    listed = report["backends"]
    rows = {r["backend"]: r for r in listed if r.get("ociRuntime") in (None, "runc")}
    assert set(rows) == set(BACKEND_IDS)
    assert rows["native"]["available"] is True
    # The oci backend once more for every other OCI runtime installed (gVisor's runsc).
    if shutil.which("runsc"):
        runsc = next(r for r in listed if r.get("ociRuntime") == "runsc")
        assert runsc["available"] and "platform" in runsc["details"], runsc
    for row in rows.values():
        if not row["available"]:
            assert row["reason"]


@pytest.mark.docker
def test_missing_image_asks_the_gate_denies_non_interactive_and_audits(worktree: Path) -> None:
    from tests.backends import require_runtime

    require_runtime("docker")
    image = "localhost/fusion-oci/never-built:1"
    p = cli("run", "--backend", "docker", "--image", image, "--", "true", cwd=worktree)
    assert p.returncode == 125, p.stderr
    assert "sandbox_provision" in p.stderr and "--allow-provision" in p.stderr
    events = [
        json.loads(line)
        for line in (worktree / ".fusion/sandbox-audit.jsonl").read_text().splitlines()
    ]
    gate = [e for e in events if e["type"] == "sandbox:gate"]
    assert gate, [e["type"] for e in events]
    assert gate[-1]["taskId"] == "adhoc"
    assert events[-1]["type"] == "sandbox:failure"


@pytest.mark.docker
@pytest.mark.podman
def test_gc_reports_as_json(worktree: Path) -> None:
    from tests.backends import require_runtime

    require_runtime("docker")
    require_runtime("podman")
    p = cli("gc", "--dry-run", "--json", cwd=worktree, timeout=120)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert {"removed", "kept", "errors", "engines"} <= set(report)
    assert any(e.startswith("docker") for e in report["engines"])
