"""Flags that take one of a few values: listed in --help, completed by the shell, and a wrong
value is a usage error (exit 2) that names the value probably meant."""

from __future__ import annotations

import difflib
from typing import Any

import typer


def choice(flag: str, choices: tuple[str, ...]) -> dict[str, Any]:
    """``typer.Option(..., **choice("--backend", BACKENDS))``."""

    def parse(value: str) -> str:
        if value in choices:
            return value
        near = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
        hint = f" Did you mean {near[0]}?" if near else ""
        raise typer.BadParameter(
            f"'{value}' is not one of {', '.join(choices)}.{hint}", param_hint=flag
        )

    def complete(incomplete: str) -> list[str]:
        return [c for c in choices if c.startswith(incomplete)]

    return {"parser": parse, "autocompletion": complete, "metavar": "|".join(choices)}
