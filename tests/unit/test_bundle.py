from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest

from fusion_oci.errors import BundleError
from fusion_oci.models import CacheMode, CpuLimit, PrepareContext, RunOptions, SandboxPolicy
from fusion_oci.oci.bundle import write_bundle
from fusion_oci.oci.host import HostInfo, probe_host
from fusion_oci.oci.model import ANN_NETWORK, ANN_POLICY, ANN_TASK
from fusion_oci.policy.layout import CacheMount, GitLayout, TaskLayout, resolve_layout
from fusion_oci.resolve import compile_spec
from tests.golden import GOLDEN_HOST, assert_golden
from tests.tasks import config_for, resolved

HOST = GOLDEN_HOST


def spec_env(spec: dict[str, Any]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in spec["process"]["env"])


LAYOUT = TaskLayout(
    worktree="/work/repo-wt/task-1",
    git=GitLayout("linked", "/work/repo/.git/worktrees/task-1", "/work/repo/.git"),
    caches=(
        CacheMount(
            "pnpm-store",
            "/cache/p/pnpm-store",
            "/var/cache/fusion-oci/pnpm-store",
            (("npm_config_store_dir", "/var/cache/fusion-oci/pnpm-store"),),
        ),
    ),
    ca_bundle="/etc/ssl/certs/ca-certificates.crt",
    ca_complete=True,  # the host's own bundle, as hostCa: auto resolves
)
ENV = {
    "PATH": "/home/u/bin:/usr/bin",
    "HOME": "/home/u",
    "LANG": "en_US.UTF-8",
    "GITHUB_TOKEN": "ghp_secret",
    "AWS_SECRET_ACCESS_KEY": "aws_secret",
    "CI": "true",
}

POLICIES = {
    "default": SandboxPolicy(),
    "locked-down": SandboxPolicy(
        allow_network=False,
        memory_limit_mb=512,
        pids_limit=128,
        cpu_limit=CpuLimit(max_cores=1.5, max_ms=60_000),
        allowed_paths=["/opt/sdk"],
        writable_paths=["/work/shared-out"],
        env_allowlist=["CI"],
        tmp_size_mb=256,
        file_size_limit_mb=100,
    ),
    "host-network": SandboxPolicy(network="host"),
}


def ctx(policy: SandboxPolicy, image: str | None = None) -> PrepareContext:
    return PrepareContext(
        task_id="task-1", run_id="run-1", worktree_path=LAYOUT.worktree, policy=policy, image=image
    )


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_golden_spec_and_schema(name: str, oci_validator: Any) -> None:
    spec = config_for(ctx(POLICIES[name]), LAYOUT, HOST, "pnpm test", RunOptions(), ENV)
    oci_validator.validate(spec)
    assert_golden(f"bundles/{name}.json", spec)


def test_image_spec_validates(oci_validator: Any) -> None:
    spec = config_for(
        ctx(SandboxPolicy(), image="localhost/fusion-oci/node:abc"),
        LAYOUT,
        HOST,
        ["node", "-v"],
        RunOptions(),
        ENV,
    )
    oci_validator.validate(spec)
    assert spec["annotations"]["io.fusion-oci.image"] == "localhost/fusion-oci/node:abc"
    assert not any(m["destination"] == "/usr" for m in spec["mounts"])
    assert spec["process"]["args"] == ["node", "-v"]


def test_compile_is_pure() -> None:
    a = config_for(ctx(POLICIES["locked-down"]), LAYOUT, HOST, "true", RunOptions(), ENV)
    b = config_for(ctx(POLICIES["locked-down"]), LAYOUT, HOST, "true", RunOptions(), ENV)
    assert a == b


