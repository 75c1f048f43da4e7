"""Runtimes: one small class per backend behind :class:`fusion_oci.runtimes.protocol.Runtime`."""
