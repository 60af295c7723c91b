"""The tiny model loads in transformers with no missing keys, runs, and is deterministic."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from clawbridge.devtools.tinymodel import SPECIAL_TOKENS, build_tiny_model, summarize


def test_config_is_qwen3_and_server_friendly(tiny_model_dir: Path) -> None:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] >= 32
    assert cfg["tie_word_embeddings"] is False
    assert cfg["max_position_embeddings"] == 32768
    assert cfg["rope_theta"] == 1e6
    tok = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    n_vocab = len(tok["model"]["vocab"]) + sum(
        1 for t in tok["added_tokens"] if t["id"] >= len(tok["model"]["vocab"])
    )
    assert cfg["vocab_size"] == n_vocab
    assert 3000 <= n_vocab <= 5000
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert cfg["eos_token_id"] in gen["eos_token_id"]


def test_loads_with_transformers_and_runs(tiny_model_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir, local_files_only=True)
    assert config.rope_parameters["rope_theta"] == 1e6
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, local_files_only=True, output_loading_info=True
    )
    model, info = loaded
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    ids = tok("Hello world, call the read_file tool.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids)
    assert out.logits.shape == (1, ids.shape[1], config.vocab_size)
    assert torch.isfinite(out.logits).all()
    # Random init: logits are close to uniform but not constant.
    assert out.logits.std() > 0


def test_special_tokens_are_single_ids(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    for t in SPECIAL_TOKENS:
        ids = tok(t, add_special_tokens=False).input_ids
        assert len(ids) == 1, t
        assert tok.decode(ids) == t
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok(" x", add_special_tokens=False).input_ids == tok.encode(" x", add_special_tokens=True)


def test_byte_level_round_trip(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    rng = random.Random(1)
    samples = [
        "plain ascii",
        "  leading and trailing spaces  \n\n\t",
        "emoji 🦀🧠👍🏽 and CJK 中文字符 and 한국어, Ελληνικά, עברית",
        "combining: e\u0301 vs é; zero width\u200bjoiner",
        '{"name": "exec", "arguments": {"cmd": "ls -la ~/"}}',
    ]
    for _ in range(50):
        samples.append(
            "".join(
                chr(
                    rng.choice(
                        [rng.randint(32, 126), rng.randint(0xA0, 0x2FFF), rng.randint(0x1F300, 0x1FAFF)]
                    )
                )
                for _ in range(rng.randint(1, 40))
            )
        )
    for s in samples:
        ids = tok(s, add_special_tokens=False).input_ids
        assert tok.decode(ids) == s


def test_build_is_deterministic(tmp_path: Path, tiny_model_dir: Path) -> None:
    start = time.perf_counter()
    other = build_tiny_model(tmp_path / "again", seed=0)
    elapsed = time.perf_counter() - start
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        a = hashlib.sha256((tiny_model_dir / name).read_bytes()).hexdigest()
        b = hashlib.sha256((other / name).read_bytes()).hexdigest()
        assert a == b, name
    print(f"\ntiny model built in {elapsed:.2f}s")  # a figure, not a test: timings vary by machine
    different = build_tiny_model(tmp_path / "seed1", seed=1)
    assert (different / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_summary(tiny_model_dir: Path) -> None:
    s = summarize(tiny_model_dir)
    # embed + lm_head dominate; both are vocab x 128.
    assert s.num_parameters > 2 * s.vocab_size * 128
    assert s.num_parameters < 5_000_000
    assert "parameters" in str(s) and str(s.vocab_size) in str(s)


def test_build_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from clawbridge.devtools.tinymodel import build_tiny_model; "
        f"build_tiny_model(Path({str(tmp_path / 'm')!r})); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_main_builds_and_prints_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from clawbridge.devtools.tinymodel import main

    assert main([str(tmp_path / "cli"), "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in out and "parameters" in out
    assert (tmp_path / "cli" / "model.safetensors").is_file()
