"""The exec agent: one resident process per sandbox runs every command (see PROTOCOL.md).

``agent.c`` is the agent (a static binary, ``fusion-oci-agent``, built by hatch_build.py);
:mod:`fusion_oci.agent.protocol` is the wire format; :mod:`fusion_oci.agent.client` the host side.
"""
