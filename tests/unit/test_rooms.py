"""The house's rooms: who may import whom, and the few places one job is done (the probe
subprocess, the error body). Walked over every module: a module added later is covered unasked,
and one the tables do not place fails until it is placed.

A room is a subpackage (``runtimes``, ``oci``, ...) or a top-level module (``resolve``, ...).
Imports count wherever they are written, inside functions too: a lazy import is a dependency
all the same, and a circle is a circle even when it works. Imports under TYPE_CHECKING are
annotations, never run: they are held to the named rules (NEVER, the runtime families: a
folder of runtimes/ each) but not to the tiers nor the circle check.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Mapping, Sequence

from fusion_oci.errors import (
    ERROR_KINDS,
    FlagError,
    PolicyNotEnforceableError,
    error_body,
    error_json,
)
from tests.modules import ROOT, Import, imports, package_modules

MODULES = package_modules()


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


TREES = _trees()

Edge = tuple[str, Import]
"""(importing module, the import)."""

EDGES: list[Edge] = [(m, i) for m in MODULES for i in imports(m)]


def _targets(module: str) -> set[str]:
    return {i.target for i in imports(module)}


# --------------------------------------------------------------------------- the tables

TIERS: tuple[tuple[str, ...], ...] = (
    # The package's __init__ runs before any of its modules: it holds the version and a lazy
    # map of the public names (strings), so it is a leaf whatever it exports.
    ("fusion_oci", "errors", "shims"),
    ("models",),
    ("host",),
    ("store",),
    ("audit", "policy", "agent"),
    ("egress",),
    ("services",),
    ("oci",),
    ("resolve", "engines"),
    ("images", "gc", "replay"),
    ("runtimes", "sidecars"),
    ("sandbox", "doctor"),
    ("streaming", "otel", "dashboard", "export", "repro"),
    ("caller",),
    ("server",),
    ("cli",),
)
"""Bottom to top. A room imports (at run time) only rooms of a lower tier: two rooms of one
tier know nothing of each other. Together with NEVER and the runtime families this is the whole
rule table: a room not in it fails test_every_module_is_placed."""

NEVER: Mapping[str, frozenset[str]] = {
    "oci": frozenset({"runtimes"}),
    "policy": frozenset({"runtimes"}),
    "agent": frozenset({"runtimes"}),
    "images": frozenset({"runtimes"}),
    "engines": frozenset({"runtimes", "images", "gc"}),
    "gc": frozenset({"runtimes", "images"}),
    "server": frozenset({"cli"}),
}
"""Rules that hold for every import, type-only ones included (on top of the tiers, and of
"nothing imports cli/ but cli/"): the ones issue #21 named."""

SHARED_FOLDERS = frozenset({"linux"})
"""Folders of runtimes/ that are no runtime: the Linux primitives every runtime may use."""


def runtime_families(modules: Iterable[str] = MODULES) -> dict[str, str]:
    """Every module of runtimes/ by its runtime family, read from the folders: a runtime is a
    folder ``runtimes/X/`` (its runtime class beside its pure translation), family X; what
    lies loose in runtimes/ (the protocol, the skeleton, the registry, ...) and in the
    SHARED_FOLDERS is ``shared``, what every runtime may use."""
    modules = list(modules)
    folders = {
        m.split(".")[2]
        for m in modules
        if m.startswith("fusion_oci.runtimes.") and m.count(".") > 2
    }
    out = {}
    for m in modules:
        parts = m.split(".")
        if parts[:2] != ["fusion_oci", "runtimes"]:
            continue
        family = parts[2] if len(parts) > 2 and parts[2] in folders else "shared"
        out[m] = "shared" if family in SHARED_FOLDERS else family
    return out


RUNTIME_FAMILIES = runtime_families()
"""A family imports its own modules and the shared ones, never another runtime's (the shared
ones import only shared ones)."""

PENDING: frozenset[tuple[str, str]] = frozenset()
"""Known breaks of the tiers and the circle check, each to leave when it is fixed (the test
fails when one no longer exists)."""


# --------------------------------------------------------------------------- the checks


