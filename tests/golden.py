"""Golden files: compare with tests/data/...; FUSION_OCI_UPDATE_GOLDEN=1 (re)writes them.

A missing golden fails: a test that writes its own expectation proves nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"


def assert_golden(name: str, value: Any) -> None:
    path = DATA / name
    text = (json.dumps(value, indent=2, sort_keys=True) + "\n") if not isinstance(value, str) \
        else value
    if os.environ.get("FUSION_OCI_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"golden {path} is missing (FUSION_OCI_UPDATE_GOLDEN=1 writes it)"
    assert path.read_text() == text, f"{path} differs (FUSION_OCI_UPDATE_GOLDEN=1 to accept)"
