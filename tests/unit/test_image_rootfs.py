"""An image's root filesystem from the engine's export: the extraction filter and the cache
(one tree per digest, renamed into place, nothing half-written on failure)."""

from __future__ import annotations

import contextlib
import io
import stat
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from fusion_oci.errors import ProvisionError
from fusion_oci.images import rootfs
from fusion_oci.images.rootfs import _ChunkReader, export_image_rootfs, extract_rootfs, podman_url


def tar_bytes(entries: Sequence[tuple[str, str, str | bytes, int]]) -> bytes:
    """(kind, name, data-or-link-target, mode) → a tar, as an engine's export streams it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for kind, name, data, mode in entries:
            info = tarfile.TarInfo(name)
            info.mode = mode
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, str(data)
                tar.addfile(info)
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, str(data)
                tar.addfile(info)
            elif kind in ("chr", "blk"):
                info.type = tarfile.CHRTYPE if kind == "chr" else tarfile.BLKTYPE
                info.devmajor, info.devminor = 1, 3
                tar.addfile(info)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
                tar.addfile(info)
            else:
                raw = data.encode() if isinstance(data, str) else data
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def chunks(data: bytes, size: int = 7) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_extract_keeps_absolute_symlinks_and_drops_setuid_and_devices(tmp_path: Path) -> None:
    data = tar_bytes(
        [
            ("dir", "usr", "", 0o755),
            ("dir", "usr/bin", "", 0o755),
            ("file", "usr/bin/sudo", "x", 0o4755),
            ("symlink", "bin", "/usr/bin", 0o777),
            ("dir", "dev", "", 0o755),
            ("chr", "dev/null", "", 0o666),
            ("chr", "opt-disk", "", 0o666),
        ]
    )
    root = tmp_path / "rootfs"
    extract_rootfs(_ChunkReader(chunks(data)), root)
    assert (root / "bin").is_symlink() and str((root / "bin").readlink()) == "/usr/bin"
    assert not stat.S_IMODE((root / "usr/bin/sudo").stat().st_mode) & stat.S_ISUID
    # No device node on the host: the container's /dev is its own tmpfs.
    assert not (root / "dev/null").exists() and not (root / "opt-disk").exists()


def test_extract_refuses_what_would_land_outside(tmp_path: Path) -> None:
    outside = tmp_path / "host"
    outside.mkdir()
    secret = tmp_path / "secret"
    secret.write_text("host only")
    cases = [
        [("file", "../escape", "x", 0o644)],
        [("symlink", "link", str(outside), 0o777), ("file", "link/planted", "x", 0o644)],
        # hard links: the tar filter alone would link the host's file into the rootfs
        [("hardlink", "shadow", str(secret), 0o644)],
        [("dir", "a", "", 0o755), ("hardlink", "a/shadow", "../../secret", 0o644)],
    ]
    for i, entries in enumerate(cases):
        root = tmp_path / f"rootfs-{i}"
        with pytest.raises(tarfile.TarError):
            extract_rootfs(io.BytesIO(tar_bytes(entries)), root)
        assert not any(
            p.stat().st_ino == secret.stat().st_ino
            for p in root.rglob("*")
            if p.is_file() and not p.is_symlink()
        )
    assert not list(outside.iterdir())
    assert not (tmp_path / "escape").exists()
    assert secret.stat().st_nlink == 1


def test_hard_links_inside_the_image_are_kept(tmp_path: Path) -> None:
    data = tar_bytes(
        [
            ("dir", "usr", "", 0o755),
            ("file", "usr/perl", "p", 0o755),
            ("hardlink", "usr/perl5", "usr/perl", 0o755),
            ("hardlink", "usr/perl6", "/usr/perl", 0o755),
        ]
    )
    root = tmp_path / "rootfs"
    extract_rootfs(io.BytesIO(data), root)
    assert (root / "usr/perl5").stat().st_ino == (root / "usr/perl").stat().st_ino
    assert (root / "usr/perl6").stat().st_ino == (root / "usr/perl").stat().st_ino


def extract(
    tmp_path: Path, entries: Sequence[tuple[str, str, str | bytes, int]], name: str = "rootfs"
) -> Path:
    root = tmp_path / name
    extract_rootfs(io.BytesIO(tar_bytes(entries)), root)
    return root


def test_our_rules_not_the_interpreters_filter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """extractall's ``filter=`` is 3.11.4+ and its default changes in 3.14: never called, so
    every rule below holds the same on Debian 12's 3.11.2 and on newer interpreters."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("TarFile.extract/extractall called")

    monkeypatch.setattr(tarfile.TarFile, "extractall", refuse)
    monkeypatch.setattr(tarfile.TarFile, "extract", refuse)
    root = extract(
        tmp_path,
        [
            ("dir", "etc", "", 0o755),
            ("file", "etc/os", "deb", 0o644),
            ("symlink", "os", "/etc/os", 0o777),
        ],
    )
    assert (root / "etc/os").read_text() == "deb"


