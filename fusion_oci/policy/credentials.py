"""``sandbox.credentials``: secrets by reference (issue #24).

Settings name a credential, the hosts it is for and where the host reads it; never its
value. At prepare the host reads the value (:mod:`fusion_oci.egress.credentials`), the sandbox
gets a random sentinel in the variable instead, and the task's egress proxy swaps the sentinel
for the value in the ``Authorization`` header of requests to those hosts only.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from fusion_oci.models import Model

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HOST = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
_METHOD = re.compile(r"^(\*|[A-Z]+)$")

Scope = Literal["git", "npm", "any"]
"""What a credential is for. ``git``: git's smart-HTTP endpoints (``GET .../info/refs?service=
git-upload-pack|git-receive-pack``, ``POST .../git-upload-pack|git-receive-pack``, git LFS's
``.../info/lfs/objects/batch`` and ``locks``). ``npm``: a registry's package paths (``GET``/
``HEAD`` of ``/<name>``, ``/@scope/<name>`` and their ``/-/*.tgz`` tarballs; ``POST
/-/npm/v1/security/*``, the audit npm runs at install). ``any``: every request to its hosts."""
DEFAULT_SCOPE: list[Scope] = ["git", "npm"]


class CredentialSource(Model):
    """Where the host reads the value: exactly one of ``env``, ``file``, ``command``."""

    env: str | None = None
    """A variable of the caller's environment (the host's, not the sandbox's)."""
    file: str | None = None
    """An absolute path of a file on the host; its content, without the final newline."""
    command: list[str] | None = None
    """An argv run on the host at prepare (``[gh, auth, token]``), with a timeout; its
    stdout, stripped."""

    @model_validator(mode="after")
    def _exactly_one(self) -> CredentialSource:
        given = [k for k in ("env", "file", "command") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"write exactly one of env, file or command (got {', '.join(given) or 'none'})"
            )
        if self.file is not None and not self.file.startswith("/"):
            raise ValueError(f"file '{self.file}' is not an absolute path")
        if self.command is not None and (not self.command or not self.command[0]):
            raise ValueError("command is an empty argv: write it as a list, e.g. [gh, auth, token]")
        return self

    def describe(self) -> str:
        """Where the value comes from, for messages (never the value)."""
        if self.env is not None:
            return f"env {self.env}"
        if self.file is not None:
            return f"file {self.file}"
        return "command " + " ".join(self.command or [])


class CredentialSpec(Model):
    """One brokered credential: its variable, the hosts it may be sent to, its source."""

    name: str
    """The variable the sandbox sees (holding a sentinel, never the value)."""
    hosts: list[str]
    """Hosts (exact names, lower case, no port) whose ``Authorization`` header may carry
    it; the proxy intercepts TLS to these hosts only."""
    source: CredentialSource = Field(alias="from")
    """Where the host reads the value."""
    username: str = "x-access-token"
    """The user name git sends with it (basic auth over https); GitHub's convention."""
    allowed_refs: list[str] | None = None
    """Refs a ``git push`` through this credential may update (globs: ``refs/heads/fusion/*``).
    None: any ref; empty: no push at all."""
    allowed_repos: list[str] | None = None
    """Repositories a ``git push`` through this credential may update: globs over the URL's
    path without ``.git`` (``acme/*``, ``acme/widget``). None: any repository of its hosts."""
    scope: list[Scope] = Field(default_factory=lambda: list(DEFAULT_SCOPE))
    """The requests the value is swapped into (presets, :data:`Scope`; a single name is
    read as a list of one). Default: git's and npm's (either's requests). Empty: only
    ``allowedRequests``. A request outside the scope that carries the sentinel is refused
    (403) and audited; it never reaches the host."""
    allowed_requests: list[str] = Field(default_factory=list)
    """More requests the value may go into, beyond the scope: ``METHOD /path-glob``
    (``PUT /my-pkg``, ``GET /api/v4/projects/*``; ``*`` for any method; ``*`` in the path
    crosses ``/``; the query is not matched)."""
    ca_file: str | None = None
    """A PEM bundle that verifies the real hosts (a private registry's own CA). None: the
    machine's trust store."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _ENV_NAME.match(value):
            raise ValueError(f"'{value}' is not an environment variable name")
        return value

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one host the credential is for")
        out = []
        for host in value:
            norm = host.strip().lower().rstrip(".")
            if not _HOST.match(norm):
                raise ValueError(
                    f"'{host}' is not a host name: write the name only "
                    "(github.com), without a scheme, port, path or wildcard"
                )
            out.append(norm)
        return out

    @field_validator("scope", mode="before")
    @classmethod
    def _scope(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("allowed_requests")
    @classmethod
    def _requests(cls, value: list[str]) -> list[str]:
        out = []
        for entry in value:
            method, _, path = entry.strip().partition(" ")
            path = path.strip()
            if not _METHOD.match(method) or not path.startswith("/") or " " in path:
                raise ValueError(
                    f"allowedRequests entry '{entry}' is not 'METHOD /path': write the method "
                    "in capitals (or *) and a path glob from its first /, e.g. 'PUT /my-pkg' "
                    "or 'GET /api/v4/projects/*'"
                )
            out.append(f"{method} {path}")
        return out

    @model_validator(mode="after")
    def _some_request(self) -> CredentialSpec:
        if not self.scope and not self.allowed_requests:
            raise ValueError(
                f"credential {self.name}: scope is empty and allowedRequests is not set, so "
                "the value would never be sent; write scope: [git], [npm] or [any], or list "
                "allowedRequests"
            )
        return self

    @field_validator("allowed_refs")
    @classmethod
    def _refs(cls, value: list[str] | None) -> list[str] | None:
        for ref in value or []:
            if not ref.startswith("refs/"):
                raise ValueError(
                    f"allowedRefs entry '{ref}' is not a full ref: write "
                    "refs/heads/NAME (globs allowed: refs/heads/fusion/*)"
                )
        return value


def check_unique(credentials: list[CredentialSpec]) -> list[CredentialSpec]:
    """Each variable and each host belongs to one credential (a host's header gets one
    value)."""
    names: set[str] = set()
    hosts: dict[str, str] = {}
    for cred in credentials:
        if cred.name in names:
            raise ValueError(f"credential {cred.name} is listed twice")
        names.add(cred.name)
        for host in cred.hosts:
            if host in hosts:
                raise ValueError(f"host {host} is named by both {hosts[host]} and {cred.name}")
            hosts[host] = cred.name
    return credentials
