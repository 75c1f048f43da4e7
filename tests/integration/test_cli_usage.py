"""The CLI as people expect it: output streams as it comes, stdin with -i, --cwd, prompts from
stdin, --version/-h, choices with a suggestion, exit 2 for usage errors, doctor's status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.native


def fusion(*args: str, cwd: Path) -> list[str]:
    del cwd
    return [sys.executable, "-m", "fusion_oci.cli.main", *args]


def env_for(cwd: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HOME": str(cwd.parent / "home"),
        "XDG_CONFIG_HOME": str(cwd.parent / "home/.config"),
    }


def cli(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        fusion(*args, cwd=cwd),
        cwd=cwd,
        env=env_for(cwd),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def test_run_streams_output_as_it_comes_and_in_order(worktree: Path) -> None:
    proc = subprocess.Popen(
        fusion("run", "--", "echo a; sleep 2; echo b >&2; sleep 1; echo c", cwd=worktree),
        cwd=worktree,
        env=env_for(worktree),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    start = time.monotonic()
    lines: list[tuple[bytes, float]] = []
    for line in proc.stdout:
        lines.append((line, time.monotonic() - start))
    assert proc.wait(30) == 0
    proc.stdout.close()
    texts = [text for text, _ in lines if not text.startswith(b"fusion-oci: note")]
    assert texts == [b"a\n", b"b\n", b"c\n"]
    at = {text: t for text, t in lines}
    assert at[b"a\n"] < at[b"c\n"] - 2.0  # a arrived while the command still ran


def test_pass_through_is_not_capped_but_json_is(worktree: Path) -> None:
    p = cli(
        "run", "--max-buffer", "1000", "--", "head -c 200000 /dev/zero | tr '\\0' x", cwd=worktree
    )
    assert (p.returncode, len(p.stdout)) == (0, 200000)
    p = cli("run", "--json", "--max-buffer", "1000", "--", "head -c 200000 /dev/zero", cwd=worktree)
    assert json.loads(p.stdout)["truncated"] is True


def test_interactive_forwards_stdin(worktree: Path) -> None:
    p = cli("run", "-i", "--", "cat", cwd=worktree, stdin="hello\n")
    assert (p.returncode, p.stdout) == (0, "hello\n")
    p = cli("run", "--", "cat", cwd=worktree, stdin="hello\n")
    assert (p.returncode, p.stdout) == (0, "")  # without -i stdin stays closed


def test_cwd_inside_the_worktree(worktree: Path) -> None:
    (worktree / "pkg").mkdir()
    p = cli("run", "--cwd", "pkg", "--", "pwd", cwd=worktree)
    assert (p.returncode, p.stdout.strip()) == (0, str(worktree / "pkg"))


def test_task_prompt_from_stdin(worktree: Path) -> None:
    p = cli(
        "run",
        "--task-prompt",
        "-",
        "--",
        "true",
        cwd=worktree,
        stdin="# Task\n**Sandbox:** custom\n",
    )
    assert p.returncode == 125
    assert "'custom'" in p.stderr
    p = cli("run", "-i", "--task-prompt", "-", "--", "true", cwd=worktree, stdin="x")
    assert p.returncode == 2
    assert "both read stdin" in p.stderr


def test_version_and_short_help(worktree: Path) -> None:
    from fusion_oci import __version__

    p = cli("--version", cwd=worktree)
    assert (p.returncode, p.stdout.strip()) == (0, f"fusion-oci {__version__}")
    for args in (("-h",), ("run", "-h"), ("settings", "show", "-h")):
        p = cli(*args, cwd=worktree)
        assert p.returncode == 0, (args, p.stderr)
        assert "Usage" in p.stdout


@pytest.mark.parametrize(
    ("flag", "value", "meant"),
    [
        ("--backend", "bubblewarp", "bubblewrap"),
        ("--network", "egres", "egress"),
        ("--failure-mode", "fallback", "fallback-native"),
    ],
)
def test_choices_suggest_what_was_meant(worktree: Path, flag: str, value: str, meant: str) -> None:
    p = cli("run", flag, value, "--", "true", cwd=worktree)
    assert p.returncode == 2
    assert f"Did you mean {meant}?" in p.stderr
    assert "Traceback" not in p.stderr


def test_help_lists_choices_and_every_option_has_help(worktree: Path) -> None:
    p = subprocess.run(
        fusion("run", "-h", cwd=worktree),
        cwd=worktree,
        env={**env_for(worktree), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "native|bubblewrap|landlock|oci|podman|docker|kubernetes|sandbox-exec|custom" in p.stdout
    from typer.main import get_command

    from fusion_oci.cli.main import _mount_images, app

    _mount_images(["images"])  # the images sub-app too (mounted only when asked for)

    def walk(command: object, path: str) -> list[str]:
        missing = [
            f"{path} {p.opts[0]}"
            for p in getattr(command, "params", [])
            if getattr(p, "opts", [""])[0].startswith("-") and not getattr(p, "help", "x")
        ]
        for name, sub in getattr(command, "commands", {}).items():
            missing += walk(sub, f"{path} {name}")
        return missing

    assert walk(get_command(app), "fusion-oci") == []


def test_usage_errors_exit_2(worktree: Path, tmp_path: Path) -> None:
    taken = tmp_path / "bundle"
    taken.mkdir()
    (taken / "config.json").write_text("{}")
    for args in (
        ("images", "build", "nosuch"),
        ("images", "list", "--engine", "dokcer"),
        ("bundle", "create", "-o", str(taken), "--", "true"),
        ("run",),
        ("nosuch",),
    ):
        p = cli(*args, cwd=worktree)
        assert p.returncode == 2, (args, p.returncode, p.stderr)
        assert "Traceback" not in p.stderr


def test_doctor_reads_the_settings_and_fails_when_the_backend_is_unavailable(
    worktree: Path,
) -> None:
    settings = worktree / ".fusion" / "settings.yaml"
    settings.parent.mkdir()
    settings.write_text("sandbox:\n  backend: custom\n")
    p = cli("doctor", "--json", cwd=worktree)
    assert p.returncode == 1
    report = json.loads(p.stdout)
    assert report["configured"]["backend"] == "custom"
    assert report["configured"]["source"].endswith("settings.yaml")
    assert report["configured"]["available"] is False
    p = cli("doctor", cwd=worktree)
    assert p.returncode == 1
    assert "configured backend 'custom'" in p.stderr


def test_json_keys_are_camel_case(worktree: Path) -> None:
    def keys(value: object) -> set[str]:
        if isinstance(value, dict):
            out = set(value)
            for v in value.values():
                out |= keys(v)
            return out
        if isinstance(value, list):
            return set().union(*(keys(v) for v in value)) if value else set()
        return set()

    p = cli("doctor", "--json", cwd=worktree)
    bad = {k for k in keys(json.loads(p.stdout)) if "_" in k or " " in k}
    assert bad == set()
    p = cli("plan", "--json", "--backend", "docker", "--", "true", cwd=worktree)
    launch = json.loads(p.stdout)["launch"]
    assert "sdkKwargs" in launch["sandbox"] and "sdk_kwargs" not in launch["sandbox"]


def test_piped_plan_keeps_long_lines_whole(worktree: Path) -> None:
    long = "x" * 300
    p = cli("plan", "--", f"echo {long}", cwd=worktree)
    assert p.returncode == 0
    assert any(long in line for line in p.stdout.splitlines())


def test_settings_show_warns_about_ignored_settings(worktree: Path) -> None:
    (worktree / ".fusion").mkdir()
    (worktree / ".fusion" / "settings.yml").write_text("sandbox:\n  backend: bubblewrap\n")
    p = cli("settings", "show", "--json", cwd=worktree)
    assert p.returncode == 0, p.stderr
    assert "settings.yml is ignored" in p.stderr
    rows = {r["key"]: r for r in json.loads(p.stdout)}
    assert rows["backend"] == {"key": "backend", "value": "native", "source": "default"}


@pytest.mark.parametrize(
    "backend", ["native", pytest.param("bubblewrap", marks=pytest.mark.bubblewrap)]
)
def test_tty_gives_the_command_a_terminal(worktree: Path, backend: str) -> None:
    from tests.backends import require_runtime

    require_runtime(backend)
    p = cli(
        "run",
        "--backend",
        backend,
        "--network",
        "none",
        "-t",
        "--",
        "test -t 0 && test -t 1 && echo terminal; exit 4",
        cwd=worktree,
    )
    assert p.returncode == 4, p.stderr
    assert p.stdout.splitlines() == ["terminal"]  # (text mode reads CRLF as a newline)
    p = cli(
        "run",
        "--backend",
        backend,
        "--network",
        "none",
        "--",
        "test -t 1 || echo no-terminal",
        cwd=worktree,
    )
    assert p.stdout == "no-terminal\n"


def test_reader_of_stdout_gone_ends_the_command_like_a_pipeline(worktree: Path) -> None:
    marker = f"fusion-oci-sigpipe-{os.getpid()}-{time.monotonic_ns()}"
    script = (
        f"set -o pipefail; {' '.join(fusion('run', cwd=worktree))} -- "
        f"\"sh -c 'yes' {marker}\" | head -2"
    )
    start = time.monotonic()
    p = subprocess.run(
        ["bash", "-c", script],
        cwd=worktree,
        env=env_for(worktree),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.stdout == "y\ny\n"
    assert p.returncode == 141  # 128 + SIGPIPE, as a shell pipeline reports it
    assert time.monotonic() - start < 30
    from tests.hostside import pids_with

    assert pids_with(marker) == []