def test_env_reduced_to_fixed_set_plus_allowlist() -> None:
    spec = config_for(ctx(POLICIES["default"]), LAYOUT, HOST, "env", RunOptions(), ENV)
    env = spec_env(spec)
    assert "GITHUB_TOKEN" not in env
    assert "AWS_SECRET_ACCESS_KEY" not in env
    assert "CI" not in env
    assert env["HOME"] == "/home/sandbox"
    assert env["PATH"].startswith("/usr/local/sbin")
    # The host's whole store: Node.js reads it through OpenSSL, at its first handshake.
    assert env["SSL_CERT_FILE"] == "/etc/fusion-oci/host-ca.pem"
    assert env["NODE_OPTIONS"] == "--use-openssl-ca" and "NODE_EXTRA_CA_CERTS" not in env
    allowed = config_for(
        ctx(SandboxPolicy(env_allowlist=["GITHUB_TOKEN", "MISSING"])),
        LAYOUT,
        HOST,
        "env",
        RunOptions(),
        ENV,
    )
    env = spec_env(allowed)
    assert env["GITHUB_TOKEN"] == "ghp_secret"
    assert "MISSING" not in env
    assert "AWS_SECRET_ACCESS_KEY" not in env


def test_rlimits_stay_within_host_hard_limits() -> None:
    host = HostInfo(rlimits={"RLIMIT_NOFILE": (1024, 4096), "RLIMIT_CPU": (-1, 30)})
    policy = SandboxPolicy(cpu_limit=CpuLimit(max_ms=600_000))
    spec = config_for(ctx(policy), LAYOUT, host, "true", RunOptions(), {})
    limits = {r["type"]: (r["soft"], r["hard"]) for r in spec["process"]["rlimits"]}
    assert limits["RLIMIT_NOFILE"] == (4096, 4096)
    assert limits["RLIMIT_CPU"] == (30, 30)


def test_network_namespaces_and_annotations() -> None:
    for name, has_netns, mode in (
        ("default", True, "egress"),
        ("locked-down", True, "none"),
        ("host-network", False, "host"),
    ):
        spec = config_for(ctx(POLICIES[name]), LAYOUT, HOST, "true", RunOptions(), {})
        types = {n["type"] for n in spec["linux"]["namespaces"]}
        assert ("network" in types) is has_netns, name
        assert spec["annotations"][ANN_NETWORK] == mode
        assert spec["annotations"][ANN_TASK] == "task-1"
        assert spec["annotations"][ANN_POLICY] == POLICIES[name].digest()


def test_git_hooks_and_config_mounted_read_only_after_writable_parents() -> None:
    spec = config_for(ctx(SandboxPolicy()), LAYOUT, HOST, "true", RunOptions(), {})
    dests = [m["destination"] for m in spec["mounts"]]
    hooks = dests.index("/work/repo/.git/hooks")
    assert hooks > dests.index("/work/repo/.git")
    assert hooks > dests.index("/work/repo/.git/worktrees/task-1")
    for m in spec["mounts"]:
        if m["destination"] in (
            "/work/repo/.git/hooks",
            "/work/repo/.git/config",
            "/work/repo/.git",
        ):
            assert "ro" in m["options"]
        if m["destination"] in ("/work/repo/.git/objects", LAYOUT.worktree):
            assert "rw" in m["options"]


def test_no_capabilities_and_no_new_privileges() -> None:
    spec = config_for(ctx(SandboxPolicy()), LAYOUT, HOST, "true", RunOptions(), {})
    assert spec["process"]["noNewPrivileges"] is True
    assert all(v == [] for v in spec["process"]["capabilities"].values())
    assert spec["root"]["readonly"] is True
    assert "/proc/kcore" in spec["linux"]["maskedPaths"]


def test_relative_cwd_is_inside_worktree() -> None:
    spec = config_for(ctx(SandboxPolicy()), LAYOUT, HOST, "true", RunOptions(cwd="pkg/a"), {})
    assert spec["process"]["cwd"] == "/work/repo-wt/task-1/pkg/a"


def test_real_layout_of_linked_worktree(
    linked_worktree: tuple[Path, Path], tmp_path: Path, oci_validator: Any
) -> None:
    repo, wt = linked_worktree
    c = PrepareContext(
        task_id="t",
        run_id="r",
        worktree_path=str(wt),
        cache_mode=CacheMode.ISOLATED,
        project_dir=str(repo),
    )
    layout = resolve_layout(c, cache_root=tmp_path / "cache", ca_bundle=None)
    assert layout.git is not None
    assert layout.git.kind == "linked"
    assert layout.git.common_dir == str((repo / ".git").resolve())
    assert all("/tasks/t/" in m.host_path for m in layout.caches)
    assert all(Path(m.host_path).is_dir() for m in layout.caches)
    oci_validator.validate(config_for(c, layout, probe_host(), "true", RunOptions(), {}))


