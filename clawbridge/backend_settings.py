"""A backend's own settings: a pydantic model the backend declares, filled from its TOML section
`[backends.<name>]` and its environment variables `CLAWBRIDGE_<NAME>_<FIELD>`.

This is how a backend installed by entry point (group `clawbridge.backends`), including a
third-party one, gets options without the core's `Settings` knowing them.

Invariants:
- A backend declares its options by giving its entry-point factory a `settings_model` attribute:
  a pydantic `BaseModel` subclass (unknown options are refused here whatever its `extra`). It reads them with
  `backend_section(settings, name, model)`.
- Sources, highest first: the environment `CLAWBRIDGE_<NAME>_<FIELD>` (`env_prefix(name)`: the
  backend name upper-cased, `-` and `.` as `_`), then the TOML section `Settings.backends[name]`,
  then the model's defaults. Environment values of list or dict fields are JSON.
- Validated when the backend is selected (`clawbridge.backend.load_backend`), before its factory
  runs: a bad value or an unknown option raises `BackendSettingsError` naming
  `backends.<name>.<field>` and its environment variable. A section given to a backend that
  declares no settings model is refused the same way, so a mistyped option never passes silently.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar, get_origin

from pydantic import BaseModel, ValidationError

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


def _values(name: str, model: type[BaseModel] | None, section: Mapping[str, Any],
            environ: Mapping[str, str]) -> dict[str, Any]:
    values = dict(section)
    if model is None:
        return values
    prefix = env_prefix(name)
    for field_name, info in model.model_fields.items():
        raw = environ.get(prefix + field_name.upper())
        if raw is None:
            continue
        if _is_structured(info.annotation):
            try:
                values[field_name] = json.loads(raw)
            except ValueError:
                raise BackendSettingsError(
                    f"{prefix}{field_name.upper()}: expected JSON (a list or object), got {raw[:80]!r}"
                ) from None
        else:
            values[field_name] = raw
    return values


def backend_section(settings: Settings, name: str, model: type[M], *,
                    environ: Mapping[str, str] | None = None) -> M:
    """Backend `name`'s options as `model` (module invariants); raises `BackendSettingsError`."""
    values = _values(name, model, settings.backends.get(name, {}), os.environ if environ is None else environ)
    prefix = env_prefix(name)
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
            problems.append(f"backends.{name}.{field} (env {prefix}{top.upper()}): {err['msg']}")
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
