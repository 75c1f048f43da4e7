"""Where task image definitions are found: env override, a checkout's images/, else the copy a
wheel ships as fusion_oci/_images."""

from __future__ import annotations

from pathlib import Path

from fusion_oci.images.spec import PACKAGED_IMAGES, default_images_dir, resolve_image


def _package(top: Path) -> Path:
    package = top / "fusion_oci"
    (package / PACKAGED_IMAGES / "node").mkdir(parents=True)
    (package / PACKAGED_IMAGES / "node" / "Containerfile").write_text("FROM scratch\n")
    return package


def test_env_wins(tmp_path: Path) -> None:
    assert default_images_dir({"FUSION_OCI_IMAGES_DIR": str(tmp_path)}) == tmp_path


def test_checkout_images_preferred_over_packaged_copy(tmp_path: Path) -> None:
    package = _package(tmp_path)
    (tmp_path / "pyproject.toml").write_text("[project]\nname='fusion-oci'\n")
    (tmp_path / "images").mkdir()
    assert default_images_dir({}, package_root=package) == tmp_path / "images"


def test_installed_package_uses_its_copy(tmp_path: Path) -> None:
    # site-packages: no pyproject.toml beside the package; another distribution's images/ there
    # is not ours.
    package = _package(tmp_path)
    (tmp_path / "images").mkdir()
    found = default_images_dir({}, package_root=package)
    assert found == package / PACKAGED_IMAGES
    spec = resolve_image("node", images_dir=found)
    assert spec.context == package / PACKAGED_IMAGES / "node"


def test_this_checkout_resolves_its_own_images() -> None:
    top = Path(__file__).resolve().parents[2]
    assert default_images_dir({}) == top / "images"


def test_packaged_copy_hashes_like_the_checkout(tmp_path: Path) -> None:
    """The tag is a content hash, so the wheel's copy names the very image a checkout builds."""
    import shutil

    from tests.unit.test_images_toolchain import _toolchain

    top = Path(__file__).resolve().parents[2]
    shutil.copytree(top / "images" / "node", tmp_path / "node")
    tc = _toolchain()
    assert (
        resolve_image("node", images_dir=tmp_path, toolchain=tc).ref
        == resolve_image("node", images_dir=top / "images", toolchain=tc).ref
    )
