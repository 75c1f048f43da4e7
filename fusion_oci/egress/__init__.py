"""Egress by policy (``network: filtered``): the host side.

- :mod:`~fusion_oci.egress.rules`: which names, ports and addresses may be reached (pure);
- :mod:`~fusion_oci.egress.profile`: the built-in git/npm profile's hosts, each with its source;
- :mod:`~fusion_oci.egress.proxy`: the task's proxy (HTTP CONNECT, plain HTTP, SOCKS5), audited;
- :mod:`~fusion_oci.egress.splice`: an open tunnel's bytes, moved by ``splice(2)``;
- :mod:`~fusion_oci.egress.loop`: the per-process thread the proxies are served on;
- :mod:`~fusion_oci.egress.task`: a task's proxy from prepare to dispose (folder, rules);
- :mod:`~fusion_oci.egress.show`: what ``fusion-oci settings show`` lists for it;
- :mod:`~fusion_oci.egress.env`: the proxy environment of a filtered sandbox's commands.

The sandbox side (the forwarder on 127.0.0.1:3128 in the sandbox's empty network namespace,
spliced to the proxy's unix socket) is the exec agent's; see docs/egress.md.
"""

from fusion_oci.egress.env import PROXY_PORT, SANDBOX_SOCKET, proxy_env
from fusion_oci.egress.proxy import EgressProxy, Limits, start_proxy
from fusion_oci.egress.rules import Decision, EgressRules, PatternError, validate_patterns

__all__ = [
    "PROXY_PORT",
    "SANDBOX_SOCKET",
    "Decision",
    "EgressProxy",
    "EgressRules",
    "Limits",
    "PatternError",
    "proxy_env",
    "start_proxy",
    "validate_patterns",
]
