"""Brokered credentials of one task (issue #24): the values read on the host, the sentinels
the sandbox sees instead, the per-task CA the proxy intercepts with, and the checks on a
request (where a sentinel may go, which refs a push may update).

Nothing here writes a key to disk: the CA's and the leaf certificates' private keys live in
this process only (a leaf is loaded into its ``ssl.SSLContext`` through a memfd, which no other
process can open). The one file made is the per-task CA *bundle* (certificates only), which
the sandbox trusts.
"""

from __future__ import annotations

import base64
import datetime
import fnmatch
import os
import re
import secrets
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_oci.errors import SandboxSetupError, SettingsError
from fusion_oci.policy.credentials import CredentialSpec

if TYPE_CHECKING:
    from fusion_oci.policy.layout import TaskLayout

SYSTEM_TRUST = "/etc/ssl/certs/ca-certificates.crt"
"""What verifies the real hosts unless a credential names its own ``caFile``."""
BUNDLE_NAME = "ca-bundle.pem"
COMMAND_TIMEOUT_S = 20.0
SENTINEL_PREFIX = "fusion-sentinel-"


@dataclass(frozen=True)
class Brokered:
    """One credential of a running task: the value (host only) and its sentinel."""

    spec: CredentialSpec
    value: str
    sentinel: str

    def __repr__(self) -> str:  # a value never reaches a log through repr()
        return f"Brokered(name={self.spec.name!r}, hosts={self.spec.hosts!r})"


@dataclass
class Broker:
    """The task's credentials and its CA: what the proxy needs to intercept and swap."""

    credentials: tuple[Brokered, ...]
    ca_cert_pem: bytes
    _ca_key: object = field(repr=False)
    _ca_cert: object = field(repr=False)
    _server_contexts: dict[str, ssl.SSLContext] = field(default_factory=dict, repr=False)
    echo_forms: set[bytes] = field(default_factory=set, repr=False)
    """Each value as swapped into a header (``Basic <base64>`` too): a response holding
    one of these, or the value, is cut (a host that echoes or stores request headers)."""
    _client_contexts: dict[str, ssl.SSLContext] = field(default_factory=dict, repr=False)
    _needles: list[bytes] = field(default_factory=list, repr=False)

    def echo_needles(self) -> list[bytes]:
        """What a response must not hold: every value's :func:`echo_needles` (a host could
        echo a value a request of another connection carried)."""
        if not self._needles:
            self._needles = [n for c in self.credentials for n in echo_needles(c.value)]
        return self._needles

    def for_host(self, host: str) -> Brokered | None:
        """The credential a host's requests may carry, or None (the host is not intercepted)."""
        for cred in self.credentials:
            if host in cred.spec.hosts:
                return cred
        return None

    @property
    def sentinels(self) -> dict[str, str]:
        """Variable -> sentinel: the sandbox's environment."""
        return {c.spec.name: c.sentinel for c in self.credentials}

    def sentinel_bytes(self) -> list[tuple[bytes, Brokered]]:
        """Every form a sentinel may be sent in, as bytes (plain and base64 of ``user:s``)."""
        return [(c.sentinel.encode(), c) for c in self.credentials]

    def find_sentinel(self, data: bytes) -> Brokered | None:
        """The credential whose sentinel appears in ``data`` (plain), or None."""
        for needle, cred in self.sentinel_bytes():
            if needle in data:
                return cred
        return None

    def server_context(self, host: str) -> ssl.SSLContext:
        """The TLS server side the sandbox talks to: a leaf for ``host`` signed by the CA."""
        ctx = self._server_contexts.get(host)
        if ctx is None:
            ctx = _leaf_context(host, self._ca_key, self._ca_cert)
            self._server_contexts[host] = ctx
        return ctx

    def client_context(self, cred: Brokered) -> ssl.SSLContext:
        """The TLS client side to the real host: normal certificate and name checks."""
        cafile = cred.spec.ca_file or SYSTEM_TRUST
        ctx = self._client_contexts.get(cafile)
        if ctx is None:
            ctx = ssl.create_default_context(cafile=cafile)
            ctx.set_alpn_protocols(["http/1.1"])
            self._client_contexts[cafile] = ctx
        return ctx


# -- reading the values ------------------------------------------------------------------------