def room(module: str) -> str:
    """``fusion_oci.runtimes.oci`` -> ``runtimes``; ``fusion_oci.audit`` -> ``audit``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unplaced(modules: Iterable[str], tiers: Sequence[Sequence[str]] = TIERS) -> list[str]:
    """The modules no table places: a room in no tier; and tier entries that name no module.
    (A runtimes/ module's family is its folder: it is always placed.)"""
    modules = list(modules)
    placed = [r for tier in tiers for r in tier]
    out = [f"{r} is in {placed.count(r)} tiers" for r in set(placed) if placed.count(r) > 1]
    out += [f"{m}: room {room(m)!r} is in no tier" for m in modules if room(m) not in placed]
    rooms = {room(m) for m in modules}
    out += [f"tier entry {r!r} names no module" for r in placed if r not in rooms]
    return out


def _pending(edge: Edge, pending: frozenset[tuple[str, str]]) -> bool:
    return (edge[0], edge[1].target) in pending


def _say(edge: Edge) -> str:
    who, imp = edge
    return f"{who}:{imp.line} imports {imp.target}" + (" (type-only)" if imp.type_only else "")


def tier_breaks(
    edges: Iterable[Edge],
    tiers: Sequence[Sequence[str]] = TIERS,
    pending: frozenset[tuple[str, str]] = PENDING,
) -> list[str]:
    """Run-time imports of a room of the same or a higher tier."""
    level = {r: n for n, tier in enumerate(tiers) for r in tier}
    out = []
    for edge in edges:
        a, b = room(edge[0]), room(edge[1].target)
        if a == b or edge[1].type_only or _pending(edge, pending):
            continue
        if a in level and b in level and level[b] >= level[a]:
            out.append(f"{_say(edge)}: {b} (tier {level[b]}) is not below {a} (tier {level[a]})")
    return out


def never_breaks(edges: Iterable[Edge], never: Mapping[str, frozenset[str]] = NEVER) -> list[str]:
    """Imports the named rules forbid, type-only ones included."""
    out = []
    for edge in edges:
        a, b = room(edge[0]), room(edge[1].target)
        if b in never.get(a, frozenset()) or (b == "cli" and a != "cli"):
            out.append(f"{_say(edge)}: {a} never imports {b}")
    return out


def family_breaks(
    edges: Iterable[Edge], families: Mapping[str, str] = RUNTIME_FAMILIES
) -> list[str]:
    """A runtime importing another runtime's modules (or a shared module a runtime's)."""
    out = []
    for edge in edges:
        if room(edge[0]) != "runtimes" or room(edge[1].target) != "runtimes":
            continue
        mine, theirs = families.get(edge[0]), families.get(edge[1].target)
        if theirs not in (mine, "shared"):
            out.append(f"{_say(edge)}: runtime family {mine} reaches into {theirs}")
    return out


def room_circles(
    edges: Iterable[Edge], pending: frozenset[tuple[str, str]] = PENDING
) -> list[list[str]]:
    """The circles of the rooms' run-time import graph (its strongly connected components of
    more than one room), from the imports alone: the tiers are not trusted for it."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        a, b = room(edge[0]), room(edge[1].target)
        graph.setdefault(a, set())
        graph.setdefault(b, set())
        if a != b and not edge[1].type_only and not _pending(edge, pending):
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# --------------------------------------------------------------------------- the house


def test_the_walk_sees_function_level_and_type_only_imports() -> None:
    assert "fusion_oci.runtimes.registry" in _targets("fusion_oci.server.resident")
    assert "fusion_oci.server" in _targets("fusion_oci.cli.serve")
    typed = [i for i in imports("fusion_oci.streaming") if i.target == "fusion_oci.sandbox"]
    assert typed and all(i.type_only for i in typed)
    # relative imports resolve; `from pkg import module` names the module
    assert "fusion_oci.runtimes.linux.cgroups" in _targets("fusion_oci.runtimes.bubblewrap.runtime")


def test_every_module_is_placed() -> None:
    assert len(MODULES) > 100
    assert not unplaced(MODULES)


def test_every_import_goes_down_the_tiers() -> None:
    assert not tier_breaks(EDGES)


def test_the_named_rules_hold_for_every_import() -> None:
    """oci/, policy/, agent/ and images/ import no runtimes/; engines/ no runtimes/, images/
    nor gc; gc no runtimes/ nor images/; server/ no cli/; nothing but cli/ imports cli/."""
    assert not never_breaks(EDGES)


def test_a_runtime_imports_no_other_runtime() -> None:
    assert not family_breaks(EDGES)


def test_every_runtime_is_a_folder() -> None:
    """The families are the folders of runtimes/, and each built-in runtime (its entry point)
    lives in one of its own, not among the shared modules."""
    assert set(RUNTIME_FAMILIES.values()) >= {
        "shared",
        "bubblewrap",
        "engine",
        "kubernetes",
        "landlock",
        "native",
        "oci",
        "sandbox_exec",
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    built_in = project["project"]["entry-points"]["fusion_oci.builtin_runtimes"]
    for backend, target in built_in.items():
        module = target.partition(":")[0]
        assert RUNTIME_FAMILIES.get(module) not in (None, "shared"), backend


def test_no_circle_between_rooms() -> None:
    assert not room_circles(EDGES)


def test_pending_breaks_still_exist() -> None:
    """The allow-list shrinks: a break that was fixed leaves PENDING."""
    edges = {(m, i.target) for m, i in EDGES}
    assert edges >= PENDING, PENDING - edges


def test_server_never_imports_cli() -> None:
    """The resident server is handed the CLI's parser; the run is fusion_oci.caller.runrequest."""
    server = [m for m in MODULES if room(m) == "server"]
    assert len(server) >= 5
    assert not [e for e in EDGES if e[0] in server and room(e[1].target) == "cli"]


def _edge(who: str, target: str, *, type_only: bool = False) -> Edge:
    return who, Import(target, 1, type_only)


def test_the_checks_catch_what_they_forbid() -> None:
    """Each check, fed a broken house, says so (the real one passes above)."""
    upward = _edge("fusion_oci.images.rootfs", "fusion_oci.runtimes.engine.probe")
    assert tier_breaks([upward]) and never_breaks([upward])
    assert never_breaks(
        [_edge("fusion_oci.engines.base", "fusion_oci.runtimes.engine.containers", type_only=True)]
    )
    assert not tier_breaks(
        [_edge("fusion_oci.engines.base", "fusion_oci.runtimes.engine.containers", type_only=True)]
    )
    assert tier_breaks([_edge("fusion_oci.oci.spec", "fusion_oci.resolve")])
    assert tier_breaks([_edge("fusion_oci.resolve", "fusion_oci.engines")])  # same tier
    assert never_breaks([_edge("fusion_oci.caller.runrequest", "fusion_oci.cli.run")])
    assert family_breaks([_edge("fusion_oci.runtimes.native", "fusion_oci.runtimes.oci")])
    assert family_breaks([_edge("fusion_oci.runtimes.skeleton", "fusion_oci.runtimes.engine")])
    assert not family_breaks(
        [_edge("fusion_oci.runtimes.oci.probe", "fusion_oci.runtimes.linux.cgroups")]
    )
    loop = [
        _edge("fusion_oci.runtimes.engine", "fusion_oci.gc"),
        _edge("fusion_oci.gc", "fusion_oci.runtimes.engine.containers"),
    ]
    assert room_circles(loop) == [["gc", "runtimes"]]
    assert not room_circles([loop[0], _edge(*loop[1][:1], loop[1][1].target, type_only=True)])
    assert unplaced([*MODULES, "fusion_oci.newroom"]) == [
        "fusion_oci.newroom: room 'newroom' is in no tier"
    ]
    grown = runtime_families(
        [*MODULES, "fusion_oci.runtimes.new", "fusion_oci.runtimes.new.runtime"]
    )
    assert grown["fusion_oci.runtimes.new.runtime"] == grown["fusion_oci.runtimes.new"] == "new"
    assert family_breaks(
        [_edge("fusion_oci.runtimes.new.runtime", "fusion_oci.runtimes.oci")], grown
    )
    assert runtime_families([*MODULES, "fusion_oci.runtimes.loose"])[
        "fusion_oci.runtimes.loose"
    ] == ("shared")
    assert not unplaced(MODULES)


# --------------------------------------------------------------------------- subprocesses

SPAWNERS = {"run", "Popen", "check_output", "check_call", "call", "getoutput", "getstatusoutput"}

LONG_LIVED = {
    # Long-lived children, not probes: a detached watchdog and the engines' daemons, which
    # outlive the call that starts them (process.py's helpers wait for their child).
    "fusion_oci.shims.watchdog",
    "fusion_oci.engines.service",
    # the namespace helper of a rootless engine's service containers: the task's lifetime
    "fusion_oci.services.netns",
}
"""Not short probes. Every short one goes through process.probe: no module is left out."""

IN_THE_SANDBOX = {
    # Stdlib-only scripts that run inside the task's image (where fusion_oci is not
    # installed), never on the host: they cannot use process.py, and import nothing of ours.
    "fusion_oci.runtimes.kubernetes.sync.remote",
    "fusion_oci.agent.mux",
}


def _spawns(module: str) -> list[str]:
    """The ``subprocess.X(...)`` calls (and ``from subprocess import X``) of ``module``."""
    found: list[str] = []
    for node in ast.walk(TREES[module]):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in SPAWNERS
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "subprocess"
        ):
            found.append(f"subprocess.{node.func.attr} at line {node.lineno}")
        elif isinstance(node, ast.ImportFrom) and node.module == "subprocess":
            found += [f"from subprocess import {a.name}" for a in node.names if a.name in SPAWNERS]
    return found


