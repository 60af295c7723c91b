"""Pure conversions between clawbridge's training types and the Fireworks SDK's.

Invariants:
- `model_input = tokens[:-1]`, `target_tokens = tokens[1:]` (ARCHITECTURE.md, "Training datum").
- Masking is carried as zero advantages: positions with mask 0 get advantage 0, so prompt and
  side-turn tokens carry no policy-gradient loss. No `mask`/`weights` key is sent; the built-in
  RL losses take exactly `target_tokens`, `logprobs` (sampler) and `advantages`.
- ppo/cispo clip thresholds are ratio bounds: `clip_low_threshold = 1 - clip_low`,
  `clip_high_threshold = 1 + clip_high` (the SDK's `loss_fn_config` keys).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from clawbridge.backend import Datum, LossConfig, loss_inputs
from clawbridge_fireworks.sdk import FwDatum, ModelInput, TensorData

LOSS_FN_BY_NAME: dict[str, str] = {
    "importance_sampling": "importance_sampling",
    "ppo": "ppo",
    "cispo": "cispo",
}
"""clawbridge loss name -> Fireworks built-in `loss_fn`."""


class UnsupportedLoss(ValueError):
    """The loss configuration has no Fireworks built-in equivalent."""


def loss_options(loss: LossConfig) -> tuple[str, dict[str, float] | None]:
    """Map a LossConfig to the SDK's `(loss_fn, loss_fn_config)`."""
    if loss.name not in LOSS_FN_BY_NAME:
        raise UnsupportedLoss(
            f"loss {loss.name!r} has no Fireworks built-in; use one of {sorted(LOSS_FN_BY_NAME)}"
        )
    if loss.kl_coef:
        raise UnsupportedLoss(
            "kl_coef > 0 is not supported by the Fireworks built-in losses; fold a KL penalty into the advantages"
        )
    if loss.name == "importance_sampling":
        return "importance_sampling", None
    return LOSS_FN_BY_NAME[loss.name], {
        "clip_low_threshold": 1.0 - loss.clip_low,
        "clip_high_threshold": 1.0 + loss.clip_high,
    }


def to_fireworks_datum(datum: Datum) -> FwDatum:
    """One clawbridge Datum as the SDK's Datum (see module invariants)."""
    x = loss_inputs(datum)
    n = len(x.target_tokens)
    return FwDatum(
        model_input=ModelInput.from_ints(x.model_input),
        loss_fn_inputs={
            "target_tokens": TensorData(data=x.target_tokens.tolist(), dtype="int64", shape=[n]),
            "logprobs": TensorData(data=x.logprobs, dtype="float32", shape=[n]),
            "advantages": TensorData(data=x.advantages, dtype="float32", shape=[n]),
        },
    )


def step_metrics(
    batch: Sequence[Datum], fwd_metrics: Mapping[str, float], optim_metrics: Mapping[str, float] | None
) -> dict[str, float]:
    """The StepResult metrics: `loss`, `tokens`, `sequences`, then every server metric as sent.

    Server metric names look like `loss:sum`; `loss` is taken from `loss:sum`, `loss:mean` or
    `loss`, whichever the trainer reports first. Optimizer metrics get an `optim/` prefix.
    """
    out: dict[str, float] = {}
    for key in ("loss:sum", "loss:mean", "loss"):
        if key in fwd_metrics:
            out["loss"] = float(fwd_metrics[key])
            break
    out["tokens"] = float(sum(sum(1 for m in d.mask if m) for d in batch))
    out["sequences"] = float(len(batch))
    for k, v in fwd_metrics.items():
        out[k] = float(v)
    for k, v in (optim_metrics or {}).items():
        out[f"optim/{k}"] = float(v)
    return out


def metrics_of(obj: Any) -> dict[str, float]:
    """`obj.metrics` as a plain dict (empty when the SDK object has none)."""
    metrics = getattr(obj, "metrics", None) or {}
    return {str(k): float(v) for k, v in dict(metrics).items()}
