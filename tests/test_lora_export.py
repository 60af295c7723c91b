"""LoRA through the local trainer: the exported peft adapter reproduces the trained model exactly.

CPU, fp32, the tiny Qwen3 model from `clawbridge.devtools.tinymodel`; the base is loaded with
transformers and the adapter with `peft.PeftModel.from_pretrained`, as a serving engine would.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch
from clawbridge_local.trainer import FsdpTrainerClient, LoraSettings, TrainerConfig
from peft import PeftModel
from transformers import AutoModelForCausalLM

from clawbridge.backend import Datum, LossConfig
from clawbridge.devtools.tinymodel import TinyModelSpec, build_tiny_model

TINY = TinyModelSpec(
    hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128
)
LORA = LoraSettings(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", spec=TINY)


def make_batch(seed: int) -> list[Datum]:
    rng = random.Random(seed)
    out = []
    for n in (4, 7, 3):
        prompt = [rng.randrange(10, 3000) for _ in range(6)]
        comp = [rng.randrange(10, 3000) for _ in range(n)]
        out.append(Datum.from_turn(prompt, comp, [-8.0] * n, [rng.uniform(-1, 1) for _ in comp], 0))
    return out


def config(model: Path, micro_batch_size: int = 2) -> TrainerConfig:
    return TrainerConfig(
        model_path=str(model), lora=LORA, learning_rate=5e-3, micro_batch_size=micro_batch_size
    )


def probe_ids() -> torch.Tensor:
    return torch.tensor([random.Random(99).choices(range(10, 3000), k=12) for _ in range(2)])


def load_exported(base: Path, adapter: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()


def test_adapter_export_import_gives_identical_logits(tiny_model: Path, tmp_path: Path) -> None:
    client = FsdpTrainerClient(config(tiny_model), tmp_path / "work")
    client.start(1)
    for seed in (1, 2):
        client.train_step(make_batch(seed), LossConfig("importance_sampling", kl_coef=0.1))
    adapter = client.export_weights(tmp_path / "adapters")

    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and Path(cfg["base_model_name_or_path"]) == tiny_model
    assert set(cfg["target_modules"]) == set(LORA.target_modules)

    ids = probe_ids()
    trained = client.core.model.eval()
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        got = load_exported(tiny_model, adapter)(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert float((want - base).abs().max()) > 1e-3  # the adapter is not a no-op
    client.close()


@pytest.mark.slow
def test_two_rank_lora_adapter_matches_in_process_training(tiny_model: Path, tmp_path: Path) -> None:
    """peft LoRA under FSDP2 (torchrun, 2 ranks, gloo) trains the same adapter as 1 process."""
    batch, loss = make_batch(3), LossConfig("cispo", kl_coef=0.1)
    one = FsdpTrainerClient(config(tiny_model), tmp_path / "one")
    one.start(1)
    m1 = one.train_step(batch, loss).metrics

    two = FsdpTrainerClient(config(tiny_model, micro_batch_size=1), tmp_path / "two", launcher="torchrun")
    two.start(2)
    m2 = two.train_step(batch, loss).metrics
    adapter = two.export_weights(tmp_path / "adapters", name="v1")
    two.close()

    for key in ("loss", "grad_norm", "tokens", "ratio_mean"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5), key
    ids = probe_ids()
    with torch.no_grad():
        want = one.core.model.eval()(input_ids=ids).logits
        got = load_exported(tiny_model, adapter)(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    one.close()
