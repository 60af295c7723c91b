"""The trainer's chunked target logprobs (no whole [B, T, V] fp32 logits) equal the plain ones.

Real torch, the tiny Qwen3 model: logprobs and gradients of a token-sum loss through the chunked
path (chunks of a few positions) against one full forward, for a plain model and a peft LoRA model
(adapter on and disabled, as the KL reference uses it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from clawbridge.backend import Datum  # noqa: E402


def _batch() -> Any:
    from clawbridge_local.trainer.batch import collate

    gen = torch.Generator().manual_seed(0)
    datums = []
    for n in (9, 23, 17):  # ragged: padding positions take part in the chunks too
        ids = torch.randint(5, 200, (n,), generator=gen).tolist()
        p = 4
        datums.append(Datum.from_turn(ids[:p], ids[p:], [-1.0] * (n - p), [0.5] * (n - p), 0))
    return collate(datums)


def _loss_grads(model: Any, c: Any, chunk: int | None) -> tuple[Any, dict[str, Any]]:
    from clawbridge_local.trainer.logprobs import full_token_logprobs, token_logprobs

    model.zero_grad(set_to_none=True)
    lp = full_token_logprobs(model, c) if chunk is None else token_logprobs(model, c, chunk_elements=chunk)
    (lp * c.mask).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), grads


def _check(model: Any, vocab: int) -> None:
    c = _batch()
    full, g_full = _loss_grads(model, c, None)
    chunk = 3 * c.targets.shape[0] * vocab  # 3 positions per chunk: several chunks plus a short last one
    part, g_part = _loss_grads(model, c, chunk)
    assert part.shape == full.shape == c.targets.shape
    assert (part - full).abs().max().item() <= 1e-4
    assert g_full and g_full.keys() == g_part.keys()
    for name, g in g_full.items():
        assert torch.allclose(g, g_part[name], atol=1e-5, rtol=1e-4), name


def test_chunked_logprobs_equal_full_forward(tiny_model_dir: Path) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    _check(model, model.config.vocab_size)


def test_chunked_logprobs_equal_full_forward_under_lora(tiny_model_dir: Path) -> None:
    peft = pytest.importorskip("peft")
    from clawbridge_local.trainer.logprobs import full_token_logprobs, token_logprobs

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    _check(model, base.config.vocab_size)
    c = _batch()
    with torch.no_grad(), model.disable_adapter():
        off_full, off_part = full_token_logprobs(model, c), token_logprobs(model, c, chunk_elements=1)
    with torch.no_grad():
        on = token_logprobs(model, c)
    assert (off_part - off_full).abs().max().item() <= 1e-4
    assert (on - off_full).abs().max().item() > 1e-3  # the adapter is really applied on the chunked path


def test_one_chunk_runs_the_head_once_and_equals_the_full_forward(tiny_model_dir: Path) -> None:
    """Where every position fits one chunk (CUDA with memory to spare) the head runs once, forward
    only (no recompute in the backward), with the full forward's logprobs and gradients; on CPU the
    default chunk stays 16 MB."""
    from clawbridge_local.trainer.logprobs import CHUNK_ELEMENTS, default_chunk_elements

    assert default_chunk_elements(torch.device("cpu")) == CHUNK_ELEMENTS
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    c = _batch()
    calls = [0]
    model.lm_head.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    full, g_full = _loss_grads(model, c, None)
    calls[0] = 0
    one, g_one = _loss_grads(model, c, c.targets.numel() * model.config.vocab_size)
    assert calls[0] == 1
    assert (one - full).abs().max().item() <= 1e-5
    for name, g in g_full.items():
        assert torch.allclose(g, g_one[name], atol=1e-6, rtol=1e-5), name
    calls[0] = 0
    _loss_grads(model, c, 3 * c.targets.shape[0] * model.config.vocab_size)
    assert calls[0] > 2 * 3  # several chunks, each run again in the backward
