"""The house's rooms: who may import whom, and the few places one job is done (the probe
subprocess, the error body). Walked over every module: a module added later is covered unasked."""

from __future__ import annotations

import ast

from fusion_oci.errors import (
    ERROR_KINDS,
    FlagError,
    PolicyNotEnforceableError,
    error_body,
    error_json,
)
from tests.modules import package_modules

MODULES = package_modules()


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


TREES = _trees()


def _imports(module: str) -> set[str]:
    """Every module ``module`` imports, at the top or inside a function (relative imports
    resolved)."""
    out: set[str] = set()
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_walk_sees_function_level_imports() -> None:
    assert "fusion_oci.runtimes.registry" in _imports("fusion_oci.server.resident")
    assert "fusion_oci.server" in _imports("fusion_oci.cli.serve")


def test_server_never_imports_cli() -> None:
    """The resident server is handed the CLI's parser; the run is fusion_oci.runrequest."""
    server = [m for m in MODULES if m == "fusion_oci.server" or m.startswith("fusion_oci.server.")]
    assert len(server) >= 5
    bad = {m: sorted(i for i in _imports(m) if i == "fusion_oci.cli"
                     or i.startswith("fusion_oci.cli."))
           for m in server}
    assert not {m: i for m, i in bad.items() if i}


# --------------------------------------------------------------------------- subprocesses

SPAWNERS = {"run", "Popen", "check_output", "check_call", "call", "getoutput",
            "getstatusoutput"}

NOT_MOVED = {
    # Long-lived children, not probes: a detached watchdog and the engines' daemons, which
    # outlive the call that starts them (process.py's helpers wait for their child).
    "fusion_oci.watchdog",
    "fusion_oci.engines.service",
    # Short probes still hand-rolled, in files another branch of issue #21 rewrites now
    # (the runtimes' translations): to be moved to process.probe when that lands.
    "fusion_oci.runtimes.bubblewrap",
    "fusion_oci.runtimes.landlock",
    "fusion_oci.runtimes.ocicli.probe",
}


def _spawns(module: str) -> list[str]:
    """The ``subprocess.X(...)`` calls (and ``from subprocess import X``) of ``module``."""
    found: list[str] = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in SPAWNERS and isinstance(node.func.value, ast.Name) \
                and node.func.value.id == "subprocess":
            found.append(f"subprocess.{node.func.attr} at line {node.lineno}")
        elif isinstance(node, ast.ImportFrom) and node.module == "subprocess":
            found += [f"from subprocess import {a.name}" for a in node.names
                      if a.name in SPAWNERS]
    return found


def test_only_process_py_starts_subprocesses() -> None:
    spawning = {m: s for m in MODULES if m != "fusion_oci.process" and (s := _spawns(m))}
    assert not {m: s for m, s in spawning.items() if m not in NOT_MOVED}
    # The allow-list shrinks: a module that no longer spawns leaves it.
    assert set(spawning) >= NOT_MOVED, NOT_MOVED - set(spawning)
    assert _spawns("fusion_oci.process")


# --------------------------------------------------------------------------- error body


def test_one_function_builds_the_error_body() -> None:
    body = error_body("bad-flags", "--x 1", "too small", "pass 2", ["memoryLimitMb"])
    assert body == {"kind": "bad-flags", "what": "--x 1", "why": "too small", "hint": "pass 2",
                    "unenforced": ["memoryLimitMb"]}
    assert error_body("bad-request", "not initialized") == {
        "kind": "bad-request", "what": "not initialized", "why": "", "hint": "",
        "unenforced": []}
    flag = FlagError("--x 1", "too small", "pass 2")
    assert flag.to_json() == {"error": error_body("bad-flags", "--x 1", "too small", "pass 2")}
    refused = PolicyNotEnforceableError("bubblewrap", ["memoryLimitMb"])
    assert refused.to_json()["error"]["unenforced"] == ["memoryLimitMb"]  # type: ignore[index]
    assert error_json(flag) == flag.to_json()
    assert error_json(OSError("disk full")) == {"error": error_body("setup-failed",
                                                                    "disk full")}
    assert "setup-failed" in ERROR_KINDS


def test_no_error_body_is_spelled_by_hand() -> None:
    """A dict literal with the error body's keys is error_body's alone (summaries and the
    doctor's rows name the same words for other things: they are not error bodies)."""
    spelled = []
    for module, tree in TREES.items():
        if module == "fusion_oci.errors":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                if {"kind", "what", "hint"} <= keys:
                    spelled.append(f"{module}:{node.lineno}")
    assert not spelled
