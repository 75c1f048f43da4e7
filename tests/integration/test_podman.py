"""The podman runtime against real podman services: rootful (FUSION_OCI_PODMAN_URL) with the
shared cases, and rootless, by running the library as the unprivileged CI user (its own
$XDG_RUNTIME_DIR socket, keep-id, slirp4netns)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.registry import create_runtime
from tests.backends import require
from tests.integration import container_cases as cases
from tests.integration.container_cases import *  # noqa: F403  (shared cases, collected per engine)
from tests.integration.images_fixture import ensure_node_image

pytestmark = [pytest.mark.podman, pytest.mark.slow]


@pytest.fixture
def engine() -> str:
    return "podman"


def test_missing_socket_without_podman_binary_says_what_to_do(tmp_path: Path) -> None:
    runtime = create_runtime(
        "podman",
        SandboxSettings(backend="podman"),
        {"PATH": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path)},
    )
    avail = runtime.availability()
    if os.getuid() == 0 and Path("/run/podman/podman.sock").exists():
        pytest.skip("a system podman socket answers here")
    assert not avail.available
    assert "podman is not installed" in avail.reason and "apt-get install podman" in avail.hint


def test_starts_podman_system_service_when_no_socket_answers(tmp_path: Path) -> None:
    """No CONTAINER_HOST, no socket at the default path: availability() starts nothing and
    says prepare will; connecting for a task starts the service (saying so), close stops it
    and removes its socket folder."""
    require("podman", shutil.which("podman") is not None, "podman is not installed")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    if os.getuid() == 0 and Path("/run/podman/podman.sock").exists():
        pytest.skip("the system socket answers here; nothing to start")
    runtime: Any = create_runtime("podman", SandboxSettings(backend="podman"), env)
    try:
        avail = runtime.availability()
        assert avail.available, avail
        assert "started for the task at prepare" in avail.details["socket source"]
        assert runtime._service is None
        adapter = runtime._connect()  # what prepare does
        assert "started by fusion-oci" in adapter.endpoint.source
        service = runtime._service.process
        folder = Path(runtime._service.folder)
        assert service is not None and service.poll() is None and folder.is_dir()
    finally:
        runtime.close()
    assert service.wait(10) is not None
    assert not folder.exists()


async def test_network_egress_reaches_a_container_network_not_host_loopback(
    settings: SandboxSettings,
    worktree: Path,
    tmp_path: Path,
    host_loopback_server: tuple[int, list[str]],
    podman_canary: tuple[str, int],
) -> None:
    port, seen = host_loopback_server
    matrix = await cases.network_matrix("podman", settings, worktree, tmp_path, port, podman_canary)
    cases.assert_network(matrix, seen, with_canary=True)


@pytest.fixture
def podman_canary(settings: SandboxSettings) -> Iterator[tuple[str, int]]:
    """The compose canary's server, as a podman container on podman's default network."""
    import podman

    script = Path(__file__).resolve().parents[1] / "data" / "compose" / "canary.js"
    with podman.PodmanClient(base_url=settings.podman_url) as client:
        container = client.containers.create(
            image=cases.image("podman"),
            command=["node", "/canary.js"],
            user="65534:65534",
            labels={"io.fusion-oci.test": "canary"},
            network_mode="bridge",
            volumes={str(script): {"bind": "/canary.js", "extended_mode": ["ro"]}},
            ulimits=[
                {"Name": "nproc", "Soft": 4096, "Hard": 4096},
                {"Name": "nofile", "Soft": 1024, "Hard": 1024},
            ],
        )
        try:
            container.start()
            container.reload()
            nets = container.attrs["NetworkSettings"]["Networks"]
            ip = next(iter(nets.values()))["IPAddress"]
            yield str(ip), 8080
        finally:
            container.remove(force=True)


# ---------------------------------------------------------------------------- rootless


@pytest.fixture(scope="module")
def rootless() -> Iterator[dict[str, Any]]:
    """The unprivileged user, its runtime dir, and an interpreter it can run."""
    with cases.rootless_user("podman-rootless", "podman/podman.sock") as rl:
        yield rl


drive = cases.drive_rootless
workdir = cases.rootless_workdir


@pytest.mark.podman_rootless
def test_rootless_availability_says_socket_and_rootless(rootless: dict[str, Any]) -> None:
    result = drive(rootless, "availability")
    assert result["available"], result
    assert result["rootless"] is True
    assert result["details"]["socket"].endswith(
        f"/run/user/{rootless['user'].pw_uid}/podman/podman.sock"
    )
    assert "XDG_RUNTIME_DIR" in result["details"]["socket source"]


@pytest.mark.podman_rootless
def test_rootless_pnpm_project_installs_tests_builds_and_commits(rootless: dict[str, Any]) -> None:
    image = ensure_node_image("podman-rootless").ref
    result = drive(
        rootless,
        "pnpm",
        dir=str(workdir(rootless, "pnpm")),
        image=image,
        project=str(cases.rootless_project()),
    )
    for step in ("install", "test", "build", "commit"):
        assert result[step]["exit"] == 0, (step, result[step])
    assert result["hooks"]["exit"] != 0, "the common dir's hooks are read-only"
    assert "from the rootless sandbox" in result["log"]
    assert result["id"]["stdout"].strip() == str(rootless["user"].pw_uid), "keep-id"
    assert result["files"] > 0 and result["not_mine"] == [], result["not_mine"]


@pytest.mark.podman_rootless
def test_rootless_timeout_ends_the_tree_and_files_stay_the_users(rootless: dict[str, Any]) -> None:
    image = ensure_node_image("podman-rootless").ref
    result = drive(rootless, "timeout", dir=str(workdir(rootless, "timeout")), image=image)
    assert result["timed_out"] and result["reason"] == "timeout"
    assert result["took"] < 15
    assert not any("sleep 30" in p for p in result["procs"]), result["procs"]
    assert result["owner"] == result["me"] == rootless["user"].pw_uid
    assert drive(rootless, "leftovers") == {"left": []}


@pytest.mark.podman_rootless
def test_rootless_egress_keeps_host_loopback_closed(
    rootless: dict[str, Any], host_loopback_server: tuple[int, list[str]]
) -> None:
    port, seen = host_loopback_server
    image = ensure_node_image("podman-rootless").ref
    result = drive(rootless, "network", dir=str(workdir(rootless, "net")), image=image, port=port)
    for mode, row in result.items():
        for host, outcome in row.items():
            assert not outcome.startswith("open"), (mode, host, result)
    assert seen == []


@pytest.mark.podman_rootless
def test_rootless_agent_is_unreachable_and_leaves_no_conmon(rootless: dict[str, Any]) -> None:
    image = ensure_node_image("podman-rootless").ref
    result = drive(rootless, "agent", dir=str(workdir(rootless, "agent")), image=image)
    assert result["connect"].startswith("closed"), result
    assert all(code not in (0, None) for code in result["tamper"].values()), result
    before, after = result["monitors"]
    assert before >= 1 and after == before, result
    assert result["outputs_ok"]
    assert drive(rootless, "leftovers") == {"left": []}