def test_absolute_names_land_under_the_root(tmp_path: Path) -> None:
    root = extract(
        tmp_path,
        [
            ("dir", "/etc", "", 0o755),
            ("file", "/etc/planted", "x", 0o644),
            ("file", "./etc/dotted", "y", 0o644),
        ],
    )
    assert (root / "etc/planted").read_text() == "x" and (root / "etc/dotted").exists()


@pytest.mark.parametrize("name", ["../escape", "etc/../../escape", "/../escape"])
def test_dot_dot_in_a_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(rootfs.UnsafeMemberError, match=r"'\.\.'"):
        extract(tmp_path, [("dir", "etc", "", 0o755), ("file", name, "x", 0o644)])
    assert not (tmp_path / "escape").exists()


def test_no_member_is_written_through_a_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "file").write_text("host")
    with pytest.raises(rootfs.UnsafeMemberError, match="not a directory"):
        extract(tmp_path, [("symlink", "etc", "/", 0o777), ("file", "etc/passwd", "x", 0o644)])
    # a later member of the same name replaces the symlink; the host file is left alone
    root = extract(
        tmp_path,
        [("symlink", "f", str(outside / "file"), 0o777), ("file", "f", "image", 0o644)],
        "r2",
    )
    assert not (root / "f").is_symlink() and (root / "f").read_text() == "image"
    assert (outside / "file").read_text() == "host"
    # a directory swapped for a symlink after it was made: its mode is not applied through it
    before = stat.S_IMODE(outside.stat().st_mode)
    extract(tmp_path, [("dir", "d", "", 0o700), ("symlink", "d", str(outside), 0o777)], "r3")
    assert stat.S_IMODE(outside.stat().st_mode) == before


def test_symlinks_absolute_kept_relative_must_stay_inside(tmp_path: Path) -> None:
    root = extract(
        tmp_path,
        [
            ("dir", "usr", "", 0o755),
            ("dir", "usr/lib", "", 0o755),
            ("symlink", "lib", "usr/lib", 0o777),
            ("symlink", "usr/lib/up", "../../etc", 0o777),
            ("symlink", "sh", "/bin/dash", 0o777),
        ],
    )
    assert str((root / "lib").readlink()) == "usr/lib"
    assert str((root / "usr/lib/up").readlink()) == "../../etc"
    assert str((root / "sh").readlink()) == "/bin/dash"  # resolved inside the container
    for link in ["../etc", "usr/../../etc", "a/../../../x"]:
        with pytest.raises(rootfs.UnsafeMemberError, match="climbs out"):
            extract(tmp_path, [("symlink", "bad", link, 0o777)], f"r-{link.count('/')}")


