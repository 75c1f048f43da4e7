"""The shims run as the package runs them (``python -S -E -s PATH``) from a copy of their folder
alone, as a wheel installs it (``site-packages/fusion_oci/shims/``) but with nothing of
fusion_oci beside it: what they import, they find in the standard library or in that folder
(tests/unit/test_shims.py checks the same rule in the source)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fusion_oci.host.scratch import process_start
from fusion_oci.shims import REAPER
from tests.backends import require_runtime

ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


@pytest.fixture
def shims(tmp_path: Path) -> Path:
    """A copy of fusion_oci/shims/*.py in a site-packages-like tree with no fusion_oci."""
    where = tmp_path / "site-packages" / "fusion_oci" / "shims"
    where.mkdir(parents=True)
    for source in REAPER.parent.glob("*.py"):
        shutil.copy2(source, where / source.name)
    return where


def by_path(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-S", "-E", "-s", str(script), *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_the_reaper_runs_alone_and_ends_what_its_command_left(shims: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "leftover"
    done = by_path(
        shims / "reaper.py",
        "2.0",
        str(os.getpid()),
        "RLIMIT_NOFILE=512:512",
        "--",
        "/bin/sh",
        "-c",
        f"sleep 30 & echo $! > {pidfile}; ulimit -n; exit 3",
        cwd=tmp_path,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "512\n", "")
    assert not alive(int(pidfile.read_text()))  # the leftover sleep was ended (proctree)


def test_the_watchdog_runs_alone_and_removes_its_folder(shims: Path, tmp_path: Path) -> None:
    usage = by_path(shims / "watchdog.py", cwd=tmp_path)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: watchdog.py"), usage
    folder = tmp_path / "service"
    folder.mkdir()
    me = os.getpid()
    done = by_path(
        shims / "watchdog.py",
        str(me),
        process_start(me) or "0",
        str(folder),
        "--",
        "/bin/true",
        cwd=tmp_path,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert not folder.exists()  # the service exited: the watchdog ended and cleaned up


@pytest.mark.landlock
def test_the_reaper_confines_its_child_alone(shims: Path, tmp_path: Path) -> None:
    """SANDBOX=FILE: the reaper imports the confinement and the supervisor as siblings; the
    child reads what the launch file grants and nothing else."""
    require_runtime("landlock")
    from fusion_oci.runtimes.landlock.host import host_abi
    from fusion_oci.runtimes.landlock.rules import RO, LandlockRules, launch_config, launch_text

    granted = [(p, RO) for p in ("/bin", "/etc", "/lib", "/lib64", "/usr") if Path(p).exists()]
    rules = LandlockRules(
        paths=granted, network="host", seccomp={"defaultAction": "SCMP_ACT_ALLOW"}
    )
    launch = tmp_path / "launch"
    launch.write_text(launch_text(launch_config(rules, host_abi(), platform.machine())))
    secret = tmp_path / "secret"
    secret.write_text("not for the command\n")

    def confined(command: str) -> subprocess.CompletedProcess[str]:
        return by_path(
            shims / "reaper.py",
            "2.0",
            str(os.getpid()),
            f"SANDBOX={launch}",
            "--",
            "/bin/sh",
            "-c",
            command,
            cwd=tmp_path,
        )

    ok = confined("head -c 4 /etc/passwd")
    assert (ok.returncode, ok.stdout) == (0, "root"), ok.stderr
    denied = confined(f"cat {secret}")
    assert denied.returncode == 1 and "Permission denied" in denied.stderr, denied
    assert "not for the command" not in denied.stdout
