"""Build-context hashing, context tars, image names: pure parts of fusion_oci.images."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from fusion_oci.errors import ProvisionError
from fusion_oci.images.context import content_tag, context_hash, write_context_tar
from fusion_oci.images.engine import strip_secret_mounts
from fusion_oci.images.spec import (
    BASE_REF,
    LABEL_HASH,
    LABEL_MANAGED,
    is_loopback_registry,
    normalize_ref,
    resolve_image,
    with_mirror,
)


@pytest.fixture
def ctx(tmp_path: Path) -> Path:
    d = tmp_path / "images" / "demo"
    d.mkdir(parents=True)
    (d / "Containerfile").write_text("ARG BASE=x\nFROM ${BASE}\nCOPY . /ctx\n")
    (d / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (d / "sub").mkdir()
    (d / "sub" / "data.txt").write_text("data\n")
    return d


def test_hash_ignores_times_and_is_stable(ctx: Path) -> None:
    first = context_hash(ctx)
    os.utime(ctx / "run.sh", (1, 1))
    assert context_hash(ctx) == first
    assert len(content_tag(first)) == 12


@pytest.mark.parametrize(
    "change", ["content", "exec-bit", "new-file", "rename", "symlink", "empty-dir"]
)
def test_any_change_changes_the_hash(ctx: Path, change: str) -> None:
    before = context_hash(ctx)
    if change == "content":
        (ctx / "sub" / "data.txt").write_text("data2\n")
    elif change == "exec-bit":
        (ctx / "run.sh").chmod(0o755)
    elif change == "new-file":
        (ctx / "extra").write_text("")
    elif change == "rename":
        (ctx / "sub" / "data.txt").rename(ctx / "sub" / "data2.txt")
    elif change == "symlink":
        (ctx / "link").symlink_to("run.sh")
    else:
        (ctx / "empty").mkdir()
    assert context_hash(ctx) != before


def test_build_args_and_containerfile_name_are_part_of_the_hash(ctx: Path) -> None:
    plain = context_hash(ctx)
    assert context_hash(ctx, build_args={"BASE": BASE_REF}) != plain
    assert context_hash(ctx, build_args={"BASE": "other"}) != context_hash(
        ctx, build_args={"BASE": BASE_REF}
    )
    assert context_hash(ctx, containerfile="Dockerfile") != plain


def test_ignored_files_do_not_count(ctx: Path) -> None:
    (ctx / ".containerignore").write_text("# comment\nnode_modules\n*.log\n")
    before = context_hash(ctx)
    (ctx / "node_modules").mkdir()
    (ctx / "node_modules" / "big").write_text("x" * 1000)
    (ctx / "debug.log").write_text("noise")
    assert context_hash(ctx) == before
    (ctx / "kept.txt").write_text("counts")
    assert context_hash(ctx) != before


def test_context_tar_has_files_owned_by_root_and_the_secret_apart(
    ctx: Path, tmp_path: Path
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("MARKER-CA\n")
    (ctx / ".containerignore").write_text("*.log\n")
    (ctx / "x.log").write_text("no")
    buf = io.BytesIO()
    write_context_tar(
        ctx, buf, secrets={".secret-abc": ca}, replace={"Containerfile": b"FROM scratch\n"}
    )
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {
            "Containerfile",
            "run.sh",
            "sub",
            "sub/data.txt",
            ".containerignore",
            ".secret-abc",
        }
        assert all(m.uid == 0 and m.uname == "root" for m in members.values())
        assert members[".secret-abc"].mode == 0o600
        cf = tar.extractfile("Containerfile")
        assert cf is not None and cf.read() == b"FROM scratch\n"
        sec = tar.extractfile(".secret-abc")
        assert sec is not None and sec.read() == b"MARKER-CA\n"


def test_resolve_short_name_builds_with_a_content_tag(ctx: Path) -> None:
    spec = resolve_image("demo", images_dir=ctx.parent)
    assert spec.kind == "build" and spec.context == ctx
    assert spec.ref == f"localhost/fusion-oci/demo:{context_hash(ctx)[:12]}"
    assert spec.labels[LABEL_MANAGED] == "true" and spec.labels[LABEL_HASH] == spec.context_hash
    offline = resolve_image("demo", images_dir=ctx.parent, base=BASE_REF)
    assert offline.build_args == {"BASE": BASE_REF} and offline.ref != spec.ref


def test_unknown_short_name_is_refused_with_the_known_ones(ctx: Path) -> None:
    with pytest.raises(ProvisionError) as err:
        resolve_image("debian", images_dir=ctx.parent)
    assert "images here: demo" in str(err.value)
    assert "docker.io/library/debian" in err.value.hint


def test_fusion_oci_image_is_the_top_level_containerfile(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "Containerfile").write_text("FROM x\n")
    spec = resolve_image("fusion-oci", images_dir=tmp_path / "images")
    assert spec.context == tmp_path and spec.kind == "build"


def test_repository_images_resolve() -> None:
    from tests.unit.test_images_toolchain import _toolchain

    spec = resolve_image("node", toolchain=_toolchain())
    assert spec.kind == "build" and spec.ref.startswith("localhost/fusion-oci/node:")
    assert (spec.context / "Containerfile").is_file()  # type: ignore[operator]
    # the node folder is built with a toolchain: without one it is an error, not a guess
    with pytest.raises(ProvisionError, match=r"needs its Node\.js toolchain"):
        resolve_image("node")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("debian:bookworm", "docker.io/library/debian:bookworm"),
        ("debian", "docker.io/library/debian:latest"),
        ("library/debian:12", "docker.io/library/debian:12"),
        ("quay.io/podman/stable", "quay.io/podman/stable:latest"),
        ("127.0.0.1:5000/tiny:1", "127.0.0.1:5000/tiny:1"),
        ("localhost/fusion-oci/node:abc", "localhost/fusion-oci/node:abc"),
        ("localhost:5000/x", "localhost:5000/x:latest"),
        ("ghcr.io/a/b@sha256:" + "0" * 64, "ghcr.io/a/b@sha256:" + "0" * 64),
    ],
)
def test_normalize_ref(given: str, expected: str) -> None:
    assert normalize_ref(given) == expected
    if "/" in given or ":" in given:
        assert resolve_image(given).ref == expected


def test_mirrors_and_loopback() -> None:
    ref = "docker.io/library/debian:bookworm-slim"
    assert with_mirror(ref, "127.0.0.1:5000") == "127.0.0.1:5000/library/debian:bookworm-slim"
    hub = with_mirror(ref, "mirror.example/hub/")
    assert hub == "mirror.example/hub/library/debian:bookworm-slim"
    assert is_loopback_registry("127.0.0.1:5000/x:1")
    assert is_loopback_registry("localhost:5000/x:1")
    assert is_loopback_registry("[::1]:5000/x:1")
    assert not is_loopback_registry("docker.io/library/x:1")
    assert not is_loopback_registry("registry.example:5000/x:1")


def test_strip_secret_mounts_for_the_classic_builder() -> None:
    text = (
        "FROM x\nRUN --mount=type=secret,id=hostca \\\n    if [ -s /run/secrets/hostca ]; "
        "then echo y; fi\nRUN --mount=type=cache,target=/c echo keep\n"
    )
    out = strip_secret_mounts(text)
    assert "type=secret" not in out
    assert "RUN if [ -s /run/secrets/hostca ]" in out.replace("\\\n    ", "")
    assert "--mount=type=cache" in out


def test_ignore_rules_are_the_docker_sdks_with_reincludes(ctx: Path) -> None:
    """`!` lines re-include (they were dropped before), later lines win, a matched directory
    excludes its contents, and the Containerfile is always sent: docker's own rules."""
    (ctx / ".containerignore").write_text(
        "# logs, but keep the one the build reads\n*.log\n!keep.log\n"
        "sub\n!sub/data.txt\nContainerfile\n"
    )
    (ctx / "debug.log").write_text("noise")
    (ctx / "keep.log").write_text("read by the build")
    (ctx / "sub" / "other.txt").write_text("ignored")
    out = io.BytesIO()
    write_context_tar(ctx, out)
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:
        names = set(tar.getnames())
    assert {"keep.log", "sub/data.txt", "Containerfile", "run.sh"} <= names
    assert not names & {"debug.log", "sub/other.txt"}
    before = context_hash(ctx)
    (ctx / "keep.log").write_text("changed")
    assert context_hash(ctx) != before, "a re-included file is part of the hash"
    before = context_hash(ctx)
    (ctx / "other.log").write_text("still ignored")
    assert context_hash(ctx) == before
