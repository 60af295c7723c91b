"""A tiny Qwen3-architecture model and tokenizer, built offline in about a second.

Used by tests and benchmarks in place of a real model; nothing is downloaded.

Invariants:
- Deterministic: the same `seed` gives byte-identical files (corpus, tokenizer, weights).
- Torch-free: weights are written with numpy + safetensors (fp32), so the core package can build
  the model without torch installed. transformers' `Qwen3ForCausalLM` loads it with no missing or
  unexpected keys, and `AutoTokenizer.from_pretrained(dir)` loads the tokenizer offline.
- Real-server friendly: head_dim 32, untied embeddings, 32k positions, Qwen3 config keys.
- The tokenizer is byte-level BPE (any UTF-8 text round-trips through encode/decode) with the
  ChatML / Hermes special tokens as single special ids, and the Qwen3-style chat template in
  `chat_template.jinja` beside this module.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
"""Added as special tokens (single ids, appended after the BPE vocabulary, in this order)."""

TARGET_VOCAB_SIZE = 4000
"""BPE vocabulary size asked of the trainer (bytes + merges), before the special tokens."""

# Qwen2/Qwen3's pre-tokenization split pattern (then byte-level, without its own regex).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture of the tiny model (Qwen3 field names)."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6


@dataclass(frozen=True)
class TinyModelSummary:
    """What `summarize` reports about a built model folder."""

    path: Path
    num_parameters: int
    vocab_size: int
    hidden_size: int
    num_layers: int

    def __str__(self) -> str:
        return (
            f"{self.path}: Qwen3ForCausalLM, {self.num_parameters:,} parameters, vocab {self.vocab_size}, "
            f"hidden {self.hidden_size}, {self.num_layers} layers"
        )


def chat_template() -> str:
    """The Qwen3-style chat template shipped with clawbridge."""
    return Path(__file__).with_name("chat_template.jinja").read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Corpus

_LISTS: dict[str, list[str]] = json.loads(
    Path(__file__).with_name("tinymodel_words.json").read_text(encoding="utf-8")
)
"""The corpus's word lists (`tinymodel_words.json` beside this module): common English words,
agent vocabulary, tool names and code snippets, in the order the seeded corpus draws from."""

_WORDS = list(_LISTS["words"])
_AGENT_WORDS = list(_LISTS["agent_words"])
_NAMES = tuple(_LISTS["names"])
_CODE = tuple(_LISTS["code"])


_SYLLABLES = tuple(
    c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "er", "an")
)


class _CorpusWriter:
    """Generates the tokenizer's training documents from one seeded `random.Random`."""

    def __init__(self, seed: int, lexicon_size: int = 1500) -> None:
        self.rng = random.Random(seed)
        # Pseudo-English words, so the BPE learns a few thousand merges like a real vocabulary.
        self.lexicon = tuple(
            "".join(self.rng.choice(_SYLLABLES) for _ in range(self.rng.randint(1, 4)))
            for _ in range(lexicon_size)
        )

    def word(self) -> str:
        rng, r = self.rng, self.rng.random()
        if r < 0.45:
            return rng.choice(_WORDS)
        if r < 0.7:
            return rng.choice(_AGENT_WORDS)
        if r < 0.9:
            return rng.choice(self.lexicon)
        return "_".join(rng.choice(_AGENT_WORDS) for _ in range(2))

    def sentence(self) -> str:
        words = [self.word() for _ in range(self.rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        return " ".join(words) + self.rng.choice((".", ".", ".", "?", "!", ":"))

    def json_value(self, depth: int = 0) -> object:
        rng, r = self.rng, self.rng.random()
        if depth < 2 and r < 0.25:
            return {self.word(): self.json_value(depth + 1) for _ in range(rng.randint(1, 4))}
        if depth < 2 and r < 0.35:
            return [self.json_value(depth + 1) for _ in range(rng.randint(1, 3))]
        if r < 0.6:
            return " ".join(self.word() for _ in range(rng.randint(1, 5)))
        if r < 0.8:
            return rng.randint(-1000, 100000)
        if r < 0.9:
            return round(rng.uniform(-10, 10), 3)
        return rng.choice((True, False, None))

    def tool_schema(self) -> dict[str, object]:
        props = {
            self.word(): {
                "type": self.rng.choice(("string", "integer", "boolean")),
                "description": self.sentence(),
            }
            for _ in range(self.rng.randint(1, 4))
        }
        return {
            "type": "function",
            "function": {
                "name": self.rng.choice(_NAMES),
                "description": self.sentence(),
                "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
            },
        }

    def document(self) -> str:
        rng = self.rng
        kind = rng.randrange(7)
        if kind == 0:
            return " ".join(self.sentence() for _ in range(rng.randint(1, 6)))
        if kind == 1:
            return json.dumps(self.json_value(), ensure_ascii=False, indent=rng.choice((None, 2)))
        if kind == 2:
            return rng.choice(_CODE)
        if kind == 3:
            lines = [f"{'#' * rng.randint(1, 3)} {self.sentence()[:-1]}", ""]
            lines += [f"- {self.sentence()}" for _ in range(rng.randint(1, 5))]
            lines += ["", f"`{rng.choice(_NAMES)}` {self.sentence()}", "", "**Note:** " + self.sentence()]
            return "\n".join(lines)
        if kind == 4:
            args = {self.word(): self.json_value(1) for _ in range(rng.randint(1, 3))}
            call = json.dumps({"name": rng.choice(_NAMES), "arguments": args}, ensure_ascii=False)
            return f"<tool_call>\n{call}\n</tool_call>"
        if kind == 5:
            return json.dumps(self.tool_schema(), ensure_ascii=False)
        return f"<think>\n{self.sentence()} {self.sentence()}\n</think>\n\n{self.sentence()}"


def build_corpus(seed: int = 0, n_docs: int = 8000) -> list[str]:
    """Deterministic training text for the tokenizer: prose, JSON, code, markdown, tool calls."""
    writer = _CorpusWriter(seed)
    return [writer.document() for _ in range(n_docs)]


# --------------------------------------------------------------------------------------------
# Tokenizer and weights


def build_tokenizer(seed: int = 0) -> Tokenizer:
    """Train the byte-level BPE tokenizer on `build_corpus(seed)` and add the special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(build_corpus(seed), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _weights(spec: TinyModelSpec, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """Qwen3ForCausalLM parameters: normal(0, 0.02) matrices, ones for every RMSNorm weight."""
    rng = np.random.default_rng(seed)
    h, d = spec.hidden_size, spec.head_dim

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, size=shape).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones((n,), dtype=np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(vocab_size, h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(spec.num_attention_heads * d, h)
        w[p + "self_attn.k_proj.weight"] = normal(spec.num_key_value_heads * d, h)
        w[p + "self_attn.v_proj.weight"] = normal(spec.num_key_value_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, spec.num_attention_heads * d)
        w[p + "self_attn.q_norm.weight"] = ones(d)
        w[p + "self_attn.k_norm.weight"] = ones(d)
        w[p + "mlp.gate_proj.weight"] = normal(spec.intermediate_size, h)
        w[p + "mlp.up_proj.weight"] = normal(spec.intermediate_size, h)
        w[p + "mlp.down_proj.weight"] = normal(h, spec.intermediate_size)
        w[p + "input_layernorm.weight"] = ones(h)
        w[p + "post_attention_layernorm.weight"] = ones(h)
    w["model.norm.weight"] = ones(h)
    w["lm_head.weight"] = normal(vocab_size, h)
    return w


def _config(spec: TinyModelSpec, vocab_size: int, ids: dict[str, int]) -> dict[str, object]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": spec.rms_norm_eps,
        "use_cache": True,
        "tie_word_embeddings": False,
        # Both spellings: `rope_theta` for transformers 4.x / SGLang, `rope_parameters` for 5.x.
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": spec.num_hidden_layers,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "torch_dtype": "float32",
    }


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tiny_model(out_dir: Path, *, seed: int = 0, spec: TinyModelSpec | None = None) -> Path:
    """Write a loadable tiny Qwen3 model + tokenizer folder to `out_dir`; return `out_dir`."""
    spec = spec or TinyModelSpec()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(seed)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        tid = tok.token_to_id(t)
        if tid is None:
            raise RuntimeError(f"special token {t!r} missing from the trained tokenizer")
        ids[t] = tid
    tok.save(str(out_dir / "tokenizer.json"))
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "model_max_length": spec.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            "add_prefix_space": False,
            "chat_template": chat_template(),
        },
    )
    _write_json(out_dir / "config.json", _config(spec, vocab_size, ids))
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
            "do_sample": True,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
        },
    )
    save_file(_weights(spec, vocab_size, seed), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def summarize(model_dir: Path) -> TinyModelSummary:
    """Parameter count and sizes of a model folder (reads only the safetensors header + config)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    with (model_dir / "model.safetensors").open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    n_params = sum(int(np.prod(v["shape"])) for k, v in header.items() if k != "__metadata__")
    return TinyModelSummary(
        path=model_dir,
        num_parameters=n_params,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        num_layers=int(config["num_hidden_layers"]),
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m clawbridge.devtools.tinymodel OUT_DIR [--seed N]`: build the model and print its summary."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m clawbridge.devtools.tinymodel", description=main.__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(summarize(build_tiny_model(args.out_dir, seed=args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
