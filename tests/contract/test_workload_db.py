"""A project whose tests need a database, on every runtime (issue #35): what most real test
suites are after their unit tests. tests/data/workload-db-project's ``pnpm test`` runs vitest
tests that make, write and read a table through the ``pg`` driver from the npm registry, on a
PostgreSQL the test starts on the host's loopback (tests/services_world.py), granted to the
task by ``policy.hostServices`` and reached inside at the same ``127.0.0.1`` port, as a
developer's ``docker compose up -d db && pnpm test`` reaches it (kubernetes: the pod's relay
listens there and carries each connection back over the agent's stream to the grant's relay on
the executor). The network is the one the workload case uses (``egress``; landlock's
``filtered`` or ``host``; kubernetes ``filtered``): the grant adds the database to it and
nothing else.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusion_oci.runtimes.requirements import Requirement
from tests.conftest import git
from tests.contract.harness import Runtime, sandbox
from tests.contract.test_workload import INSTALL, LOCAL, NETWORK, STEP

# Engine volumes bound under this session's temporary directory go at the module's end.
from tests.integration.container_cases import drop_test_cache_volumes  # noqa: F401
from tests.services_world import Postgres, postgres_server

PROJECT = Path(__file__).resolve().parents[1] / "data" / "workload-db-project"


@pytest.fixture(scope="module")
def pg() -> Iterator[Postgres]:
    with postgres_server() as server:
        yield server


async def test_a_project_whose_tests_need_a_database_installs_and_passes(
    runtime: Runtime, site: Path, pg: Postgres
) -> None:
    wt = site / "wt-db"
    wt.mkdir()
    git(wt, "init", "-q", "-b", "main")
    shutil.copytree(PROJECT, wt, dirs_exist_ok=True, ignore=LOCAL)
    network = NETWORK.get(runtime.name, "egress")
    url = f"postgres://postgres@127.0.0.1:{pg.port}/postgres"
    # network host (the test plugin) reaches the database already: a grant there is refused
    # as one that limits nothing.
    grants = [] if network == "host" else [f"127.0.0.1:{pg.port}"]
    async with sandbox(runtime, wt, network=network, host_services=grants) as sb:
        install = await sb.run("pnpm install --frozen-lockfile", INSTALL)
        assert install.exit_code == 0, (
            runtime.name,
            install.stdout[-2000:],
            install.stderr[-3000:],
        )
        tested = await sb.run(f"DATABASE_URL={url} pnpm test", STEP)
        plain = re.sub(r"\x1b\[[0-9;]*m", "", tested.stdout)
        assert tested.exit_code == 0, (runtime.name, plain[-3000:], tested.stderr[-3000:])
        assert re.search(r"Tests\s+3 passed", plain), plain[-2000:]
        # The grant is enforced where the runtime isolates the network (native keeps the
        # host's: there it is reported, as every unenforced part is).
        hosted = Requirement.HOST_SERVICES.value in tested.unenforced
        assert hosted == (runtime.name == "native"), (runtime.name, tested.unenforced)
