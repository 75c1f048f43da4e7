"""Where the cluster is and who we are to it, found the way kubectl finds it.

Order (kubectl's, client-go's ``clientcmd``): ``kubernetes.kubeconfig`` when set; else every
file of ``KUBECONFIG`` (``:``-separated; a context, cluster or user is taken from the first file
that has it, the current context from the first file that names one); else
``~/.kube/config``; else, inside a pod, the service account's token and CA with
``KUBERNETES_SERVICE_HOST``/``PORT``. :func:`find_access` reads those files and nothing else.

Supported credentials: client certificates and bearer tokens (files or inline data). An
``exec`` plugin or an ``auth-provider`` (cloud login helpers) runs a program of the user's;
that is refused with a named error rather than run behind the user's back.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fusion_oci.errors import SettingsError
from fusion_oci.policy.kubernetes import KubernetesSettings

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class ClusterAccess:
    """An API server and the credentials to reach it (secrets held as given, never logged)."""

    server: str
    """``https://host:port``."""
    namespace: str
    source: str
    """Where it was found (a kubeconfig path and context, or ``in-cluster``), for doctor."""
    context: str = ""
    ca_file: str | None = None
    ca_data: bytes | None = None
    cert_file: str | None = None
    cert_data: bytes | None = None
    key_file: str | None = None
    key_data: bytes | None = None
    token: str | None = None
    insecure: bool = False
    """``insecure-skip-tls-verify``: kept as the kubeconfig says; doctor reports it."""

    def __repr__(self) -> str:  # never print a credential
        return f"ClusterAccess(server={self.server!r}, source={self.source!r})"


def kubeconfig_paths(settings: KubernetesSettings, env: Mapping[str, str]) -> list[Path]:
    """The kubeconfig files to read, in kubectl's order (existing or not). Pure."""
    if settings.kubeconfig:
        return [Path(settings.kubeconfig).expanduser()]
    listed = [p for p in env.get("KUBECONFIG", "").split(":") if p]
    if listed:
        return [Path(p).expanduser() for p in listed]
    home = env.get("HOME")
    return [Path(home) / ".kube" / "config"] if home else []


def find_access(settings: KubernetesSettings, env: Mapping[str, str]) -> ClusterAccess | None:
    """The cluster the settings point at; None when nothing names one (no kubeconfig file,
    not in a pod). A file that exists but is wrong raises :class:`SettingsError`."""
    paths = [p for p in kubeconfig_paths(settings, env) if p.is_file()]
    if settings.kubeconfig and not paths:
        raise SettingsError(
            "settings error at sandbox.kubernetes.kubeconfig",
            f"{settings.kubeconfig} does not exist",
            "point kubernetes.kubeconfig at your kubeconfig file, or leave it out to use "
            "KUBECONFIG / ~/.kube/config",
        )
    if paths:
        docs = [(p, _read(p)) for p in paths]
        return from_kubeconfig(docs, settings)
    if env.get("KUBERNETES_SERVICE_HOST") and (SERVICE_ACCOUNT / "token").is_file():
        return in_cluster(env, settings)
    return None


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(
            f"cannot read kubeconfig {path}",
            str(exc).splitlines()[0],
            "fix the file (kubectl config view shows what kubectl reads), or set "
            "kubernetes.kubeconfig to another",
        ) from exc
    return doc if isinstance(doc, dict) else {}


def _named(docs: list[tuple[Path, dict[str, Any]]], kind: str, name: str) -> tuple[Path, Any]:
    """The first entry ``name`` of list ``kind`` (clusters, users, contexts) over the files."""
    for path, doc in docs:
        for item in doc.get(kind) or []:
            if isinstance(item, dict) and item.get("name") == name:
                return path, item.get(kind[:-1]) or {}
    where = ", ".join(str(p) for p, _ in docs)
    raise SettingsError(
        f"kubeconfig ({where}) has no {kind[:-1]} named '{name}'",
        f"the context refers to it, or kubernetes.context names it ({kind}: missing)",
        "kubectl config get-contexts lists the contexts; set kubernetes.context to one",
    )


def from_kubeconfig(
    docs: list[tuple[Path, dict[str, Any]]], settings: KubernetesSettings
) -> ClusterAccess:
    """The access a set of parsed kubeconfig files gives. Pure (relative file paths are
    resolved against the file that names them, as kubectl does)."""
    context = settings.context or next(
        (str(d["current-context"]) for _, d in docs if d.get("current-context")), ""
    )
    if not context:
        raise SettingsError(
            "settings error at sandbox.kubernetes.context",
            "no context is named and the kubeconfig has no current-context",
            "set kubernetes.context, or run `kubectl config use-context NAME`",
        )
    _, ctx = _named(docs, "contexts", context)
    cpath, cluster = _named(docs, "clusters", str(ctx.get("cluster", "")))
    upath, user = _named(docs, "users", str(ctx.get("user", "")))
    for plugin in ("exec", "auth-provider"):
        if user.get(plugin):
            raise SettingsError(
                f"kubeconfig user '{ctx.get('user')}' logs in with an {plugin} plugin",
                "fusion-oci runs no credential program of the kubeconfig's",
                "use a kubeconfig with a client certificate or a token (e.g. a ServiceAccount "
                "token bound to the Role in docs/kubernetes.md)",
            )
    server = str(cluster.get("server", ""))
    if not server.startswith("https://"):
        raise SettingsError(
            f"kubeconfig cluster '{ctx.get('cluster')}' has server {server!r}",
            "only https API servers are spoken to",
            "point the cluster's server at the API server's https address",
        )
    token = user.get("token")
    if not token and user.get("tokenFile"):
        token = _rel(upath, user["tokenFile"]).read_text(encoding="utf-8").strip()
    return ClusterAccess(
        server=server.rstrip("/"),
        namespace=settings.namespace or str(ctx.get("namespace") or "default"),
        source=f"{cpath} (context {context})",
        context=context,
        ca_file=_path(cpath, cluster.get("certificate-authority")),
        ca_data=_b64(cluster.get("certificate-authority-data")),
        cert_file=_path(upath, user.get("client-certificate")),
        cert_data=_b64(user.get("client-certificate-data")),
        key_file=_path(upath, user.get("client-key")),
        key_data=_b64(user.get("client-key-data")),
        token=str(token) if token else None,
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )


def in_cluster(env: Mapping[str, str], settings: KubernetesSettings) -> ClusterAccess:
    """The pod's own service account (only when fusion-oci runs in a pod)."""
    host = env["KUBERNETES_SERVICE_HOST"]
    port = env.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    ns_file = SERVICE_ACCOUNT / "namespace"
    namespace = settings.namespace or (
        ns_file.read_text(encoding="utf-8").strip() if ns_file.is_file() else "default"
    )
    return ClusterAccess(
        server=f"https://{host}:{port}",
        namespace=namespace,
        source="in-cluster (service account)",
        ca_file=str(SERVICE_ACCOUNT / "ca.crt"),
        token=(SERVICE_ACCOUNT / "token").read_text(encoding="utf-8").strip(),
    )


def _rel(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base.parent / path


def _path(base: Path, value: Any) -> str | None:
    return str(_rel(base, str(value))) if value else None


def _b64(value: Any) -> bytes | None:
    return base64.b64decode(str(value)) if value else None
