"""The npm registry, as the image pipeline uses it: version lists and verified tarballs.

Metadata is the abbreviated packument (``application/vnd.npm.install-v1+json``), kept on disk
for :data:`METADATA_TTL_S` so that provisioning an image that is already present costs no
request (and keeps working from the last answer when the registry is down). Tarballs are kept
by their integrity hash and checked against it (``dist.integrity``, sha512) when fetched and
when read back; a corepack hash (``packageManager``'s ``+sha512.<hex>``) is checked on top.

Every failure is a typed :class:`RegistryError` or :class:`IntegrityError` that names the
package, the URL and the cause.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import ssl
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusion_oci.errors import ProvisionError

DEFAULT_REGISTRY = "https://registry.npmjs.org/"
REGISTRY_ENV = ("FUSION_OCI_NPM_REGISTRY", "npm_config_registry")
"""Where the registry URL may be set (first wins), else :data:`DEFAULT_REGISTRY`."""
METADATA_TTL_S = 6 * 3600.0
ABBREVIATED = "application/vnd.npm.install-v1+json"
_TIMEOUT_S = 60.0


class RegistryError(ProvisionError):
    """The npm registry could not be reached, or did not know a package or version."""


class IntegrityError(ProvisionError):
    """A tarball from the registry does not match its integrity (or corepack) hash."""


@dataclass(frozen=True)
class Release:
    """One version of a package: where its tarball is and what it must hash to."""

    package: str
    version: str
    tarball: str
    integrity: str
    """``sha512-<base64>`` (Subresource Integrity, as ``dist.integrity``)."""
    engines_node: str | None = None
    bin: tuple[tuple[str, str], ...] = ()
    """The package's commands: (name, path inside the package), as ``package.json`` ``bin``."""
    optional: tuple[tuple[str, str], ...] = ()
    """``optionalDependencies``: (name, version); pnpm ≥ 11 ships its native binary so."""


def registry_url(env: Mapping[str, str]) -> str:
    for key in REGISTRY_ENV:
        if env.get(key):
            return env[key].rstrip("/") + "/"
    return DEFAULT_REGISTRY


def sri_sha512(data_digest: bytes) -> str:
    return "sha512-" + base64.b64encode(data_digest).decode()


