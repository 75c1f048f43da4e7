"""Project files → ImageRecipe (pure), and the semver subset it reads ranges with."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusion_oci.images import semver
from fusion_oci.images.recipe import (
    DEFAULT_NODE_MAJOR,
    DEFAULT_PNPM_MAJOR,
    DEFAULT_RECIPE,
    ProjectFiles,
    RecipeError,
    major_for_range,
    read_project_files,
    recipe_for,
)


def pkg(**fields: object) -> str:
    import json

    return json.dumps(fields)


@pytest.mark.parametrize(
    ("files", "why"),
    [
        (
            ProjectFiles(),
            f"node {DEFAULT_NODE_MAJOR} from default, pnpm {DEFAULT_PNPM_MAJOR} from default",
        ),
        (
            ProjectFiles(nvmrc="22\n", package_json=pkg(packageManager="pnpm@9.15.0")),
            "node 22 from .nvmrc, pnpm 9.15.0 from packageManager",
        ),
        (
            ProjectFiles(node_version="v20.11.1", package_json=pkg(packageManager="yarn@1.22.22")),
            "node 20 from .node-version, yarn 1.22.22 from packageManager",
        ),
        (
            ProjectFiles(package_json=pkg(engines={"node": "^22.1"}, packageManager="npm@10.9.0")),
            "node 22 from engines.node, npm 10.9.0 from packageManager",
        ),
        (
            ProjectFiles(nvmrc="system"),
            f"Debian's nodejs from .nvmrc, pnpm {DEFAULT_PNPM_MAJOR} from default",
        ),
        (
            ProjectFiles(nvmrc="lts/iron"),
            f"node 20 from .nvmrc, pnpm {DEFAULT_PNPM_MAJOR} from default",
        ),
        (
            ProjectFiles(nvmrc="lts/*"),
            f"node {DEFAULT_NODE_MAJOR} from .nvmrc, pnpm {DEFAULT_PNPM_MAJOR} from default",
        ),
        (
            ProjectFiles(nvmrc="node"),
            f"node (newest) from .nvmrc, pnpm {DEFAULT_PNPM_MAJOR} from default",
        ),
        (
            ProjectFiles(nvmrc="lts/-1"),
            f"node {DEFAULT_NODE_MAJOR - 2} from .nvmrc, pnpm {DEFAULT_PNPM_MAJOR} from default",
        ),
    ],
)
def test_why_line_names_the_choice_and_its_file(files: ProjectFiles, why: str) -> None:
    assert recipe_for(files).why() == why


def test_precedence_nvmrc_then_node_version_then_engines() -> None:
    every = dict(nvmrc="22", node_version="20", package_json=pkg(engines={"node": "18"}))
    assert recipe_for(ProjectFiles(**every)).node.source == ".nvmrc"
    assert recipe_for(ProjectFiles(**{**every, "nvmrc": None})).node.major == 20
    only = ProjectFiles(package_json=pkg(engines={"node": "18"}))
    assert recipe_for(only).node.major == 18 and recipe_for(only).node.range == "18"
    # an empty or comment-only .nvmrc says nothing: the next file decides
    assert recipe_for(ProjectFiles(nvmrc="# none\n\n", node_version="20")).node.major == 20


def test_only_system_asks_for_debians_node() -> None:
    eighteen = recipe_for(ProjectFiles(package_json=pkg(engines={"node": "18.19.0"}))).node
    assert not eighteen.debian and eighteen.major == 18 and eighteen.range == "18.19.0"
    assert recipe_for(ProjectFiles(node_version="system")).node.debian


@pytest.mark.parametrize(
    ("declared", "major"),
    [
        (">=20", DEFAULT_NODE_MAJOR),
        ("^22.1", 22),
        ("~20.9", 20),
        ("22.x", 22),
        ("18 - 20", 20),
        ("<21", 20),
        ("^16 || ^18", 18),
        (">=28", 28),
        ("^23", 23),
        ("*", DEFAULT_NODE_MAJOR),
        (">=18 <23", 22),
        ("v22", 22),
        ("24.1.0", 24),
    ],
)
def test_ranges_resolve_to_one_major(declared: str, major: int) -> None:
    assert major_for_range(semver.parse_range(declared)) == major


@pytest.mark.parametrize(
    ("manager", "name", "version", "hash_"),
    [
        ("pnpm@9.12.0+sha512.abc123", "pnpm", "9.12.0", ("sha512", "abc123")),
        ("yarn@4.5.0", "yarn", "4.5.0", None),
        ("npm@10.9.0+sha256.00ff", "npm", "10.9.0", ("sha256", "00ff")),
    ],
)
def test_package_manager_follows_corepack(
    manager: str, name: str, version: str, hash_: tuple[str, str] | None
) -> None:
    pm = recipe_for(ProjectFiles(package_json=pkg(packageManager=manager))).package_manager
    assert (pm.name, pm.version, pm.hash, pm.source) == (name, version, hash_, "packageManager")


@pytest.mark.parametrize(
    ("files", "words"),
    [
        (ProjectFiles(package_json=pkg(packageManager="pnpm@9")), "not an exact version"),
        (ProjectFiles(package_json=pkg(packageManager="bun@1.1.0")), "not pnpm, yarn or npm"),
        (ProjectFiles(package_json=pkg(packageManager="pnpm@9.1.0+md5.aa")), "ALGORITHM.HEX"),
        (ProjectFiles(package_json=pkg(packageManager=9)), "not a string"),
        (ProjectFiles(package_json="{not json"), "not valid JSON"),
        (ProjectFiles(nvmrc="lts/nonesuch"), "not an LTS codename"),
        (ProjectFiles(nvmrc="banana"), "is not a version"),
        (ProjectFiles(package_json=pkg(engines={"node": ">=99"})), "no Node.js line"),
    ],
)
def test_bad_declarations_are_typed_errors_naming_the_file(files: ProjectFiles, words: str) -> None:
    with pytest.raises(RecipeError) as err:
        recipe_for(files)
    assert words in str(err.value)
    assert err.value.hint


def test_read_project_files(tmp_path: Path) -> None:
    assert read_project_files(tmp_path) == ProjectFiles()
    (tmp_path / ".nvmrc").write_text("22\n")
    (tmp_path / "package.json").write_text(pkg(packageManager="pnpm@9.15.0"))
    assert (
        recipe_for(read_project_files(tmp_path)).why()
        == "node 22 from .nvmrc, pnpm 9.15.0 from packageManager"
    )
    assert recipe_for(ProjectFiles()) == DEFAULT_RECIPE


@pytest.mark.parametrize(
    ("range_", "inside", "outside"),
    [
        ("^22.1", ["22.1.0", "22.23.5"], ["22.0.9", "23.0.0"]),
        ("~20.9", ["20.9.0", "20.9.7"], ["20.10.0"]),
        (">=20 <23", ["20.0.0", "22.99.0"], ["19.9.9", "23.0.0"]),
        ("18 - 20", ["18.0.0", "20.20.2"], ["21.0.0", "17.9.0"]),
        ("^0.2.3", ["0.2.3", "0.2.9"], ["0.3.0"]),
        ("^22.22.2 || ^24.15.0 || >=26.0.0", ["22.23.5", "26.12.1"], ["22.21.0", "24.14.0"]),
        ("<=20.1", ["20.1.9"], ["20.2.0"]),
        (">20", ["21.0.0"], ["20.99.0"]),
    ],
)
def test_semver_ranges(range_: str, inside: list[str], outside: list[str]) -> None:
    intervals = semver.parse_range(range_)
    for v in inside:
        assert semver.satisfies(semver.parse_version(v), intervals), v
    for v in outside:
        assert not semver.satisfies(semver.parse_version(v), intervals), v


def test_newest_skips_prereleases() -> None:
    versions = ["22.1.0", "22.23.5", "23.0.0-rc.1", "22.3.0", "21.0.0"]
    assert semver.newest(versions, semver.parse_range("22")) == "22.23.5"
    assert semver.newest(versions, semver.parse_range(">=23")) is None


def test_a_symlinked_declaration_is_refused_without_reading_its_target(tmp_path: Path) -> None:
    import os

    from fusion_oci.images.recipe import read_project_files

    secret = tmp_path / "secret"
    secret.write_text("SECRET-VALUE\n")
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / ".nvmrc").symlink_to(secret)
    with pytest.raises(RecipeError) as refused:
        read_project_files(wt)
    assert "symlink" in refused.value.render() and "SECRET" not in refused.value.render()
    (wt / ".nvmrc").unlink()
    os.mkfifo(wt / ".nvmrc")  # never waited on
    (wt / "package.json").mkdir()
    assert read_project_files(wt).nvmrc is None
    assert read_project_files(wt).package_json is None
