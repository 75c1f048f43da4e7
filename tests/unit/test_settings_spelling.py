"""One spelling per settings key (the README's camelCase), and warnings for what is ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusion_oci.errors import SettingsError
from fusion_oci.policy.settings import load_settings


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    return {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}


@pytest.mark.parametrize(
    ("yaml", "wrong", "right"),
    [
        ("sandbox:\n  failure_mode: fallback-native\n", "sandbox.failure_mode", "failureMode"),
        (
            "sandbox:\n  policy:\n    allow_network: false\n",
            "sandbox.policy.allow_network",
            "allowNetwork",
        ),
        (
            "sandbox:\n  policy:\n    cpuLimit: {max_cores: 1}\n",
            "sandbox.policy.cpuLimit.max_cores",
            "maxCores",
        ),
        (
            "sandbox:\n  gates: {sandbox_provision: allow}\n",
            "sandbox.gates.sandbox_provision",
            "sandboxProvision",
        ),
    ],
)
def test_python_spelling_is_refused_with_the_right_one(
    tmp_path: Path, env: dict[str, str], yaml: str, wrong: str, right: str
) -> None:
    project = tmp_path / "p"
    write(project / ".fusion" / "settings.yaml", yaml)
    with pytest.raises(SettingsError) as info:
        load_settings(project_dir=project, env=env)
    assert wrong in info.value.what
    assert info.value.hint == f"write it as {right}"


def test_camel_case_is_read_and_its_source_named(tmp_path: Path, env: dict[str, str]) -> None:
    project = tmp_path / "p"
    path = write(
        project / ".fusion" / "settings.yaml", "sandbox:\n  policy:\n    allowNetwork: false\n"
    )
    eff = load_settings(project_dir=project, env=env)
    assert eff.settings.policy.allow_network is False
    assert eff.provenance["policy.allowNetwork"] == str(path)
    assert eff.warnings == []


def test_ignored_files_and_top_level_keys_are_warned_about(
    tmp_path: Path, env: dict[str, str]
) -> None:
    project = tmp_path / "p"
    write(project / ".fusion" / "settings.yml", "sandbox:\n  backend: bubblewrap\n")
    path = write(project / ".fusion" / "settings.yaml", "backend: bubblewrap\nother: 1\n")
    eff = load_settings(project_dir=project, env=env)
    assert eff.settings.backend == "native"
    assert len(eff.warnings) == 2
    assert "settings.yml is ignored" in eff.warnings[0]
    assert eff.warnings[1] == (
        f"{path}: backend at the top level is ignored; indent it under `sandbox:`"
    )
