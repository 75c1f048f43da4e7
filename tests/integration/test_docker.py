"""The docker runtime against a real dockerd (DOCKER_HOST from scripts/services.sh), and
against the CI user's rootless dockerd (``docker-rootless``), driven as that user."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.policy.settings import DockerSettings, GateSettings, SandboxSettings
from fusion_oci.runtimes.registry import create_runtime
from tests.integration import container_cases as cases
from tests.integration.container_cases import *  # noqa: F403  (shared cases, collected per engine)
from tests.integration.images_fixture import ensure_node_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture
def engine() -> str:
    return "docker"


def test_missing_daemon_says_how_to_start_it(tmp_path: Path) -> None:
    runtime = create_runtime(
        "docker",
        SandboxSettings(backend="docker", docker_url=f"unix://{tmp_path}/nothing.sock"),
        {},
    )
    avail = runtime.availability()
    assert not avail.available
    assert "no docker service answers" in avail.reason and "nothing.sock" in avail.reason
    assert "DOCKER_HOST" in avail.hint


def test_permission_denied_on_the_socket() -> None:
    import socket

    tmp = Path(tempfile.mkdtemp(prefix="fusion-oci-perm-"))
    tmp.chmod(0o755)
    sock_path = tmp / "d.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(sock_path))
    srv.listen()
    os.chmod(sock_path, 0o600)
    code = (
        "from fusion_oci.runtimes.registry import create_runtime\n"
        "from fusion_oci.policy.settings import SandboxSettings\n"
        f"a = create_runtime('docker', SandboxSettings(backend='docker', "
        f"docker_url='unix://{sock_path}'), {{}}).availability()\n"
        "print(a.reason); print(a.hint)\n"
    )
    out = subprocess.run(
        ["runuser", "-u", "fusionci", "--", *cases.rootless_python(), "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    srv.close()
    sock_path.unlink()
    tmp.rmdir()
    assert "permission denied" in out.stdout, out.stdout + out.stderr
    assert "docker` group" in out.stdout


def test_availability_reports_socket_and_rootless(settings: SandboxSettings) -> None:
    avail = create_runtime("docker", settings, {}).availability()
    assert avail.available and avail.details["rootless"] in ("yes", "no")
    assert avail.details["socket"].startswith("unix://")


async def test_network_egress_reaches_a_container_network_not_host_loopback(
    settings: SandboxSettings,
    worktree: Path,
    tmp_path: Path,
    host_loopback_server: tuple[int, list[str]],
    canary: tuple[str, int],
) -> None:
    port, seen = host_loopback_server
    matrix = await cases.network_matrix("docker", settings, worktree, tmp_path, port, canary)
    cases.assert_network(matrix, seen, with_canary=True)


# ---------------------------------------------------------------------------- rootless
# The docker runtime as the unprivileged CI user against that user's rootless dockerd
# (scripts/services.sh docker-rootless), through tests/integration/rootless_driver.py like
# rootless podman's cases in test_podman.py.


@pytest.fixture(scope="module")
def dockerless() -> Iterator[dict[str, Any]]:
    """The user, its rootless dockerd's socket, the settings that name it, an interpreter."""

    def settings(xdg: str) -> SandboxSettings:
        return SandboxSettings(
            backend="docker",
            docker=DockerSettings(url=f"unix://{xdg}/docker.sock"),
            gates=GateSettings(sandbox_provision="allow"),
        )

    with cases.rootless_user("docker-rootless", "docker.sock", settings) as rl:
        yield rl


drive = cases.drive_rootless
workdir = cases.rootless_workdir


@pytest.mark.docker_rootless
def test_rootless_dockerd_is_seen_as_rootless_without_cgroups(dockerless: dict[str, Any]) -> None:
    result = drive(dockerless, "availability")
    assert result["available"] and result["rootless"] is True, result
    assert result["details"]["socket"] == f"unix://{dockerless['xdg']}/docker.sock"
    # This host is cgroup v1/hybrid: a rootless dockerd runs without cgroups there, and the
    # contract suite checks that memory and pids limits are refused (not ignored).
    assert result["details"]["cgroup"] == "v1"


