"""The oci runtime's pure parts: golden argv/plans, the bundle it hands the runtime, statuses."""

from __future__ import annotations

import io
import json
import signal
import tarfile
from pathlib import Path
from typing import Any

import pytest

from fusion_oci.models import CpuLimit, NetworkMode, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.spec import Spec, bind, compile_spec
from fusion_oci.policy.layout import GitLayout, TaskLayout
from fusion_oci.policy.settings import SandboxSettings
from fusion_oci.process import ProcessOutcome
from fusion_oci.runtimes.base import Requirement
from fusion_oci.runtimes.oci import (
    CgroupCounters,
    CgroupHost,
    EgressHook,
    OciRuntime,
    apply_layer,
    bundle_spec,
    container_id,
    egress_launch_argv,
    exec_failure_status,
    exit_status,
    parse_cgroup_mounts,
    parse_counter,
    podman_url,
    run_argv,
    runtime_flags,
    state_base,
    unpack_docker_archive,
)
from tests.golden import GOLDEN_HOST, assert_golden

HOST = GOLDEN_HOST
LAYOUT = TaskLayout(
    worktree="/work/repo-wt/task-1",
    git=GitLayout("linked", "/work/repo/.git/worktrees/task-1", "/work/repo/.git"),
    caches=(),
    ca_bundle="/etc/ssl/certs/ca-certificates.crt",
)
POLICIES = {
    "none-limits": SandboxPolicy(allow_network=False, memory_limit_mb=256, pids_limit=64,
                                 cpu_limit=CpuLimit(max_cores=1.0, max_ms=30_000)),
    "egress": SandboxPolicy(),
    "host": SandboxPolicy(network="host"),
}


def spec_for(policy: SandboxPolicy, image: str | None = None) -> Spec:
    ctx = PrepareContext(task_id="task-1", run_id="run-1", worktree_path=LAYOUT.worktree,
                         policy=policy, image=image)
    return compile_spec(ctx, LAYOUT, HOST, "pnpm test", RunOptions(), {"PATH": "/usr/bin"})


def runtime(uid: int = 0, oci_runtime: str = "runc") -> OciRuntime:
    rt = OciRuntime(SandboxSettings(backend="oci", oci_runtime=oci_runtime),
                    {"HOME": "/home/u", "PATH": "/usr/sbin:/usr/bin"},
                    cache_root=Path("/home/u/.cache/fusion-oci"), host=HOST)
    rt.uid, rt.gid = uid, uid
    return rt


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("uid", [0, 1000], ids=["root", "rootless"])
def test_golden_plan(name: str, uid: int) -> None:
    plan = runtime(uid).plan(spec_for(POLICIES[name]))
    assert_golden(f"oci/plan-{name}-{'root' if uid == 0 else 'rootless'}.json", plan.to_json())


def test_golden_plan_image() -> None:
    plan = runtime().plan(spec_for(POLICIES["none-limits"], image="localhost/fusion-base:1"))
    assert_golden("oci/plan-image.json", plan.to_json())


def test_run_argv_is_exact() -> None:
    assert run_argv("runc", "/run/s", "/run/b/1", "t-r-ab12cd-1", "/run/b/1.pid") == [
        "runc", "--root", "/run/s", "run", "--keep", "--pid-file", "/run/b/1.pid",
        "--bundle", "/run/b/1", "t-r-ab12cd-1",
    ]
    assert "--keep" not in run_argv("runsc", "/s", "/b", "id", "/p", keep=False)


def test_keep_only_with_counters_to_read_and_a_runtime_that_takes_it() -> None:
    limited, plain = spec_for(POLICIES["none-limits"]), spec_for(POLICIES["egress"])
    assert runtime(oci_runtime="runc").keep_for(limited)
    assert runtime(oci_runtime="/usr/bin/crun").keep_for(limited)
    assert not runtime(oci_runtime="runsc").keep_for(limited)
    assert not runtime(oci_runtime="runc").keep_for(plain)
    assert "--keep" not in runtime().plan(plain).argv  # type: ignore[operator]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_root_bundle_is_the_compiled_spec(name: str, oci_validator: Any) -> None:
    spec = spec_for(POLICIES[name])
    out = bundle_spec(spec)
    oci_validator.validate(out)
    assert out == spec
    assert out is not spec


