"""Where the docker and podman APIs are: the one endpoint resolver.

Every part of fusion-oci that talks to an engine (the podman and docker runtimes, image
provisioning, ``gc``, ``repro``, the oci runtime's image export) asks here. The order is the
settings first (``docker.url``, ``podman.url``), then each engine's own conventions as its CLI
and SDK read them, then the defaults:

- docker: ``DOCKER_HOST`` (with ``DOCKER_TLS_VERIFY`` / ``DOCKER_CERT_PATH`` as
  ``docker.from_env()`` reads them), then the Docker CLI's context (``DOCKER_CONTEXT``, else
  ``currentContext`` of ``$DOCKER_CONFIG/config.json``, its endpoint in
  ``contexts/meta/<sha256 of the name>/meta.json`` and its TLS files under ``contexts/tls``),
  then the system socket and a rootless dockerd's.
- podman: ``CONTAINER_HOST``, then a named system connection (``CONTAINER_CONNECTION``, else
  the default one) from ``podman-connections.json`` (podman 5) or the
  ``[engine.service_destinations]`` tables of containers.conf (podman 4.3), then podman's own
  socket for this user (``/run/podman/podman.sock`` for root, ``$XDG_RUNTIME_DIR/podman/...``).

``FUSION_OCI_PODMAN_URL`` and ``FUSION_OCI_ROOTLESS_PODMAN_URL`` are the test harness's names
(``scripts/services.sh env`` prints them for its rootful and rootless services); they rank
just after ``CONTAINER_HOST``. Everything here is a pure function of an environment mapping,
a uid and the files under a home and a root directory, so tests run it on fake ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

EngineKind = Literal["podman", "docker"]


@dataclass(frozen=True)
class TLSFiles:
    """Client TLS for a ``tcp://`` docker endpoint (docker's cert.pem/key.pem/ca.pem)."""

    ca: str | None
    cert: str | None
    key: str | None
    verify: bool


@dataclass(frozen=True)
class Endpoint:
    """An engine API address and where it came from (for ``doctor`` and error messages)."""

    url: str
    source: str
    explicit: bool = False
    """Named by the user (settings, env, a context or connection): never silently replaced
    by another socket."""
    tls: TLSFiles | None = None
    identity: str | None = None
    """An ssh key for a podman ``ssh://`` connection."""


@dataclass(frozen=True)
class EngineTarget:
    """An engine endpoint for image operations: ``name`` is podman, podman-rootless or docker,
    ``kind`` the SDK."""

    name: str
    kind: EngineKind
    url: str
    endpoint: Endpoint | None = None


def home_of(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or os.path.expanduser("~"))  # noqa: PTH111 - no HOME: passwd


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_toml(path: Path) -> dict[str, Any] | None:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


# --------------------------------------------------------------------------- docker


def docker_config_dir(env: Mapping[str, str], home: Path) -> Path:
    """``$DOCKER_CONFIG``, else ``~/.docker`` (where the CLI keeps config.json and contexts)."""
    return Path(env["DOCKER_CONFIG"]) if env.get("DOCKER_CONFIG") else home / ".docker"


def docker_env_tls(env: Mapping[str, str], home: Path) -> TLSFiles | None:
    """TLS from ``DOCKER_TLS_VERIFY`` / ``DOCKER_CERT_PATH``, read as docker-py's
    ``kwargs_from_env`` reads them: an empty DOCKER_TLS_VERIFY means off, any other value on;
    a cert path alone enables TLS without verification; the path defaults to ``~/.docker``."""
    cert_path = env.get("DOCKER_CERT_PATH") or None
    raw = env.get("DOCKER_TLS_VERIFY")
    verify = raw is not None and raw != ""
    if not (cert_path or verify):
        return None
    base = Path(cert_path) if cert_path else home / ".docker"
    return TLSFiles(
        ca=str(base / "ca.pem"),
        cert=str(base / "cert.pem"),
        key=str(base / "key.pem"),
        verify=verify,
    )


def docker_context(env: Mapping[str, str], home: Path) -> Endpoint | None:
    """The Docker CLI's current context when it is not ``default``; None otherwise."""
    config = docker_config_dir(env, home)
    name = env.get("DOCKER_CONTEXT") or ""
    source = "DOCKER_CONTEXT"
    if not name:
        name = str((_read_json(config / "config.json") or {}).get("currentContext") or "")
        source = f"currentContext in {config / 'config.json'}"
    if not name or name == "default":
        return None
    digest = hashlib.sha256(name.encode()).hexdigest()
    meta_path = config / "contexts" / "meta" / digest / "meta.json"
    meta = _read_json(meta_path) or {}
    docker = (meta.get("Endpoints") or {}).get("docker") or {}
    host = str(docker.get("Host") or "")
    if not host:
        # The CLI refuses an unknown context; so do we, with an address that names it.
        return Endpoint(
            f"context://{name}",
            f"docker context '{name}' ({source}) has no endpoint in {meta_path}",
            explicit=True,
        )
    tls_dir = config / "contexts" / "tls" / digest / "docker"
    tls = None
    if tls_dir.is_dir():
        files = {
            n: str(tls_dir / f"{n}.pem")
            for n in ("ca", "cert", "key")
            if (tls_dir / f"{n}.pem").is_file()
        }
        tls = TLSFiles(
            ca=files.get("ca"),
            cert=files.get("cert"),
            key=files.get("key"),
            verify=not bool(docker.get("SkipTLSVerify")),
        )
    return Endpoint(host, f"docker context '{name}' ({source})", explicit=True, tls=tls)