def test_hard_links_must_point_at_a_member_inside(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host only")
    cases: list[tuple[list[tuple[str, str, str | bytes, int]], type[Exception]]] = [
        ([("hardlink", "shadow", str(secret), 0o644)], tarfile.ExtractError),  # root-relative
        ([("hardlink", "shadow", "../secret", 0o644)], rootfs.UnsafeMemberError),
        (
            [("symlink", "up", str(tmp_path), 0o777), ("hardlink", "shadow", "up/secret", 0o644)],
            rootfs.UnsafeMemberError,
        ),
        ([("dir", "etc", "", 0o755), ("hardlink", "etc2", "etc", 0o644)], tarfile.ExtractError),
    ]
    for i, (entries, error) in enumerate(cases):
        with pytest.raises(error):
            extract(tmp_path, entries, f"r{i}")
    assert secret.stat().st_nlink == 1
    assert not list((tmp_path / "r0").iterdir())  # no directory made for the missing target


def test_devices_and_fifos_are_not_made(tmp_path: Path) -> None:
    root = extract(
        tmp_path,
        [
            ("dir", "dev", "", 0o755),
            ("chr", "dev/null", "", 0o666),
            ("blk", "dev/sda", "", 0o660),
            ("fifo", "run-pipe", "", 0o666),
            ("file", "kept", "k", 0o644),
        ],
    )
    assert sorted(p.name for p in root.rglob("*")) == ["dev", "kept"]


def test_mode_bits_masked_owners_numeric(tmp_path: Path) -> None:
    import os

    root = extract(
        tmp_path,
        [
            ("dir", "tmp", "", 0o1777),
            ("dir", "ro", "", 0o555),
            ("file", "ro/inside", "x", 0o644),
            ("file", "suid", "x", 0o4755),
            ("file", "sgid", "x", 0o2755),
            ("file", "gw", "x", 0o666),
        ],
    )
    modes = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*")}
    assert modes == {
        "tmp": 0o755,
        "ro": 0o555,
        "inside": 0o644,
        "suid": 0o755,
        "sgid": 0o755,
        "gw": 0o644,
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("owned")
        info.uid, info.gid, info.uname, info.mode = 4321, 4322, "root", 0o644
        tar.addfile(info, io.BytesIO(b""))
    owned = tmp_path / "owned"
    extract_rootfs(io.BytesIO(buf.getvalue()), owned)
    st = (owned / "owned").lstat()
    if os.geteuid() == 0:  # numeric ids, never the name's ("root" here); only root can chown
        assert (st.st_uid, st.st_gid) == (4321, 4322)
    else:
        assert st.st_uid == os.geteuid()


class FakeExport:
    def __init__(self, digest: str, data: bytes, fail_after: int | None = None) -> None:
        self.digest, self._data, self._fail_after = digest, data, fail_after
        self.streamed = 0

    def stream(self) -> Iterator[bytes]:
        for i, chunk in enumerate(chunks(self._data, 64)):
            if self._fail_after is not None and i >= self._fail_after:
                raise ProvisionError("export broke", "connection reset")
            self.streamed += 1
            yield chunk


def fake_engine(monkeypatch: pytest.MonkeyPatch, export: FakeExport) -> None:
    @contextlib.contextmanager
    def engine_export(ref: str, url: str) -> Iterator[FakeExport]:
        yield export

    monkeypatch.setattr(rootfs, "_engine_export", engine_export)


IMAGE = tar_bytes([("dir", "etc", "", 0o755), ("file", "etc/hello", "hi\n" * 100, 0o644)])


def test_one_tree_per_digest_renamed_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    export = FakeExport("sha256:" + "a" * 64, IMAGE)
    fake_engine(monkeypatch, export)
    got = export_image_rootfs("localhost/x:1", tmp_path / "cache", "unix:///p.sock")
    assert got == tmp_path / "cache" / ("a" * 64) / "rootfs"
    assert (got / "etc/hello").read_text().startswith("hi\n")
    streamed = export.streamed
    assert export_image_rootfs("localhost/x:1", tmp_path / "cache", "u") == got
    assert export.streamed == streamed  # cached by digest: nothing exported again
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["a" * 64]


def test_a_failed_export_leaves_no_half_written_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_engine(monkeypatch, FakeExport("sha256:" + "b" * 64, IMAGE, fail_after=2))
    with pytest.raises(ProvisionError, match="export broke"):
        export_image_rootfs("localhost/x:1", tmp_path / "cache", "u")
    assert not list((tmp_path / "cache").iterdir())


def test_what_a_killed_export_left_is_swept(tmp_path: Path) -> None:
    import os

    cache = tmp_path / "cache"
    old, young, done = cache / ".new-aaaa.x1", cache / ".new-bbbb.x2", cache / ("c" * 64)
    for d in (old, young, done):
        (d / "rootfs").mkdir(parents=True)
    os.utime(old, (1, 1))
    assert rootfs.sweep_partial(cache) == [old]
    assert sorted(p.name for p in cache.iterdir()) == sorted([young.name, done.name])


def test_podman_url() -> None:
    assert podman_url({"FUSION_OCI_PODMAN_URL": "unix:///x.sock"}, 0) == "unix:///x.sock"
    assert podman_url({}, 0) == "unix:///run/podman/podman.sock"
    assert podman_url({}, 1000) == "unix:///run/user/1000/podman/podman.sock"
    assert podman_url({"CONTAINER_HOST": "unix:///e.sock"}, 0, "unix:///s.sock") == "unix:///s.sock"


class FakeContainer:
    def __init__(self, data: bytes, fail: bool) -> None:
        self.data, self.fail, self.removed = data, fail, False

    def export(self) -> Iterator[bytes]:
        yield self.data[:100]
        if self.fail:
            raise ProvisionError("export broke", "connection reset")
        yield self.data[100:]

    def remove(self, **kw: object) -> None:
        self.removed = True


class FakeEngine:
    """Stands in for images.engine's client: the calls _engine_export makes, recorded."""

    def __init__(self, data: bytes, fail: bool = False) -> None:
        self.created: list[FakeContainer] = []
        self.create_kwargs: list[dict[str, object]] = []
        self._data, self._fail = data, fail
        engine = self

        class Containers:
            def create(self, image: str, **kw: object) -> FakeContainer:
                engine.create_kwargs.append({"image": image, **kw})
                engine.created.append(FakeContainer(engine._data, engine._fail))
                return engine.created[-1]

        class Client:
            containers = Containers()

        self.client = Client()

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def image(self, ref: str) -> object:
        from fusion_oci.engines import ImageInfo

        return ImageInfo(engine="podman", id="sha256:" + "d" * 64, tags=[ref])

    def call(self, what: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def test_the_export_container_is_created_once_and_always_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fusion_oci.images import engine as engine_module

    fake = FakeEngine(IMAGE, fail=True)
    monkeypatch.setattr(engine_module, "open_engine", lambda kind, url: fake)
    with pytest.raises(ProvisionError):
        export_image_rootfs("localhost/x:1", tmp_path / "cache", "u")
    assert [c.removed for c in fake.created] == [True]
    assert fake.create_kwargs[0]["image"] == "sha256:" + "d" * 64  # the digest, not the tag
    assert fake.create_kwargs[0]["command"] == rootfs.EXPORT_COMMAND
    assert not list((tmp_path / "cache").iterdir())

    fake = FakeEngine(IMAGE)
    monkeypatch.setattr(engine_module, "open_engine", lambda kind, url: fake)
    got = export_image_rootfs("localhost/x:1", tmp_path / "cache", "u")
    assert (got / "etc/hello").exists() and [c.removed for c in fake.created] == [True]
    export_image_rootfs("localhost/x:1", tmp_path / "cache", "u")
    assert len(fake.created) == 1  # cached by digest: one inspect, no container
