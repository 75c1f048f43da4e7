from __future__ import annotations

from pathlib import Path

import pytest

from fusion_oci.errors import SettingsError
from fusion_oci.models import NetworkMode
from fusion_oci.policy.prompt import parse_prompt_override
from fusion_oci.policy.settings import Layer, load_settings, merge_layers


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    home = tmp_path / "home"
    project = tmp_path / "project"
    project.mkdir()
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    return home, project, env


def test_defaults_when_no_files(dirs: tuple[Path, Path, dict[str, str]]) -> None:
    _, project, env = dirs
    eff = load_settings(project_dir=project, env=env)
    assert eff.settings.backend == "native"
    assert eff.settings.failure_mode == "fail-hard"
    assert eff.settings.policy.network_mode is NetworkMode.EGRESS
    assert eff.provenance == {}


def test_project_wins_and_policy_merges_key_by_key(dirs: tuple[Path, Path, dict[str, str]]) -> None:
    home, project, env = dirs
    gpath = write(
        home / ".config/fusion/settings.yaml",
        """
sandbox:
  backend: bubblewrap
  failureMode: fallback-native
  policy:
    memoryLimitMb: 512
    envAllowlist: [CI]
    cpuLimit: {maxCores: 2, maxMs: 1000}
""",
    )
    ppath = write(
        project / ".fusion/settings.yaml",
        """
sandbox:
  backend: podman
  policy:
    allowNetwork: false
    cpuLimit: {maxMs: 5000}
""",
    )
    eff = load_settings(project_dir=project, env=env)
    s = eff.settings
    assert s.backend == "podman"
    assert s.failure_mode == "fallback-native"
    assert s.policy.memory_limit_mb == 512
    assert s.policy.env_allowlist == ["CI"]
    assert s.policy.allow_network is False
    assert s.policy.network_mode is NetworkMode.NONE
    assert s.policy.cpu_limit is not None
    assert (s.policy.cpu_limit.max_cores, s.policy.cpu_limit.max_ms) == (2, 5000)
    assert eff.provenance["backend"] == str(ppath)
    assert eff.provenance["failureMode"] == str(gpath)
    assert eff.provenance["policy.cpuLimit.maxCores"] == str(gpath)
    assert eff.provenance["policy.cpuLimit.maxMs"] == str(ppath)


def test_prompt_then_cli_override(dirs: tuple[Path, Path, dict[str, str]]) -> None:
    _, project, env = dirs
    write(project / ".fusion/settings.yaml", "sandbox:\n  backend: bubblewrap\n")
    eff = load_settings(project_dir=project, env=env, task_prompt="Do it.\n**Sandbox:** podman\n")
    assert eff.settings.backend == "podman"
    assert eff.provenance["backend"] == "task prompt"
    eff = load_settings(
        project_dir=project,
        env=env,
        task_prompt="**Sandbox:** podman",
        overrides={"backend": "docker"},
    )
    assert eff.settings.backend == "docker"
    assert eff.provenance["backend"] == "command line"


@pytest.mark.parametrize(
    ("text", "keypath", "needle"),
    [
        ("sandbox:\n  backend: lxc\n", "sandbox.backend", "'native'"),
        (
            "sandbox:\n  policy:\n    allowedPaths: [relative/dir]\n",
            "sandbox.policy.allowedPaths",
            "absolute",
        ),
        (
            "sandbox:\n  policy:\n    memoryLimitMb: -5\n",
            "sandbox.policy.memoryLimitMb",
            "greater than 0",
        ),
        (
            "sandbox:\n  policy:\n    memoryLimit: 5\n",
            "sandbox.policy.memoryLimit",
            "memoryLimitMb",
        ),
        ("sandbox:\n  bakend: podman\n", "sandbox.bakend", "backend"),
        ("sandbox:\n  failureMode: retry\n", "sandbox.failureMode", "fallback-native"),
        (
            "sandbox:\n  policy:\n    cpuLimit: {maxCores: 0}\n",
            "sandbox.policy.cpuLimit.maxCores",
            "greater than 0",
        ),
        (
            "sandbox:\n  policy:\n    allowNetwork: false\n    network: egress\n",
            "sandbox.policy",
            "allowNetwork",
        ),
    ],
)
def test_bad_file_names_file_key_value_and_fix(
    dirs: tuple[Path, Path, dict[str, str]], text: str, keypath: str, needle: str
) -> None:
    _, project, env = dirs
    path = write(project / ".fusion/settings.yaml", text)
    with pytest.raises(SettingsError) as info:
        load_settings(project_dir=project, env=env)
    message = str(info.value)
    assert str(path) in message
    assert keypath in message
    assert needle in message
    assert "hint:" in message
    assert info.value.exit_code == 2


def test_broken_yaml_names_line(dirs: tuple[Path, Path, dict[str, str]]) -> None:
    _, project, env = dirs
    path = write(project / ".fusion/settings.yaml", "sandbox:\n  backend: [podman\n")
    with pytest.raises(SettingsError) as info:
        load_settings(project_dir=project, env=env)
    assert str(path) in str(info.value)
    assert "line" in str(info.value)


def test_sandbox_not_a_mapping(dirs: tuple[Path, Path, dict[str, str]]) -> None:
    _, project, env = dirs
    write(project / ".fusion/settings.yaml", "sandbox: podman\n")
    with pytest.raises(SettingsError, match="expected a mapping"):
        load_settings(project_dir=project, env=env)


def test_error_in_global_file_names_global_file(dirs: tuple[Path, Path, dict[str, str]]) -> None:
    home, project, env = dirs
    gpath = write(home / ".config/fusion/settings.yaml", "sandbox:\n  cacheMode: sometimes\n")
    with pytest.raises(SettingsError) as info:
        load_settings(project_dir=project, env=env)
    assert str(gpath) in str(info.value)


def test_cross_layer_conflict_is_reported() -> None:
    with pytest.raises(SettingsError, match="allowNetwork"):
        merge_layers(
            [
                Layer("a.yaml", {"policy": {"network": "egress"}}),
                Layer("b.yaml", {"policy": {"allowNetwork": False}}),
            ]
        )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("**Sandbox:** podman", "podman"),
        ("**sandbox:**   Bubblewrap  ", "bubblewrap"),
        ("** SANDBOX ** : docker", "docker"),
        ("**Sandbox**: `native`", "native"),
        ("- **Sandbox:** sandbox-exec", "sandbox-exec"),
        ("intro\n**Sandbox:** podman\nmore\n**Sandbox:** docker\n", "docker"),
        ("no override here, Sandbox: podman", None),
        ("", None),
    ],
)
def test_prompt_override(prompt: str, expected: str | None) -> None:
    assert parse_prompt_override(prompt) == expected


def test_prompt_override_unknown_backend() -> None:
    with pytest.raises(SettingsError) as info:
        parse_prompt_override("**Sandbox:** firecracker")
    assert "task prompt" in str(info.value)
    assert "bubblewrap" in str(info.value)