def docker_endpoints(
    settings_url: str | None, env: Mapping[str, str], uid: int, *, home: Path | None = None
) -> list[Endpoint]:
    """settings ``docker.url``, DOCKER_HOST, the CLI's context, the system socket, then a
    rootless dockerd's. Pure over ``env`` and the files under ``home``."""
    home = home or home_of(env)
    tls = docker_env_tls(env, home)
    if settings_url:
        return [
            Endpoint(
                settings_url,
                "settings docker.url",
                True,
                tls if settings_url.startswith("tcp://") else None,
            )
        ]
    if env.get("DOCKER_HOST"):
        host = env["DOCKER_HOST"]
        return [Endpoint(host, "DOCKER_HOST", True, tls if host.startswith("tcp://") else None)]
    context = docker_context(env, home)
    if context is not None:
        return [context]
    out = [Endpoint("unix:///var/run/docker.sock", "docker's default socket")]
    if uid != 0:
        xdg = env.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
        out.append(Endpoint(f"unix://{xdg}/docker.sock", "rootless dockerd's socket"))
    return out


# --------------------------------------------------------------------------- podman


def containers_conf_files(
    env: Mapping[str, str], uid: int, home: Path, root: Path = Path("/")
) -> list[Path]:
    """containers.conf files in the order podman (containers/common) reads them, later ones
    overriding: ``$CONTAINERS_CONF`` alone when set; else /usr/share, /etc, /etc/...d/*.conf
    and, when not root, the user's file and its .d directory."""
    if env.get("CONTAINERS_CONF"):
        return [Path(env["CONTAINERS_CONF"])]
    files = [
        _under(root, "/usr/share/containers/containers.conf"),
        _under(root, "/etc/containers/containers.conf"),
    ]
    dirs = [_under(root, "/etc/containers/containers.conf.d")]
    if uid != 0:
        user = _user_config(env, home) / "containers" / "containers.conf"
        files.append(user)
        dirs.append(user.with_name("containers.conf.d"))
    out = [f for f in files[:2] if f.is_file()]
    out += sorted(dirs[0].glob("*.conf")) if dirs[0].is_dir() else []
    if uid != 0:
        out += [files[2]] if files[2].is_file() else []
        out += sorted(dirs[1].glob("*.conf")) if dirs[1].is_dir() else []
    return out


def _user_config(env: Mapping[str, str], home: Path) -> Path:
    return Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else home / ".config"


def podman_connections(
    env: Mapping[str, str], uid: int, home: Path, root: Path = Path("/")
) -> tuple[str, dict[str, Endpoint]]:
    """(default connection name, name → endpoint) of podman's system connections.

    podman-connections.json (podman 5, ``podman system connection add``) wins over the
    containers.conf tables (podman 4.3 writes those) for the same name, as podman 5 does."""
    default = ""
    found: dict[str, Endpoint] = {}
    for path in containers_conf_files(env, uid, home, root):
        engine = (_read_toml(path) or {}).get("engine") or {}
        default = str(engine.get("active_service") or default)
        for name, dest in (engine.get("service_destinations") or {}).items():
            if isinstance(dest, dict) and dest.get("uri"):
                found[name] = Endpoint(
                    str(dest["uri"]),
                    f"podman connection '{name}' ({path})",
                    True,
                    identity=dest.get("identity") or None,
                )
    json_paths = (
        [Path(env["PODMAN_CONNECTIONS_CONF"])]
        if env.get("PODMAN_CONNECTIONS_CONF")
        else [_user_config(env, home) / "containers" / "podman-connections.json"]
    )
    for path in json_paths:
        conn = (_read_json(path) or {}).get("Connection") or {}
        default = str(conn.get("Default") or default)
        for name, dest in (conn.get("Connections") or {}).items():
            if isinstance(dest, dict) and dest.get("URI"):
                found[name] = Endpoint(
                    str(dest["URI"]),
                    f"podman connection '{name}' ({path})",
                    True,
                    identity=dest.get("Identity") or None,
                )
    return default, found


