"""Whether the audit log's hash chain verifies, through ``fusion_oci.audit.verify_chain``.

The chain itself belongs to :mod:`fusion_oci.audit`; this is only the adapter that turns its
report into the summary's ``chain`` section, and says ``unsupported`` when the installed audit
module has no chain (an older fusion-oci, or a log written before chaining).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fusion_oci.audit as audit_module


def chain_status(path: Path) -> dict[str, Any]:
    """``{"status": ok|broken|unsupported|empty|error, "lines", "firstBadLine", "reason"}``."""
    verify = getattr(audit_module, "verify_chain", None)
    if verify is None:
        return {"status": "unsupported", "lines": None, "firstBadLine": None,
                "reason": "this fusion-oci's audit log has no hash chain"}
    try:
        if not path.exists() or path.stat().st_size == 0:
            return {"status": "empty", "lines": 0, "firstBadLine": None, "reason": None}
        report = verify(path)
    except Exception as exc:  # a report, never a crash of the page
        return {"status": "error", "lines": None, "firstBadLine": None,
                "reason": f"{type(exc).__name__}: {exc}"}
    return {"status": "ok" if report.ok else "broken", "lines": report.lines,
            "firstBadLine": report.first_bad_line, "reason": report.reason}