async def read_value(spec: CredentialSpec, env: Mapping[str, str]) -> str:
    """The credential's value, read on the host; a SettingsError saying which source failed."""
    src = spec.source
    where = f"sandbox.credentials {spec.name} (from {src.describe()})"
    if src.env is not None:
        value = env.get(src.env, "")
        if not value:
            raise SettingsError(
                f"settings error at {where}",
                f"the variable {src.env} is not set or empty",
                f"export {src.env} before starting fusion-oci",
            )
        return value
    if src.file is not None:
        try:
            value = _read_text(Path(src.file)).rstrip("\r\n")
        except OSError as exc:
            raise SettingsError(
                f"settings error at {where}",
                str(exc),
                "point the credential's file at a readable file",
            ) from exc
        if not value:
            raise SettingsError(
                f"settings error at {where}", "the file is empty", "write the token into it"
            )
        return value
    from fusion_oci.host.process import run_process

    assert src.command is not None
    try:
        done = await run_process(src.command, env=dict(env), timeout_s=COMMAND_TIMEOUT_S)
    except OSError as exc:
        raise SettingsError(
            f"settings error at {where}",
            f"cannot run it: {exc}",
            "install the program or fix the argv",
        ) from exc
    if done.timed_out or done.returncode != 0:
        # stderr may say why; stdout may hold a partial secret: never shown
        why = (
            f"it did not finish in {COMMAND_TIMEOUT_S:.0f} s"
            if done.timed_out
            else f"exit status {done.returncode}: "
            f"{done.stderr.decode(errors='replace').strip()[-300:]}"
        )
        raise SettingsError(
            f"settings error at {where}", why, "run the command yourself and fix what it says"
        )
    value = done.stdout.decode(errors="replace").strip()
    if not value or "\n" in value:
        raise SettingsError(
            f"settings error at {where}",
            "its output is empty" if not value else "its output has several lines",
            "the command must print the token alone",
        )
    return value


def _read_text(path: Path) -> str:
    # A small local file, read once at prepare.
    return path.read_text(encoding="utf-8")


def new_sentinel(name: str) -> str:
    """A random value, unique to the task, that is worth nothing anywhere else."""
    return f"{SENTINEL_PREFIX}{name.lower()}-{secrets.token_hex(20)}"


async def make_broker(specs: Sequence[CredentialSpec], env: Mapping[str, str]) -> Broker:
    """Read every value, draw the sentinels, generate the task's CA."""
    creds = []
    for spec in specs:
        value = await read_value(spec, env)
        if any(ord(c) < 0x20 or c == "\x7f" for c in value):
            # It goes into a header: a line break there would be a header of its own.
            raise SettingsError(
                f"settings error at sandbox.credentials {spec.name} "
                f"(from {spec.source.describe()})",
                "the value has a control character (a line break?)",
                "store the token alone, on one line",
            )
        creds.append(Brokered(spec, value, new_sentinel(spec.name)))
    key, cert, pem = _new_ca()
    return Broker(tuple(creds), pem, key, cert)


def write_bundle(broker: Broker, base_bundle: str | None, folder: Path) -> Path:
    """The per-task CA bundle: the host's bundle (what the sandbox trusted so far) and the
    task's CA. Certificates only; the folder is the host's."""
    parts: list[bytes] = []
    if base_bundle:
        try:
            parts.append(Path(base_bundle).read_bytes().rstrip(b"\n") + b"\n")
        except OSError as exc:
            raise SandboxSetupError(
                "the per-task CA bundle could not be made",
                f"{base_bundle}: {exc}",
                "check sandbox.hostCa",
            ) from exc
    parts.append(broker.ca_cert_pem)
    path = folder / BUNDLE_NAME
    path.write_bytes(b"".join(parts))
    path.chmod(0o644)
    return path


# -- the checks on a request ---------------------------------------------------------------------


def swap_authorization(value: str, cred: Brokered) -> str | None:
    """The header value with the sentinel replaced by the real value, or None when the
    sentinel is not in it (in any of the forms handled: ``Bearer S``, ``token S``, basic
    ``user:S`` or ``S:x`` base64-encoded)."""
    scheme, _, rest = value.strip().partition(" ")
    rest = rest.strip()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(rest, validate=True).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return None
        user, sep, password = decoded.partition(":")
        if cred.sentinel not in decoded:
            return None
        user = user.replace(cred.sentinel, cred.value)
        password = password.replace(cred.sentinel, cred.value)
        return "Basic " + base64.b64encode(f"{user}{sep}{password}".encode()).decode()
    if cred.sentinel in rest:
        return f"{scheme} {rest.replace(cred.sentinel, cred.value)}"
    return None


