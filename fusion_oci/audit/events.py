"""The audit events: one model per ``type``, and :data:`AuditEvent`, their union.

A consumer matches on the classes and ends with ``typing.assert_never``, so ``mypy --strict``
names every consumer that misses a type when one is added here.

The wire form is fixed: the chain (:mod:`fusion_oci.audit.chain`) hashes each line, so old
logs must re-serialise byte for byte. Each model therefore declares its fields in the order the
single flat model of before declared them (``type``, ``ts``, ``taskId``, ``runId``,
``backend``, ``policyHash``, ``policySummary``, ``reason``, ``durationMs``, ``exitCode``,
``signal``, ``timedOut``, ``endReason``, ``fellBack``, ``unenforced``, ``envNames``,
``command``, ``details``, the run's replay fields, ``host``, ``port``, ``address``,
``allowed``, ``rule``, ``bytesUp``, ``bytesDown``), and ends with the chain's two fields:
``prev``, the SHA-256 of the line before (set when written), and ``mac``, the line's
HMAC-SHA256 under the host's audit key (set when written; the writer splices it in as the
line's last key). Pydantic puts inherited fields first, so each model declares those two
itself rather than inheriting them. None is never written.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from fusion_oci.models import Model

EventType = Literal[
    "sandbox:prepare",
    "sandbox:run",
    "sandbox:failure",
    "sandbox:fallback",
    "sandbox:dispose",
    "sandbox:provision",
    "sandbox:gate",
    "sandbox:egress",
    "sandbox:credential",
    "sandbox:inbound",
]


def event_time() -> str:
    """An event's ``ts``: now, to the millisecond, UTC."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class _Event(Model):
    """What every event carries: who it is about and when."""

    type: EventType
    ts: str = Field(default_factory=event_time)
    task_id: str
    run_id: str
    backend: str


class _SandboxEvent(_Event):
    """A step of a sandbox's lifecycle (:class:`fusion_oci.sandbox.Sandbox`)."""

    policy_hash: str | None = None
    policy_summary: str | None = None


class PrepareEvent(_SandboxEvent):
    """``sandbox:prepare``: the sandbox is ready."""

    type: Literal["sandbox:prepare"] = "sandbox:prepare"
    duration_ms: int | None = None
    fell_back: bool | None = None
    unenforced: list[str] | None = None
    env_names: list[str] | None = None
    details: dict[str, Any] | None = None
    """Store links, egress profile, service containers, published ports, store tree."""
    prev: str | None = None
    mac: str | None = None


class RunEvent(_SandboxEvent):
    """``sandbox:run``: one command ended (or was aborted)."""

    type: Literal["sandbox:run"] = "sandbox:run"
    duration_ms: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    timed_out: bool | None = None
    end_reason: str | None = None
    fell_back: bool | None = None
    unenforced: list[str] | None = None
    env_names: list[str] | None = None
    command: str | None = None
    details: dict[str, Any] | None = None
    replay: str | None = None
    """Id of the stored :class:`fusion_oci.replay.ReplayRecord`."""
    image_digest: str | None = None
    """Id of the image the command ran in (container runtimes)."""
    cwd: str | None = None
    version: str | None = None
    """fusion-oci version that wrote the event."""
    worktree_head: str | None = None
    """Commit checked out in the worktree before the command."""
    worktree_status: str | None = None
    """Digest of the worktree's uncommitted state before the command."""
    stdout_digest: str | None = None
    stderr_digest: str | None = None
    prev: str | None = None
    mac: str | None = None


class FailureEvent(_SandboxEvent):
    """``sandbox:failure``: preparing the sandbox, or setting up a command, failed."""

    type: Literal["sandbox:failure"] = "sandbox:failure"
    reason: str | None = None
    unenforced: list[str] | None = None
    command: str | None = None
    details: dict[str, Any] | None = None
    prev: str | None = None
    mac: str | None = None


class FallbackEvent(_SandboxEvent):
    """``sandbox:fallback``: the backend could not start; the task runs natively."""

    type: Literal["sandbox:fallback"] = "sandbox:fallback"
    reason: str | None = None
    fell_back: bool | None = None
    unenforced: list[str] | None = None
    details: dict[str, Any] | None = None
    prev: str | None = None
    mac: str | None = None


