"""Pure conversions between clawbridge's seam types and the Tinker SDK's types.

Invariants:
- A clawbridge `Datum` becomes exactly one `tinker.Datum` with
  `model_input = tokens[:-1]` and `loss_fn_inputs` = `target_tokens` (int64), `logprobs`
  and `advantages` (float32), all of length len(tokens) - 1.
- Masking is expressed as zero advantages (advantage * mask); no `mask`/`weights` key is ever
  sent: the policy-gradient losses reject keys they do not take.
- Clip settings are sent as ratio bounds: Tinker clamps p/q to
  [clip_low_threshold, clip_high_threshold], so clip_low=0.2 becomes 0.8 and clip_high=0.2 1.2.
"""

from __future__ import annotations

from collections.abc import Sequence

from clawbridge.backend import Datum, LossConfig, loss_inputs
from clawbridge.serving.sampler import SamplingParams

from .sdk import ModelInput, TensorData, TinkerDatum
from .sdk import SamplingParams as TinkerSamplingParams

LOSS_INPUT_KEYS: tuple[str, ...] = ("target_tokens", "logprobs", "advantages")
"""The `loss_fn_inputs` keys sent for every policy-gradient loss."""


def to_tinker_datum(datum: Datum) -> TinkerDatum:
    """Convert one aligned training sequence; masked positions get advantage 0."""
    x = loss_inputs(datum)
    return TinkerDatum(
        model_input=ModelInput.from_ints(x.model_input),
        loss_fn_inputs={
            "target_tokens": TensorData.from_numpy(x.target_tokens),
            "logprobs": TensorData.from_numpy(x.logprobs),
            "advantages": TensorData.from_numpy(x.advantages),
        },
    )


def loss_fn_and_config(loss: LossConfig) -> tuple[str, dict[str, float] | None]:
    """Map our loss options to Tinker's built-in loss name and its `loss_fn_config`."""
    if loss.kl_coef != 0.0:
        raise ValueError(
            "the tinker backend does not support kl_coef: Tinker's built-in losses take no KL term; "
            "fold a KL penalty into the advantages instead"
        )
    if loss.name == "importance_sampling":
        return "importance_sampling", None
    if loss.name in ("ppo", "cispo"):
        if not (0.0 <= loss.clip_low < 1.0) or loss.clip_high < 0.0:
            raise ValueError(f"invalid clip thresholds: clip_low={loss.clip_low}, clip_high={loss.clip_high}")
        return loss.name, {
            "clip_low_threshold": 1.0 - loss.clip_low,
            "clip_high_threshold": 1.0 + loss.clip_high,
        }
    raise ValueError(f"unknown loss {loss.name!r}; expected importance_sampling, ppo or cispo")


def loss_tokens(batch: Sequence[Datum]) -> int:
    """How many positions carry loss (mask 1) in a batch."""
    return int(sum(sum(1 for m in d.mask if m) for d in batch))


def to_tinker_sampling_params(params: SamplingParams) -> TinkerSamplingParams:
    """Our sampling options as Tinker's. top_k 0 (off) is -1 there; stop ids stay ids."""
    return TinkerSamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        seed=params.seed,
        stop=list(params.stop_token_ids) if params.stop_token_ids else None,
    )
