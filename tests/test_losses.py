"""clawbridge_local.losses: hand-computed values, clipping on both sides, masking, KL, gradient signs.

Each example sets the ratio per token directly: sampler logprob -1.0, trainer logprob
-1.0 + log(ratio). Expected values below are worked out by hand from the Tinker formulas.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

import torch
from clawbridge_local.losses import (
    LossInputs,
    LossSums,
    compute_loss,
    finalize_metrics,
)

from clawbridge.backend import LossConfig

RATIOS = [1.5, 0.5, 1.1, 1.5, 0.5]
ADVS = [1.0, -1.0, 2.0, -1.0, 1.0]
# Asymmetric thresholds so a swapped low/high would show: floor 0.9, ceiling 1.3.
CLIP = {"clip_low": 0.1, "clip_high": 0.3}


def _inputs(ref: list[float] | None = None) -> tuple[LossInputs, torch.Tensor]:
    """Five loss tokens plus one masked position holding absurd values (must not matter)."""
    logp = torch.tensor(
        [-1.0 + math.log(r) for r in RATIOS] + [50.0], dtype=torch.float64, requires_grad=True
    )
    inputs = LossInputs(
        target_logprobs=logp,
        sampler_logprobs=torch.tensor([-1.0] * 5 + [-80.0], dtype=torch.float64),
        advantages=torch.tensor([*ADVS, 100.0], dtype=torch.float64),
        mask=torch.tensor([1.0] * 5 + [0.0], dtype=torch.float64),
        ref_logprobs=None if ref is None else torch.tensor([*ref, 0.0], dtype=torch.float64),
    )
    return inputs, logp


def _run(cfg: LossConfig, ref: list[float] | None = None) -> tuple[float, list[float], dict[str, float]]:
    inputs, logp = _inputs(ref)
    out = compute_loss(cfg, inputs)
    out.loss.backward()
    assert logp.grad is not None
    return float(out.loss.detach()), logp.grad.tolist(), finalize_metrics(out.sums)


def test_importance_sampling_hand_values() -> None:
    loss, grad, m = _run(LossConfig("importance_sampling", **CLIP))
    # sum(r*A) = 1.5 - 0.5 + 2.2 - 1.5 + 0.5 = 2.2 ; no clipping at all
    assert loss == pytest.approx(-2.2)
    # d(-r*A)/dlogp = -r*A per token; masked position gets nothing
    assert grad == pytest.approx([-1.5, 0.5, -2.2, 1.5, -0.5, 0.0])
    assert m["clip_fraction"] == 0.0
    assert m["tokens"] == 5.0
    assert m["ratio_mean"] == pytest.approx(sum(RATIOS) / 5)
    assert m["loss"] == pytest.approx(-2.2)


def test_ppo_clips_both_sides_only_where_it_binds() -> None:
    loss, grad, m = _run(LossConfig("ppo", **CLIP))
    # tok0 r=1.5 A=+1: min(1.5, 1.3)=1.3   clipped high (no gradient)
    # tok1 r=0.5 A=-1: min(-0.5, -0.9)=-0.9 clipped low (no gradient)
    # tok2 r=1.1 A=+2: 2.2                 inside the range
    # tok3 r=1.5 A=-1: min(-1.5, -1.3)=-1.5 above the ceiling but unclipped (A<0): gradient flows
    # tok4 r=0.5 A=+1: min(0.5, 0.9)=0.5   below the floor but unclipped (A>0): gradient flows
    assert loss == pytest.approx(-(1.3 - 0.9 + 2.2 - 1.5 + 0.5))  # -1.6
    assert grad == pytest.approx([0.0, 0.0, -2.2, 1.5, -0.5, 0.0])
    assert m["clip_fraction"] == pytest.approx(2 / 5)


def test_ppo_symmetric_default_thresholds() -> None:
    loss, _, m = _run(LossConfig("ppo"))  # floor 0.8, ceiling 1.2
    # tok0 1.2 (clipped) ; tok1 -0.8 (clipped) ; tok2 r=1.1 A=2 -> 2.2 ; tok3 -1.5 ; tok4 0.5
    assert loss == pytest.approx(-(1.2 - 0.8 + 2.2 - 1.5 + 0.5))
    assert m["clip_fraction"] == pytest.approx(2 / 5)


def test_cispo_hand_values() -> None:
    loss, grad, m = _run(LossConfig("cispo", **CLIP))
    w = [1.3, 0.9, 1.1, 1.3, 0.9]  # clamp(r, 0.9, 1.3), detached
    logp = [-1.0 + math.log(r) for r in RATIOS]
    assert loss == pytest.approx(-sum(wi * a * lp for wi, a, lp in zip(w, ADVS, logp, strict=True)))
    assert loss == pytest.approx(
        1.990318, abs=1e-5
    )  # by hand: -(-0.77290 + 1.52383 - 1.99032 + 0.77290 - 1.52383)
    # the gradient is the clipped weight times A, never zeroed (unlike PPO)
    assert grad == pytest.approx([-1.3, 0.9, -2.2, 1.3, -0.9, 0.0])
    assert m["clip_fraction"] == pytest.approx(4 / 5)


def test_kl_penalty_k3() -> None:
    # ref - logp per token: +0.5, -0.5, 0, 0, 0
    logp = [-1.0 + math.log(r) for r in RATIOS]
    ref = [logp[0] + 0.5, logp[1] - 0.5, logp[2], logp[3], logp[4]]
    k3 = [math.exp(0.5) - 1 - 0.5, math.exp(-0.5) - 1 + 0.5, 0.0, 0.0, 0.0]  # 0.148721, 0.106531
    loss_kl, grad_kl, m = _run(LossConfig("importance_sampling", kl_coef=0.1), ref=ref)
    loss_plain, grad_plain, _ = _run(LossConfig("importance_sampling"), ref=ref)
    assert sum(k3) == pytest.approx(0.255252, abs=1e-6)
    assert loss_kl == pytest.approx(-2.2 + 0.1 * sum(k3))
    assert loss_plain == pytest.approx(-2.2)  # kl_coef 0: reported, not applied
    assert m["kl"] == pytest.approx(sum(k3) / 5)
    assert m["pg_loss"] == pytest.approx(-2.2)
    # d k3 / d logp = 1 - exp(ref - logp): the penalty pulls logp toward the reference
    extra = [g1 - g0 for g1, g0 in zip(grad_kl, grad_plain, strict=True)]
    assert extra == pytest.approx([0.1 * (1 - math.exp(0.5)), 0.1 * (1 - math.exp(-0.5)), 0, 0, 0, 0])
    assert extra[0] < 0 < extra[1]  # below the reference: push up; above: push down


def test_sums_add_up_across_micro_batches() -> None:
    inputs, _ = _inputs()
    whole = compute_loss(LossConfig("ppo"), inputs).sums
    parts = LossSums.zero()
    for sl in (slice(0, 2), slice(2, 6)):
        part = LossInputs(
            *(
                t[sl].detach()
                for t in (inputs.target_logprobs, inputs.sampler_logprobs, inputs.advantages, inputs.mask)
            )
        )
        parts = parts + compute_loss(LossConfig("ppo"), part).sums
    assert finalize_metrics(parts) == pytest.approx(finalize_metrics(whole))
    assert LossSums.from_tensor(parts.as_tensor()).values == pytest.approx(parts.values)


def test_rejects_unknown_loss_and_bad_thresholds() -> None:
    inputs, _ = _inputs()
    with pytest.raises(ValueError, match="unknown loss"):
        compute_loss(LossConfig("reinforce"), inputs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip"):
        compute_loss(LossConfig("ppo", clip_low=1.5), inputs)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo"])
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_gradient_step_moves_logprob_with_advantage(name: str, adv: float) -> None:
    """One SGD step on logits: A>0 raises the sampled token's logprob, A<0 lowers it."""
    torch.manual_seed(0)
    logits = torch.randn(3, 7, requires_grad=True)
    targets = torch.tensor([2, 5, 0])

    def logp() -> torch.Tensor:
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)

    before = logp().detach()
    out = compute_loss(
        LossConfig(name),  # type: ignore[arg-type]
        LossInputs(logp(), before.clone(), torch.full((3,), adv), torch.tensor([1.0, 1.0, 0.0])),
    )
    out.loss.backward()
    assert logits.grad is not None
    with torch.no_grad():
        logits -= 0.1 * logits.grad
    after = logp().detach()
    delta = after - before
    assert (delta[:2] * adv > 0).all(), delta
