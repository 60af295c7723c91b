"""Real model shapes without weights: random-initialized models of published architectures and sizes.

For throughput and memory benchmarks (`clawbridge model tiny --shape NAME`): speed and memory depend
on the shape, not on the weights, so a random model of the real size measures what the real one would.

Invariants:
- The architecture numbers below are copied from each model's published `config.json` on the
  Hugging Face hub (the repository named in `Shape.source`); nothing is downloaded at run time.
- `count_parameters(shape)` is exact arithmetic on those numbers (tied embeddings counted once) and
  equals the parameter count of the transformers model built from `hf_config(shape)`.
- The tokenizer is a byte-level BPE built offline with `tokenizers`: the tiny model's trained merges,
  extended with seeded synthetic merges until its vocabulary (special tokens included) is exactly the
  config's `vocab_size`. Its merges are not the real ones; its size, and so the embedding and the
  LM-head matmul, are.
- Deterministic: the same shape, seed and dtype give the same files. Building needs torch (bf16);
  a meta-device model supplies the parameter names, so no architecture is written out by hand.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tokenizers import AddedToken, Tokenizer, models

from clawbridge.devtools.tinymodel import SPECIAL_TOKENS, build_tokenizer, chat_template

Dtype = Literal["bf16", "fp32"]


@dataclass(frozen=True)
class Shape:
    """One published architecture (field names as in its `config.json`)."""

    name: str
    source: str
    """The hub repository whose config.json these numbers come from."""
    published: str
    """The parameter count its model card states."""
    published_params: float
    model_type: Literal["qwen3", "llama"]
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    rms_norm_eps: float
    rope_scaling: dict[str, object] | None = field(default=None)


SHAPES: dict[str, Shape] = {
    # Qwen/Qwen3-0.6B config.json; model card: "Number of Parameters: 0.6B (0.44B non-embedding)".
    "qwen3-0.6b": Shape(
        name="qwen3-0.6b", source="Qwen/Qwen3-0.6B", published="0.6B", published_params=0.6e9,
        model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    # Qwen/Qwen3-1.7B config.json; model card: "Number of Parameters: 1.7B (1.4B non-embedding)".
    "qwen3-1.7b": Shape(
        name="qwen3-1.7b", source="Qwen/Qwen3-1.7B", published="1.7B", published_params=1.7e9,
        model_type="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=True, rms_norm_eps=1e-6,
    ),
    # meta-llama/Llama-3.2-1B config.json (llama3 RoPE scaling); model card: 1.23B parameters.
    "llama-1b": Shape(
        name="llama-1b", source="meta-llama/Llama-3.2-1B", published="1.23B", published_params=1.23e9,
        model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500_000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
}


def count_parameters(shape: Shape) -> int:
    """Exact parameter count of `shape` (embeddings once when tied; Qwen3 adds per-head q/k norms)."""
    h, d = shape.hidden_size, shape.head_dim
    attn = h * shape.num_attention_heads * d * 2 + h * shape.num_key_value_heads * d * 2
    if shape.model_type == "qwen3":
        attn += 2 * d  # q_norm, k_norm
    mlp = 3 * h * shape.intermediate_size
    layer = attn + mlp + 2 * h  # + input / post-attention RMSNorm
    embed = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    return embed + shape.num_hidden_layers * layer + h  # + final norm


def describe(shape: Shape) -> str:
    """One line for --help: name, parameters, published size and source."""
    return (f"{shape.name}: {count_parameters(shape) / 1e9:.2f}B parameters (published {shape.published}, "
            f"{shape.source}), {shape.num_hidden_layers} layers, hidden {shape.hidden_size}, vocab {shape.vocab_size}")


def scaled(shape: Shape, *, layers: int, hidden: int, vocab: int) -> Shape:
    """The same architecture with fewer layers, a narrower hidden size and a smaller vocabulary (tests)."""
    ratio = hidden / shape.hidden_size
    heads = max(1, int(shape.num_attention_heads * ratio))
    kv = max(1, int(shape.num_key_value_heads * ratio))
    return Shape(**{**shape.__dict__, "name": f"{shape.name}-scaled", "hidden_size": hidden,
                    "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
                    "intermediate_size": int(shape.intermediate_size * ratio), "vocab_size": vocab})


def hf_config(shape: Shape, ids: dict[str, int], dtype: Dtype = "bf16") -> dict[str, object]:
    """The `config.json` of `shape` (transformers 5 `rope_parameters` and the 4.x keys both)."""
    rope: dict[str, object] = dict(shape.rope_scaling or {"rope_type": "default"})
    rope["rope_theta"] = shape.rope_theta
    cfg: dict[str, object] = {
        "architectures": ["Qwen3ForCausalLM" if shape.model_type == "qwen3" else "LlamaForCausalLM"],
        "model_type": shape.model_type,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": shape.rms_norm_eps,
        "use_cache": True,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "rope_theta": shape.rope_theta,
        "rope_scaling": shape.rope_scaling,
        "rope_parameters": rope,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "torch_dtype": "bfloat16" if dtype == "bf16" else "float32",
        "dtype": "bfloat16" if dtype == "bf16" else "float32",
    }
    if shape.model_type == "qwen3":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.num_hidden_layers)
    else:
        cfg.update(mlp_bias=False, pretraining_tp=1)
    return cfg


def sized_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids (special tokens included)."""
    base = build_tokenizer(seed)
    state = json.loads(base.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges: list[list[str]] = [m.split(" ") if isinstance(m, str) else list(m) for m in state["model"]["merges"]]
    target = vocab_size - len(SPECIAL_TOKENS)
    if target < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is below the base tokenizer's {len(vocab) + len(SPECIAL_TOKENS)}")
    rng = random.Random(seed)
    tokens = sorted(vocab, key=vocab.__getitem__)
    # Synthetic merges: join two existing tokens into a new one (valid BPE: every merged token is the
    # concatenation of its pair and both halves exist); short tokens are preferred so they stay plausible.
    while len(vocab) < target:
        # Indexing, not slicing: a slice per draw made this quadratic (46 s at 151,936 ids); same draws.
        a, b = tokens[rng.randrange(min(len(tokens), max(512, len(tokens) // 4)))], rng.choice(tokens)
        new = a + b
        if new in vocab or len(new) > 24:
            continue
        vocab[new] = len(vocab)
        tokens.append(new)
        merges.append([a, b])
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for a, b in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer, tok.decoder = base.pre_tokenizer, base.decoder
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"built {tok.get_vocab_size(with_added_tokens=True)} ids, wanted {vocab_size}")
    return tok


def meta_model(config: dict[str, object]) -> object:
    """The transformers model of `config` on the meta device (names and shapes, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    cfg = AutoConfig.for_model(str(config["model_type"]), **kwargs)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def build_shape(out_dir: Path, shape: Shape, *, dtype: Dtype = "bf16", seed: int = 0, device: str = "cpu") -> Path:
    """Write a random-initialized model of `shape` + a tokenizer of its vocabulary size to `out_dir`.
    `device`: where the random weights are drawn (a GPU draws a 1.7B model in a second; the same
    seed gives other numbers on another device)."""
    import torch
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = sized_tokenizer(shape.vocab_size, seed)
    ids = {t: tok.token_to_id(t) or 0 for t in SPECIAL_TOKENS}  # all present: sized_tokenizer adds them
    config = hf_config(shape, ids, dtype)
    model = meta_model(config)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # type: ignore[attr-defined]  # tied weights listed once
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(p.shape, dtype=torch_dtype)
        else:
            drawn = torch.empty(p.shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=gen)
            tensors[name] = drawn.to(torch_dtype).cpu()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": shape.max_position_embeddings,
        "clean_up_tokenization_spaces": False, "split_special_tokens": False, "add_prefix_space": False,
        "chat_template": chat_template(),
    })
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
    })
    return out_dir


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
