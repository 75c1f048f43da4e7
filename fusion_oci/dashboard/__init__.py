"""Sandbox telemetry from the audit log: a live page, a JSON API and terminal summaries.

``fusion-oci dashboard`` serves :func:`fusion_oci.dashboard.app.create_app` through
:func:`fusion_oci.dashboard.server.serve`; ``fusion-oci audit --summary`` prints
:func:`fusion_oci.dashboard.report.full_summary`. Importing this package imports no web stack:
the CLI's other commands stay fast.
"""

from __future__ import annotations
