"""The backend ids have one source (fusion_oci/models/backends.py); what cannot import it is checked
against it here: the TypeScript client's ``SandboxBackendId`` and its capabilities table (a
copy of ``CAPABILITIES``), the built-in runtimes' entry points, and the contract suite's
runtimes."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from fusion_oci.cli.options import BACKEND_CHOICES
from fusion_oci.models import BACKEND_IDS as MODELS_IDS
from fusion_oci.models.backends import BACKEND_IDS, CAPABILITIES
from tests.contract.harness import RUNTIMES

ROOT = Path(__file__).resolve().parents[2]
TS = ROOT / "clients" / "typescript" / "src"


def test_the_python_side_reads_the_one_list() -> None:
    assert MODELS_IDS is BACKEND_IDS
    assert BACKEND_CHOICES is BACKEND_IDS
    assert len(set(BACKEND_IDS)) == len(BACKEND_IDS)


def test_the_typescript_client_names_every_backend_and_no_other() -> None:
    types = (TS / "types.ts").read_text(encoding="utf-8")
    union = re.search(r"export type SandboxBackendId =(.*?);", types, re.S)
    assert union, "no SandboxBackendId in types.ts"
    ids = re.findall(r'\|\s*"([a-z-]+)"', re.sub(r"//[^\n]*", "", union.group(1)))
    assert sorted(ids) == sorted(BACKEND_IDS)
    backend = (TS / "backend.ts").read_text(encoding="utf-8")
    table = re.search(r"const CAPABILITIES[^{]*\{(.*?)\n\};", backend, re.S)
    assert table, "no CAPABILITIES table in backend.ts"
    rows = re.findall(r'^\s*"?([a-z-]+)"?:\s*caps\((.*?)\),?$', table.group(1), re.M)
    assert sorted(k for k, _ in rows) == sorted(BACKEND_IDS)
    # The client's copy of every backend's capabilities is the Python table's, field for field.
    for backend, args in rows:
        values = [json.loads(a) for a in args.split(",")]
        assert tuple(values) == CAPABILITIES[backend], backend


def test_every_backend_but_custom_is_a_built_in_runtime() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    built_in = project["project"]["entry-points"]["fusion_oci.builtin_runtimes"]
    assert sorted(built_in) == sorted(set(BACKEND_IDS) - {"custom"})


def test_the_contract_suite_runs_every_linux_backend() -> None:
    backends = {re.sub(r"-(runsc|rootless)$", "", name) for name in RUNTIMES}
    backends = {"custom" if b == "plugin" else b for b in backends}
    assert backends == set(BACKEND_IDS) - {"sandbox-exec"}  # macOS only: its own suite