def podman_default_socket(env: Mapping[str, str], uid: int) -> Endpoint:
    if uid == 0:
        return Endpoint("unix:///run/podman/podman.sock", "podman's default socket for root")
    xdg = env.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
    return Endpoint(
        f"unix://{xdg}/podman/podman.sock", "podman's default rootless socket ($XDG_RUNTIME_DIR)"
    )


def podman_endpoints(
    settings_url: str | None,
    env: Mapping[str, str],
    uid: int,
    *,
    home: Path | None = None,
    root: Path = Path("/"),
) -> list[Endpoint]:
    """settings ``podman.url``, CONTAINER_HOST, the harness's FUSION_OCI_PODMAN_URL, a system
    connection (CONTAINER_CONNECTION, else the default one), then podman's own socket. Pure
    over ``env`` and the files under ``home`` and ``root``."""
    if settings_url:
        return [Endpoint(settings_url, "settings podman.url", True)]
    for name in ("CONTAINER_HOST", "FUSION_OCI_PODMAN_URL"):
        if env.get(name):
            return [Endpoint(env[name], name, True)]
    home = home or home_of(env)
    default, connections = podman_connections(env, uid, home, root)
    wanted = env.get("CONTAINER_CONNECTION") or default
    if wanted:
        if wanted in connections:
            return [connections[wanted]]
        where = "CONTAINER_CONNECTION" if env.get("CONTAINER_CONNECTION") else "the default"
        return [
            Endpoint(
                f"connection://{wanted}",
                f"podman connection '{wanted}' ({where}) is not defined",
                True,
            )
        ]
    return [podman_default_socket(env, uid)]


# --------------------------------------------------------------------------- image targets


def engine_targets(
    env: Mapping[str, str],
    uid: int | None = None,
    *,
    podman_url: str | None = None,
    docker_url: str | None = None,
    home: Path | None = None,
) -> dict[str, EngineTarget]:
    """The engines image operations look at: podman (as this user resolves it), a rootless
    podman (``FUSION_OCI_ROOTLESS_PODMAN_URL``, else this uid's rootless socket), docker (as
    the runtime resolves it: of its candidates, the first whose socket exists) and a rootless
    dockerd (``FUSION_OCI_ROOTLESS_DOCKER_URL``, else this uid's ``$XDG_RUNTIME_DIR``
    socket)."""
    uid = os.getuid() if uid is None else uid
    podman = podman_endpoints(podman_url, env, uid, home=home)[0]
    xdg = (env.get("XDG_RUNTIME_DIR") if uid != 0 else None) or f"/run/user/{uid}"
    if env.get("FUSION_OCI_ROOTLESS_PODMAN_URL"):
        rootless = Endpoint(
            env["FUSION_OCI_ROOTLESS_PODMAN_URL"], "FUSION_OCI_ROOTLESS_PODMAN_URL", True
        )
    else:
        rootless = Endpoint(f"unix://{xdg}/podman/podman.sock", "podman's default rootless socket")
    if env.get("FUSION_OCI_ROOTLESS_DOCKER_URL"):
        rootless_docker = Endpoint(
            env["FUSION_OCI_ROOTLESS_DOCKER_URL"], "FUSION_OCI_ROOTLESS_DOCKER_URL", True
        )
    else:
        rootless_docker = Endpoint(f"unix://{xdg}/docker.sock", "rootless dockerd's socket")
    candidates = docker_endpoints(docker_url, env, uid, home=home)
    docker = next(
        (e for e in candidates if (path := socket_path(e.url)) is not None and Path(path).exists()),
        candidates[0],
    )
    return {
        "podman": EngineTarget("podman", "podman", podman.url, podman),
        "podman-rootless": EngineTarget("podman-rootless", "podman", rootless.url, rootless),
        "docker": EngineTarget("docker", "docker", docker.url, docker),
        "docker-rootless": EngineTarget(
            "docker-rootless", "docker", rootless_docker.url, rootless_docker
        ),
    }


# --------------------------------------------------------------------------- sockets


def socket_path(url: str) -> str | None:
    for prefix in ("unix://", "http+unix://"):
        if url.startswith(prefix):
            return "/" + url.removeprefix(prefix).lstrip("/")
    return None


def preflight(endpoint: Endpoint) -> None:
    """A missing or forbidden unix socket, told apart before any HTTP is attempted."""
    if endpoint.url.startswith(("context://", "connection://")):
        raise FileNotFoundError(2, endpoint.source, endpoint.url)
    path = socket_path(endpoint.url)
    if path is None:
        return
    os.stat(path)  # noqa: PTH116 - FileNotFoundError, or PermissionError on a parent dir
    if not os.access(path, os.R_OK | os.W_OK):
        raise PermissionError(13, "Permission denied", path)
