"""Shared pytest fixtures.

`tiny_model_dir`: the tiny Qwen3 model + tokenizer (clawbridge.tinymodel), built once per test
session into a temporary folder. Treat it as read-only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from clawbridge.tinymodel import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with config.json, model.safetensors, tokenizer.json and tokenizer_config.json."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny-qwen3", seed=0)
