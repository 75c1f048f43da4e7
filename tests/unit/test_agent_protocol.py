"""The exec agent's wire format (fusion_oci/agent/protocol.py) and the native runtime's plan:
exactly the spawn frame the agent gets."""

from __future__ import annotations

import os

import pytest

from fusion_oci.agent.protocol import (
    MAX_FRAME,
    Decoder,
    ProtocolError,
    Spawn,
    encode,
    encode_kill,
    encode_spawn,
)
from fusion_oci.models import CpuLimit, PrepareContext, SandboxPolicy
from fusion_oci.policy.layout import TaskLayout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.runtimes.native import NativeRuntime
from fusion_oci.runtimes.plans import AgentPlan, ArgvPlan, spawn_of
from tests.golden import GOLDEN_HOST, assert_golden
from tests.tasks import plan_for, resolved


def test_spawn_frame_bytes() -> None:
    frame = encode_spawn(
        Spawn(
            id="7",
            argv=["/bin/sh", "-c", "echo hi"],
            env={"A": "b=c"},
            cwd="/w",
            rlimits=[("RLIMIT_CPU", 30, -1)],
            umask=0o22,
        )
    )
    body = (
        b"S"
        b"id=7\0"
        b"cwd=/w\0"
        b"umask=22\0"
        b"rlimit=RLIMIT_CPU:30:-1\0"
        b"argv=/bin/sh\0"
        b"argv=-c\0"
        b"argv=echo hi\0"
        b"env=A=b=c\0"
    )
    assert frame == len(body).to_bytes(4, "big") + body


def test_optional_identity_fields_come_before_the_command() -> None:
    fields = Spawn(id="1", argv=["id"], env={}, uid=1000, gid=1000, groups=[]).fields()
    assert fields == [("id", "1"), ("uid", "1000"), ("gid", "1000"), ("groups", ""), ("argv", "id")]


def test_kill_frame() -> None:
    body = b"Kid=3\0signal=15\0tree=1\0grace_ms=2000\0"
    assert encode_kill("3", 15) == len(body).to_bytes(4, "big") + body
    assert encode_kill("3", 9, tree=False, grace_ms=-5).endswith(b"tree=0\0grace_ms=0\0")


@pytest.mark.parametrize(
    "bad",
    [
        Spawn(id="1", argv=["a\0b"], env={}),
        Spawn(id="1", argv=["a"], env={"K": "v\0"}),
        Spawn(id="1", argv=[], env={}),
    ],
)
def test_what_the_agent_cannot_take_is_refused_here(bad: Spawn) -> None:
    with pytest.raises(ValueError):
        encode_spawn(bad)


def test_decoder_splits_a_stream_fed_byte_by_byte() -> None:
    stream = encode(b"H", [("version", "1"), ("pid", "1")]) + encode(
        b"X", [("id", "2"), ("status", "256")]
    )
    decoder = Decoder()
    frames = [f for i in range(len(stream)) for f in decoder.feed(stream[i : i + 1])]
    assert frames == [(b"H", {"version": "1", "pid": "1"}), (b"X", {"id": "2", "status": "256"})]


def test_decoder_refuses_bad_lengths_and_fields() -> None:
    with pytest.raises(ProtocolError):
        Decoder().feed((MAX_FRAME + 1).to_bytes(4, "big"))
    with pytest.raises(ProtocolError):
        Decoder().feed((0).to_bytes(4, "big"))
    with pytest.raises(ProtocolError):
        Decoder().feed((3).to_bytes(4, "big") + b"Xab")


def test_non_utf8_survives_the_round_trip() -> None:
    raw = os.fsdecode(b"caf\xe9")
    ((_, fields),) = Decoder().feed(encode(b"F", [("what", raw)]))
    assert os.fsencode(fields["what"]) == b"caf\xe9"


# --- over a byte stream (mux.py) -----------------------------------------------------------


def test_data_frame_bytes_and_round_trip() -> None:
    from fusion_oci.agent.protocol import STDOUT, decode_data, encode_data

    frame = encode_data("12", STDOUT, b"\0\xffraw")
    body = b"D12\x001\x00\xffraw"
    assert frame == len(body).to_bytes(4, "big") + body
    assert decode_data(body[1:]) == ("12", b"1", b"\0\xffraw")
    assert decode_data(b"3\x000") == ("3", b"0", b"")  # an empty D: the stream's end
    with pytest.raises(ProtocolError):
        decode_data(b"no-separator")


def test_framer_keeps_bodies_raw_and_splits_any_feed() -> None:
    from fusion_oci.agent.protocol import STDERR, Framer, encode_data

    stream = encode_data("1", STDERR, b"a=b\0c") + encode(b"X", [("id", "1"), ("status", "0")])
    framer = Framer()
    frames = [f for i in range(len(stream)) for f in framer.feed(stream[i : i + 1])]
    assert frames == [(b"D", b"1\x002a=b\x00c"), (b"X", b"id=1\0status=0\0")]
    assert Framer().feed(stream) == frames


