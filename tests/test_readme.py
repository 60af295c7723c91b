"""README and CI agree with the code: every option is documented; CI runs the README's test command."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from clawbridge.config import Settings

ROOT = Path(__file__).resolve().parent.parent


def test_every_option_is_in_the_readme_table() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in Settings.model_fields if f"| `{name}` |" not in readme]
    assert not missing, f"README configuration table lacks {missing}: run scripts/config_table.py"


def test_the_readme_tables_are_what_the_script_generates() -> None:
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    assert spec is not None and spec.loader is not None
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    block = table.readme_block((ROOT / "README.md").read_text())
    assert block, "README.md lacks the configuration tables' markers"
    assert block == table.tables(), "README configuration tables are stale: run python scripts/config_table.py --write"
    titles = [title for title, _ in table.sections()]
    assert titles[0] == "server" and any("tinker" in t for t in titles) and any("fireworks" in t for t in titles)
    assert sum(len(names) for _, names in table.sections()) == len(Settings.model_fields)


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in readme and "python -m pytest -q" in ci
    assert "bash scripts/install.sh" in readme and "bash scripts/install.sh" in ci