def basic_sentinel(value: str, broker: Broker) -> Brokered | None:
    """A sentinel hidden in a basic-auth header (base64), for the leak check."""
    scheme, _, rest = value.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(rest.strip(), validate=True)
    except ValueError:
        return None
    return broker.find_sentinel(decoded)


def request_origin(
    target: str, hosts: Sequence[str], host: str, port: int
) -> tuple[str, str | None]:
    """(the request's origin-form target, None) when a request is for ``host:port``, the
    CONNECTed origin; ("", why not) otherwise. A shared front end (a CDN, a multi-tenant load
    balancer) routes by the Host header or an absolute-form target's authority, so both must
    name the credential's host: exactly one ``Host``, equal to ``host`` (``:port`` optional
    when the CONNECTed port is 443), and an absolute-form target only ``https://`` with that
    same authority and no user part."""
    if len(hosts) != 1:
        return "", "no Host header" if not hosts else f"{len(hosts)} Host headers"
    if _authority(hosts[0], 443) != (host, port):
        return "", f"Host: {hosts[0]} is not {host}:{port}"
    if target.startswith("/"):
        return target, None
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() != "https":
        return "", f"the target '{target[:80]}' is neither a path nor an https:// URL"
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, path = rest[:end], rest[end:]
    if "@" in authority or _authority(authority, 443) != (host, port):
        return "", f"the target's authority {authority[:80]} is not {host}:{port}"
    if not path.startswith("/"):
        path = "/" + path
    return path, None


def _authority(text: str, default_port: int) -> tuple[str, int] | None:
    """``name`` / ``name:port`` (lower-cased; no trailing dot, brackets or user part)."""
    name, sep, port_text = text.strip().lower().rpartition(":")
    if not sep:
        name, port_text = text.strip().lower(), str(default_port)
    if not port_text.isdigit() or not name or not _NAME.match(name):
        return None
    return name, int(port_text)


_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
_SEGMENT = r"[A-Za-z0-9_.~][A-Za-z0-9._~-]*"
_PACKAGE = rf"(?:@{_SEGMENT}/)?{_SEGMENT}"
_PRESETS: dict[str, tuple[tuple[frozenset[str], re.Pattern[str]], ...]] = {
    "git": (
        (frozenset({"GET"}), re.compile(r"^/.+/info/refs$")),  # and a service query: below
        (frozenset({"POST"}), re.compile(r"^/.+/git-(upload|receive)-pack$")),
        (frozenset({"POST"}), re.compile(r"^/.+/info/lfs/objects/batch$")),
        (
            frozenset({"GET", "POST"}),
            re.compile(r"^/.+/info/lfs/locks(/verify|/[A-Za-z0-9_-]+/unlock)?$"),
        ),
    ),
    "npm": (
        (frozenset({"GET", "HEAD"}), re.compile(rf"^/{_PACKAGE}$")),
        (frozenset({"GET", "HEAD"}), re.compile(rf"^/{_PACKAGE}/-/[A-Za-z0-9._~@-]+\.tgz$")),
        (
            frozenset({"POST"}),
            re.compile(r"^/-/npm/v1/security/(advisories/bulk|audits(/quick)?)$"),
        ),
    ),
}
_GIT_SERVICES = frozenset({"service=git-upload-pack", "service=git-receive-pack"})


def clean_path(target: str) -> tuple[str, str] | None:
    """(path, query) of an origin-form target, or None when the path could mean another one
    to the host than it reads here: dot segments, ``//``, a backslash, percent-encoded dots,
    slashes, backslashes or NULs (npm's ``/@scope%2fname`` is read as ``/@scope/name``)."""
    path, _, query = target.partition("?")
    path = re.sub(r"(/@[A-Za-z0-9_.~-]+)%2[fF]", r"\1/", path)
    if not path.startswith("/") or "//" in path or "\\" in path:
        return None
    if re.search(r"%(2[eEfF]|5[cC]|00)", path) or "#" in path:
        return None
    if any(seg in (".", "..") for seg in path.split("/")):
        return None
    return path, query


def in_scope(spec: CredentialSpec, method: str, target: str) -> bool:
    """Whether a request (method, origin-form target) is one the credential is for: its
    ``scope`` presets or an ``allowedRequests`` entry."""
    if "any" in spec.scope:
        return True
    clean = clean_path(target)
    if clean is None:
        return False
    path, query = clean
    for preset in spec.scope:
        for methods, pattern in _PRESETS.get(preset, ()):
            if method in methods and pattern.match(path):
                if path.endswith("/info/refs") and query not in _GIT_SERVICES:
                    continue
                return True
    for entry in spec.allowed_requests:
        want, _, glob = entry.partition(" ")
        if want in ("*", method) and fnmatch.fnmatchcase(path, glob):
            return True
    return False


