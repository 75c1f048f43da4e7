"""Gates: allow, deny and ask (sync and async callbacks, none at all), each decision audited."""

from __future__ import annotations

import io

import pytest

from fusion_oci.audit import AuditEvent, AuditLog
from fusion_oci.errors import GateDeniedError, ProvisionError, SandboxSetupError
from fusion_oci.images.gates import AuditContext, GateRequest, ProvisionGate, tty_ask
from fusion_oci.policy.settings import GateSettings


def gate_for(setting: str, ask=None, allow=frozenset()):  # type: ignore[no-untyped-def]
    events: list[AuditEvent] = []
    audit = AuditLog()
    audit.subscribe(events.append)
    gate = ProvisionGate(
        GateSettings(sandbox_provision=setting, network_api=setting),
        AuditContext(audit, "t1", "r1", "podman"),
        ask,
        allow=allow,
        settings_file="/p/.fusion/settings.yaml",
    )
    return gate, events


REQ = GateRequest(
    "sandbox_provision",
    "build",
    "localhost/fusion-oci/node:abc",
    "podman",
    alternative="fusion-oci images build node --engine podman",
)


def only_gate_event(events: list[AuditEvent]) -> dict[str, object]:
    assert [e.type for e in events] == ["sandbox:gate"]
    assert events[0].task_id == "t1" and events[0].run_id == "r1"
    assert events[0].details is not None
    return events[0].details


async def test_allow_from_settings_is_audited() -> None:
    gate, events = gate_for("allow")
    await gate.check(REQ)
    d = only_gate_event(events)
    assert d["decision"] == "allow" and d["decided_by"] == "settings"
    assert d["gate"] == "sandbox_provision" and d["target"] == REQ.target


async def test_deny_from_settings_raises_with_the_setting_that_allows_it() -> None:
    gate, events = gate_for("deny", ask=lambda r: True, allow=frozenset({"sandbox_provision"}))
    with pytest.raises(GateDeniedError) as err:
        await gate.check(REQ)
    # deny in settings wins over a callback and a CLI flag
    d = only_gate_event(events)
    assert d["decision"] == "deny" and d["decided_by"] == "settings"
    exc = err.value
    assert isinstance(exc, PermissionError) and isinstance(exc, ProvisionError)
    assert isinstance(exc, SandboxSetupError) and exc.exit_code == 125
    assert "`sandbox.gates.sandboxProvision: allow` in /p/.fusion/settings.yaml" in exc.hint
    assert "fusion-oci images build node --engine podman" in exc.hint


@pytest.mark.parametrize("answer", [True, False])
async def test_ask_uses_the_sync_callback(answer: bool) -> None:
    asked: list[GateRequest] = []

    def ask(req: GateRequest) -> bool:
        asked.append(req)
        return answer

    gate, events = gate_for("ask", ask=ask)
    if answer:
        await gate.check(REQ)
    else:
        with pytest.raises(GateDeniedError, match="the answer was no"):
            await gate.check(REQ)
    assert asked == [REQ]
    d = only_gate_event(events)
    assert d["decided_by"] == "callback" and d["decision"] == ("allow" if answer else "deny")


async def test_ask_awaits_an_async_callback() -> None:
    async def ask(req: GateRequest) -> bool:
        return req.gate == "sandbox_provision"

    gate, events = gate_for("ask", ask=ask)
    await gate.check(REQ)
    with pytest.raises(GateDeniedError):
        await gate.check(GateRequest("network_api", "pull", "docker.io/x:1", "docker"))
    assert [e.details["decision"] for e in events if e.details] == ["allow", "deny"]


async def test_ask_without_anyone_to_ask_denies_and_says_how_to_allow() -> None:
    gate, events = gate_for("ask")
    with pytest.raises(GateDeniedError) as err:
        await gate.check(REQ)
    assert "not interactive" in err.value.why
    assert "--allow-provision" in err.value.hint
    assert "sandbox.gates.sandboxProvision: allow" in err.value.hint
    assert only_gate_event(events)["decided_by"] == "no-callback"


async def test_flag_clears_an_ask_gate() -> None:
    gate, events = gate_for("ask", allow=frozenset({"sandbox_provision"}))
    await gate.check(REQ)
    assert only_gate_event(events)["decided_by"] == "flag"


def test_network_api_hint_names_its_own_key() -> None:
    from fusion_oci.images.gates import deny_hint

    req = GateRequest("network_api", "pull", "docker.io/x:1", "docker")
    assert deny_hint(req, "deny", "s.yaml") == "set `sandbox.gates.networkApi: allow` in s.yaml"


class FakeTty(io.StringIO):
    def __init__(self, text: str, tty: bool) -> None:
        super().__init__(text)
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_tty_ask_asks_only_on_a_terminal() -> None:
    err = io.StringIO()
    assert tty_ask(stdin=FakeTty("y\n", True), stderr=err)(REQ) is True
    assert "[sandbox_provision]" in err.getvalue() and "[y/N]" in err.getvalue()
    assert tty_ask(stdin=FakeTty("\n", True), stderr=io.StringIO())(REQ) is False
    # not a terminal: no question, no
    quiet = io.StringIO()
    assert tty_ask(stdin=FakeTty("y\n", False), stderr=quiet)(REQ) is False
    assert quiet.getvalue() == ""
    assert tty_ask(stdin=FakeTty("", False), assume_yes=True)(REQ) is True
