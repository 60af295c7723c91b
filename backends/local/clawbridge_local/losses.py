"""Policy-gradient losses with the semantics of Tinker's built-ins, in torch, per token.

Invariants:
- Ratio per token is `exp(logp_train - logp_sampler)`; `logp_sampler` is the logprob recorded at
  serving time (`Datum.sampler_logprobs`), `logp_train` the trainer's logprob of the same target.
- Every per-token term is multiplied by `mask` before it is summed, so prompt and padding
  positions contribute neither loss nor gradient (even where their advantage is not 0).
- NORMALIZATION (the one rule, the same for every backend): the loss of a batch is the plain
  SUM over all masked tokens of all datums. No division by token count, sequence count,
  micro-batch count or world size. Hosted APIs (Tinker `loss = -objective.sum()`, Fireworks) do
  exactly this per datum and add datums up; the local trainer therefore reduces gradients across
  ranks with SUM (FSDP divide factor 1) and adds micro-batch gradients unscaled. Any per-token or
  per-sequence averaging a trainer loop wants is folded into the advantages before they are sent.
- The KL penalty (k3 estimator, `exp(r) - 1 - r` with `r = logp_ref - logp_train`, always >= 0)
  is added as `kl_coef * sum(mask * k3)`, following the same token-sum rule. It needs reference
  logprobs; without them it is skipped (and `kl` is reported as 0).
- Metrics are returned as additive SUMS (`LossSums`, or the same numbers as a device tensor,
  `LossOutput.totals`) so micro-batches and ranks combine by addition; `finalize_metrics` turns the
  totals into the reported means once, at the end. Computing a loss never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clawbridge.backend import LossConfig

NORMALIZATION = "token_sum"
"""Name of the normalization rule above; recorded in step metrics' provenance by callers."""

SUM_KEYS: tuple[str, ...] = ("loss", "pg_loss", "kl", "clipped", "tokens", "ratio")
"""The additive quantities in `LossSums.values`, in a fixed order for all-reduce."""


@dataclass(frozen=True)
class LossInputs:
    """Per-position tensors aligned with `Datum` (any shape, all the same shape)."""

    target_logprobs: torch.Tensor
    """Trainer logprob of each target token; carries the gradient."""
    sampler_logprobs: torch.Tensor
    """Logprob of each target token under the sampling policy (`Datum.sampler_logprobs`)."""
    advantages: torch.Tensor
    """Advantage per position (`Datum.advantages`)."""
    mask: torch.Tensor
    """1.0 where the loss applies, 0.0 elsewhere (`Datum.mask`, 0 on padding)."""
    ref_logprobs: torch.Tensor | None = None
    """Reference (base) policy logprobs for the KL penalty; None disables it."""


@dataclass(frozen=True)
class LossSums:
    """Additive totals over the tokens one call saw; combine across micro-batches/ranks by `+`."""

    values: dict[str, float]
    """Keys `SUM_KEYS`: loss (total objective), pg_loss (without KL), kl (sum of k3), clipped
    (count of clipped tokens), tokens (masked-token count), ratio (sum of ratios)."""

    def __add__(self, other: LossSums) -> LossSums:
        return LossSums({k: self.values[k] + other.values[k] for k in SUM_KEYS})

    @staticmethod
    def zero() -> LossSums:
        """The neutral element of `+`."""
        return LossSums(dict.fromkeys(SUM_KEYS, 0.0))

    def as_tensor(self) -> torch.Tensor:
        """float64 vector in `SUM_KEYS` order (for `all_reduce`)."""
        return torch.tensor([self.values[k] for k in SUM_KEYS], dtype=torch.float64)

    @staticmethod
    def from_tensor(t: torch.Tensor) -> LossSums:
        """Inverse of `as_tensor`."""
        return LossSums({k: float(v) for k, v in zip(SUM_KEYS, t.tolist(), strict=True)})