def test_only_process_py_starts_subprocesses() -> None:
    spawning = {m: s for m in MODULES if m != "fusion_oci.host.process" and (s := _spawns(m))}
    assert not {m: s for m, s in spawning.items() if m not in LONG_LIVED | IN_THE_SANDBOX}
    # The list shrinks: a module that no longer spawns leaves it.
    assert set(spawning) >= LONG_LIVED, LONG_LIVED - set(spawning)
    assert _spawns("fusion_oci.host.process")


def test_scripts_run_in_the_sandbox_import_nothing_of_ours() -> None:
    for module in IN_THE_SANDBOX:
        for node in ast.walk(TREES[module]):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not [n for n in names if n.split(".")[0] == "fusion_oci"], module


# --------------------------------------------------------------------------- the caller's context

NOT_THE_CALLERS = {
    # A provision gate's audit context (fusion_oci.images.gates.ProvisionGate.ctx), which only
    # shares the attribute's name with the caller's PrepareContext.
    ("fusion_oci.runtimes.kubernetes.provision", "gate.ctx"),
}
"""(module, expression): ``.ctx`` reads under runtimes/ that are not the caller's context."""


def _context_reads(tree: ast.Module) -> list[str]:
    """Where a module reads a ``.ctx`` attribute or names ``PrepareContext``."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "ctx":
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Name) and node.id == "PrepareContext":
            found.append("PrepareContext")
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] == "PrepareContext":
            found.append(f"import {node.name}")
    return found


def test_no_runtime_reads_the_callers_context() -> None:
    """A runtime reads the TaskSpec and ProcessSpec (and the resolved task's layout), not the
    caller's context (issue #32): what it needs is compiled into them once, so it runs the
    task a plan shows and a bundle holds, not the settings that task came from."""
    runtimes = [m for m in MODULES if room(m) == "runtimes"]
    reads = {(m, r) for m in runtimes for r in _context_reads(TREES[m])}
    assert not reads - NOT_THE_CALLERS
    # The list shrinks: an exception no longer read leaves it.
    assert reads >= NOT_THE_CALLERS, NOT_THE_CALLERS - reads


def test_the_context_check_sees_every_spelling() -> None:
    tree = ast.parse(
        "from fusion_oci.models import PrepareContext\n"
        "def f(task, self):\n"
        "    a: PrepareContext = task.ctx\n"
        "    return self.task.ctx.policy\n"
    )
    assert sorted(_context_reads(tree)) == [
        "PrepareContext",
        "import PrepareContext",
        "self.task.ctx",
        "task.ctx",
    ]


# --------------------------------------------------------------------------- error body


def test_one_function_builds_the_error_body() -> None:
    body = error_body("bad-flags", "--x 1", "too small", "pass 2", ["memoryLimitMb"])
    assert body == {
        "kind": "bad-flags",
        "what": "--x 1",
        "why": "too small",
        "hint": "pass 2",
        "unenforced": ["memoryLimitMb"],
    }
    assert error_body("bad-request", "not initialized") == {
        "kind": "bad-request",
        "what": "not initialized",
        "why": "",
        "hint": "",
        "unenforced": [],
    }
    flag = FlagError("--x 1", "too small", "pass 2")
    assert flag.to_json() == {"error": error_body("bad-flags", "--x 1", "too small", "pass 2")}
    refused = PolicyNotEnforceableError("bubblewrap", ["memoryLimitMb"])
    assert refused.to_json()["error"]["unenforced"] == ["memoryLimitMb"]  # type: ignore[index]
    assert error_json(flag) == flag.to_json()
    assert error_json(OSError("disk full")) == {"error": error_body("setup-failed", "disk full")}
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
