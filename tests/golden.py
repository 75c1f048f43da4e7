"""Golden files: compare with tests/data/...; FUSION_OCI_UPDATE_GOLDEN=1 rewrites them."""

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
    if os.environ.get("FUSION_OCI_UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.read_text() == text, f"{path} differs (FUSION_OCI_UPDATE_GOLDEN=1 to accept)"
