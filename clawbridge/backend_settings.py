"""A backend's own settings: a pydantic model the backend declares, filled from its TOML section
`[backends.<name>]` and its environment variables `CLAWBRIDGE_<NAME>_<FIELD>`.

This is how a backend installed by entry point (group `clawbridge.backends`), including a
third-party one, and the bundled local, tinker and fireworks backends get options without the
core's `Settings` knowing them.

Invariants:
- A backend declares its options by giving its entry-point factory a `settings_model` attribute:
  a pydantic `BaseModel` subclass (unknown options are refused here whatever its `extra`), and
  may name the same class in the `clawbridge.backend_settings` group so it is listed without
  importing the backend (`clawbridge.plugins.settings_models`). It reads them with
  `backend_section(settings, name, model)`.
- Sources, highest first: flags (`Settings.backend_flags`, set by the CLI through
  `load_settings(backend_flags=...)`), the environment, then the TOML section
  `Settings.backends[name]`, then the model's defaults. A field's environment variable is
  `CLAWBRIDGE_<NAME>_<FIELD>` (`env_prefix(name)`: the backend name upper-cased, `-` and `.` as
  `_`), or the names it lists itself in `json_schema_extra={"env": [...]}` (first set wins: how
  `api_key` keeps reading `TINKER_API_KEY`). Environment values of list or dict fields are JSON.
- Validated when the backend is selected (`clawbridge.plugins.load_backend`), before its factory
  runs: a bad value or an unknown option raises `BackendSettingsError` naming
  `backends.<name>.<field>` and its environment variable. A section given to a backend that
  declares no settings model is refused the same way, so a mistyped option never passes silently.
- An option that moved from the flat `Settings` into a backend's section (`tinker_base_url` ->
  `[backends.tinker] base_url`, `engine` -> `[backends.local] engine`) is refused at the top level
  with `clawbridge.config.OptionMoved`, whose message names where it went
  (`clawbridge.plugins.moved_option`) and no value. Its old
  environment variable keeps working: it is the section's own (`CLAWBRIDGE_TINKER_BASE_URL`), or
  the option lists it after its own (`CLAWBRIDGE_LOCAL_ENGINE`, then `CLAWBRIDGE_ENGINE`).
- Secrets are never shown: `clawbridge.config.masked_section` prints a `SecretStr` field, or any option whose name
  says key/secret/token/password, as `***`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

if TYPE_CHECKING:
    from clawbridge.config import Settings

M = TypeVar("M", bound=BaseModel)

class BackendSettingsError(ValueError):
    """A backend's section (TOML or environment) does not fit its settings model."""


def env_prefix(name: str) -> str:
    """`CLAWBRIDGE_<NAME>_`: where backend `name`'s options are read from the environment."""
    return "CLAWBRIDGE_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper() + "_"


def _is_structured(annotation: Any) -> bool:
    origin = get_origin(annotation) or annotation
    return origin in (list, dict, tuple, set)


def env_names(name: str, field_name: str, info: FieldInfo) -> list[str]:
    """The environment variables that set option `field_name` of backend `name`, highest first."""
    extra = info.json_schema_extra
    listed = extra.get("env") if isinstance(extra, dict) else None
    if isinstance(listed, list) and listed:
        return [str(v) for v in listed]
    return [env_prefix(name) + field_name.upper()]


def _values(name: str, model: type[BaseModel] | None, settings: Settings,
            environ: Mapping[str, str]) -> dict[str, Any]:
    values = dict(settings.backends.get(name, {}))
    if model is None:
        return values
    for field_name, info in model.model_fields.items():
        var, raw = next(((v, environ[v]) for v in env_names(name, field_name, info) if v in environ), ("", None))
        if raw is None:
            continue
        if _is_structured(info.annotation):
            try:
                values[field_name] = json.loads(raw)
            except ValueError:
                raise BackendSettingsError(
                    f"{var}: expected JSON (a list or object), got {raw[:80]!r}"
                ) from None
        else:
            values[field_name] = raw
    values.update(settings.backend_flags.get(name, {}))
    return values


def backend_section(settings: Settings, name: str, model: type[M], *,
                    environ: Mapping[str, str] | None = None) -> M:
    """Backend `name`'s options as `model` (module invariants); raises `BackendSettingsError`."""
    values = _values(name, model, settings, os.environ if environ is None else environ)
    unknown = sorted(set(values) - set(model.model_fields))
    if unknown:
        raise BackendSettingsError(
            f"backend {name!r} settings: unknown option(s) {', '.join(f'backends.{name}.{k}' for k in unknown)}; "
            f"known: {', '.join(model.model_fields) or 'none'}"
        )
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            top = str(err["loc"][0]) if err["loc"] else ""
            info = model.model_fields.get(top)
            env = " or ".join(env_names(name, top, info)) if info else env_prefix(name) + top.upper()
            problems.append(f"backends.{name}.{field} (env {env}): {err['msg']}")
        raise BackendSettingsError(f"backend {name!r} settings: " + "; ".join(problems)) from None


def check_backend_section(settings: Settings, name: str, model: type[BaseModel] | None) -> None:
    """Validate backend `name`'s section when it is selected; a section for a backend without a
    settings model is an error (module invariants)."""
    if model is None:
        section = settings.backends.get(name)
        if section:
            raise BackendSettingsError(
                f"backend {name!r} takes no options, but [backends.{name}] sets {', '.join(sorted(section))}"
            )
        return
    backend_section(settings, name, model)