def test_the_mux_speaks_the_frame_layout_of_protocol_py() -> None:
    """mux.py travels alone (no fusion_oci import), so its copy of the layout is checked here."""
    from fusion_oci.agent import mux, protocol

    assert mux.MAX_FRAME == protocol.MAX_FRAME
    assert mux.frame(b"D", b"1\x001x") == protocol.encode_data("1", protocol.STDOUT, b"x")
    assert mux.first_field(b"id=7\0bytes=9\0", b"bytes") == b"9"
    assert mux.first_field(b"id=7\0", b"closed") == b""


def test_mux_argv_is_how_a_pod_exec_starts_the_far_end() -> None:
    from fusion_oci.agent.streamed import MUX, mux_argv

    argv = mux_argv("/run/fusion-oci/agent", ["--egress", "/run/fusion-oci/egress.sock"])
    assert argv == [
        "python3",
        "-S",
        "-E",
        "-s",
        str(MUX),
        "--agent",
        "/run/fusion-oci/agent",
        "--egress",
        "/run/fusion-oci/egress.sock",
    ]
    assert MUX.name == "mux.py" and MUX.is_file()


# --- the native runtime's plan -------------------------------------------------------------

LAYOUT = TaskLayout("/work/wt/task-1", None, (), None)
CALLER_ENV = {
    "PATH": "/home/u/bin:/usr/bin",
    "HOME": "/home/u",
    "LANG": "C.UTF-8",
    "GITHUB_TOKEN": "ghp_secret",
    "CI": "true",
}
CASES = {
    "default": SandboxPolicy(),
    "limits": SandboxPolicy(cpu_limit=CpuLimit(max_ms=30_000), file_size_limit_mb=100),
    "env-allowlist": SandboxPolicy(env_allowlist=["CI"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_native_plan(name: str) -> None:
    ctx = PrepareContext(
        task_id="task-1", run_id="run-1", worktree_path=LAYOUT.worktree, policy=CASES[name]
    )
    task = resolved(ctx, LAYOUT, env=CALLER_ENV)
    runtime = NativeRuntime(SandboxSettings(), CALLER_ENV, host=GOLDEN_HOST)
    plan = plan_for(runtime, task)  # adopted: the plan reads the policy's allowlist
    assert_golden(f"native/plan-{name}.json", plan.to_json())
    assert isinstance(plan, AgentPlan)
    assert plan.spawn == spawn_of(plan.process, env=runtime._env(None))


def test_without_the_agent_platform_native_plans_the_reaper_shim() -> None:
    """macOS: no agent (Linux C); native keeps the per-command reaper shim there."""
    ctx = PrepareContext(task_id="task-1", run_id="run-1", worktree_path=LAYOUT.worktree)
    runtime = NativeRuntime(SandboxSettings(), CALLER_ENV, host=GOLDEN_HOST)
    runtime.uses_agent = False
    plan = plan_for(runtime, resolved(ctx, LAYOUT, env=CALLER_ENV))
    assert isinstance(plan, ArgvPlan)
    assert plan.argv[-4:] == ["--", "/bin/sh", "-c", "pnpm test"]
    assert plan.argv[4].endswith("reaper.py")
    assert runtime.availability().available


def test_the_egress_paths_and_port_are_the_agents_own() -> None:
    """protocol.py's in-sandbox egress names are agent.c's (one binary, one Python view), and
    the proxy environment points at them."""
    import re
    from pathlib import Path

    from fusion_oci.agent import protocol
    from fusion_oci.oci.environment import filtered_env

    source = (Path(protocol.__file__).parent / "agent.c").read_text()
    assert re.search(rf'#define EGRESS_SOCKET "{re.escape(protocol.EGRESS_SOCKET)}"', source)
    assert re.search(rf"#define FWD_PORT {protocol.EGRESS_PORT}\b", source)
    assert protocol.forward_args() == ["--egress", protocol.EGRESS_SOCKET]
    env = filtered_env()
    assert env["HTTP_PROXY"] == f"http://127.0.0.1:{protocol.EGRESS_PORT}"
    assert env["GIT_SSH_COMMAND"] == protocol.ssh_proxy_command()


def test_egress_frames_and_the_filtered_far_end_are_pure() -> None:
    from fusion_oci.agent.protocol import Framer, encode_bytes
    from fusion_oci.agent.streamed import mux_argv
    from fusion_oci.runtimes.kubernetes.hostservices import pod_mux_argv
    from fusion_oci.runtimes.kubernetes.runtime import MUX_ARGV
    from tests.unit.test_containers_translate import FILTERED, task_for

    frames = Framer().feed(encode_bytes(7, b"\0ab") + encode_bytes(12, b""))
    assert frames == [(b"B", b"7\0\0ab"), (b"B", b"12\0")]  # raw bytes, NUL included
    assert mux_argv("/a", ["--x"], mux="/m.py", egress_listen=3128) == [
        "python3", "-S", "-E", "-s", "/m.py", "--egress-listen", "3128", "--agent", "/a", "--x",
    ]  # fmt: skip
    # the pod's relay: the listener's option before --agent, the rest as without it
    filtered = pod_mux_argv(task_for(FILTERED).spec)
    assert filtered[5:7] == ["--egress-listen", "3128"]
    assert filtered[:5] + filtered[7:] == MUX_ARGV
