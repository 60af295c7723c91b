"""Real shapes without weights: parameter counts against the published sizes, and one scaled build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawbridge.devtools.shapes import SHAPES, build_shape, count_parameters, hf_config, meta_model, scaled
from tests.test_cli import cli

torch = pytest.importorskip("torch", reason="torch is needed to build shapes (meta device)")
pytest.importorskip("transformers", reason="transformers is needed to build shapes")

_IDS = {"<|endoftext|>": 0, "<|im_end|>": 1}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_parameter_counts_match_transformers_and_published(name: str) -> None:
    shape = SHAPES[name]
    model = meta_model(hf_config(shape, _IDS))  # meta device: names and shapes, no memory
    built = sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]
    assert built == count_parameters(shape)
    assert abs(built / shape.published_params - 1) < 0.03, (name, built, shape.published)
    assert type(model).__name__ == ("Qwen3ForCausalLM" if shape.model_type == "qwen3" else "LlamaForCausalLM")


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-1b"])
def test_scaled_shape_builds_loads_and_runs(tmp_path: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = scaled(SHAPES[name], layers=2, hidden=128, vocab=6000)
    out = build_shape(tmp_path / "m", shape, dtype="bf16", seed=3)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == shape.vocab_size == json.loads((out / "config.json").read_text())["vocab_size"]
    assert tok.decode(tok("héllo <|im_end|> {\"a\": 1}")["input_ids"]) == "héllo <|im_end|> {\"a\": 1}"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) == count_parameters(shape)
    ids = torch.tensor([tok("hello world")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], shape.vocab_size) and torch.isfinite(logits.float()).all()


def test_model_tiny_help_lists_shapes_and_rejects_unknown(tmp_path: Path) -> None:
    out = " ".join(cli("model", "tiny", "--help", env={"COLUMNS": "300"}).stdout.split())
    for name, shape in SHAPES.items():
        assert name in out and f"{count_parameters(shape) / 1e9:.2f}B" in out
    r = cli("model", "tiny", str(tmp_path / "m"), "--shape", "gpt-5", check=False)
    assert r.returncode == 2 and "qwen3-0.6b" in r.stderr
    r = cli("model", "tiny", str(tmp_path / "m"), "--shape", "llama-1b", "--dtype", "fp8", check=False)
    assert r.returncode == 2 and "bf16 or fp32" in r.stderr and not (tmp_path / "m").exists()