def test_image_bundle_points_at_the_shared_rootfs(oci_validator: Any) -> None:
    spec = spec_for(POLICIES["egress"], image="localhost/x:1")
    out = bundle_spec(spec, rootfs="/cache/oci-rootfs/abc/rootfs")
    oci_validator.validate(out)
    assert out["root"] == {"path": "/cache/oci-rootfs/abc/rootfs", "readonly": True}
    assert spec["root"]["path"] == "rootfs"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_rootless_bundle_maps_only_the_caller_and_drops_cgroup_limits(
        name: str, oci_validator: Any) -> None:
    out = bundle_spec(spec_for(POLICIES[name]), rootless_ids=(1000, 1001))
    oci_validator.validate(out)
    linux = out["linux"]
    assert {"type": "user"} in linux["namespaces"]
    assert linux["uidMappings"] == [{"containerID": 0, "hostID": 1000, "size": 1}]
    assert linux["gidMappings"] == [{"containerID": 0, "hostID": 1001, "size": 1}]
    assert out["process"]["user"] == {"uid": 0, "gid": 0}
    home = next(m for m in out["mounts"] if m["destination"] == "/home/sandbox")
    assert "uid=0" in home["options"] and "uid=1000" not in home["options"]
    assert not {"memory", "pids", "cpu"} & set(linux["resources"])
    sys_mount = next(m for m in out["mounts"] if m["destination"] == "/sys")
    # Without its own network namespace a user namespace may not mount sysfs: bind it.
    assert sys_mount["type"] == ("bind" if name == "host" else "sysfs")


def test_egress_bundle_has_the_hook_and_slirp_dns(oci_validator: Any) -> None:
    hook = EgressHook("/s/1.egress-request", "/s/1.egress-reply", "/s/resolv.conf")
    out = bundle_spec(spec_for(POLICIES["egress"]), egress=hook)
    oci_validator.validate(out)
    assert_golden("oci/egress-hooks.json", out["hooks"])
    assert out["mounts"][-1] == {"destination": "/etc/resolv.conf", "type": "bind",
                                 "source": "/s/resolv.conf",
                                 "options": ["rbind", "ro", "nosuid", "nodev"]}
    # The network namespace stays: slirp4netns is the only way out of it.
    assert {"type": "network"} in out["linux"]["namespaces"]


def test_container_ids_are_unique_per_command_and_name_safe() -> None:
    assert container_id("t", "r", "ab12cd", 3) == "t-r-ab12cd-3"
    long = container_id("a" * 128, "b" * 128, "ab12cd", 12345)
    assert len(long) < 200
    assert long.endswith("-ab12cd-12345")


def test_state_base() -> None:
    assert state_base({}, 0) == Path("/run/fusion-oci/oci")
    assert state_base({"XDG_RUNTIME_DIR": "/run/user/1000"}, 1000) == \
        Path("/run/user/1000/fusion-oci/oci")
    assert state_base({}, 1000) == Path("/tmp/fusion-oci-1000/oci")


def test_podman_url() -> None:
    assert podman_url({"FUSION_OCI_PODMAN_URL": "unix:///x.sock"}, 0) == "unix:///x.sock"
    assert podman_url({}, 0) == "unix:///run/podman/podman.sock"
    assert podman_url({}, 1000) == "unix:///run/user/1000/podman/podman.sock"
    assert podman_url({"CONTAINER_HOST": "unix:///e.sock"}, 0, "unix:///s.sock") == \
        "unix:///s.sock"


@pytest.mark.parametrize(("rc", "expected"), [
    (0, (0, None)), (3, (3, None)), (128, (128, None)),
    (137, (None, "SIGKILL")), (143, (None, "SIGTERM")), (200, (200, None)),
])
def test_exit_status(rc: int, expected: tuple[int | None, str | None]) -> None:
    assert exit_status(rc, None) == expected


def test_exit_status_passes_a_signal_of_the_cli_itself() -> None:
    assert exit_status(None, "SIGKILL") == (None, "SIGKILL")


