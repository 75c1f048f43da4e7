"""The sandbox's environment, as policy: what a command inside sees of the caller's.

A fixed minimal set (PATH, HOME, TMPDIR, LANG, TERM), the caches' and the CA bundle's
variables, git's settings for a worktree it does not own, the brokered credentials' sentinels,
the proxy variables of a ``filtered`` network, and only the caller's variables the allowlist
names; a name that looks like a credential passes only when named exactly. Everything here is
pure: :func:`sandbox_env` is what :func:`fusion_oci.oci.spec.compile_process` puts in the OCI
``process.env``, and the runtimes without a spec (native) and the replay read the same rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fusion_oci.models import NetworkMode, SandboxPolicy
from fusion_oci.models.hostservice import no_proxy
from fusion_oci.policy.layout import CA_IN_SANDBOX, TaskLayout

SANDBOX_HOME = "/home/sandbox"
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Environment variables that tools read to trust an extra CA bundle.
CA_ENV_VARS = (
    "NODE_EXTRA_CA_CERTS",
    "npm_config_cafile",
    "GIT_SSL_CAINFO",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
)
NO_UPDATE_CHECKS = {
    "npm_config_update_notifier": "false",
    "pnpm_config_update_notifier": "false",
    "NO_UPDATE_NOTIFIER": "1",
}
"""No package manager asks its registry for a newer version of itself. They remember the
last check in ``$HOME/.local/state`` and ask once a day, but a sandbox's home is new with each
task, so pnpm asked at every task's first command: a request to its registry (~120 ms of
each new task's ``pnpm install`` here, measured) and an egress event, for a version the image
pins anyway. npm and pnpm up to 10 read ``npm_config_*``, pnpm 11 ``pnpm_config_*``,
the ``update-notifier`` package of other CLIs ``NO_UPDATE_NOTIFIER``. The allowlist can pass
the caller's own value."""
NODE_OPENSSL_CA = "--use-openssl-ca"
"""Node.js trusts OpenSSL's store (``SSL_CERT_FILE``: the shared bundle) in place of its own
roots. Used instead of ``NODE_EXTRA_CA_CERTS`` when the bundle is the host's whole trust store
(``TaskLayout.ca_complete``): that variable makes every Node.js start parse its own roots and
the bundle before running anything (45 ms a start here, measured: 144 certificates; with one,
still 28 ms), where OpenSSL's store is read at a process's first TLS handshake only. A task's
commands start Node.js many times (pnpm, then the tool it runs, then its children)."""


def sandbox_env(
    policy: SandboxPolicy,
    layout: TaskLayout,
    source: Mapping[str, str],
) -> dict[str, str]:
    """The command's whole environment: a fixed minimal set plus the allow-listed names.

    Nothing else of the caller's environment passes: tokens and keys stay out unless named.
    """
    env = {
        "PATH": SANDBOX_PATH,
        "HOME": SANDBOX_HOME,
        "TMPDIR": "/tmp",
        "LANG": source.get("LANG", "C.UTF-8"),
        "TERM": source.get("TERM", "dumb"),
        **NO_UPDATE_CHECKS,
    }
    for cache in layout.caches:
        env.update(dict(cache.env))
    if layout.ca_bundle:
        env.update({name: CA_IN_SANDBOX for name in CA_ENV_VARS})
        if layout.ca_complete:
            del env["NODE_EXTRA_CA_CERTS"]
            env["NODE_OPTIONS"] = NODE_OPENSSL_CA
    if layout.git is not None:
        # The worktree belongs to the caller, maybe under another uid inside a container.
        env["GIT_CONFIG_COUNT"] = "1"
        env["GIT_CONFIG_KEY_0"] = "safe.directory"
        env["GIT_CONFIG_VALUE_0"] = "*"
    allowed = allowed_env(policy.env_allowlist, source)
    if "NODE_OPTIONS" in allowed and env.get("NODE_OPTIONS") == NODE_OPENSSL_CA:
        merged = node_options(allowed["NODE_OPTIONS"])
        if merged is None:  # theirs stands; the bundle is added as a partial one would be
            env["NODE_EXTRA_CA_CERTS"] = CA_IN_SANDBOX
        else:
            allowed["NODE_OPTIONS"] = merged
    env.update(allowed)
    # After the allowlist: a brokered variable holds its sentinel even where the allowlist
    # names it (the value must never pass).
    env.update(credential_env(layout, env))
    if policy.network_mode is NetworkMode.FILTERED:
        # Last: the allowlist cannot point a tool past the proxy (it could not reach anything
        # anyway: the sandbox's only way out is the forwarder on 127.0.0.1:3128).
        env.update(filtered_env())
        if bypass := no_proxy(policy.relayed()):
            # Granted services and service containers, directly (by their names too).
            names = ",".join(s.name for s in policy.services)
            bypass = f"{bypass},{names}" if names else bypass
            env["NO_PROXY"] = env["no_proxy"] = bypass
    return env


