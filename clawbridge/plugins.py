"""The backend registry: which backends are installed (entry points), their settings models, and
creating the selected one. It sits above the settings (`clawbridge.config`, which knows no
backend), the settings sections (`clawbridge.backend_settings`) and the backend seam's types and
protocols (`clawbridge.backend`).

Backends are plugins found through the `clawbridge.backends` entry-point group; the core never
imports torch, tinker or fireworks. An entry point names a factory
`create(settings: clawbridge.config.Settings) -> ServingBackend` (a `TrainingBackend` when the
backend can train); a factory with a `settings_model` attribute has its own options
(`clawbridge.backend_settings`), validated by `load_backend` before the factory runs.
A backend may also name that model in the `clawbridge.backend_settings` group (same name, value
`package.settings:Model`), so its options can be listed (`settings_models`, `clawbridge config
show`) without importing the backend itself, with torch or its SDK.

Invariants:
- Listing settings models loads only the `clawbridge.backend_settings` entry points; a backend
  that declares none there is loaded for its factory's `settings_model` instead. Where both are
  declared they name the same class (`load_backend` warns otherwise and uses the factory's).
- Importing this module teaches `Settings` where a backend's old flat option moved
  (`moved_option`, through `clawbridge.config.explain_unknown_options`); the CLI and the server
  import it before reading settings. Without it an old flat option is still refused, by name.
"""

from __future__ import annotations

import logging
import re
from importlib import metadata
from typing import Any

from pydantic import BaseModel

from clawbridge.backend import ServingBackend
from clawbridge.backend_settings import (
    BackendSettingsError,
    backend_section,
    check_backend_section,
    env_names,
    env_prefix,
)
from clawbridge.config import Settings, explain_unknown_options, masked_section

ENTRY_POINT_GROUP = "clawbridge.backends"
SETTINGS_ENTRY_POINT_GROUP = "clawbridge.backend_settings"
"""Entry points naming a backend's settings model directly (module invariants)."""

log = logging.getLogger(__name__)

# Which pip package provides each known backend, for the "install X" message.
KNOWN_BACKEND_PACKAGES: dict[str, str] = {
    "local": "backends/local (pip install -e backends/local)",
    "tinker": "backends/tinker (pip install -e backends/tinker)",
    "fireworks": "backends/fireworks (pip install -e backends/fireworks)",
}


class BackendNotInstalled(RuntimeError):
    """No entry point provides the requested backend."""


def available_backends() -> dict[str, metadata.EntryPoint]:
    """Backends installed in this environment, by name."""
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _light_entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=SETTINGS_ENTRY_POINT_GROUP)}


def settings_model(name: str) -> type[BaseModel] | None:
    """Installed backend `name`'s settings model (None: it declares none, or is not installed),
    from its light `clawbridge.backend_settings` entry point where it has one, else from its
    factory (module invariants). Raises what importing it raises."""
    return _settings_model(available_backends().get(name), _light_entry_points().get(name))


def _settings_model(ep: metadata.EntryPoint | None, light: metadata.EntryPoint | None) -> type[BaseModel] | None:
    if ep is None:
        return None
    model: type[BaseModel] | None = light.load() if light is not None else getattr(ep.load(), "settings_model", None)
    return model


def settings_models() -> dict[str, type[BaseModel] | None]:
    """Each installed backend's `settings_model`, by name. A backend whose entry point fails to
    import is left out (`load_backend` reports it when it is selected)."""
    out: dict[str, type[BaseModel] | None] = {}
    light = _light_entry_points()  # the installed metadata is scanned once per listing, not per backend
    for name, ep in sorted(available_backends().items()):
        try:
            out[name] = _settings_model(ep, light.get(name))
        except Exception as exc:  # a broken plugin must not hide the others
            log.warning("backend %r could not be loaded to read its options: %s", name, exc)
    return out


def _factory_settings_model(name: str, factory: Any) -> type[BaseModel] | None:
    """The settings model the factory declares; a different one in the light group is a packaging
    mistake, reported (module invariants)."""
    model: type[BaseModel] | None = getattr(factory, "settings_model", None)
    light = _light_entry_points().get(name)
    if light is not None and model is not None:
        try:
            declared: object = light.load()
        except Exception as exc:  # reported below like any other disagreement
            declared = exc
        if declared is not model:
            log.warning("backend %r: entry point %s:%s names %s but its factory declares %s; using the factory's",
                        name, SETTINGS_ENTRY_POINT_GROUP, name, light.value, model.__name__)
    return model


