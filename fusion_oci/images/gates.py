"""Action gates (brief 4.3): allow, deny, or ask through the executor's callback.

``sandbox_provision`` guards the first build or pull of an image and any helper install;
``network_api`` guards provisioning that fetches from the network (a pull, a build whose steps
download packages, ``debootstrap``). Every decision is an audited ``sandbox:gate`` event; a
denial raises :class:`~fusion_oci.errors.GateDeniedError` (CLI exit 125) whose hint is the exact
setting or command that would allow it. The ``native`` backend never reaches a gate: it
provisions nothing.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO, Literal

from fusion_oci.audit import AuditLog, GateEvent, ProvisionEvent
from fusion_oci.errors import GateDeniedError
from fusion_oci.policy.settings import GateSettings

GateName = Literal["sandbox_provision", "network_api"]
SETTING_KEYS: dict[GateName, str] = {
    "sandbox_provision": "sandbox.gates.sandboxProvision",
    "network_api": "sandbox.gates.networkApi",
}


@dataclass(frozen=True)
class GateRequest:
    """What a gate is asked about: the gate, the action (build, pull, load, bootstrap), its
    target (an image reference), the backend, and a sentence for the person deciding."""

    gate: GateName
    action: str
    target: str
    backend: str
    reason: str = ""
    alternative: str = ""
    """A command that provisions ahead of time (shown in the denial hint)."""

    def question(self) -> str:
        what = {"sandbox_provision": "provision", "network_api": "fetch from the network to"}
        return (
            f"[{self.gate}] allow fusion-oci to {what[self.gate]} {self.action} "
            f"{self.target} for the {self.backend} backend?"
            + (f" ({self.reason})" if self.reason else "")
        )


AskCallback = Callable[[GateRequest], bool | Awaitable[bool]]
"""The executor's question to a person: True allows. May be sync or async."""


@dataclass
class AuditContext:
    """Where provisioning events go and whom they belong to."""

    audit: AuditLog
    task_id: str
    run_id: str
    backend: str

    def emit(
        self,
        type_: Literal["sandbox:provision", "sandbox:gate"],
        reason: str,
        duration_ms: int | None = None,
        **details: object,
    ) -> ProvisionEvent | GateEvent:
        kind = GateEvent if type_ == "sandbox:gate" else ProvisionEvent
        event = kind(
            task_id=self.task_id,
            run_id=self.run_id,
            backend=self.backend,
            reason=reason,
            duration_ms=duration_ms,
            details={k: v for k, v in details.items() if v is not None},
        )
        self.audit.emit(event)
        return event


@dataclass
class ProvisionGate:
    """Decides gated actions from settings, asking through ``ask`` when the setting is ``ask``.

    ``allow`` lists gates a caller has already cleared (e.g. the CLI's ``--allow-provision``
    flag, or an explicit ``fusion-oci images build`` which is itself the person's consent).
    Without ``ask``, an ``ask`` gate denies: nobody is there to answer.
    """

    settings: GateSettings
    ctx: AuditContext
    ask: AskCallback | None = None
    allow: frozenset[GateName] = field(default_factory=frozenset)
    settings_file: str = ".fusion/settings.yaml"

    async def check(self, request: GateRequest) -> None:
        """Return when allowed; raise :class:`GateDeniedError` when not. Always audited."""
        configured = getattr(self.settings, request.gate)
        if configured == "deny":
            allowed, by = False, "settings"
        elif configured == "allow":
            allowed, by = True, "settings"
        elif request.gate in self.allow:
            allowed, by = True, "flag"
        elif self.ask is None:
            allowed, by = False, "no-callback"
        else:
            answer = self.ask(request)
            if inspect.isawaitable(answer):
                answer = await answer
            allowed, by = bool(answer), "callback"
        decision = "allow" if allowed else "deny"
        self.ctx.emit(
            "sandbox:gate",
            f"{request.gate} {decision} ({by}): {request.action} {request.target}",
            gate=request.gate,
            action=request.action,
            target=request.target,
            decision=decision,
            decided_by=by,
            configured=configured,
        )
        if not allowed:
            raise GateDeniedError(
                f"gate {request.gate} denied: {request.action} {request.target}",
                _why(configured, by),
                deny_hint(request, configured, self.settings_file),
            )


def _why(configured: str, by: str) -> str:
    if by == "settings":
        return "the settings say deny"
    if by == "no-callback":
        return "the setting is ask and nobody can be asked (not interactive)"
    return "the answer was no"


def deny_hint(request: GateRequest, configured: str, settings_file: str) -> str:
    """The exact setting (and, when there is one, the command) that would allow the action."""
    key = SETTING_KEYS[request.gate]
    parts = [f"set `{key}: allow` in {settings_file}"]
    if configured == "ask":
        parts.append("or answer yes on a terminal, or pass `--allow-provision`")
    if request.alternative:
        parts.append(f"or provision ahead of time with `{request.alternative}`")
    return ", ".join(parts)


def tty_ask(
    *, stdin: IO[str] | None = None, stderr: IO[str] | None = None, assume_yes: bool = False
) -> AskCallback:
    """The CLI's callback: ask on a terminal, say no when stdin is not one (unless told yes)."""
    inp = stdin or sys.stdin
    out = stderr or sys.stderr

    def ask(request: GateRequest) -> bool:
        if assume_yes:
            return True
        if not inp.isatty():
            return False
        out.write(request.question() + " [y/N] ")
        out.flush()
        return inp.readline().strip().lower() in ("y", "yes")

    return ask