def test_dry_layout_creates_nothing(worktree: Path, tmp_path: Path) -> None:
    c = PrepareContext(task_id="t", run_id="r", worktree_path=str(worktree))
    resolve_layout(c, cache_root=tmp_path / "cache", ca_bundle=None, create=False)
    assert not (tmp_path / "cache").exists()


def test_write_bundle_atomic(tmp_path: Path, oci_validator: Any) -> None:
    spec = compile_spec(resolved(ctx(SandboxPolicy()), LAYOUT, HOST), "true", RunOptions())
    bundle = write_bundle(spec, tmp_path / "b")
    assert bundle.path is not None
    assert (bundle.path / "rootfs").is_dir()
    oci_validator.validate(json.loads(bundle.config_path.read_text()))
    with pytest.raises(BundleError, match="not an empty directory"):
        write_bundle(spec, tmp_path / "b")
    assert sorted(os.listdir(tmp_path)) == ["b"]  # no half-written siblings left


def test_write_bundle_failure_leaves_nothing(tmp_path: Path) -> None:
    spec = compile_spec(resolved(ctx(SandboxPolicy()), LAYOUT, HOST), "true", RunOptions())
    # Not JSON-serialisable (model_copy does not validate): fails mid-write.
    bad = spec.task.model_copy(update={"annotations": {"bad": object()}})
    spec = spec.with_task(bad)
    with pytest.raises((TypeError, ValueError)):
        write_bundle(spec, tmp_path / "b")
    assert os.listdir(tmp_path) == []


def test_env_globs_never_pass_secret_names() -> None:
    from fusion_oci.oci.environment import allowed_env

    source = {
        "CI": "1",
        "CI_JOB_ID": "7",
        "CI_JOB_TOKEN": "t",
        "NPM_TOKEN": "n",
        "AWS_REGION": "eu",
        "GITHUB_TOKEN": "g",
        "LANGUAGE": "en",
        "SSH_AUTH_SOCK": "/s",
    }
    assert allowed_env(["CI*"], source) == {"CI": "1", "CI_JOB_ID": "7"}
    assert allowed_env(["*"], source) == {"CI": "1", "CI_JOB_ID": "7", "LANGUAGE": "en"}
    # Named exactly, a secret passes: the user asked for that one variable.
    assert allowed_env(["NPM_TOKEN", "CI_*"], source) == {"NPM_TOKEN": "n", "CI_JOB_ID": "7"}


def test_worktree_config_is_read_only_when_the_extension_is_on(
    linked_worktree: tuple[Path, Path], tmp_path: Path
) -> None:
    from tests.conftest import git

    repo, wt = linked_worktree
    git(repo, "config", "extensions.worktreeConfig", "true")
    c = PrepareContext(task_id="t", run_id="r", worktree_path=str(wt))
    layout = resolve_layout(c, cache_root=tmp_path / "cache", ca_bundle=None)
    assert layout.git is not None and layout.git.worktree_config
    assert Path(layout.git.worktree_config).is_file()
    spec = config_for(c, layout, HOST, "true", RunOptions(), {})
    last = [m for m in spec["mounts"] if m["destination"] == layout.git.worktree_config][-1]
    assert "ro" in last["options"]
    assert spec["mounts"][-1] is not None


# ------------------------------------------------------------ how Node.js trusts the bundle


def test_a_bundle_the_settings_name_is_added_to_nodes_roots() -> None:
    """A bundle that may hold a company's CA only: NODE_EXTRA_CA_CERTS (added to Node.js's
    own roots), as before; the host's whole store (LAYOUT): OpenSSL's store in their place."""
    import dataclasses

    partial = dataclasses.replace(LAYOUT, ca_complete=False)
    env = spec_env(config_for(ctx(SandboxPolicy()), partial, HOST, "env", RunOptions(), ENV))
    assert env["NODE_EXTRA_CA_CERTS"] == "/etc/fusion-oci/host-ca.pem"
    assert "NODE_OPTIONS" not in env
    none = dataclasses.replace(LAYOUT, ca_bundle=None)
    env = spec_env(config_for(ctx(SandboxPolicy()), none, HOST, "env", RunOptions(), ENV))
    assert "NODE_OPTIONS" not in env and "SSL_CERT_FILE" not in env


