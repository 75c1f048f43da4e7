"""Every registered runtime has every member of the Runtime protocol, with the protocol's
signature (parameter names and kinds, sync or async, the same parameter annotations, a return
annotation that is the protocol's or a subclass of it), not just the name."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import pytest

from fusion_oci import resolve
from fusion_oci.models import BACKEND_IDS
from fusion_oci.oci import model
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes import plans, protocol, registry
from fusion_oci.runtimes.protocol import Runtime, RuntimeDefaults
from fusion_oci.runtimes.skeleton import UnavailableRuntime
from tests import plugin_runtime

METHODS = sorted(
    n for n, v in vars(Runtime).items() if inspect.isfunction(v) and not n.startswith("_")
)
DATA = sorted(n for n in Runtime.__annotations__)
FLAGS = ("isolates", "streams_stdin", "egress_via_tcp", "runs_services")


def _classes() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for backend in BACKEND_IDS:
        cls = registry.runtime_class(backend, SandboxSettings.model_validate({"backend": backend}))
        out[backend] = cls if not isinstance(cls, UnavailableRuntime) else UnavailableRuntime
    out["plugin"] = registry.with_defaults(plugin_runtime.HostPluginRuntime)
    return out


CLASSES = _classes()


def test_the_protocol_declares_the_optional_members() -> None:
    assert {"enforces_for", "image_digest", "close", "check", "adopt", "plan", "execute"} <= set(
        METHODS
    )
    assert {"isolates", "streams_stdin", "egress_via_tcp", "audit", "ask", "id"} <= set(DATA)
    assert all(not name.startswith("_") and hasattr(RuntimeDefaults, name) for name in FLAGS)


def _resolve(annotation: Any, func: Any) -> Any:
    """A string annotation as the object it names, when the function's module has it."""
    if not isinstance(annotation, str):
        return annotation
    module = sys.modules[func.__module__]
    try:
        names = dict(vars(model)) | vars(resolve) | vars(plans) | vars(protocol)
        return eval(annotation, names | vars(module))
    except NameError:
        return annotation


@pytest.mark.parametrize("name", sorted(CLASSES))
@pytest.mark.parametrize("member", METHODS)
def test_every_runtime_method_has_the_protocol_signature(name: str, member: str) -> None:
    cls = CLASSES[name]
    want_fn, got_fn = getattr(Runtime, member), getattr(cls, member)
    assert inspect.iscoroutinefunction(got_fn) == inspect.iscoroutinefunction(want_fn), (
        f"{name}.{member}: async differs from the protocol"
    )
    want, got = inspect.signature(want_fn), inspect.signature(got_fn)
    assert [(p.name, p.kind) for p in got.parameters.values()] == [
        (p.name, p.kind) for p in want.parameters.values()
    ], f"{name}.{member}{got}"
    for wp, gp in zip(want.parameters.values(), got.parameters.values(), strict=True):
        if wp.name != "self":
            assert gp.annotation == wp.annotation, f"{name}.{member}({gp.name})"
    wr, gr = _resolve(want.return_annotation, want_fn), _resolve(got.return_annotation, got_fn)
    assert gr == wr or (isinstance(gr, type) and isinstance(wr, type) and issubclass(gr, wr)), (
        f"{name}.{member} returns {got.return_annotation}, not {want.return_annotation}"
    )


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_runtime_has_the_protocol_data_members(name: str) -> None:
    cls = CLASSES[name]
    for flag in FLAGS:
        assert isinstance(getattr(cls, flag), bool), f"{name}.{flag}"
    assert issubclass(cls, RuntimeDefaults)
    settings = SandboxSettings.model_validate({"backend": "native"})
    runtime = (
        cls(name, "why") if cls is UnavailableRuntime else cls(settings, {"PATH": "/usr/bin:/bin"})
    )
    for member in DATA:
        assert hasattr(runtime, member), f"{name}.{member}"
    assert isinstance(runtime, Runtime)
    runtime.close()


def test_only_native_does_not_isolate() -> None:
    assert sorted(n for n, c in CLASSES.items() if not c.isolates) == ["native"]


def test_a_plugin_s_own_members_win_over_the_defaults() -> None:
    class Plugin:
        streams_stdin = True

        def close(self) -> None:
            raise RuntimeError("mine")

    made = registry.with_defaults(Plugin)
    assert made.streams_stdin and not made.egress_via_tcp
    assert made.__qualname__ == Plugin.__qualname__ and made.__module__ == __name__
    with pytest.raises(RuntimeError, match="mine"):
        made().close()
    assert registry.with_defaults(made) is made


def test_not_isolating_is_never_inherited() -> None:
    """Fail closed: a runtime built on native's code is refused what it does not enforce."""
    from fusion_oci.runtimes.native import NativeRuntime

    class OnNative(NativeRuntime):
        id = "on-native"

    class StatusQuo:
        isolates = False

    assert not NativeRuntime.isolates and OnNative.isolates
    assert not registry.with_defaults(StatusQuo).isolates
