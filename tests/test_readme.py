"""README, docs and CI agree with the code: every option is in the generated configuration reference,
CI runs the README's two commands, the README stays a short guide, and its links resolve."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from clawbridge.config import Settings

ROOT = Path(__file__).resolve().parent.parent


REFERENCE = ROOT / "docs" / "configuration.md"


def test_every_option_is_in_the_configuration_reference() -> None:
    reference = REFERENCE.read_text()
    missing = [name for name in Settings.model_fields if f"| `{name}` |" not in reference]
    assert not missing, f"docs/configuration.md lacks {missing}: run python scripts/config_table.py --write"


def test_the_configuration_tables_are_what_the_script_generates() -> None:
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    assert spec is not None and spec.loader is not None
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    block = table.marked_block(REFERENCE.read_text())
    assert block, "docs/configuration.md lacks the configuration tables' markers"
    assert block == table.tables(), "configuration tables are stale: run python scripts/config_table.py --write"
    titles = [title for title, _ in table.sections()]
    assert titles[0].startswith("Server") and any("tinker" in t for t in titles) and any("fireworks" in t for t in titles)
    assert sum(len(names) for _, names in table.sections()) == len(Settings.model_fields)


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in readme and "python -m pytest -q" in ci
    assert "bash scripts/install.sh" in readme and "bash scripts/install.sh" in ci


def test_the_readme_gives_the_install_and_test_commands_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/install.sh && .venv/bin/clawbridge demo" in readme
    assert ".venv/bin/python -m pytest -q" in readme
    assert (ROOT / "scripts" / "install.sh").is_file()


def test_the_readme_is_a_short_guide() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 320, f"README.md has {len(lines)} lines: move reference and history into docs/"


def _anchors(markdown: str) -> set[str]:
    """GitHub-style anchors of a markdown file's headings."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, f"broken links: {broken}"
    linked = set(re.findall(r"\(docs/([a-z0-9-]+\.md)", (ROOT / "README.md").read_text()))
    assert {"configuration.md", "training.md", "benchmarks.md"} <= linked