@dataclass
class Registry:
    """A registry at ``url``; ``cache_dir`` holds metadata and tarballs; ``ca`` is the CA
    bundle TLS is checked against (the host's, behind an intercepting proxy)."""

    url: str
    cache_dir: Path
    ca: Path | None = None
    ttl_s: float = METADATA_TTL_S
    timeout_s: float = _TIMEOUT_S
    clock: Callable[[], float] = time.time
    _memo: dict[str, dict[str, Release]] = field(default_factory=dict, init=False, repr=False)

    # -- metadata
    def releases(self, package: str) -> dict[str, Release]:
        """Every version of ``package`` (fresh cache, else the registry, else a stale cache)."""
        if package in self._memo:
            return self._memo[package]
        path = self.cache_dir / "metadata" / (urllib.parse.quote(package, safe="") + ".json")
        cached = _read_json(path)
        if cached is not None and self.clock() - float(cached.get("fetched", 0)) < self.ttl_s:
            data = cached["packument"]
        else:
            try:
                data = json.loads(self._get(self._packument_url(package), ABBREVIATED, package))
            except RegistryError:
                if cached is None:
                    raise
                data = cached["packument"]  # the registry is down: the last answer stands
            else:
                _write_atomic(
                    path, json.dumps({"fetched": self.clock(), "packument": data}).encode()
                )
        out = _releases(package, data)
        self._memo[package] = out
        return out

    def _packument_url(self, package: str) -> str:
        return self.url + urllib.parse.quote(package, safe="@")

    # -- tarballs
    def tarball(self, release: Release, corepack_hash: tuple[str, str] | None = None) -> Path:
        """The verified tarball of ``release`` on disk (downloaded once, checked each time)."""
        algo, _, b64 = release.integrity.partition("-")
        if algo != "sha512" or not b64:
            raise IntegrityError(
                f"{release.package}@{release.version} has no sha512 integrity",
                f"the registry says '{release.integrity}'",
                "fusion-oci only installs tarballs it can check",
            )
        key = base64.b64decode(b64).hex()
        path = self.cache_dir / "tarballs" / f"{key}.tgz"
        data = path.read_bytes() if path.is_file() else None
        if data is None or hashlib.sha512(data).hexdigest() != key:
            data = self._get(
                release.tarball, "application/octet-stream", f"{release.package}@{release.version}"
            )
            got = hashlib.sha512(data).digest()
            if got.hex() != key:
                raise IntegrityError(
                    f"{release.package}@{release.version} does not match its integrity hash",
                    f"{release.tarball} hashes to {sri_sha512(got)}, the registry's metadata "
                    f"says {release.integrity}",
                    "the tarball or the metadata was altered on the way (a proxy, a mirror); "
                    "nothing was built. Check the registry setting, then retry",
                )
            _write_atomic(path, data)
        if corepack_hash is not None:
            check_corepack_hash(release, data, corepack_hash)
        return path

    def _get(self, url: str, accept: str, what: str) -> bytes:
        context = ssl.create_default_context(cafile=str(self.ca) if self.ca else None)
        if not url.startswith(("https://", "http://")):
            raise RegistryError(
                f"cannot fetch {what}",
                f"'{url}' is not an http(s) URL",
                "set FUSION_OCI_NPM_REGISTRY to an https:// registry",
            )
        # The scheme is checked above.
        headers = {"Accept": accept, "User-Agent": "fusion-oci"}
        request = urllib.request.Request(url, headers=headers)  # noqa: S310
        try:
            with urllib.request.urlopen(  # noqa: S310
                request, timeout=self.timeout_s, context=context
            ) as resp:
                body: bytes = resp.read()
                return body
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise RegistryError(
                    f"{what} is not in the npm registry",
                    f"{url} answered 404",
                    "check the name and version in the project files",
                ) from exc
            raise RegistryError(
                f"the npm registry failed for {what}",
                f"{url} answered HTTP {exc.code}",
                "retry later, or point FUSION_OCI_NPM_REGISTRY at a mirror",
            ) from exc
        except (urllib.error.URLError, OSError, ssl.SSLError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RegistryError(
                f"the npm registry is unreachable (needed for {what})",
                f"{url}: {reason}",
                "check the network, the proxy and its CA (sandbox.hostCa), or "
                "point FUSION_OCI_NPM_REGISTRY at a reachable mirror",
            ) from exc


def check_corepack_hash(release: Release, data: bytes, expected: tuple[str, str]) -> None:
    """``packageManager``'s ``+ALGO.HEX`` against the tarball (or, for yarn ≥ 2, whose hash
    corepack takes over ``yarn.js``, against that file inside it)."""
    algo, hex_ = expected
    if hashlib.new(algo, data).hexdigest() == hex_:
        return
    inner = _yarn_js(data) if release.package == "@yarnpkg/cli-dist" else None
    if inner is not None and hashlib.new(algo, inner).hexdigest() == hex_:
        return
    raise IntegrityError(
        f"{release.package}@{release.version} does not match packageManager's hash",
        f"{release.tarball} hashes to {algo}.{hashlib.new(algo, data).hexdigest()}, "
        f"package.json says {algo}.{hex_}",
        "fix the hash in packageManager (corepack use NAME@VERSION writes it), or drop it",
    )


def _yarn_js(data: bytes) -> bytes | None:
    import io
    import tarfile

    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            member = tar.extractfile("package/bin/yarn.js")
            return member.read() if member else None
    except (tarfile.TarError, KeyError, OSError):
        return None


def _releases(package: str, data: Any) -> dict[str, Release]:
    versions = data.get("versions") if isinstance(data, dict) else None
    if not isinstance(versions, dict):
        raise RegistryError(
            f"the npm registry's answer for {package} has no versions",
            "",
            "check the registry setting (FUSION_OCI_NPM_REGISTRY)",
        )
    out: dict[str, Release] = {}
    for version, meta in versions.items():
        dist = meta.get("dist") if isinstance(meta, dict) else None
        if not isinstance(dist, dict) or not dist.get("tarball"):
            continue
        engines = meta.get("engines")
        node = engines.get("node") if isinstance(engines, dict) else None
        out[version] = Release(
            package,
            version,
            str(dist["tarball"]),
            str(dist.get("integrity") or ""),
            node if isinstance(node, str) else None,
            _bins(package, meta.get("bin")),
            _pairs(meta.get("optionalDependencies")),
        )
    return out


def _bins(package: str, value: object) -> tuple[tuple[str, str], ...]:
    if isinstance(value, str):  # "bin": "cli.js" names the command after the package
        return ((package.rsplit("/", 1)[-1], value),)
    if isinstance(value, dict):
        return tuple(sorted((str(k), str(v)) for k, v in value.items()))
    return ()


def _pairs(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        return ()
    return tuple(sorted((str(k), str(v)) for k, v in value.items()))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "packument" in data else None


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