ECHO_WINDOWS = 16
"""How many pieces of the value the response scan looks for (besides the whole value): each
is one more search over every response byte (a 40-character token: 21 needles, ~250 MiB/s
on one core, measured, against ~4.6 GiB/s for the value alone)."""


def echo_needles(value: str) -> list[bytes]:
    """What the response scan looks for besides the swapped header forms: the value, reversed,
    hex, base64 (standard and URL-safe, at each of the three byte alignments, so also inside a
    longer base64 text), and its pieces of a third of its length (12 bytes at least) at a
    stride, so that any piece of it a little longer than a third holds one (a value echoed in
    halves over two responses). A value sent otherwise
    (compressed by the host itself in a format not read here, encrypted, in smaller pieces)
    is not found: the credential's scope is what keeps it from endpoints that echo."""
    raw = value.encode()
    out = {raw, raw[::-1], raw.hex().encode(), raw.hex().upper().encode()}
    for pad in range(3):
        enc = base64.b64encode(b"\0" * pad + raw)
        first = -(-8 * pad // 6)
        last = (8 * (pad + len(raw))) // 6
        core = enc[first:last]
        if len(core) >= 8:
            out.add(core)
            out.add(core.translate(bytes.maketrans(b"+/", b"-_")))
    size = min(len(raw), max(12, -(-len(raw) // 3)))
    if size < len(raw):
        step = max(1, -(-(len(raw) - size + 1) // ECHO_WINDOWS))
        # A piece of at least size + step - 1 bytes holds one of these windows.
        out.update(raw[start : start + size] for start in range(0, len(raw) - size + 1, step))
    return sorted(out, key=len, reverse=True)


def push_repo(path: str) -> str:
    """The repository of a receive-pack URL path: ``/acme/widget.git/git-receive-pack`` ->
    ``acme/widget``."""
    repo = path.removesuffix("/git-receive-pack").strip("/")
    return repo.removesuffix(".git")


def repo_allowed(repo: str, allowed: Sequence[str] | None) -> bool:
    """Whether a push may go to ``repo`` (None: any)."""
    if allowed is None:
        return True
    return any(
        fnmatch.fnmatchcase(repo, pattern.strip("/").removesuffix(".git")) for pattern in allowed
    )


def ref_allowed(ref: str, allowed: Sequence[str] | None) -> bool:
    """Whether a push may update ``ref`` (None: any ref)."""
    if allowed is None:
        return True
    return any(fnmatch.fnmatchcase(ref, pattern) for pattern in allowed)


# -- the CA ---------------------------------------------------------------------------------------


def _new_ca() -> tuple[object, object, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, f"fusion-oci task CA {secrets.token_hex(4)}")]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert, cert.public_bytes(serialization.Encoding.PEM)


def _leaf_context(host: str, ca_key: object, ca_cert: object) -> ssl.SSLContext:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    assert isinstance(ca_cert, x509.Certificate) and isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.set_alpn_protocols(["http/1.1"])  # the swap speaks HTTP/1.1 only
    # The leaf key goes to OpenSSL through an anonymous memory file: never onto a disk, and
    # no other process can open it (the fd is this process's, closed right after).
    fd = os.memfd_create("fusion-oci-leaf", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    return ctx


def credential_layout(
    layout: TaskLayout, host_ca: str | None, broker: Broker, folder: Path
) -> TaskLayout:
    """A task's layout as its sandbox sees the credentials: the per-task CA bundle in place of
    the host's (``host_ca`` when the layout shares none; written to ``folder``, the host's), the
    sentinels and git's helper in the env."""
    import dataclasses

    bundle = write_bundle(broker, layout.ca_bundle or host_ca, folder)
    git = tuple(
        (host, c.spec.username, c.spec.name) for c in broker.credentials for host in c.spec.hosts
    )
    return dataclasses.replace(
        layout,
        ca_bundle=str(bundle),
        # The broker's CA added to what the task trusted: as whole a store as that was.
        ca_complete=layout.ca_complete if layout.ca_bundle else host_ca is not None,
        sentinels=tuple(broker.sentinels.items()),
        git_credentials=git,
    )
