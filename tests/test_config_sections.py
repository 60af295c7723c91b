"""TOML section tables (`clawbridge.config.SECTIONS`): each option in one table, read from it with
or without the table's prefix, flat keys and the environment still working, misplaced keys refused."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from clawbridge.config import SECTION_OPTIONS, Settings, load_settings, section_key, section_of


def test_every_option_is_in_exactly_one_section() -> None:
    listed = [n for names in SECTION_OPTIONS.values() for n in names]
    assert sorted(listed) == sorted(n for n in Settings.model_fields if n != "backends")
    assert section_of("batch_size") == "trainer" and section_of("judge_votes") == "rewards"
    assert section_of("backends") is None


def test_keys_with_and_without_the_table_prefix() -> None:
    assert section_key("promotion", "mode") == "promotion_mode"
    assert section_key("promotion", "promotion_mode") == "promotion_mode"
    assert section_key("privacy", "mode") == "privacy"
    assert section_key("privacy", "detectors") == "privacy_detectors"
    assert section_key("trainer", "poll_interval_s") == "trainer_poll_interval_s"
    assert section_key("trainer", "judge") is None


def test_sections_in_toml_and_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CLAWBRIDGE_BATCH_SIZE", "CLAWBRIDGE_LOSS", "CLAWBRIDGE_JUDGE", "CLAWBRIDGE_PRIVACY"):
        monkeypatch.delenv(var, raising=False)
    cfg = tmp_path / "c.toml"
    cfg.write_text('gamma = 0.5\n[server]\nport = 9001\n[trainer]\nbatch_size = 3\nloss = "ppo"\n'
                   'poll_interval_s = 0.25\n[rewards]\njudge = "base"\njudge_votes = 3\n'
                   '[privacy]\nmode = "on"\ndetectors = ["email"]\n')
    s = load_settings(cfg)
    assert (s.port, s.batch_size, s.loss, s.trainer_poll_interval_s) == (9001, 3, "ppo", 0.25)
    assert (s.judge, s.judge_votes, s.privacy, s.privacy_detectors, s.gamma) == ("base", 3, "on", ["email"], 0.5)
    monkeypatch.setenv("CLAWBRIDGE_BATCH_SIZE", "7")  # the environment wins over the file
    assert load_settings(cfg).batch_size == 7
    assert load_settings(cfg, batch_size=9).batch_size == 9  # and a flag over both


@pytest.mark.parametrize("text, says", [
    ('[trainer]\njudge = "base"\n', "judge is an option of [rewards]"),
    ("[trainer]\nbogus = 1\n", "[trainer] has no option 'bogus'"),
    ('[trainer]\nloss = "sometimes"\n', "loss"),
])
def test_a_misplaced_or_bad_key_is_refused_naming_it(tmp_path: Path, text: str, says: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    with pytest.raises(ValueError) as err:
        load_settings(cfg)
    assert says in str(err.value)


def test_the_privacy_option_still_works_at_the_top_level(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('privacy = "off"\n')
    assert load_settings(cfg).privacy == "off"


def test_the_toml_examples_of_the_readme_and_the_reference_load(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(__file__).resolve().parent.parent
    for var in [v for v in os.environ if v.startswith("CLAWBRIDGE_")]:
        monkeypatch.delenv(var)
    blocks = [b for doc in ("README.md", "docs/configuration.md")
              for b in re.findall(r"```toml\n(.*?)```", (root / doc).read_text(), re.S)]
    assert len(blocks) >= 3
    for i, block in enumerate(blocks):
        cfg = tmp_path / f"example{i}.toml"
        cfg.write_text(block)
        load_settings(cfg)  # raises on a misplaced or unknown key
