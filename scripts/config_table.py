"""Print the README's configuration table from `Settings` (so the two never drift)."""

from __future__ import annotations

import json

from pydantic import AliasChoices

from clawbridge.config import Settings


def rows() -> list[str]:
    out = ["| option (TOML key) | environment | default | what it does |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            env = ", ".join(f"`{a}`" for a in alias.choices if isinstance(a, str) and a.isupper())
        else:
            env = f"`CLAWBRIDGE_{name.upper()}`"
        default = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
        shown = "(secret)" if "key" in name and default is None else json.dumps(default, default=str)
        out.append(f"| `{name}` | {env} | `{shown}` | {field.description or ''} |")
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