@pytest.mark.docker_rootless
def test_rootless_pnpm_project_installs_tests_builds_and_commits(
    dockerless: dict[str, Any],
) -> None:
    image = ensure_node_image("docker-rootless").ref
    result = drive(
        dockerless,
        "pnpm",
        dir=str(workdir(dockerless, "pnpm")),
        image=image,
        project=str(cases.rootless_project()),
    )
    for step in ("install", "test", "build", "commit"):
        assert result[step]["exit"] == 0, (step, result[step])
    assert result["hooks"]["exit"] != 0, "the common dir's hooks are read-only"
    assert "from the rootless sandbox" in result["log"]
    # The user namespace's root, without capabilities: the user itself on the host.
    assert result["id"]["stdout"].strip() == "0"
    assert result["files"] > 0 and result["not_mine"] == [], result["not_mine"]


@pytest.mark.docker_rootless
def test_rootless_timeout_ends_the_tree_and_files_stay_the_users(
    dockerless: dict[str, Any],
) -> None:
    image = ensure_node_image("docker-rootless").ref
    result = drive(dockerless, "timeout", dir=str(workdir(dockerless, "timeout")), image=image)
    assert result["timed_out"] and result["reason"] == "timeout"
    assert result["took"] < 15
    assert not any("sleep 30" in p for p in result["procs"]), result["procs"]
    assert result["uid_inside"] == "0"
    assert result["owner"] == result["me"] == dockerless["user"].pw_uid
    assert drive(dockerless, "leftovers") == {"left": []}


@pytest.mark.docker_rootless
def test_rootless_egress_keeps_host_loopback_closed(
    dockerless: dict[str, Any], host_loopback_server: tuple[int, list[str]]
) -> None:
    port, seen = host_loopback_server
    image = ensure_node_image("docker-rootless").ref
    result = drive(
        dockerless, "network", dir=str(workdir(dockerless, "net")), image=image, port=port
    )
    for mode, row in result.items():
        for host, outcome in row.items():
            assert not outcome.startswith("open"), (mode, host, result)
    assert seen == []


@pytest.mark.docker_rootless
def test_rootless_agent_is_unreachable_and_leaves_no_process_per_command(
    dockerless: dict[str, Any],
) -> None:
    """The agent runs as the same uid 0 as the commands here (both are the user on the
    host): still nothing can connect to it, replace it, or read its environment or fds."""
    image = ensure_node_image("docker-rootless").ref
    result = drive(dockerless, "agent", dir=str(workdir(dockerless, "agent")), image=image)
    assert result["connect"].startswith("closed"), result
    assert all(code not in (0, None) for code in result["tamper"].values()), result
    before, after = result["monitors"]
    assert before >= 1 and after == before, result  # the container's shim, nothing per command
    assert result["outputs_ok"]
    assert drive(dockerless, "leftovers") == {"left": []}


# ---------------------------------------------------------------------------- compose canary


@pytest.fixture(scope="session")
def docker_compose_file() -> str:
    return str(Path(__file__).resolve().parents[2] / "compose.yaml")


@pytest.fixture(scope="session")
def docker_compose_command() -> str:
    import shutil

    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if v2.returncode == 0:
        return "docker compose"
    return shutil.which("docker-compose") or "docker-compose"


@pytest.fixture(scope="session")
def canary(docker_services: object) -> tuple[str, int]:
    """The canary's address on the bridge network (the image is built before compose up)."""
    import docker

    client = docker.DockerClient(base_url=os.environ.get("DOCKER_HOST"))
    try:
        found = client.containers.list(filters={"label": "io.fusion-oci.test=canary"})
        assert found, "compose did not start the canary"
        ip = found[0].attrs["NetworkSettings"]["IPAddress"]
        return str(ip), 8080
    finally:
        client.close()


@pytest.fixture(scope="session", autouse=False)
def docker_setup() -> list[str]:
    # compose needs the base image name before `up --build`; the node image is made first.
    os.environ["FUSION_OCI_CANARY_BASE"] = cases.image("docker")
    return ["up --build -d"]
