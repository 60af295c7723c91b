"""`clawbridge export-weights DIR`: a local LoRA checkpoint becomes a merged transformers folder
(or, with --adapter, a peft adapter) that transformers / peft load with the trained model's
exact logits. CPU, float32, a tiny Qwen3 model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("clawbridge_local", reason="needs the local backend (pip install -e backends/local)")

import torch
from clawbridge_local.trainer.client import FsdpTrainerClient
from clawbridge_local.training import trainer_config
from peft import PeftModel
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from clawbridge.backend import Datum, LossConfig
from clawbridge.cli.main import app
from clawbridge.config import Settings
from clawbridge.devtools.tinymodel import TinyModelSpec, build_tiny_model
from clawbridge.store import Store
from clawbridge.store.versions import VersionStore

TINY = TinyModelSpec(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128)
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def batch(seed: int) -> list[Datum]:
    rng = random.Random(seed)
    out = []
    for n in (4, 7):
        prompt = [rng.randrange(10, 3000) for _ in range(6)]
        comp = [rng.randrange(10, 3000) for _ in range(n)]
        out.append(Datum.from_turn(prompt, comp, [-8.0] * n, [rng.uniform(-1, 1) for _ in comp], 0))
    return out


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([random.Random(99).choices(range(10, 3000), k=12)])
    with torch.no_grad():
        return model(input_ids=ids).logits  # type: ignore[no-any-return]


def test_lora_checkpoint_exports_merged_and_as_adapter(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "base", spec=TINY)
    state = tmp_path / "state"
    toml = tmp_path / "c.toml"
    toml.write_text(f'model = "{model}"\nlora_rank = 4\nlora_alpha = 8.0\nlora_target_modules = {TARGETS!r}\n'
                    'learning_rate = 0.005\n'.replace("'", '"'))
    settings = Settings(model=str(model), state_dir=state, lora_rank=4, lora_alpha=8.0,
                        lora_target_modules=TARGETS, learning_rate=5e-3)
    client = FsdpTrainerClient(trainer_config(settings, str(model)), tmp_path / "work")
    client.start(1)
    try:
        client.train_step(batch(1), LossConfig("importance_sampling"))
        path = client.save_checkpoint(state / "checkpoints" / "local" / "v00000001-step", policy_version=1)
        reference = client.export_weights(tmp_path / "ref")
    finally:
        client.close()
    store = Store.open(state)  # as the trainer loop commits it: export takes the newest committed one
    versions = VersionStore(store)
    versions.commit(versions.reserve("step"), str(path), None)
    store.close()
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    before = logits(base)
    want = logits(PeftModel.from_pretrained(base, reference).eval())
    assert not torch.allclose(want, before)  # the step changed the model

    runner = CliRunner()
    r = runner.invoke(app, ["export-weights", str(tmp_path / "merged"), "--config", str(toml), "--state-dir", str(state)])
    assert r.exit_code == 0, r.output
    assert "merged weights of policy v1" in r.output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert torch.allclose(logits(merged), want, atol=1e-5)
    assert (tmp_path / "merged" / "tokenizer.json").exists()

    r = runner.invoke(app, ["export-weights", str(tmp_path / "adapter"), "--adapter", "--config", str(toml),
                            "--state-dir", str(state)])
    assert r.exit_code == 0, r.output
    fresh = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assert torch.allclose(logits(PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()), want, atol=1e-6)

    # bad input: a folder in the way, no checkpoint
    r = runner.invoke(app, ["export-weights", str(tmp_path / "merged"), "--config", str(toml), "--state-dir", str(state)])
    assert r.exit_code == 1 and "not empty" in r.output
    r = runner.invoke(app, ["export-weights", str(tmp_path / "x"), "--config", str(toml),
                            "--state-dir", str(tmp_path / "empty")])
    assert r.exit_code == 1 and "no checkpoint" in r.output and not (tmp_path / "x").exists()