def test_exec_failures_read_like_a_shell() -> None:
    nf = ('level=error msg="runc run failed: unable to start container process: exec: '
          '\\"/nope\\": stat /nope: no such file or directory"')
    assert exec_failure_status(nf) == 127
    assert exec_failure_status('exec: "x": executable file not found in $PATH') == 127
    assert exec_failure_status('exec: "/etc/passwd": permission denied') == 126
    assert exec_failure_status("error setting rlimits for ready process") is None


def test_parse_counter() -> None:
    oom_control = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"
    assert parse_counter(oom_control, "oom_kill") == 2
    assert parse_counter("max 0\n", "max") == 0
    assert parse_counter("low 0\nhigh 0\nmax 0\noom 1\noom_kill 1\n", "oom_kill") == 1
    assert parse_counter("", "max") is None


def outcome(rc: int | None = 0, sig: str | None = None, *, timed_out: bool = False,
            truncated: bool = False) -> ProcessOutcome:
    return ProcessOutcome(b"", b"", rc, sig, timed_out, truncated, 1)


def test_cgroup_counters_feed_the_one_classifier() -> None:
    from fusion_oci.runtimes.base import classify
    from fusion_oci.runtimes.oci import limit_counters

    spec = spec_for(POLICIES["none-limits"])
    oom = limit_counters(CgroupCounters(oom_kills=1, pids_max_hits=0))
    pids = limit_counters(CgroupCounters(oom_kills=0, pids_max_hits=3))
    # One precedence for every runtime (base.classify): a limit that fired wins over the
    # timeout that followed it, and over maxBuffer.
    assert classify(outcome(None, "SIGKILL", timed_out=True), spec, pids) == "pids"
    assert classify(outcome(None, "SIGTERM", truncated=True), spec, oom) == "oom"
    assert classify(outcome(None, "SIGKILL"), spec, oom) == "oom"
    assert classify(outcome(2), spec, pids) == "pids"
    # A command that survived the limit and succeeded ended by its own exit.
    assert classify(outcome(0), spec, oom) == "exit"
    assert classify(outcome(0), spec, pids) == "exit"
    # Counters unknown: no claim; RLIMIT_CPU in the spec makes a SIGKILL cpu-time.
    unknown = limit_counters(CgroupCounters())
    assert classify(outcome(None, "SIGKILL"), spec, unknown) == "cpu-time"
    assert classify(outcome(None, "SIGKILL"), spec_for(POLICIES["egress"]), unknown) == "signal"


HYBRID = """\
25 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
26 25 0:23 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
27 26 0:24 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
28 26 0:25 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
29 26 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
30 26 0:27 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
31 26 0:28 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
"""
UNIFIED = "26 25 0:23 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n"


def test_parse_cgroup_mounts() -> None:
    assert parse_cgroup_mounts(HYBRID) == CgroupHost(
        "hybrid", frozenset({"memory", "pids", "cpu", "cpuacct"}))
    v1_only = "\n".join(line for line in HYBRID.splitlines() if "cgroup2" not in line)
    assert parse_cgroup_mounts(v1_only).mode == "v1"
    assert parse_cgroup_mounts(UNIFIED, "cpuset cpu io memory pids\n") == CgroupHost(
        "v2", frozenset({"cpuset", "cpu", "io", "memory", "pids"}))
    assert parse_cgroup_mounts("").mode == "none"


def test_enforces_follows_controllers_and_rootless() -> None:
    rt = runtime()
    rt._cgroups = CgroupHost("hybrid", frozenset({"memory", "pids", "cpu"}))
    rt._egress = (False, "no slirp4netns")
    assert rt.enforces() == {
        Requirement.FILESYSTEM, Requirement.PROC_PATHS, Requirement.ENV, Requirement.NETWORK_NONE,
        Requirement.CPU_TIME,
        Requirement.MEMORY, Requirement.PIDS, Requirement.CPU_QUOTA, Requirement.TMP_SIZE,
        Requirement.FILE_SIZE,
    }
    rt._egress = (True, "/usr/bin/slirp4netns")
    assert Requirement.NETWORK_EGRESS in rt.enforces()
    rootless = runtime(uid=1000)
    rootless._cgroups = rt._cgroups
    rootless._egress = (False, "x")
    assert not {Requirement.MEMORY, Requirement.PIDS, Requirement.CPU_QUOTA} & \
        rootless.enforces()
    assert rootless.capabilities().resource_limits == "basic"