def node_options(theirs: str) -> str | None:
    """The caller's allow-listed ``NODE_OPTIONS`` after :data:`NODE_OPENSSL_CA`, or None where
    theirs names Node.js's own store (``--use-bundled-ca``, which Node.js refuses beside it).
    Pure."""
    words = theirs.split()
    if "--use-bundled-ca" in words:
        return None
    return " ".join([NODE_OPENSSL_CA, *(w for w in words if w != NODE_OPENSSL_CA)])


def credential_env(layout: TaskLayout, env: Mapping[str, str]) -> dict[str, str]:
    """The sentinels of brokered credentials, and git's credential helper for their hosts
    (it prints the sentinel; the proxy swaps it in the Authorization header). Pure."""
    out = dict(layout.sentinels)
    count = int(env.get("GIT_CONFIG_COUNT", "0"))
    for host, user, name in layout.git_credentials:
        helper = (
            f'!f() {{ test "$1" = get && echo username={user} && echo "password=${name}"; }}; f'
        )
        # ssh remotes of the host go over https: there is no key inside to sign with, and
        # only https carries the brokered token.
        for key, value in (
            (f"credential.https://{host}.helper", helper),
            (f"url.https://{host}/.insteadOf", f"git@{host}:"),
            (f"url.https://{host}/.insteadOf", f"ssh://git@{host}/"),
        ):
            out[f"GIT_CONFIG_KEY_{count}"] = key
            out[f"GIT_CONFIG_VALUE_{count}"] = value
            count += 1
    if layout.git_credentials:
        out["GIT_CONFIG_COUNT"] = str(count)
    return out


def filtered_env() -> dict[str, str]:
    """The proxy environment of a ``filtered`` sandbox's commands: every tool's proxy variables
    at the agent's forwarder, ssh through the agent's ``connect`` mode at the path every
    runtime binds it to. Pure."""
    from fusion_oci.agent.protocol import EGRESS_AGENT, EGRESS_PORT
    from fusion_oci.egress.env import proxy_env

    return proxy_env("127.0.0.1", EGRESS_PORT, agent=EGRESS_AGENT)


# Names that look like credentials. They pass only when the allowlist names them exactly:
# a glob such as `CI_*` or `*` never lets `CI_JOB_TOKEN` or `AWS_SECRET_ACCESS_KEY` through.
SECRET_PATTERNS = (
    "*TOKEN*",
    "*SECRET*",
    "*PASSWORD*",
    "*PASSWD*",
    "*CREDENTIAL*",
    "*PRIVATE*KEY*",
    "*API*KEY*",
    "*ACCESS*KEY*",
    "*_KEY",
    "*SESSION*",
    "*COOKIE*",
    "*AUTH*",
    "AWS_*",
    "AZURE_*",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GCP_*",
    "SSH_AUTH_SOCK",
    "DOCKER_HOST",
    "CONTAINER_HOST",
    "KUBECONFIG",
    "VAULT_*",
    "NPM_CONFIG__AUTH*",
)


def is_secret_name(name: str) -> bool:
    from fnmatch import fnmatchcase

    upper = name.upper()
    return any(fnmatchcase(upper, pattern) for pattern in SECRET_PATTERNS)


def allowed_env(allowlist: Sequence[str], source: Mapping[str, str]) -> dict[str, str]:
    """The caller's variables the allowlist lets through (exact names or globs)."""
    from fnmatch import fnmatchcase

    exact = {name for name in allowlist if not any(c in name for c in "*?[")}
    globs = [name for name in allowlist if name not in exact]
    out = {}
    for name, value in source.items():
        if name in exact or (any(fnmatchcase(name, g) for g in globs) and not is_secret_name(name)):
            out[name] = value
    return out
