"""Backend-specific settings live in their backend's section (`docker: {url}`, `podman: {url}`,
`oci: {runtime}`); the old flat keys still load, with a warning that names the new spelling."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusion_oci.errors import SettingsError
from fusion_oci.policy.settings import SandboxSettings, flatten, load_settings


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    return {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}


def test_sections_are_read_merged_and_shown(tmp_path: Path, env: dict[str, str]) -> None:
    glob = write(
        tmp_path / "home" / ".config" / "fusion" / "settings.yaml",
        "sandbox:\n  docker: {url: 'tcp://build:2376'}\n  oci: {runtime: runsc}\n",
    )
    project = tmp_path / "p"
    proj = write(
        project / ".fusion" / "settings.yaml",
        "sandbox:\n  podman:\n    url: unix:///run/p.sock\n  oci: {runtime: crun}\n",
    )
    eff = load_settings(project_dir=project, env=env)
    s = eff.settings
    assert (s.docker.url, s.podman.url, s.oci.runtime) == (
        "tcp://build:2376",
        "unix:///run/p.sock",
        "crun",
    )
    assert eff.provenance["docker.url"] == str(glob)
    assert eff.provenance["oci.runtime"] == str(proj)
    # what `fusion-oci settings show` lists
    shown = flatten(s.model_dump(mode="json", by_alias=True))
    assert shown["docker.url"] == "tcp://build:2376" and shown["oci.runtime"] == "crun"
    assert not {"dockerUrl", "podmanUrl", "ociRuntime"} & set(shown)
    assert eff.warnings == []


def test_defaults() -> None:
    s = SandboxSettings()
    assert (s.docker.url, s.podman.url, s.oci.runtime) == (None, None, "runc")


@pytest.mark.parametrize(
    ("yaml", "old", "new"),
    [
        (
            "sandbox:\n  dockerUrl: unix:///d.sock\n",
            "sandbox.dockerUrl",
            "`docker: {url: unix:///d.sock}`",
        ),
        (
            "sandbox:\n  podmanUrl: unix:///p.sock\n",
            "sandbox.podmanUrl",
            "`podman: {url: unix:///p.sock}`",
        ),
        ("sandbox:\n  ociRuntime: runsc\n", "sandbox.ociRuntime", "`oci: {runtime: runsc}`"),
        ("sandbox:\n  oci_runtime: runsc\n", "sandbox.oci_runtime", "`oci: {runtime: runsc}`"),
    ],
)
def test_flat_keys_load_with_a_deprecation_naming_the_new_spelling(
    tmp_path: Path, env: dict[str, str], yaml: str, old: str, new: str
) -> None:
    project = tmp_path / "p"
    path = write(project / ".fusion" / "settings.yaml", yaml)
    eff = load_settings(project_dir=project, env=env)
    (warning,) = eff.warnings
    assert str(path) in warning and old in warning and "deprecated" in warning
    assert f"write it as {new}" in warning
    section, _, key = new.strip("`").partition(": {")
    value = getattr(getattr(eff.settings, section), key.split(":")[0])
    assert value == new.split(": ")[-1].rstrip("}`")


def test_flat_and_sectioned_spelling_that_disagree_is_an_error(
    tmp_path: Path, env: dict[str, str]
) -> None:
    project = tmp_path / "p"
    write(
        project / ".fusion" / "settings.yaml",
        "sandbox:\n  dockerUrl: unix:///a.sock\n  docker: {url: unix:///b.sock}\n",
    )
    with pytest.raises(SettingsError) as info:
        load_settings(project_dir=project, env=env)
    assert "sandbox.dockerUrl" in info.value.what
    assert "docker: {url" in info.value.hint


def test_unknown_key_in_a_section_names_the_accepted_ones(
    tmp_path: Path, env: dict[str, str]
) -> None:
    project = tmp_path / "p"
    write(project / ".fusion" / "settings.yaml", "sandbox:\n  docker: {host: x}\n")
    with pytest.raises(SettingsError) as info:
        load_settings(project_dir=project, env=env)
    assert "sandbox.docker.host" in info.value.what
    assert info.value.hint == "accepted keys: url"


def test_python_callers_of_the_flat_names_still_work() -> None:
    s = SandboxSettings(backend="oci", oci_runtime="runsc", podman_url="unix:///p")
    assert s.oci.runtime == "runsc" and s.podman.url == "unix:///p"
    assert s.oci_runtime == "runsc" and s.podman_url == "unix:///p" and s.docker_url is None
