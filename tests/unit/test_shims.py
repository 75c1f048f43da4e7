"""The rule of fusion_oci/shims/, written as a test: the shims run by path as ``python -S -E -s
PATH`` (no site-packages), so every module there imports the standard library and its siblings
only, and a sibling imported by bare name (run by path) is also imported from the package
(``from . import X``, when fusion_oci imports it) so that both ways work.

tests/integration/test_shims.py runs each script that way, from a copy of the folder alone."""

from __future__ import annotations

import ast
import sys

from tests.modules import ROOT

SHIMS = ROOT / "fusion_oci" / "shims"
SCRIPTS = ("reaper", "watchdog")
"""The programs of the folder (the rest are their modules, or the host's view of them)."""


def siblings() -> set[str]:
    return {p.stem for p in SHIMS.glob("*.py") if p.stem != "__init__"}


def import_problems(source: str, name: str, sibs: set[str]) -> list[str]:
    """What in ``source`` (the module ``name`` of the folder) breaks the rule. Pure."""
    bare: set[str] = set()
    relative: set[str] = set()
    out: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in sibs:
                    bare.add(top)
                elif top not in sys.stdlib_module_names:
                    out.append(f"{name}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:
                found = {a.name for a in node.names}
                out += [f"{name}:{node.lineno}: from . import {n}" for n in found - sibs]
                relative |= found & sibs
            elif node.level == 1 and node.module in sibs:
                relative.add(node.module)
            elif node.level == 0 and node.module in sibs:
                bare.add(node.module)
            elif node.level or (node.module or "").split(".")[0] not in sys.stdlib_module_names:
                where = "." * node.level + (node.module or "")
                out.append(f"{name}:{node.lineno}: from {where} import")
    # A bare import alone would fail under fusion_oci.shims; a relative one alone, by path.
    out += [f"{name}: imports {s} by path only" for s in sorted(bare - relative)]
    out += [f"{name}: imports {s} from the package only" for s in sorted(relative - bare)]
    return out


def test_the_shims_import_the_standard_library_and_their_siblings_only() -> None:
    sibs = siblings()
    problems = [
        problem
        for path in sorted(SHIMS.glob("*.py"))
        for problem in import_problems(path.read_text(encoding="utf-8"), path.stem, sibs)
    ]
    assert not problems


def test_no_sibling_shadows_a_standard_module() -> None:
    """Run by path, the folder comes first on sys.path: a sibling named like a standard module
    would replace it for every script of the folder."""
    assert not siblings() & set(sys.stdlib_module_names)
    assert set(SCRIPTS) <= siblings()


def test_the_scripts_are_the_paths_the_package_starts() -> None:
    from fusion_oci.shims import REAPER, WATCHDOG

    assert [SHIMS / f"{s}.py" for s in SCRIPTS] == [REAPER, WATCHDOG]
    for script in (REAPER, WATCHDOG):
        tree = ast.parse(script.read_text(encoding="utf-8"))
        guard = tree.body[-1]
        assert isinstance(guard, ast.If), script  # if __name__ == "__main__": sys.exit(main())
        assert ast.unparse(guard.test) == "__name__ == '__main__'", script


def test_the_check_catches_what_it_forbids() -> None:
    sibs = {"proctree", "confine"}
    assert not import_problems(
        "import os, _socket\nfrom collections import abc\nif __package__:\n"
        "    from . import proctree\nelse:\n    import proctree\n",
        "m",
        sibs,
    )
    assert import_problems("import fusion_oci.errors\n", "m", sibs) == [
        "m:1: import fusion_oci.errors"
    ]
    assert import_problems("from fusion_oci import errors\n", "m", sibs) == [
        "m:1: from fusion_oci import"
    ]
    assert import_problems("def f():\n    import yaml\n", "m", sibs) == ["m:2: import yaml"]
    assert import_problems("from .. import process\n", "m", sibs) == ["m:1: from .. import"]
    assert import_problems("from . import nothere\n", "m", sibs) == ["m:1: from . import nothere"]
    assert import_problems("import confine\n", "m", sibs) == ["m: imports confine by path only"]
    assert import_problems("from confine import apply\n", "m", sibs) == [
        "m: imports confine by path only"
    ]
    assert import_problems("from .confine import apply\n", "m", sibs) == [
        "m: imports confine from the package only"
    ]
