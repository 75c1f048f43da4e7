"""The per-task override written in a task prompt: ``**Sandbox:** podman``."""

from __future__ import annotations

import re

from fusion_oci.errors import SettingsError
from fusion_oci.models import BACKEND_IDS

# Tolerates case, spacing, and the colon inside or outside the bold: **Sandbox:** x,
# ** sandbox ** : X, **SANDBOX**:x.
_OVERRIDE = re.compile(
    r"^\s*(?:[-*]\s+)?\*\*\s*sandbox\s*(?::\s*\*\*|\*\*\s*:)\s*`?([A-Za-z][\w-]*)`?\s*$",
    re.IGNORECASE | re.MULTILINE,
)


def parse_prompt_override(prompt: str) -> str | None:
    """The backend a task prompt asks for, or None. The last override line wins."""
    matches = _OVERRIDE.findall(prompt)
    if not matches:
        return None
    backend = str(matches[-1]).lower()
    if backend not in BACKEND_IDS:
        raise SettingsError(
            "settings error in task prompt at **Sandbox:**",
            f"unknown backend '{matches[-1]}'",
            "accepted: " + ", ".join(BACKEND_IDS),
        )
    return backend
