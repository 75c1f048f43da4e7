"""ensure_image's decisions against an in-memory engine: cache hits, gates, retries, mirrors,
peers, concurrency. Real engines: tests/integration/test_images.py and test_provision_retry.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.engines import EngineAdapter, EngineOpError, EngineTarget, ImageInfo
from fusion_oci.errors import GateDeniedError, ProvisionError
from fusion_oci.images.gates import GateRequest
from fusion_oci.images.provision import ProvisionOptions, ensure_image
from fusion_oci.images.retry import RetryPolicy
from fusion_oci.images.spec import BASE_REF
from fusion_oci.policy.settings import GateSettings, SandboxSettings


class FakeEngine(EngineAdapter):
    """Images in a dict; build/pull/load calls recorded; failures scripted."""

    def __init__(self, name: str = "podman", *, secrets: bool = True) -> None:
        super().__init__(name, f"unix:///fake/{name}.sock", None, owned=False)
        self.kind = "podman" if secrets else "docker"
        self._secrets = secrets
        self.store: dict[str, str] = {BASE_REF: "sha256:base"}
        self.calls: list[tuple[str, str]] = []
        self.pull_failures: dict[str, list[EngineOpError]] = {}
        self._lock = threading.Lock()
        self._n = 0

    @property
    def supports_build_secrets(self) -> bool:
        return self._secrets

    def _new_id(self) -> str:
        with self._lock:
            self._n += 1
            return f"sha256:{self.name}-{self._n:04d}"

    def ping(self) -> str:
        return "fake"

    def image(self, ref: str) -> ImageInfo | None:
        if ref not in self.store:
            return None
        digests = (
            [f"{ref.rsplit(':', 1)[0]}@sha256:repo"]
            if "127.0.0.1" in ref or "example" in ref
            else []
        )
        return ImageInfo(self.name, self.store[ref], [ref], digests)

    def build(
        self,
        context_tar: Path,
        *,
        containerfile: str,
        tag: str,
        build_args: Mapping[str, str],
        labels: Mapping[str, str],
        secrets: Mapping[str, str],
        on_event: Any,
    ) -> str:
        self.calls.append(("build", tag))
        self.last_secrets = dict(secrets)
        on_event({"stream": "STEP 1/1: FROM base\n"})
        self.store[tag] = self._new_id()
        return self.store[tag]

    def pull(self, ref: str, *, tls_verify: bool, on_event: Any) -> str:
        self.calls.append(("pull", ref))
        failures = self.pull_failures.get(ref, [])
        if failures:
            raise failures.pop(0)
        self.store[ref] = self._new_id()
        return self.store[ref]

    def save(self, ref: str, dest: Path) -> None:
        self.calls.append(("save", ref))
        dest.write_text(f"{ref}\n{self.store[ref]}")

    def load(self, src: Path) -> list[str]:
        ref, image_id = src.read_text().splitlines()
        self.calls.append(("load", ref))
        self.store[ref] = image_id
        return [ref]

    def tag(self, image: str, ref: str) -> None:
        self.calls.append(("tag", ref))
        self.store[ref] = image


@pytest.fixture
def images_dir(tmp_path: Path) -> Path:
    d = tmp_path / "images" / "demo"
    d.mkdir(parents=True)
    (d / "Containerfile").write_text("ARG BASE\nFROM ${BASE}\nRUN true\n")
    return d.parent


@pytest.fixture
def events() -> list[AuditEvent]:
    return []


@pytest.fixture
def audit(events: list[AuditEvent]) -> AuditLog:
    log = AuditLog()
    log.subscribe(events.append)
    return log


def allow_all() -> SandboxSettings:
    return SandboxSettings(
        gates=GateSettings(sandbox_provision="allow", network_api="allow"), host_ca="off"
    )


def opts(tmp_path: Path, images_dir: Path, **kw: Any) -> ProvisionOptions:
    base: dict[str, Any] = {
        "images_dir": images_dir,
        "peers": [],
        "env": {},
        "lock_dir": tmp_path / "locks",
        "retry": RetryPolicy.immediate(),
    }
    base.update(kw)
    return ProvisionOptions(**base)


def provision_events(events: list[AuditEvent]) -> list[dict[str, Any]]:
    return [e.details or {} for e in events if e.type == "sandbox:provision"]


async def test_unchanged_context_is_not_rebuilt_and_a_changed_one_is(
    tmp_path: Path, images_dir: Path, audit: AuditLog, events: list[AuditEvent]
) -> None:
    engine = FakeEngine()
    o = opts(tmp_path, images_dir)
    first = await ensure_image("podman", engine, "demo", allow_all(), audit, "t", "r", options=o)
    assert first.action == "built" and first.ref.startswith("localhost/fusion-oci/demo:")
    # the offline base is the only one here, so it is the BASE
    assert provision_events(events)[-1]["base"] == BASE_REF
    again = await ensure_image("podman", engine, "demo", allow_all(), audit, "t", "r", options=o)
    assert again.action == "present" and again.digest == first.digest
    assert [c for c in engine.calls if c[0] == "build"] == [("build", first.ref)]
    assert provision_events(events)[-1]["digest"] == first.digest

    (images_dir / "demo" / "Containerfile").write_text("ARG BASE\nFROM ${BASE}\nRUN false\n")
    changed = await ensure_image("podman", engine, "demo", allow_all(), audit, "t", "r", options=o)
    assert changed.action == "built" and changed.ref != first.ref
    assert len([c for c in engine.calls if c[0] == "build"]) == 2


async def test_deny_builds_nothing(
    tmp_path: Path, images_dir: Path, audit: AuditLog, events: list[AuditEvent]
) -> None:
    engine = FakeEngine()
    settings = SandboxSettings(gates=GateSettings(sandbox_provision="deny"))
    with pytest.raises(GateDeniedError) as err:
        await ensure_image(
            "podman", engine, "demo", settings, audit, "t", "r", options=opts(tmp_path, images_dir)
        )
    assert engine.calls == []
    assert "fusion-oci images build demo --engine podman" in err.value.hint
    assert [e.type for e in events] == ["sandbox:gate"]


async def test_ask_is_asked_for_both_gates_then_builds(
    tmp_path: Path, images_dir: Path, audit: AuditLog, events: list[AuditEvent]
) -> None:
    engine = FakeEngine()
    asked: list[GateRequest] = []

    async def ask(req: GateRequest) -> bool:
        asked.append(req)
        return True

    settings = SandboxSettings(host_ca="off")  # both gates default to ask
    got = await ensure_image(
        "podman",
        engine,
        "demo",
        settings,
        audit,
        "t",
        "r",
        ask=ask,
        options=opts(tmp_path, images_dir),
    )
    assert [r.gate for r in asked] == ["sandbox_provision", "network_api"]
    assert all(r.target == got.ref for r in asked)
    assert [e.details["decision"] for e in events if e.type == "sandbox:gate" and e.details] == [
        "allow",
        "allow",
    ]
    # a present image asks nobody
    asked.clear()
    await ensure_image(
        "podman",
        engine,
        "demo",
        settings,
        audit,
        "t",
        "r",
        ask=ask,
        options=opts(tmp_path, images_dir),
    )
    assert asked == []


async def test_ask_without_callback_denies(
    tmp_path: Path, images_dir: Path, audit: AuditLog
) -> None:
    with pytest.raises(GateDeniedError, match="not interactive"):
        await ensure_image(
            "podman",
            FakeEngine(),
            "demo",
            SandboxSettings(),
            audit,
            "t",
            "r",
            options=opts(tmp_path, images_dir),
        )


async def test_ca_secret_is_passed_when_the_engine_takes_secrets(
    tmp_path: Path, images_dir: Path, audit: AuditLog, events: list[AuditEvent]
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("CA")
    engine = FakeEngine()
    settings = allow_all().model_copy(update={"host_ca": str(ca)})
    await ensure_image(
        "podman", engine, "demo", settings, audit, "t", "r", options=opts(tmp_path, images_dir)
    )
    assert list(engine.last_secrets) == ["hostca"]
    assert engine.last_secrets["hostca"].startswith(".fusion-oci-secret-")
    build = [d for d in provision_events(events) if d.get("action") == "build"]
    assert build[-1]["ca_secret"] is True


async def test_pull_retries_transient_errors_and_records_the_digest(
    tmp_path: Path, images_dir: Path, audit: AuditLog, events: list[AuditEvent]
) -> None:
    engine = FakeEngine()
    ref = "127.0.0.1:5000/tiny:1"
    engine.pull_failures[ref] = [
        EngineOpError("pull", "connection reset by peer", transient=True),
        EngineOpError("pull", "503 Service Unavailable", transient=True),
    ]
    got = await ensure_image(
        "docker", engine, ref, allow_all(), audit, "t", "r", options=opts(tmp_path, images_dir)
    )
    assert got.action == "pulled" and got.repo_digest == "127.0.0.1:5000/tiny@sha256:repo"
    pulls = [d for d in provision_events(events) if d.get("action") == "pull"]
    assert [(d["attempt"], d["outcome"]) for d in pulls] == [(1, "retry"), (2, "retry"), (3, "ok")]
    assert provision_events(events)[-1]["digest"] == got.digest


async def test_pull_fails_fast_on_a_permanent_error(
    tmp_path: Path, images_dir: Path, audit: AuditLog, events: list[AuditEvent]
) -> None:
    engine = FakeEngine()
    ref = "127.0.0.1:5000/tiny:nope"
    engine.pull_failures[ref] = [EngineOpError("pull", "manifest unknown", transient=False)]
    with pytest.raises(ProvisionError, match="manifest unknown"):
        await ensure_image(
            "docker",
            engine,
            ref,
            allow_all(),
            audit,
            "t",
            "r",
            options=opts(tmp_path, images_dir, retry=RetryPolicy(attempts=5)),
        )
    assert engine.calls == [("pull", ref)]


async def test_mirrors_are_tried_in_order_then_the_image_is_tagged_as_asked(
    tmp_path: Path, images_dir: Path, audit: AuditLog, events: list[AuditEvent]
) -> None:
    engine = FakeEngine()
    ref = "registry.example/team/tiny:1"
    engine.pull_failures["127.0.0.1:1/team/tiny:1"] = [
        EngineOpError("pull", "manifest unknown", transient=False)
    ]
    got = await ensure_image(
        "podman",
        engine,
        ref,
        allow_all(),
        audit,
        "t",
        "r",
        mirrors=["127.0.0.1:1", "127.0.0.1:2"],
        options=opts(tmp_path, images_dir),
    )
    assert [c for c in engine.calls if c[0] == "pull"] == [
        ("pull", "127.0.0.1:1/team/tiny:1"),
        ("pull", "127.0.0.1:2/team/tiny:1"),
    ]
    assert ("tag", ref) in engine.calls and got.ref == ref
    sources = [d.get("source") for d in provision_events(events) if d.get("action") == "pull"]
    assert sources == ["127.0.0.1:1/team/tiny:1", "127.0.0.1:2/team/tiny:1"]


async def test_docker_builds_on_the_podman_peer_and_loads(
    tmp_path: Path,
    images_dir: Path,
    audit: AuditLog,
    events: list[AuditEvent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    podman = FakeEngine("podman")
    docker = FakeEngine("docker", secrets=False)
    docker.store.clear()  # docker has no base at all: the build must not happen there
    monkeypatch.setattr("fusion_oci.images.provision.open_target", lambda t: podman)
    peer = EngineTarget("podman", "podman", podman.url)
    got = await ensure_image(
        "docker",
        docker,
        "demo",
        allow_all(),
        audit,
        "t",
        "r",
        options=opts(tmp_path, images_dir, peers=[peer]),
    )
    assert got.action == "built" and [c[0] for c in podman.calls] == ["build", "save"]
    assert docker.calls == [("load", got.ref)] and docker.store[got.ref] == podman.store[got.ref]
    assert provision_events(events)[-1]["built_on"] == "podman"
    # the next engine that wants it only loads (the gate asked is sandbox_provision alone)
    rootless = FakeEngine("podman-rootless")
    gates: list[str] = []
    await ensure_image(
        "podman",
        rootless,
        "demo",
        allow_all(),
        audit,
        "t",
        "r2",
        ask=lambda r: gates.append(r.gate) or True,
        options=opts(tmp_path, images_dir, peers=[peer], engine_name="podman-rootless"),
    )
    assert rootless.calls == [("load", got.ref)]
    assert [
        e.details["gate"]
        for e in events
        if e.type == "sandbox:gate" and e.run_id == "r2" and e.details
    ] == ["sandbox_provision"]


async def test_parallel_prepares_build_once(
    tmp_path: Path, images_dir: Path, audit: AuditLog
) -> None:
    engine = FakeEngine()
    o = opts(tmp_path, images_dir)
    results = await asyncio.gather(
        *[
            ensure_image("podman", engine, "demo", allow_all(), audit, f"t{i}", "r", options=o)
            for i in range(6)
        ]
    )
    assert len([c for c in engine.calls if c[0] == "build"]) == 1
    assert sorted(r.action for r in results) == ["built"] + ["present"] * 5
    assert len({r.digest for r in results}) == 1


def test_engine_name_is_guessed_from_the_socket() -> None:
    from fusion_oci.images.provision import _guess_name

    env = {"FUSION_OCI_ROOTLESS_PODMAN_URL": "unix:///x/rootless.sock"}
    assert _guess_name("podman", "unix:///x/rootless.sock", env) == "podman-rootless"
    assert _guess_name("podman", "unix:///run/user/1001/podman/podman.sock", {}) == (
        "podman-rootless"
    )
    assert _guess_name("podman", "unix:///run/podman/podman.sock", env) == "podman"
    assert _guess_name("docker", "", env) == "docker"
    assert _guess_name("docker", "unix:///var/run/docker.sock", env) == "docker"
    assert _guess_name("docker", "unix:///run/user/1001/docker.sock", {}) == "docker-rootless"


class TarSeeingEngine(FakeEngine):
    """Also keeps the names and build args of every context it is sent."""

    def build(self, context_tar: Path, **kw: Any) -> str:
        import tarfile

        with tarfile.open(context_tar) as tar:
            self.sent = sorted(tar.getnames())
        self.args = dict(kw["build_args"])
        return super().build(context_tar, **kw)


async def test_node_image_fits_the_project_and_an_unchanged_one_costs_no_request(
    tmp_path: Path, audit: AuditLog, events: list[AuditEvent]
) -> None:
    import json
    import shutil

    from fusion_oci.images.npm_registry import Registry
    from tests.unit.test_images_toolchain import REPO_IMAGES, FakeRegistry, publish_world

    images = tmp_path / "images"
    shutil.copytree(REPO_IMAGES / "node", images / "node")
    project = tmp_path / "project"
    project.mkdir()
    (project / ".nvmrc").write_text("22\n")
    (project / "package.json").write_text(json.dumps({"packageManager": "pnpm@9.15.0"}))
    fake = FakeRegistry()
    publish_world(fake)
    try:
        engine = TarSeeingEngine()
        o = opts(
            tmp_path, images, project_dir=project, registry=Registry(fake.url, tmp_path / "npm")
        )
        first = await ensure_image(
            "podman", engine, "node", allow_all(), audit, "t", "r", options=o
        )
        assert first.action == "built"
        assert first.why == "node 22 from .nvmrc (v22.23.5), pnpm 9.15.0 from packageManager"
        assert {
            "fusion-oci-dist/node.tgz",
            "fusion-oci-dist/npm.tgz",
            "fusion-oci-dist/pm.tgz",
            "install-toolchain.sh",
            "Containerfile",
        } <= set(engine.sent)
        assert engine.args["NODE_VERSION"] == "22.23.5" and engine.args["PM_BINS"].startswith(
            "pnpm="
        )
        asked = len(fake.requests)
        # a new process (new Registry object), the same files: present, and not one request
        again = await ensure_image(
            "podman",
            engine,
            "node",
            allow_all(),
            audit,
            "t",
            "r",
            options=opts(
                tmp_path, images, project_dir=project, registry=Registry(fake.url, tmp_path / "npm")
            ),
        )
        assert (again.action, again.ref) == ("present", first.ref)
        assert len(fake.requests) == asked
        assert [c for c in engine.calls if c[0] == "build"] == [("build", first.ref)]
    finally:
        fake.close()
