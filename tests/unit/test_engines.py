"""The engines layer: the endpoint resolver (pure over an env mapping and a fake home and root),
the mapping of real SDK exception objects to fusion-oci errors, and no import circle."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fusion_oci.engines import (
    ContainerGoneError,
    Endpoint,
    EngineOpError,
    describe,
    docker_endpoints,
    engine_errors,
    engine_targets,
    image_errors,
    podman_endpoints,
)
from fusion_oci.engines.errors import EngineForbiddenError, EngineUnreachableError
from fusion_oci.errors import (
    EngineError,
    ProvisionError,
    RuntimeUnavailableError,
    SandboxSetupError,
)
from tests.modules import package_modules

# --------------------------------------------------------------------------- docker


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


def docker_context(
    home: Path, name: str, host: str, *, tls: bool = False, current: bool = True
) -> None:
    config = home / ".docker"
    digest = hashlib.sha256(name.encode()).hexdigest()
    meta = config / "contexts" / "meta" / digest
    meta.mkdir(parents=True)
    (meta / "meta.json").write_text(
        json.dumps(
            {
                "Name": name,
                "Metadata": {},
                "Endpoints": {"docker": {"Host": host, "SkipTLSVerify": False}},
            }
        )
    )
    if tls:
        tls_dir = config / "contexts" / "tls" / digest / "docker"
        tls_dir.mkdir(parents=True)
        for f in ("ca.pem", "cert.pem", "key.pem"):
            (tls_dir / f).write_text("x")
    if current:
        (config / "config.json").write_text(json.dumps({"currentContext": name}))


def test_docker_defaults(home: Path) -> None:
    assert [e.url for e in docker_endpoints(None, {}, 0, home=home)] == [
        "unix:///var/run/docker.sock"
    ]
    urls = [e.url for e in docker_endpoints(None, {"XDG_RUNTIME_DIR": "/run/user/7"}, 7, home=home)]
    assert urls == ["unix:///var/run/docker.sock", "unix:///run/user/7/docker.sock"]
    assert not any(e.explicit for e in docker_endpoints(None, {}, 7, home=home))


def test_docker_settings_then_docker_host_then_context(home: Path) -> None:
    docker_context(home, "remote", "tcp://10.0.0.5:2376", tls=True)
    env = {"DOCKER_HOST": "unix:///d.sock"}
    first = docker_endpoints("unix:///s.sock", env, 0, home=home)
    assert [(e.url, e.source, e.explicit) for e in first] == [
        ("unix:///s.sock", "settings docker.url", True)
    ]
    assert docker_endpoints(None, env, 0, home=home)[0].source == "DOCKER_HOST"
    (ctx,) = docker_endpoints(None, {}, 0, home=home)
    assert ctx.url == "tcp://10.0.0.5:2376" and ctx.explicit
    assert "docker context 'remote'" in ctx.source
    assert ctx.tls is not None and ctx.tls.verify
    assert ctx.tls.ca is not None and ctx.tls.ca.endswith("/docker/ca.pem")


def test_docker_context_env_and_default_context(home: Path, tmp_path: Path) -> None:
    docker_context(home, "other", "unix:///other.sock", current=False)
    (home / ".docker" / "config.json").write_text(json.dumps({"currentContext": "default"}))
    assert docker_endpoints(None, {}, 0, home=home)[0].url == "unix:///var/run/docker.sock"
    (picked,) = docker_endpoints(None, {"DOCKER_CONTEXT": "other"}, 0, home=home)
    assert picked.url == "unix:///other.sock" and "DOCKER_CONTEXT" in picked.source
    # DOCKER_CONFIG moves the whole directory, contexts included.
    moved = tmp_path / "cfg"
    (home / ".docker").rename(moved)
    (picked,) = docker_endpoints(
        None, {"DOCKER_CONFIG": str(moved), "DOCKER_CONTEXT": "other"}, 0, home=home
    )
    assert picked.url == "unix:///other.sock"
    (missing,) = docker_endpoints(None, {"DOCKER_CONTEXT": "nope"}, 0, home=home)
    assert missing.explicit and "no endpoint" in missing.source


@pytest.mark.parametrize(
    "env",
    [
        {"DOCKER_HOST": "tcp://h:2376", "DOCKER_TLS_VERIFY": "1"},
        {"DOCKER_HOST": "tcp://h:2376", "DOCKER_TLS_VERIFY": "1", "DOCKER_CERT_PATH": "/certs"},
        {"DOCKER_HOST": "tcp://h:2376", "DOCKER_CERT_PATH": "/certs"},
        {"DOCKER_HOST": "tcp://h:2376", "DOCKER_TLS_VERIFY": ""},
        {"DOCKER_HOST": "tcp://h:2375"},
    ],
)
def test_docker_tls_env_reads_as_docker_from_env(
    env: dict[str, str], home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import docker.utils

    certs = home.parent / "certs"
    for folder in (certs, home / ".docker"):
        folder.mkdir(exist_ok=True)
        for name in ("ca.pem", "cert.pem", "key.pem"):
            (folder / name).write_text("x")
    env = {k: v.replace("/certs", str(certs)) for k, v in env.items()}
    monkeypatch.setenv("HOME", str(home))
    sdk = docker.utils.kwargs_from_env(environment=env)
    (ours,) = docker_endpoints(None, env, 0, home=home)
    assert ours.url == sdk["base_url"]
    if "tls" not in sdk:
        assert ours.tls is None
        return
    assert ours.tls is not None
    assert ours.tls.verify == sdk["tls"].verify
    assert ours.tls.ca == sdk["tls"].ca_cert
    assert (ours.tls.cert, ours.tls.key) == sdk["tls"].cert


# --------------------------------------------------------------------------- podman


def test_podman_defaults_and_env(home: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert (
        podman_endpoints(None, {}, 0, home=home, root=root)[0].url
        == "unix:///run/podman/podman.sock"
    )
    rootless = podman_endpoints(
        None, {"XDG_RUNTIME_DIR": "/run/user/1001"}, 1001, home=home, root=root
    )
    assert rootless[0].url == "unix:///run/user/1001/podman/podman.sock"
    assert not rootless[0].explicit
    env = {"CONTAINER_HOST": "unix:///y", "FUSION_OCI_PODMAN_URL": "unix:///harness"}
    assert podman_endpoints("unix:///x.sock", env, 0, home=home)[0].url == "unix:///x.sock"
    assert podman_endpoints(None, env, 1000, home=home)[0].source == "CONTAINER_HOST"
    (harness,) = podman_endpoints(
        None, {"FUSION_OCI_PODMAN_URL": "unix:///h"}, 0, home=home, root=root
    )
    assert harness.url == "unix:///h" and harness.explicit


def test_podman_connections_from_containers_conf(home: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc" / "containers").mkdir(parents=True)
    (root / "etc" / "containers" / "containers.conf").write_text(
        '[engine]\nactive_service = "prod"\n'
        '[engine.service_destinations.prod]\nuri = "unix:///srv/prod.sock"\n'
        '[engine.service_destinations.lab]\nuri = "ssh://u@lab/run/podman/podman.sock"\n'
        'identity = "/home/u/.ssh/id"\n'
    )
    (prod,) = podman_endpoints(None, {}, 0, home=home, root=root)
    assert prod.url == "unix:///srv/prod.sock" and prod.explicit
    assert "podman connection 'prod'" in prod.source
    (lab,) = podman_endpoints(None, {"CONTAINER_CONNECTION": "lab"}, 0, home=home, root=root)
    assert lab.url.startswith("ssh://") and lab.identity == "/home/u/.ssh/id"
    (bad,) = podman_endpoints(None, {"CONTAINER_CONNECTION": "nope"}, 0, home=home, root=root)
    assert bad.explicit and "not defined" in bad.source
    # CONTAINER_HOST still wins over a connection, as in podman.
    assert (
        podman_endpoints(None, {"CONTAINER_HOST": "unix:///h"}, 0, home=home, root=root)[0].url
        == "unix:///h"
    )
    # The user's file overrides the system one when not root.
    user = home / ".config" / "containers"
    user.mkdir(parents=True)
    (user / "containers.conf").write_text(
        '[engine]\nactive_service = "mine"\n'
        '[engine.service_destinations.mine]\nuri = "unix:///run/user/7/mine.sock"\n'
    )
    assert (
        podman_endpoints(None, {}, 7, home=home, root=root)[0].url == "unix:///run/user/7/mine.sock"
    )
    assert podman_endpoints(None, {}, 0, home=home, root=root)[0].url == "unix:///srv/prod.sock", (
        "root reads no user containers.conf"
    )
    only = tmp_path / "only.conf"
    only.write_text("[engine]\n")
    assert (
        podman_endpoints(None, {"CONTAINERS_CONF": str(only)}, 0, home=home, root=root)[0].url
        == "unix:///run/podman/podman.sock"
    )


def test_podman_connections_json_wins(home: Path, tmp_path: Path) -> None:
    user = home / ".config" / "containers"
    user.mkdir(parents=True)
    (user / "podman-connections.json").write_text(
        json.dumps(
            {
                "Connection": {
                    "Default": "box",
                    "Connections": {
                        "box": {"URI": "unix:///box.sock", "Identity": "", "IsMachine": False}
                    },
                },
                "Farm": {},
            }
        )
    )
    (box,) = podman_endpoints(None, {}, 1000, home=home, root=tmp_path / "root")
    assert box.url == "unix:///box.sock" and box.identity is None


def test_image_targets_use_the_same_resolver(home: Path) -> None:
    env = {
        "CONTAINER_HOST": "unix:///p.sock",
        "DOCKER_HOST": "unix:///d.sock",
        "FUSION_OCI_ROOTLESS_PODMAN_URL": "unix:///r.sock",
    }
    targets = engine_targets(env, 0, home=home)
    assert {n: t.url for n, t in targets.items()} == {
        "podman": "unix:///p.sock",
        "podman-rootless": "unix:///r.sock",
        "docker": "unix:///d.sock",
        "docker-rootless": "unix:///run/user/0/docker.sock",
    }
    env["FUSION_OCI_ROOTLESS_DOCKER_URL"] = "unix:///rd.sock"
    assert engine_targets(env, 0, home=home)["docker-rootless"].url == "unix:///rd.sock"
    assert (
        engine_targets(env, 0, podman_url="unix:///s.sock", home=home)["podman"].url
        == "unix:///s.sock"
    )
    assert (
        engine_targets({}, 0, home=home)["podman-rootless"].url
        == "unix:///run/user/0/podman/podman.sock"
    )


def test_the_docker_image_target_is_the_first_socket_that_exists(
    home: Path, tmp_path: Path
) -> None:
    """A user with only a rootless dockerd: images find it as the runtime does."""
    import socket as _socket

    xdg = tmp_path / "xdg"
    xdg.mkdir()
    with _socket.socket(_socket.AF_UNIX) as sock:
        sock.bind(str(xdg / "docker.sock"))
        env = {"XDG_RUNTIME_DIR": str(xdg)}
        if not Path("/var/run/docker.sock").exists():
            assert engine_targets(env, 1000, home=home)["docker"].url == f"unix://{xdg}/docker.sock"
        assert (
            engine_targets(env, 1000, home=home)["docker-rootless"].url
            == f"unix://{xdg}/docker.sock"
        )


# --------------------------------------------------------------------------- errors

ENDPOINT = Endpoint("unix:///run/x.sock", "test")


def _response(status: int, text: str = "") -> object:
    import requests

    response = requests.Response()
    response.status_code = status
    response._content = text.encode()
    response.reason = text
    return response


def test_errors_are_read_by_status_not_text() -> None:
    import docker.errors
    import podman.errors

    # The same words under another status mean another kind.
    for status, kind in ((404, "not-found"), (409, "conflict"), (500, "engine")):
        gone = docker.errors.APIError(
            "x", response=_response(status), explanation="container is not running"
        )
        failure = describe(gone)
        assert failure is not None and (failure.kind, failure.status) == (kind, status)
        pod = podman.errors.APIError(
            "x", response=_response(status), explanation="no such container"
        )
        failure = describe(pod)
        assert failure is not None and failure.kind == kind
    assert describe(docker.errors.ImageNotFound("anything")).kind == "image-missing"  # type: ignore[union-attr]
    assert describe(podman.errors.ImageNotFound("anything")).kind == "image-missing"  # type: ignore[union-attr]
    assert describe(ValueError("not ours")) is None


def test_podman_sentinel_causes_under_a_500() -> None:
    """podman 4.3 answers 500 with {"cause": "container state improper"} where docker says
    409: the cause (libpod's sentinel error, the SDK's exception cause) decides."""
    import podman.errors

    def answer(cause: str) -> podman.errors.APIError:
        body = json.dumps({"cause": cause, "message": f"x: {cause}", "response": 500})
        return podman.errors.APIError(
            cause,
            response=_response(500, body),  # type: ignore[arg-type]
            explanation=f"x: {cause}",
        )

    assert describe(answer("container state improper")).kind == "conflict"  # type: ignore[union-attr]
    assert describe(answer("image not known")).kind == "image-missing"  # type: ignore[union-attr]
    assert describe(answer("something else")).kind == "engine"  # type: ignore[union-attr]
    with pytest.raises(ContainerGoneError), engine_errors("podman", "exec", ENDPOINT, setup=False):
        raise answer("container state improper")


def test_socket_failures_by_exception_type() -> None:
    import requests

    forbidden = requests.exceptions.ConnectionError(PermissionError(13, "x"))
    assert describe(forbidden).kind == "forbidden"  # type: ignore[union-attr]
    assert describe(FileNotFoundError(2, "x")).kind == "unreachable"  # type: ignore[union-attr]
    assert describe(requests.exceptions.ReadTimeout("x")).kind == "timeout"  # type: ignore[union-attr]
    reset = requests.exceptions.ConnectionError(ConnectionResetError(104, "x"))
    assert describe(reset).kind == "reset"  # type: ignore[union-attr]


def test_engine_errors_raise_fusion_errors() -> None:
    import docker.errors
    import podman.errors
    import requests

    assert issubclass(EngineForbiddenError, RuntimeUnavailableError)
    assert issubclass(EngineUnreachableError, RuntimeUnavailableError)
    with (
        pytest.raises(EngineForbiddenError, match="permission denied"),
        engine_errors("docker", "ping", ENDPOINT),
    ):
        raise requests.exceptions.ConnectionError(PermissionError(13, "Permission denied"))
    with (
        pytest.raises(EngineUnreachableError, match="no docker service answers"),
        engine_errors("docker", "ping", ENDPOINT),
    ):
        raise FileNotFoundError(2, "No such file or directory", "/run/x.sock")
    with (
        pytest.raises(ProvisionError, match="image is missing") as missing,
        engine_errors("docker", "container create", ENDPOINT),
    ):
        raise docker.errors.ImageNotFound("No such image: node")
    assert "fusion-oci images build" in missing.value.hint
    with pytest.raises(ContainerGoneError), engine_errors("docker", "exec", ENDPOINT, setup=False):
        raise docker.errors.APIError("409", response=_response(409), explanation="whatever")
    with pytest.raises(ContainerGoneError), engine_errors("podman", "exec", ENDPOINT, setup=False):
        raise podman.errors.NotFound("404", response=_response(404))
    with (
        pytest.raises(EngineError) as run_error,
        engine_errors("docker", "exec", ENDPOINT, setup=False),
    ):
        raise docker.errors.APIError(
            "500", response=_response(500), explanation="is not running"
        )  # text decides nothing
    assert not isinstance(run_error.value, SandboxSetupError | ContainerGoneError)
    with (
        pytest.raises(ValueError, match="not an SDK error"),
        engine_errors("docker", "exec", ENDPOINT),
    ):
        raise ValueError("not an SDK error")


@pytest.mark.parametrize(
    ("message", "why", "hint"),
    [
        (
            "crun: cgroups in hybrid mode not supported, drop all controllers from cgroupv2",
            "crun refuses",
            'runtime = "runc"',
        ),
        (
            'cannot find newuidmap: exec: "newuidmap": executable file not found',
            "newuidmap",
            "apt-get install uidmap",
        ),
        (
            'cannot set up namespace using "/usr/bin/newuidmap": no subuid ranges found for user',
            "subordinate uid",
            "usermod --add-subuids",
        ),
        (
            'slirp4netns failed: open("/dev/net/tun"): Permission denied',
            "/dev/net/tun",
            "chmod 0666 /dev/net/tun",
        ),
    ],
)
def test_known_host_problems_get_the_fix_as_hint(message: str, why: str, hint: str) -> None:
    import podman.errors

    with (
        pytest.raises(SandboxSetupError) as caught,
        engine_errors("podman", "container start", ENDPOINT),
    ):
        raise podman.errors.APIError("500", response=_response(500), explanation=message)
    assert caught.value.kind == "setup-failed", "the hint changes, never the kind"
    assert why in caught.value.why and hint in caught.value.hint
    assert isinstance(caught.value.__cause__, podman.errors.APIError)


def test_image_errors_say_transient() -> None:
    import docker.errors
    import requests

    with pytest.raises(EngineOpError) as refused, image_errors("pull x", "docker", "unix:///d"):
        raise requests.exceptions.ConnectionError(ConnectionRefusedError(111, "refused"))
    assert not refused.value.transient and "start the docker API service" in refused.value.hint
    with pytest.raises(EngineOpError) as reset, image_errors("pull x", "docker", "unix:///d"):
        raise requests.exceptions.ConnectionError(ConnectionResetError(104, "reset"))
    assert reset.value.transient
    with pytest.raises(EngineOpError) as busy, image_errors("pull x", "docker", "unix:///d"):
        raise docker.errors.APIError("503", response=_response(503), explanation="busy")
    assert busy.value.transient and busy.value.status == 503
    with pytest.raises(EngineOpError) as missing, image_errors("pull x", "docker", "unix:///d"):
        raise docker.errors.ImageNotFound("manifest unknown")
    assert not missing.value.transient


# --------------------------------------------------------------------------- layering

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["fusion_oci.engines", "fusion_oci.runtimes", "fusion_oci.images"]
"""The packages the layering holds for, walked: a module added to one is covered unasked."""


MODULES = package_modules()
LAYERED = sorted(
    m
    for m in MODULES
    if m == "fusion_oci.gc" or any(m == p or m.startswith(p + ".") for p in LAYERS)
)


def test_the_layered_set_is_every_module_of_its_packages() -> None:
    for module in [
        "fusion_oci.images.provision",
        "fusion_oci.images.rootfs",
        "fusion_oci.runtimes.oci",
        "fusion_oci.runtimes.oci.runtime",
        "fusion_oci.gc",
        "fusion_oci.engines.endpoints",
    ]:
        assert module in LAYERED, module
    assert (
        len(LAYERED)
        == sum(
            1
            for m in MODULES
            if m.split(".")[1:2] in (["engines"], ["runtimes"], ["images"], ["gc"])
        )
        > 40
    )


def _imports(module: str) -> set[str]:
    """Every fusion_oci module ``module`` imports, at the top or inside a function."""
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            # `from fusion_oci.images import rootfs` imports the module images.rootfs
            out.update(
                f"{node.module}.{a.name}"
                for a in node.names
                if f"{node.module}.{a.name}" in MODULES
            )
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("fusion_oci") and m != module}


def test_no_import_circle_between_engines_runtimes_images_and_gc() -> None:
    """Lazy imports inside functions count too: a circle is a circle even when it works."""
    graph = {m: {i for i in _imports(m) if i in LAYERED} for m in LAYERED}
    for module in (m for m in LAYERED if m.startswith("fusion_oci.engines")):
        outside = {
            i
            for i in _imports(module)
            if i.startswith(
                (
                    "fusion_oci.runtimes.engine",
                    "fusion_oci.runtimes.engine.docker",
                    "fusion_oci.runtimes.engine.podman",
                    "fusion_oci.images",
                    "fusion_oci.gc",
                )
            )
        }
        assert not outside, f"{module} reaches up into {outside}"

    def visit(node: str, path: list[str]) -> None:
        for nxt in graph[node]:
            assert nxt not in path, " -> ".join([*path, nxt])
            visit(nxt, [*path, nxt])

    for start in LAYERED:
        visit(start, [start])


def test_each_module_imports_alone_in_a_fresh_interpreter() -> None:
    code = (
        "import importlib, subprocess, sys\n"
        "for m in sys.argv[1:]:\n"
        "    r = subprocess.run([sys.executable, '-c', f'import {m}'], capture_output=True,"
        " text=True)\n"
        "    assert r.returncode == 0, (m, r.stderr[-800:])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *LAYERED],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-1500:]
