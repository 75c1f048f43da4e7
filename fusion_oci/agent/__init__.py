"""The exec agent: one resident process per sandbox runs every command (see PROTOCOL.md).

``agent.c`` is the agent (a static binary, ``fusion-oci-agent``, built by hatch_build.py);
:mod:`fusion_oci.agent.protocol` is the wire format; :mod:`fusion_oci.agent.client` the host side
over a local socket (the command's pipes passed with SCM_RIGHTS), :mod:`fusion_oci.agent.streamed`
the host side over any byte stream (a pod's exec) with ``mux.py`` at its far end;
:class:`fusion_oci.agent.outcome.AgentLike` is what both are to a runtime.
"""
