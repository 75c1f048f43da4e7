"""Action gates (brief 4.3): allow, deny, or ask through the executor's callback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GateName = Literal["sandbox_provision", "network_api"]


@dataclass(frozen=True)
class GateRequest:
    """What a gate is asked about: the gate, the action ("build", "pull"), and its target."""

    gate: GateName
    action: str
    target: str
    backend: str
