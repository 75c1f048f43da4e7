"""The environment a ``filtered`` sandbox's commands get (pure): every tool's proxy variables
point at the in-sandbox forwarder, nothing bypasses it, and ssh goes through the agent."""

from __future__ import annotations

PROXY_PORT = 3128
"""Where the in-sandbox forwarder listens: 127.0.0.1:3128 inside the sandbox's netns."""

AGENT_PATH = "/dev/fusion-oci-agent"
"""Where the exec agent is inside the sandbox (bubblewrap's place; a runtime that binds it
elsewhere passes its own path). Its ``connect HOST PORT`` mode is ssh's
ProxyCommand."""

SANDBOX_SOCKET = "/run/fusion-oci/egress.sock"
"""Where the host proxy's unix socket is bound inside the sandbox."""


def proxy_env(
    host: str = "127.0.0.1", port: int = PROXY_PORT, agent: str = AGENT_PATH
) -> dict[str, str]:
    """HTTP(S)_PROXY, ALL_PROXY (socks5h: names resolved by the proxy), an empty NO_PROXY
    (nothing bypasses it: a direct connection reaches nothing anyway), npm's own proxy
    settings, and GIT_SSH_COMMAND with the agent as ssh's ProxyCommand."""
    http = f"http://{host}:{port}"
    socks = f"socks5h://{host}:{port}"
    return {
        "HTTP_PROXY": http,
        "HTTPS_PROXY": http,
        "http_proxy": http,
        "https_proxy": http,
        "ALL_PROXY": socks,
        "all_proxy": socks,
        "NO_PROXY": "",
        "no_proxy": "",
        "npm_config_proxy": http,
        "npm_config_https_proxy": http,
        "GIT_SSH_COMMAND": f"ssh -o ProxyCommand='{agent} connect %h %p'",
    }
