"""The fusion_oci package's modules, walked from the tree: what the layering and rooms tests
hold their rules over (a module added later is covered unasked)."""

from __future__ import annotations

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
