"""The docker runtime against a real dockerd (DOCKER_HOST from scripts/services.sh)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.registry import create_runtime
from tests.integration import container_cases as cases
from tests.integration.container_cases import *  # noqa: F403  (shared cases, collected per engine)

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture
def engine() -> str:
    return "docker"


def test_missing_daemon_says_how_to_start_it(tmp_path: Path) -> None:
    runtime = create_runtime("docker", SandboxSettings(
        backend="docker", docker_url=f"unix://{tmp_path}/nothing.sock"), {})
    avail = runtime.availability()
    assert not avail.available
    assert "no docker service answers" in avail.reason and "nothing.sock" in avail.reason
    assert "DOCKER_HOST" in avail.hint


def test_permission_denied_on_the_socket() -> None:
    import socket
    import subprocess
    import tempfile

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
        "print(a.reason); print(a.hint)\n")
    out = subprocess.run(["runuser", "-u", "fusionci", "--", *cases.rootless_python(), "-c", code],
                         capture_output=True, text=True, timeout=60, cwd="/")
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
    settings: SandboxSettings, worktree: Path, tmp_path: Path,
    host_loopback_server: tuple[int, list[str]],
    canary: tuple[str, int],
) -> None:
    port, seen = host_loopback_server
    matrix = await cases.network_matrix("docker", settings, worktree, tmp_path, port, canary)
    cases.assert_network(matrix, seen, with_canary=True)




# ---------------------------------------------------------------------------- compose canary


@pytest.fixture(scope="session")
def docker_compose_file() -> str:
    return str(Path(__file__).resolve().parents[2] / "compose.yaml")


@pytest.fixture(scope="session")
def docker_compose_command() -> str:
    import shutil
    import subprocess

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
