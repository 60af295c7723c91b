"""README and CI agree with the code: every option is documented; CI runs the README's test command."""

from __future__ import annotations

from pathlib import Path

from clawbridge.config import Settings

ROOT = Path(__file__).resolve().parent.parent


def test_every_option_is_in_the_readme_table() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in Settings.model_fields if f"| `{name}` |" not in readme]
    assert not missing, f"README configuration table lacks {missing}: run scripts/config_table.py"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in readme and "python -m pytest -q" in ci
    assert "bash scripts/install.sh" in readme and "bash scripts/install.sh" in ci