class DisposeEvent(_SandboxEvent):
    """``sandbox:dispose``: the sandbox is gone."""

    type: Literal["sandbox:dispose"] = "sandbox:dispose"
    duration_ms: int | None = None
    prev: str | None = None
    mac: str | None = None


class _ImageEvent(_Event):
    """A step of getting an image (:class:`fusion_oci.images.gates.AuditContext`)."""

    reason: str | None = None
    duration_ms: int | None = None
    details: dict[str, Any] | None = None


class ProvisionEvent(_ImageEvent):
    """``sandbox:provision``: an image was pulled, built, loaded, imported or pruned (or an
    attempt failed); ``details`` says which."""

    type: Literal["sandbox:provision"] = "sandbox:provision"
    prev: str | None = None
    mac: str | None = None


class GateEvent(_ImageEvent):
    """``sandbox:gate``: a gated action was allowed or denied; ``details`` says by whom."""

    type: Literal["sandbox:gate"] = "sandbox:gate"
    prev: str | None = None
    mac: str | None = None


class _ConnectionEvent(_Event):
    """One connection of a task's egress proxy, service relays or published ports
    (:class:`fusion_oci.egress.budget.BudgetedEvents`)."""

    policy_hash: str | None = None
    reason: str | None = None
    duration_ms: int | None = None
    details: dict[str, Any] | None = None
    host: str | None = None
    """The name (or address literal) the sandbox asked for; a published port: its loopback."""
    port: int | None = None
    """The destination port (None: a unix socket)."""
    address: str | None = None
    """The address the proxy connected to (None: it connected nowhere)."""
    allowed: bool | None = None
    """Whether the connection was let through."""
    rule: str | None = None
    """The rule that decided (``allowedDomains entry '*.npmjs.org'``)."""
    bytes_up: int | None = None
    """Bytes from the sandbox to the destination (a published port: towards the sandbox)."""
    bytes_down: int | None = None
    """Bytes from the destination to the sandbox."""


class EgressEvent(_ConnectionEvent):
    """``sandbox:egress``: an outbound connection, or the count the audit budget held back
    (``details.suppressed``)."""

    type: Literal["sandbox:egress"] = "sandbox:egress"
    prev: str | None = None
    mac: str | None = None


class CredentialEvent(_ConnectionEvent):
    """``sandbox:credential``: a brokered credential was swapped in, or a leak refused."""

    type: Literal["sandbox:credential"] = "sandbox:credential"
    prev: str | None = None
    mac: str | None = None


class InboundEvent(_ConnectionEvent):
    """``sandbox:inbound``: a connection from the host to a published port."""

    type: Literal["sandbox:inbound"] = "sandbox:inbound"
    prev: str | None = None
    mac: str | None = None


AuditEvent = Annotated[
    PrepareEvent
    | RunEvent
    | FailureEvent
    | FallbackEvent
    | DisposeEvent
    | ProvisionEvent
    | GateEvent
    | EgressEvent
    | CredentialEvent
    | InboundEvent,
    Field(discriminator="type"),
]
"""One audit event; ``type`` picks the model."""

SandboxEvent = PrepareEvent | RunEvent | FailureEvent | FallbackEvent | DisposeEvent
ConnectionEvent = EgressEvent | CredentialEvent | InboundEvent
CONNECTION_EVENTS: dict[str, type[ConnectionEvent]] = {
    "sandbox:egress": EgressEvent,
    "sandbox:credential": CredentialEvent,
    "sandbox:inbound": InboundEvent,
}
"""The model of each connection event's type (:class:`~fusion_oci.egress.budget.BudgetedEvents`
is handed the type by name)."""

_EVENTS: TypeAdapter[AuditEvent] = TypeAdapter(AuditEvent)


def parse_event(data: dict[str, Any] | str | bytes) -> AuditEvent:
    """The event of one decoded line (a dict) or one raw line; :class:`ValueError`
    (pydantic's ``ValidationError``) when it is none."""
    if isinstance(data, dict):
        return _EVENTS.validate_python(data)
    return _EVENTS.validate_json(data)
