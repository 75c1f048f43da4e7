"""The fusion_oci package's modules, walked from the tree: what the layering and rooms tests
hold their rules over (a module added later is covered unasked)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_modules() -> dict[str, Path]:
    """Every module of the fusion_oci package, by dotted name (packages by their name)."""
    out: dict[str, Path] = {}
    for path in sorted((ROOT / "fusion_oci").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@dataclass(frozen=True)
class Import:
    """One import of a fusion_oci module by another, wherever it is written."""

    target: str
    """The module imported: ``from fusion_oci.x import y`` is ``fusion_oci.x.y`` when y is a
    module, else ``fusion_oci.x`` (the package or module the name is taken from)."""
    line: int
    type_only: bool
    """Under ``if TYPE_CHECKING:``: an annotation's, never run."""


def _type_only_nodes(tree: ast.Module) -> set[int]:
    """The ids of every node under an ``if TYPE_CHECKING:`` (plain or ``typing.``)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in (
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        ):
            for child in node.body:
                out.update(id(n) for n in ast.walk(child))
    return out


@cache
def imports(module: str) -> tuple[Import, ...]:
    """Every fusion_oci module ``module`` imports: at the top, inside functions (a lazy import
    is an import all the same) and under TYPE_CHECKING (marked); relative imports resolved."""
    modules = _modules()
    path = modules[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    type_only = _type_only_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def add(target: str, node: ast.stmt) -> None:
        if (target == "fusion_oci" or target.startswith("fusion_oci.")) and target != module:
            found.append(Import(target, node.lineno, id(node) in type_only))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                name = f"{base}.{alias.name}"
                add(name if name in modules else base, node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
    return tuple(dict.fromkeys(found))  # one per statement, not per name


@cache
def _modules() -> dict[str, Path]:
    return package_modules()