@pytest.mark.parametrize(
    ("theirs", "options", "extra"),
    [
        ("--max-old-space-size=4096", "--use-openssl-ca --max-old-space-size=4096", None),
        ("--use-openssl-ca --inspect", "--use-openssl-ca --inspect", None),
        # Node.js refuses both stores at once: theirs stands, the bundle is added instead.
        ("--use-bundled-ca", "--use-bundled-ca", "/etc/fusion-oci/host-ca.pem"),
    ],
)
def test_an_allow_listed_node_options_keeps_the_store(
    theirs: str, options: str, extra: str | None
) -> None:
    policy = SandboxPolicy(env_allowlist=["NODE_OPTIONS"])
    caller = {**ENV, "NODE_OPTIONS": theirs}
    env = spec_env(config_for(ctx(policy), LAYOUT, HOST, "env", RunOptions(), caller))
    assert env["NODE_OPTIONS"] == options
    assert env.get("NODE_EXTRA_CA_CERTS") == extra


def test_no_package_manager_checks_for_updates_unless_the_caller_says() -> None:
    """A sandbox's home is new with each task, so a notifier's once-a-day state never holds:
    pnpm asked its registry at every task's first command. The allowlist may pass theirs."""
    env = spec_env(config_for(ctx(SandboxPolicy()), LAYOUT, HOST, "env", RunOptions(), ENV))
    assert env["npm_config_update_notifier"] == "false"
    assert env["pnpm_config_update_notifier"] == "false"
    assert env["NO_UPDATE_NOTIFIER"] == "1"
    policy = SandboxPolicy(env_allowlist=["npm_config_update_notifier"])
    caller = {**ENV, "npm_config_update_notifier": "true"}
    env = spec_env(config_for(ctx(policy), LAYOUT, HOST, "env", RunOptions(), caller))
    assert env["npm_config_update_notifier"] == "true"


def test_only_the_hosts_own_bundle_is_a_whole_store(tmp_path: Path) -> None:
    from fusion_oci.policy.settings import SandboxSettings
    from fusion_oci.resolve import resolve

    wt = tmp_path / "wt"
    wt.mkdir()
    own = tmp_path / "company.pem"
    own.write_text("-----BEGIN CERTIFICATE-----\n")
    host = HostInfo(ca_bundle=str(own))
    context = PrepareContext(task_id="t", run_id="r", worktree_path=str(wt))
    for setting, complete in (("auto", True), (str(own), True), ("off", False)):
        task = resolve(
            SandboxSettings(host_ca=setting), context, host, env={}, cache_root=tmp_path / "c"
        )
        assert task.layout.ca_complete is complete, setting
    other = HostInfo(ca_bundle="/etc/ssl/certs/ca-certificates.crt")
    task = resolve(
        SandboxSettings(host_ca=str(own)), context, other, env={}, cache_root=tmp_path / "c"
    )
    assert task.layout.ca_bundle == str(own) and not task.layout.ca_complete


def test_the_credential_bundle_is_as_whole_as_what_it_adds_to(tmp_path: Path) -> None:
    import dataclasses

    from fusion_oci.egress.credentials import credential_layout

    class Broker:  # what credential_layout reads of one
        credentials: tuple[()] = ()
        sentinels: ClassVar[dict[str, str]] = {}
        ca_cert_pem = b"-----BEGIN CERTIFICATE-----\nB\n-----END CERTIFICATE-----\n"

    host_ca = tmp_path / "host.pem"
    host_ca.write_text("-----BEGIN CERTIFICATE-----\nA\n-----END CERTIFICATE-----\n")
    partial = dataclasses.replace(LAYOUT, ca_bundle=str(host_ca), ca_complete=False)
    whole = dataclasses.replace(partial, ca_complete=True)
    none = dataclasses.replace(LAYOUT, ca_bundle=None, ca_complete=False)
    for layout, base, complete in (
        (partial, str(host_ca), False),
        (whole, str(host_ca), True),
        (none, str(host_ca), True),  # the host's own store, with the broker's CA
        (none, None, False),
    ):
        out = credential_layout(layout, base, Broker(), tmp_path)  # type: ignore[arg-type]
        assert out.ca_complete is complete, (layout.ca_complete, base)