def test_crun_on_a_hybrid_host_is_unavailable_with_the_fix() -> None:
    rt = runtime(oci_runtime="crun")
    rt._binary = "/usr/bin/crun"
    rt._cgroups = CgroupHost("hybrid", frozenset({"memory"}))
    avail = rt.availability()
    assert not avail.available
    assert "hybrid" in avail.reason
    assert "ociRuntime: runc" in avail.hint


def test_missing_runtime_is_unavailable() -> None:
    rt = OciRuntime(SandboxSettings(backend="oci", oci_runtime="no-such-runtime-xyz"),
                    {"PATH": "/nonexistent"}, host=HOST)
    avail = rt.availability()
    assert not avail.available
    assert "no-such-runtime-xyz" in avail.reason


# --- image layers -----------------------------------------------------------------------------


def layer(entries: list[tuple[str, str, str | bytes]]) -> tarfile.TarFile:
    """(kind, name, data-or-link-target) → an in-memory layer tar."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for kind, name, data in entries:
            info = tarfile.TarInfo(name)
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, str(data)
                tar.addfile(info)
            else:
                raw = data.encode() if isinstance(data, str) else data
                info.size, info.mode = len(raw), 0o644
                tar.addfile(info, io.BytesIO(raw))
    buf.seek(0)
    return tarfile.open(fileobj=buf, mode="r:")


def test_layers_apply_whiteouts_and_opaque_dirs(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    root.mkdir()
    apply_layer(layer([("dir", "etc", ""), ("file", "etc/a", "a"), ("file", "etc/b", "b"),
                       ("dir", "opt", ""), ("file", "opt/old", "x"), ("file", "keep", "k")]),
                root)
    apply_layer(layer([("file", "etc/.wh.a", ""), ("dir", "opt", ""),
                       ("file", "opt/new", "n"), ("file", "opt/.wh..wh..opq", ""),
                       ("file", "keep", "k2")]), root)
    assert sorted(p.name for p in (root / "etc").iterdir()) == ["b"]
    assert sorted(p.name for p in (root / "opt").iterdir()) == ["new"]
    assert (root / "keep").read_text() == "k2"


def test_a_file_replacing_a_symlink_does_not_write_through_it(tmp_path: Path) -> None:
    outside = tmp_path / "host-secret"
    outside.write_text("host")
    root = tmp_path / "rootfs"
    root.mkdir()
    apply_layer(layer([("symlink", "evil", str(outside))]), root)
    apply_layer(layer([("file", "evil", "image")]), root)
    assert outside.read_text() == "host"
    assert (root / "evil").read_text() == "image"
    assert not (root / "evil").is_symlink()


def test_whiteouts_and_entries_through_a_symlinked_dir_stay_inside(tmp_path: Path) -> None:
    hostdir = tmp_path / "hostdir"
    hostdir.mkdir()
    (hostdir / "precious").write_text("keep me")
    root = tmp_path / "rootfs"
    root.mkdir()
    apply_layer(layer([("symlink", "link", str(hostdir))]), root)
    apply_layer(layer([("file", "link/.wh.precious", "")]), root)
    assert (hostdir / "precious").read_text() == "keep me"
    with pytest.raises(tarfile.TarError):  # OutsideDestinationError where Python has filters
        apply_layer(layer([("file", "link/planted", "x")]), root)
    assert not (hostdir / "planted").exists()


def test_unpack_docker_archive(tmp_path: Path) -> None:
    def layer_bytes(entries: list[tuple[str, str, str | bytes]]) -> bytes:
        tar = layer(entries)
        assert tar.fileobj is not None
        tar.fileobj.seek(0)
        return bytes(tar.fileobj.read())

    layers = {"l1/layer.tar": layer_bytes([("file", "a", "1"), ("file", "b", "2")]),
              "l2/layer.tar": layer_bytes([("file", ".wh.a", "")])}
    manifest = json.dumps([{"Config": "c.json", "Layers": list(layers)}]).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("manifest.json", manifest), *layers.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    unpack_docker_archive(buf, tmp_path / "rootfs")
    assert sorted(p.name for p in (tmp_path / "rootfs").iterdir()) == ["b"]


def test_signal_names_cover_the_common_deaths() -> None:
    assert exit_status(128 + signal.SIGXCPU, None) == (None, "SIGXCPU")


# --- gVisor (runsc) ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_golden_plan_runsc(name: str) -> None:
    plan = runtime(oci_runtime="runsc").plan(spec_for(POLICIES[name]))
    assert_golden(f"oci/plan-runsc-{name}.json", plan.to_json())


def test_runsc_network_flags_come_before_the_subcommand() -> None:
    assert runtime_flags("runsc", NetworkMode.NONE) == ["--oci-seccomp", "--network=none"]
    assert runtime_flags("/usr/bin/runsc", NetworkMode.HOST)[-1] == "--network=host"
    # egress: host networking of the namespace the launch script prepared, never the host's
    assert runtime_flags("runsc", NetworkMode.EGRESS)[-1] == "--network=host"
    assert runtime_flags("runc", NetworkMode.NONE) == []
    argv = run_argv("runsc", "/s", "/b", "id", "/p", keep=False, flags=["--network=none"])
    assert argv[:5] == ["runsc", "--root", "/s", "--network=none", "run"]


def test_runsc_egress_launch_holds_the_runtime_until_slirp_is_attached() -> None:
    hook = EgressHook("/t/1.egress-request", "/t/1.egress-reply", "/t/resolv.conf", hook=False)
    argv = egress_launch_argv("/usr/bin/unshare", hook, ["runsc", "run", "x"])
    assert argv[:3] == ["/usr/bin/unshare", "--net", "--"]
    assert argv[-5:] == ["/t/1.egress-request", "/t/1.egress-reply", "runsc", "run", "x"]
    script = argv[5]
    assert script.index('read -r answer <"$2"') < script.index('exec "$@"')
    assert '[ "$answer" = go ]' in script


def test_runsc_egress_bundle_has_no_hook_and_no_second_netns(oci_validator: Any) -> None:
    spec = spec_for(POLICIES["egress"])
    hook = EgressHook("/t/1.egress-request", "/t/1.egress-reply", "/t/resolv.conf", hook=False)
    out = bundle_spec(spec, egress=hook)
    oci_validator.validate(out)
    assert "hooks" not in out
    assert all(ns["type"] != "network" for ns in out["linux"]["namespaces"])
    assert bind("/etc/resolv.conf", "/t/resolv.conf", writable=False) in out["mounts"]
    runc = bundle_spec(spec, egress=EgressHook("/a", "/b", "/t/resolv.conf"))
    assert runc["hooks"]["createRuntime"] and {"type": "network"} in runc["linux"]["namespaces"]


def test_runsc_never_claims_pids_and_is_unavailable_rootless() -> None:
    rt = runtime(oci_runtime="runsc")
    rt._cgroups = CgroupHost("v1", frozenset({"memory", "pids", "cpu"}))
    assert Requirement.PIDS not in rt.enforces()
    assert Requirement.MEMORY in rt.enforces()
    rootless = runtime(uid=1000, oci_runtime="runsc")
    rootless._binary = "/usr/bin/runsc"
    avail = rootless.availability()
    assert not avail.available and "unprivileged" in avail.reason


def test_runsc_exec_failures_read_as_a_shell_would() -> None:
    prefix = "running container: starting container: starting root container: starting sandbox: "
    assert exec_failure_status(prefix + 'error finding executable "nope" in PATH [/usr/bin '
                               "/bin]: no such file or directory\n") == 127
    assert exec_failure_status(prefix + "creating process: failed to load /etc/passwd: "
                               "permission denied\n") == 126
    assert exec_failure_status("the command printed: failed to load x: permission denied") \
        is None