@dataclass(frozen=True)
class LossOutput:
    """A differentiable loss (token sum) and the sums its metrics are made of."""

    loss: torch.Tensor
    """Scalar; `backward()` on it gives the token-sum gradient."""
    totals: torch.Tensor
    """Detached totals for metrics: float64 [len(SUM_KEYS)] on the loss's device, in `SUM_KEYS`
    order. A trainer adds these up over micro-batches on the device and reads them once a step
    (reading a number off a GPU waits for all queued work: one wait per step, not six per micro-batch)."""

    @property
    def sums(self) -> LossSums:
        """`totals` read to the host (waits for the device)."""
        return LossSums.from_tensor(self.totals.cpu())


def _policy_objective(
    config: LossConfig, logp: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token objective (to maximize) and a 0/1 tensor of tokens counted as clipped."""
    low, high = 1.0 - config.clip_low, 1.0 + config.clip_high
    if config.name == "importance_sampling":
        return ratio * adv, torch.zeros_like(ratio)
    if config.name == "ppo":
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, low, high) * adv
        # Clipped: the min picks the clamped branch and it differs, i.e. the token gets no gradient.
        return torch.minimum(unclipped, clipped), (clipped < unclipped).to(ratio.dtype)
    if config.name == "cispo":
        weight = torch.clamp(ratio, low, high).detach()
        # Clipped: the importance weight was clamped (the gradient still flows through logp).
        return weight * logp * adv, ((ratio < low) | (ratio > high)).to(ratio.dtype)
    raise ValueError(f"unknown loss {config.name!r}; expected importance_sampling, ppo or cispo")


def compute_loss(config: LossConfig, inputs: LossInputs) -> LossOutput:
    """The token-sum loss for `config.name` (+ optional KL penalty) and its metric sums."""
    if config.clip_low < 0 or config.clip_high < 0 or config.clip_low >= 1:
        raise ValueError(f"clip thresholds must satisfy 0 <= clip_low < 1, clip_high >= 0; got {config}")
    logp = inputs.target_logprobs.float()
    mask = inputs.mask.to(logp.dtype)
    adv = inputs.advantages.to(logp.dtype)
    log_ratio = logp - inputs.sampler_logprobs.to(logp.dtype)
    # Masked positions (prompt/padding) may hold anything; keep exp() finite there.
    log_ratio = torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio)
    objective, clipped = _policy_objective(config, logp, ratio, adv)
    pg_loss = -(objective * mask).sum()

    kl_sum = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if inputs.ref_logprobs is not None:
        r = inputs.ref_logprobs.to(logp.dtype) - logp
        r = torch.where(mask > 0, r, torch.zeros_like(r))
        kl_sum = ((torch.exp(r) - 1.0 - r) * mask).sum()
    loss = pg_loss + config.kl_coef * kl_sum if config.kl_coef else pg_loss

    with torch.no_grad():  # in SUM_KEYS order; no host sync here (LossOutput.totals)
        totals = torch.stack([loss.detach(), pg_loss.detach(), kl_sum.detach(), (clipped * mask).sum(), mask.sum(),
                              (ratio.detach() * mask).sum()]).to(torch.float64)
    return LossOutput(loss=loss, totals=totals)


def finalize_metrics(sums: LossSums) -> dict[str, float]:
    """Reported metrics from batch totals: loss/pg_loss are token sums (the normalization
    rule), kl/clip_fraction/ratio_mean are per-token means, tokens the masked-token count."""
    tokens = sums.values["tokens"]
    per_token = 1.0 / tokens if tokens > 0 else 0.0
    return {
        "loss": sums.values["loss"],
        "pg_loss": sums.values["pg_loss"],
        "kl": sums.values["kl"] * per_token,
        "clip_fraction": sums.values["clipped"] * per_token,
        "ratio_mean": sums.values["ratio"] * per_token if tokens > 0 else 1.0,
        "tokens": tokens,
    }