def shown_backend_options(settings: Settings) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """What `clawbridge config show` prints for the backends: each installed backend's resolved
    options (defaults, TOML section, environment, flags) and every other configured section as
    written, secrets masked; plus the problems found (a bad option of a backend not selected)."""
    shown: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    models = settings_models()
    for name in sorted(set(models) | set(settings.backends)):
        model = models.get(name)
        if model is None:
            if name in settings.backends:
                shown[name] = masked_section(settings.backends[name])
            continue
        try:
            shown[name] = masked_section(backend_section(settings, name, model))
        except BackendSettingsError as exc:
            problems.append(str(exc))
            shown[name] = masked_section(settings.backends.get(name, {}))
    return shown, problems


def resolved_config(settings: Settings) -> tuple[dict[str, Any], list[str]]:
    """Every option as the run will use it, secrets masked: `Settings.masked_dump` with `backends`
    replaced by each installed backend's resolved options (`shown_backend_options`), plus the
    problems found. What `clawbridge config show`, the dashboard and the W&B run config show."""
    dump = settings.masked_dump()
    dump["backends"], problems = shown_backend_options(settings)
    return dump, problems


def trained_model(settings: Settings, name: str) -> str:
    """The base model backend `name` trains: its own `base_model` option when its settings model
    has one and it is set (tinker's `[backends.tinker] base_model`), else `settings.model`."""
    model = settings_model(name)
    if model is not None and "base_model" in model.model_fields:
        own = getattr(backend_section(settings, name, model), "base_model", "")
        if own:
            return str(own)
    return settings.model


def load_backend(name: str, settings: Settings) -> ServingBackend:
    """Create the backend `name` through its entry point, or explain which package to install."""
    eps = available_backends()
    if name not in eps:
        hint = KNOWN_BACKEND_PACKAGES.get(name)
        installed = ", ".join(sorted(eps)) or "none"
        if hint:
            raise BackendNotInstalled(
                f"backend {name!r} is not installed; install the package in {hint}. Installed: {installed}"
            )
        raise BackendNotInstalled(f"unknown backend {name!r}; installed backends: {installed}")
    factory: Any = eps[name].load()
    check_backend_section(settings, name, _factory_settings_model(name, factory))
    backend = factory(settings)
    if not isinstance(backend, ServingBackend):
        raise TypeError(f"entry point {name!r} returned {type(backend).__name__}, not a ServingBackend")
    return backend


def _moved(key: str, backend: str, option: str, old_env: str) -> str:
    own = env_prefix(backend) + option.upper()
    env = (f"its environment variable {own} is unchanged" if old_env == own
           else f"its environment variable is {own}; {old_env} still works")
    return (f"option {key!r} moved to the {backend} backend's own section: set `{option}` under "
            f"`[backends.{backend}]` in the TOML file ({env})")


def moved_option(key: str) -> str | None:
    """Where a flat top-level option of a backend went, as the message that refuses it; None when
    `key` names no backend's option. It went to option O of backend B when `CLAWBRIDGE_<KEY>` is
    one of O's environment variables (`engine` -> `[backends.local] engine`, which still reads
    `CLAWBRIDGE_ENGINE`; `tinker_base_url` -> `[backends.tinker] base_url`), or, for a bundled
    backend that is not installed, when `key` starts with `<b>_`."""
    old_env = "CLAWBRIDGE_" + key.upper()
    models = settings_models()
    for backend, model in models.items():
        for option, info in (model.model_fields if model is not None else {}).items():
            if old_env in env_names(backend, option, info):
                return _moved(key, backend, option, old_env)
    for backend in sorted(set(KNOWN_BACKEND_PACKAGES) - set(models), key=len, reverse=True):
        stem = re.sub(r"[^A-Za-z0-9]", "_", backend).lower() + "_"
        if key.lower().startswith(stem) and len(key) > len(stem):
            return _moved(key, backend, key[len(stem):], old_env)
    return None


explain_unknown_options(moved_option)
