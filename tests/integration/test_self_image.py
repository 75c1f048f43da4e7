"""fusion-oci inside its own image (the top-level Containerfile): built, then, as the image's
unprivileged user under rootless podman and under docker, `fusion-oci run --backend bubblewrap`
passes the security probes that apply there (tests/data/incontainer/probes.sh says which), with
the engine flags docs/ci.md gives. A control run on the native backend shows the probes see
leaks when there are some."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusion_oci.audit import AuditLog
from fusion_oci.engines import engine_targets, open_target
from fusion_oci.images.gates import AuditContext
from fusion_oci.images.progress import PlainReporter
from fusion_oci.images.provision import ProvisionOptions, ensure_image, transfer_image
from fusion_oci.images.spec import BASE_REF, SELF_IMAGE
from fusion_oci.policy.settings import GateSettings, SandboxSettings
from tests.backends import require
from tests.integration.images_fixture import _machine_lock, _reachable, ensure_base

pytestmark = [pytest.mark.slow]

PROBES = (Path(__file__).resolve().parents[1] / "data" / "incontainer" / "probes.sh").read_text()
EXPECTED = {
    "home-canary",
    "write-outside-worktree",
    "secret-env",
    "loopback-tcp",
    "outer-process",
    "git-hooks-config",
    "unshare-mount",
    "timeout-tree",
}
# docs/ci.md: what each engine needs for bubblewrap's nested user namespaces.
DOCKER_FLAGS = [
    "--security-opt",
    "seccomp=unconfined",
    "--security-opt",
    "apparmor=unconfined",
    "--security-opt",
    "systempaths=unconfined",
]
PODMAN_FLAGS = ["--security-opt", "seccomp=unconfined", "--security-opt", "unmask=ALL"]
_refs: dict[str, str] = {}


def self_image(engine: str) -> str:
    """The fusion-oci image in ``engine``: built on rootful podman (offline base), copied."""
    if engine in _refs:
        return _refs[engine]
    client, why = _reachable(engine)
    require(engine, client is not None, why)
    ensure_base("podman")
    audit = AuditLog()
    settings = SandboxSettings(gates=GateSettings(sandbox_provision="allow", network_api="allow"))
    target = engine_targets(os.environ)["podman"]
    with _machine_lock():
        built = asyncio.run(
            ensure_image(
                "podman",
                target.url,
                SELF_IMAGE,
                settings,
                audit,
                "tests",
                "self-image",
                options=ProvisionOptions(
                    engine_name="podman",
                    base=BASE_REF,
                    env=dict(os.environ),
                    reporter=PlainReporter(sys.stderr),
                ),
            )
        )
        assert client is not None
        with client:
            if engine != "podman" and client.image(built.ref) is None:
                with open_target(target) as source:
                    transfer_image(
                        source,
                        client,
                        built.ref,
                        ctx=AuditContext(audit, "tests", "self-image", "images"),
                    )
    _refs[engine] = built.ref
    return built.ref


def run_in(
    engine: str, ref: str, flags: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    extra = [a for k, v in (env or {}).items() for a in ("--env", f"{k}={v}")]
    argv = [
        "run",
        "--rm",
        "--network",
        "none",
        *flags,
        *extra,
        "--entrypoint",
        "/bin/sh",
        ref,
        "-c",
        PROBES,
    ]
    if engine == "docker":
        return subprocess.run(["docker", *argv], capture_output=True, text=True, timeout=300)
    user = os.environ.get("FUSION_OCI_ROOTLESS_USER", "fusionci")
    uid = subprocess.run(
        ["id", "-u", user], capture_output=True, text=True, check=True
    ).stdout.strip()
    return subprocess.run(
        ["runuser", "-u", user, "--", "env", f"XDG_RUNTIME_DIR=/run/user/{uid}", "podman", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )


def outcomes(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("PROBE "):
            _, name, verdict = [*line.split(" ", 3), ""][:3]
            out[name] = verdict
    return out


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param("docker", marks=pytest.mark.docker),
        pytest.param("podman-rootless", marks=pytest.mark.podman_rootless),
    ],
)
def test_bubblewrap_inside_the_image_passes_the_probes(engine: str) -> None:
    ref = self_image(engine)
    flags = DOCKER_FLAGS if engine == "docker" else PODMAN_FLAGS
    p = run_in(engine, ref, flags)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "WORKS sandboxed-ok 1000" in p.stdout, p.stdout + p.stderr  # unprivileged user
    got = outcomes(p.stdout)
    assert set(got) == EXPECTED, p.stdout
    leaks = {k: v for k, v in got.items() if v != "blocked"}
    assert not leaks, p.stdout


@pytest.mark.docker
def test_probes_see_leaks_on_native_and_the_flags_are_needed() -> None:
    ref = self_image("docker")
    p = run_in("docker", ref, DOCKER_FLAGS, {"PROBE_BACKEND": "native"})
    got = outcomes(p.stdout)
    assert got["home-canary"] == "LEAK" and got["write-outside-worktree"] == "LEAK", p.stdout
    # Without the flags docs/ci.md gives, bubblewrap cannot make its namespaces: fail closed.
    bare = run_in("docker", ref, [])
    assert bare.returncode == 3 and "BROKEN" in bare.stdout, bare.stdout
    assert "unavailable" in bare.stdout
