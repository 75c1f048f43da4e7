"""Whether the audit log's hash chain verifies, through :func:`fusion_oci.audit.verify_chain`.

The chain belongs to :mod:`fusion_oci.audit`; this only turns its report into the summary's
``chain`` section and never raises: a log that cannot be checked is a status, not a crash.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fusion_oci.audit import default_key_path, load_key, verify_chain


def host_key(env: Mapping[str, str]) -> bytes | None:
    """The host's audit key when it exists (then MACs are checked too); never creates it."""
    return load_key(default_key_path(env), create=False)


def chain_status(path: Path, key: bytes | None = None) -> dict[str, Any]:
    """``{"status": ok|broken|empty|error, "lines", "firstBadLine", "reason", "keyed"}``;
    ``keyed``: MACs were checked as well as the ``prev`` hashes."""
    try:
        if not path.exists() or path.stat().st_size == 0:
            return {
                "status": "empty",
                "lines": 0,
                "firstBadLine": None,
                "reason": None,
                "keyed": bool(key),
            }
        report = verify_chain(path, key or None)
    except Exception as exc:  # a report, never a crash of the page
        return {
            "status": "error",
            "lines": None,
            "firstBadLine": None,
            "reason": f"{type(exc).__name__}: {exc}",
            "keyed": bool(key),
        }
    return {
        "status": "ok" if report.ok else "broken",
        "lines": report.lines,
        "firstBadLine": report.first_bad_line,
        "reason": report.reason,
        "keyed": report.keyed,
    }
