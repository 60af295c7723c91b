"""Teacher scoring for on-policy distillation: logprobs of given token ids under the BASE model.

API path: a forward-only pass (`FiretitanTrainingClient.forward`, loss `cross_entropy`) on a
base-only training client (`FiretitanServiceClient.create_base_training_client(base_model)`,
the SDK's frozen KL/DPO reference: the policy's trainer session with every LoRA adapter
disabled). Why not echo logprobs on the deployment's completions API: after the first publish
the hot-load deployment serves the trained snapshot, never the base model again.

Invariants:
- Token exact: each sequence is sent as `model_input = tokens[:-1]`, `target_tokens = tokens[1:]`
  (the training datum layout, conversion.py); nothing is re-tokenized. The trainer answers one
  `logprobs` tensor per datum, aligned with `target_tokens`; position j is
  logprob(tokens[j + 1] | tokens[:j + 1]), untempered. The result for a sequence is its last
  `len(tokens) - prompt_len` values, in order, checked for count and finiteness.
- `weights` are 1 on the scored positions and 0 on the prompt, so the (unused) forward loss
  covers only the completion; the logprobs themselves do not depend on the weights.
- Base model only: a full-parameter trainer (lora_rank 0) holds no frozen copy of the base
  weights on its session, so scoring there raises `ScoringUnavailable` instead of silently
  scoring the trained weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from clawbridge_fireworks.sdk import FwDatum, ModelInput, TensorData

SCORING_LOSS_FN: Final = "cross_entropy"
"""The Fireworks built-in loss whose forward output carries per-target `logprobs`."""


class ScoringFailed(RuntimeError):
    """The trainer did not return usable teacher logprobs (the turns stay RL-only)."""


class ScoringUnavailable(ScoringFailed):
    """This setup cannot score under the base model (see module invariants)."""


def check_prompt_lens(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> None:
    """Raise ValueError unless every `prompt_len` is in [1, len(tokens)] (one per sequence)."""
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt lengths")
    for seq, p in zip(sequences, prompt_lens, strict=True):
        if not 1 <= p <= len(seq):
            raise ValueError(f"prompt_len {p} must be in [1, {len(seq)}]")


def scoring_datum(tokens: Sequence[int], prompt_len: int) -> FwDatum:
    """The forward-only datum scoring `tokens[prompt_len:]` (needs 1 <= prompt_len < len)."""
    ids = [int(t) for t in tokens]
    n = len(ids) - 1
    weights = [0.0] * (prompt_len - 1) + [1.0] * (len(ids) - prompt_len)
    return FwDatum(
        model_input=ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": TensorData(data=ids[1:], dtype="int64", shape=[n]),
            "weights": TensorData(data=weights, dtype="float32", shape=[n]),
        },
    )


def completion_logprobs(
    output: Any, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]
) -> list[list[float]]:
    """The last `len - prompt_len` logprobs of each datum in a forward output, in order.

    `output` is the SDK's `ForwardBackwardOutput` for exactly these sequences (one datum each, in
    the same order). Raises ScoringFailed when it does not line up with what was sent."""
    outputs = list(getattr(output, "loss_fn_outputs", None) or [])
    if len(outputs) != len(sequences):
        raise ScoringFailed(f"forward returned {len(outputs)} outputs for {len(sequences)} sequences")
    result: list[list[float]] = []
    for i, (out, seq, p) in enumerate(zip(outputs, sequences, prompt_lens, strict=True)):
        tensor = out.get("logprobs") if isinstance(out, dict) else None
        if tensor is None:
            raise ScoringFailed(
                f"forward output {i} has no logprobs (keys: {sorted(out) if isinstance(out, dict) else out!r})"
            )
        values = np.asarray(
            tensor.to_numpy() if hasattr(tensor, "to_numpy") else tensor, dtype=np.float64
        ).ravel()
        if values.size != len(seq) - 1:
            raise ScoringFailed(
                f"forward output {i}: {values.size} logprobs for {len(seq) - 1} target tokens"
            )
        tail = [float(v) for v in values[p - 1 :]]
        if not all(math.isfinite(v) for v in tail):
            raise ScoringFailed(f"forward output {i}: non-finite logprobs: {tail!r}")
        result.append(tail)
    return result
