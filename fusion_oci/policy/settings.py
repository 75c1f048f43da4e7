"""Sandbox settings: global YAML, project YAML, task-prompt override and CLI flags, merged.

Each layer is a partial mapping under the ``sandbox:`` key. Layers merge key by key (a later
layer wins per leaf; ``policy`` and ``cpuLimit`` merge inside too), and every effective value
remembers which layer set it, for ``fusion-oci settings show``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from fusion_oci.errors import SettingsError
from fusion_oci.models import BackendId, CacheMode, FailureMode, Model, SandboxPolicy
from fusion_oci.policy.credentials import CredentialSpec, check_unique
from fusion_oci.policy.kubernetes import KubernetesSettings

GateDecision = Literal["allow", "deny", "ask"]


class GateSettings(Model):
    """Action gates (brief 4.3)."""

    sandbox_provision: GateDecision = "ask"
    """First build/pull of an image and any helper install."""
    network_api: GateDecision = "ask"
    """Outbound fetches a backend needs to provision."""


class DockerSettings(Model):
    """``docker:``: read by the docker backend, image provisioning, ``gc`` and ``repro``."""

    url: str | None = None
    """Docker API address (``unix:///path``, ``tcp://host:2376``). None: as the Docker CLI
    finds it: DOCKER_HOST (with DOCKER_TLS_VERIFY / DOCKER_CERT_PATH), the current context,
    then the default (or a rootless dockerd's) socket."""


class PodmanSettings(Model):
    """``podman:``: read by the podman backend, the oci backend's image export, image
    provisioning, ``gc`` and ``repro``."""

    url: str | None = None
    """Podman API socket (``unix:///path``). None: as podman finds it: CONTAINER_HOST, a
    system connection (CONTAINER_CONNECTION or the default one), then podman's default socket
    for this user; when none answers, the podman backend starts ``podman system service``."""


class OciSettings(Model):
    """``oci:``: read by the oci backend."""

    runtime: str = "runc"
    """OCI runtime CLI (runc, crun, runsc, youki), a name on PATH or an absolute path."""


MOVED_KEYS: dict[str, tuple[str, str]] = {
    # old flat key (either spelling) -> (section, key): every backend carried them before
    "dockerUrl": ("docker", "url"),
    "docker_url": ("docker", "url"),
    "podmanUrl": ("podman", "url"),
    "podman_url": ("podman", "url"),
    "ociRuntime": ("oci", "runtime"),
    "oci_runtime": ("oci", "runtime"),
}


def migrate_flat_keys(data: Mapping[str, Any], source: str) -> tuple[dict[str, Any], list[str]]:
    """The layer with the old flat backend keys moved into their sections, and one
    deprecation warning per moved key naming the new spelling. Pure."""
    out = dict(data)
    warnings: list[str] = []
    for key in [k for k in data if k in MOVED_KEYS]:
        section, name = MOVED_KEYS[key]
        value = out.pop(key)
        current = out.get(section)
        block = dict(current) if isinstance(current, Mapping) else {}
        if name in block and block[name] != value:
            raise SettingsError(
                f"settings error in {source} at sandbox.{key}",
                f"both '{key}' and '{section}.{name}' are set",
                f"keep only `{section}: {{{name}: ...}}`",
            )
        block[name] = value
        out[section] = block
        shown = value if isinstance(value, str) else json.dumps(value)
        warnings.append(
            f"{source}: sandbox.{key} is deprecated; write it as `{section}: {{{name}: {shown}}}`"
        )
    return out, warnings


def services_into_policy(data: Mapping[str, Any]) -> dict[str, Any]:
    """``sandbox.services`` (the spelling of CI systems and of issue #35) is
    ``sandbox.policy.services``: moved there, an error when both are set. Pure."""
    out = dict(data)
    services = out.pop("services")
    policy = out.get("policy")
    block = dict(policy) if isinstance(policy, Mapping) else {}
    if block.get("services") not in (None, [], services):
        raise ValueError(
            "both sandbox.services and sandbox.policy.services are set; keep one of the two "
            "(they are the same setting)"
        )
    block["services"] = services
    out["policy"] = block
    return out


class SandboxSettings(Model):
    """The effective ``sandbox:`` settings."""

    @model_validator(mode="before")
    @classmethod
    def _flat_backend_keys(cls, data: Any) -> Any:
        # Python callers written against the flat keys (``podman_url=...``) keep working;
        # settings files get a deprecation warning instead (see migrate_flat_keys).
        if isinstance(data, Mapping) and any(k in MOVED_KEYS for k in data):
            data = migrate_flat_keys(data, "SandboxSettings")[0]
        if isinstance(data, Mapping) and "services" in data:
            data = services_into_policy(data)
        return data

    backend: BackendId = "native"
    failure_mode: FailureMode = "fail-hard"
    policy: SandboxPolicy = Field(default_factory=SandboxPolicy)
    image: str | None = None
    """Image for container runtimes. None: the host's system directories (native, bubblewrap)."""
    cache_mode: CacheMode = CacheMode.SHARED
    host_ca: str = "auto"
    """``auto``: share the host CA bundle when one exists; ``off``; or an absolute path."""
    custom_runtime: str | None = None
    """Entry-point name of the runtime used when backend is ``custom``."""
    docker: DockerSettings = Field(default_factory=DockerSettings)
    podman: PodmanSettings = Field(default_factory=PodmanSettings)
    oci: OciSettings = Field(default_factory=OciSettings)
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)
    container_mode: Literal["warm", "oneshot"] = "warm"
    """podman/docker: ``warm`` keeps one container per task and execs each command in it;
    ``oneshot`` creates and removes a container per command."""
    gates: GateSettings = Field(default_factory=GateSettings)
    credentials: list[CredentialSpec] = Field(default_factory=list)
    """Secrets by reference (``network: filtered`` only): each variable holds a sentinel in
    the sandbox; the task's proxy puts the value in the ``Authorization`` header of requests
    to the credential's hosts (docs/egress.md, Credentials). Empty: none."""

    @field_validator("credentials")
    @classmethod
    def _unique_credentials(cls, value: list[CredentialSpec]) -> list[CredentialSpec]:
        return check_unique(value)

    # Deprecated readers of the old flat keys, for code written before the sections.
    @property
    def docker_url(self) -> str | None:
        return self.docker.url

    @property
    def podman_url(self) -> str | None:
        return self.podman.url

    @property
    def oci_runtime(self) -> str:
        return self.oci.runtime


@dataclass(frozen=True)
class Layer:
    """One source of settings: its name (a file path, "task prompt", "command line") and data."""

    source: str
    data: Mapping[str, Any]


@dataclass(frozen=True)
class EffectiveSettings:
    settings: SandboxSettings
    provenance: dict[str, str] = field(default_factory=dict)
    """Dotted camelCase key path → the layer that set it ("default" when none did)."""
    warnings: list[str] = field(default_factory=list)
    """Settings that are ignored (a file or key fusion-oci does not read), for the CLI to show."""


OUR_KEYS = frozenset(f.alias or n for n, f in SandboxSettings.model_fields.items())
IGNORED_NAMES = ("settings.yml", "settings.json", "sandbox.yaml")


def _ignored(path: Path, doc: object) -> list[str]:
    """Files beside the settings file ``path`` that look like settings but are not read, and
    sandbox keys its document ``doc`` writes outside ``sandbox:``. Never raises."""
    out: list[str] = []
    for name in IGNORED_NAMES:
        other = path.with_name(name)
        if other.is_file():
            out.append(f"{other} is ignored: fusion-oci reads {path.name} (rename it)")
    if isinstance(doc, dict):
        stray = sorted(k for k in doc if k in OUR_KEYS)
        if stray:
            out.append(
                f"{path}: {', '.join(stray)} at the top level is ignored; "
                "indent it under `sandbox:`"
            )
    return out


def global_settings_path(env: Mapping[str, str]) -> Path:
    """``$XDG_CONFIG_HOME/fusion/settings.yaml``, falling back to ``~/.config``."""
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "fusion" / "settings.yaml"


def project_settings_path(project_dir: Path) -> Path:
    return project_dir / ".fusion" / "settings.yaml"


_MISSING = object()


def _read_doc(path: Path) -> object:
    """The YAML document of a settings file; ``_MISSING`` when there is no such file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return _MISSING
    except OSError as exc:
        raise SettingsError(
            f"cannot read settings file {path}", str(exc), "fix its permissions"
        ) from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise SettingsError(
            f"settings file {path} is not valid YAML{where}",
            str(getattr(exc, "problem", exc)),
            "fix the YAML syntax",
        ) from exc


def _layer_of(path: Path, doc: object) -> Layer | None:
    if doc is _MISSING:
        return None
    if doc is None:
        return Layer(str(path), {})
    if not isinstance(doc, dict):
        raise SettingsError(
            f"settings file {path}", "the document must be a mapping", "start it with `sandbox:`"
        )
    # Other tools keep their own top-level keys in the same file; only `sandbox:` is ours.
    sandbox = doc.get("sandbox", {}) or {}
    if not isinstance(sandbox, dict):
        raise SettingsError(
            f"settings error in {path} at sandbox",
            f"expected a mapping, got {type(sandbox).__name__}",
            "write `sandbox:` followed by indented keys such as `backend: bubblewrap`",
        )
    layer = Layer(str(path), sandbox)
    validate_layer(layer)
    return layer


def read_layer(path: Path) -> Layer | None:
    """Read one YAML settings file; None when it does not exist."""
    return _layer_of(path, _read_doc(path))


def file_layers(
    project_dir: Path | None, env: Mapping[str, str], global_path: Path | None = None
) -> tuple[list[Layer], list[str]]:
    """The global, then the project settings file, each read once: the layers of those that
    exist, and what is ignored in or beside them."""
    layers: list[Layer] = []
    warnings: list[str] = []
    gpath = global_path or global_settings_path(env)
    for path in [gpath, project_settings_path(project_dir) if project_dir else None]:
        if path is None:
            continue
        doc = _read_doc(path)  # raises on a bad file, before its warnings are looked for
        if (layer := _layer_of(path, doc)) is not None:
            layers.append(layer)
        warnings += _ignored(path, None if doc is _MISSING else doc)
    return layers, warnings


def _merge(
    base: dict[str, Any],
    top: Mapping[str, Any],
    source: str,
    prov: dict[str, str],
    prefix: str = "",
) -> None:
    for key, value in top.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value, source, prov, path + ".")
        elif isinstance(value, Mapping):
            base[key] = {}
            _merge(base[key], value, source, prov, path + ".")
        else:
            base[key] = value
            for stale in [p for p in prov if p.startswith(path + ".")]:
                del prov[stale]
            prov[path] = source


def _field_hint(model: type[Model], loc: tuple[int | str, ...]) -> str:
    """Accepted keys at ``loc`` (for unknown-key errors)."""
    current: Any = model
    for part in loc[:-1]:
        fields = getattr(current, "model_fields", None)
        if fields is None:
            return ""
        match = next((f for n, f in fields.items() if part in (n, f.alias)), None)
        if match is None:
            return ""
        current = match.annotation
        # Optional[Model] → Model
        args = getattr(current, "__args__", ())
        for arg in args:
            if hasattr(arg, "model_fields"):
                current = arg
    fields = getattr(current, "model_fields", None)
    if not fields:
        return ""
    return "accepted keys: " + ", ".join(f.alias or n for n, f in fields.items())


def _raise_validation(source: str, exc: ValidationError, prov: Mapping[str, str] | None) -> None:
    first = exc.errors()[0]
    loc = tuple(first["loc"])
    keypath = ".".join(str(p) for p in loc)
    where = source
    if prov is not None:
        where = prov.get(keypath) or next(
            (s for p, s in prov.items() if p.startswith(keypath)), source
        )
    value = first.get("input")
    if first["type"] == "extra_forbidden":
        why = f"unknown key '{loc[-1]}'"
        hint = _field_hint(SandboxSettings, loc) or "remove it"
    else:
        msg = first["msg"].removeprefix("Value error, ")
        if msg.startswith("Input should be "):
            why = f"bad value {value!r}"
            hint = "accepted: " + msg.removeprefix("Input should be ")
        else:
            why = f"bad value {value!r}: {msg}"
            hint = "fix or remove the value"
    raise SettingsError(f"settings error in {where} at sandbox.{keypath}", why, hint) from exc


def _python_names(model: Any, data: Mapping[str, Any], prefix: str = "") -> tuple[str, str]:
    """The first key written with its Python name instead of the documented camelCase one:
    (key path as written, the spelling to use); ("", "") when there is none."""
    fields = getattr(model, "model_fields", {})
    for key, value in data.items():
        match = next(((n, f) for n, f in fields.items() if key in (n, f.alias)), None)
        if match is None:
            continue
        name, info = match
        alias = info.alias or name
        if key != alias:
            return f"{prefix}{key}", alias
        if isinstance(value, Mapping):
            sub = info.annotation
            for arg in (sub, *getattr(sub, "__args__", ())):
                if hasattr(arg, "model_fields"):
                    found = _python_names(arg, value, f"{prefix}{key}.")
                    if found[0]:
                        return found
    return "", ""


def validate_layer(layer: Layer) -> None:
    """Validate one layer alone, so that an error names the layer that holds it. Keys have
    one spelling, the camelCase the README uses (``allowNetwork``, not ``allow_network``)."""
    data = migrate_flat_keys(layer.data, layer.source)[0]
    wrong, right = _python_names(SandboxSettings, data)
    if wrong:
        raise SettingsError(
            f"settings error in {layer.source} at sandbox.{wrong}",
            f"unknown key '{wrong.rsplit('.', 1)[-1]}'",
            f"write it as {right}",
        )
    try:
        SandboxSettings.model_validate(data)
    except ValidationError as exc:
        _raise_validation(layer.source, exc, None)


def merge_layers(layers: list[Layer]) -> EffectiveSettings:
    """Merge layers in order (later wins, key by key) and validate the result."""
    merged: dict[str, Any] = {}
    prov: dict[str, str] = {}
    warnings: list[str] = []
    for layer in layers:
        validate_layer(layer)
        data, moved = migrate_flat_keys(layer.data, layer.source)
        warnings += moved
        _merge(merged, data, layer.source, prov)
    try:
        settings = SandboxSettings.model_validate(merged)
    except ValidationError as exc:
        _raise_validation("merged settings", exc, prov)
        raise  # unreachable; keeps type checkers calm
    return EffectiveSettings(settings, prov, warnings)


def load_settings(
    *,
    project_dir: Path | None,
    env: Mapping[str, str],
    task_prompt: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    global_path: Path | None = None,
) -> EffectiveSettings:
    """Global file, project file, task-prompt override, then CLI overrides (in that order)."""
    from fusion_oci.policy.prompt import parse_prompt_override

    layers, ignored = file_layers(project_dir, env, global_path)
    if task_prompt and (backend := parse_prompt_override(task_prompt)):
        layers.append(Layer("task prompt", {"backend": backend}))
    if overrides:
        layers.append(Layer("command line", overrides))
    merged = merge_layers(layers)
    return EffectiveSettings(merged.settings, merged.provenance, merged.warnings + ignored)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping → dotted key paths (for display)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
