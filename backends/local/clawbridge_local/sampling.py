"""Turning one position's logits into a sampled token, its logprob and its alternatives.

Invariants:
- Everything is computed in float32, whatever dtype the model runs in.
- The reported logprob is `log_softmax(logits / temperature)[token]` over the whole vocabulary
  (plain `log_softmax(logits)` for temperature 0): top-k / top-p only restrict which tokens may be
  drawn, they do not renormalise the reported logprob. This is the number a trainer compares with
  its own `log_softmax` for importance ratios.
- Never fails on numerics: a distribution that is not finite after temperature and truncation
  (overflowed logits, an empty nucleus) falls back to argmax, so a request's odd `temperature` or
  `top_p` cannot crash the engine.
- Randomness comes only from the `torch.Generator` passed in, so one request's draws do not depend
  on what other requests do.
- `choose_rows` is `choose` for every row of a batch, the same tokens and logprobs, reading the
  device once for all the rows that need no truncation and no alternatives (`choose` reads it
  several times per row: on a GPU each read waits for the queue). It draws as `torch.multinomial`
  does for one sample (an Exp(1) draw per logit from the row's generator, then argmax of p / q),
  so a seeded row draws the same token either way; a row whose distribution is not finite still
  makes that draw (its generator moves on) before it falls back to argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from clawbridge.serving.sampler import SampledToken, SamplingParams


@dataclass(frozen=True)
class Choice:
    """The result of sampling one position."""

    token_id: int
    """The sampled id."""
    logprob: float
    """Its logprob under the (tempered, untruncated) distribution."""
    top_logprobs: tuple[tuple[int, float], ...]
    """Best alternatives `(id, logprob)`, best first; empty unless asked for."""

    def to_sampled(self) -> SampledToken:
        """The seam's token type."""
        return SampledToken(self.token_id, self.logprob, self.top_logprobs)


def _truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the logits outside the top-k and outside the top-p nucleus."""
    out = scaled
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token if the mass strictly before it is < top_p (the first token is always kept).
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[0] = False  # even when top_p underflows float32 to 0
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Choice:
    """Sample one token from `logits` (shape [vocab], any dtype) as `params` asks."""
    logits = logits.float()
    if params.temperature <= 0.0:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits).item())
    else:
        scaled = logits / params.temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        allowed = _truncate(scaled, params.top_k, params.top_p)
        probs = torch.softmax(allowed, dim=-1)
        if bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0.0:
            token = int(torch.multinomial(probs, 1, generator=generator).item())
        else:
            token = int(torch.argmax(logits).item())
            if not bool(torch.isfinite(logprobs).all()):
                logprobs = torch.log_softmax(logits, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if params.top_logprobs > 0:
        k = min(params.top_logprobs, logprobs.shape[-1])
        vals, ids = torch.topk(logprobs, k)
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True))
    return Choice(token, float(logprobs[token].item()), top)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator for one request: seeded with `seed`, or from fresh OS entropy when None."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def _batchable(params: SamplingParams, vocab: int) -> bool:
    """Rows `choose_rows` takes together: no top-k, no top-p, no alternatives."""
    return params.top_logprobs == 0 and not 0 < params.top_k < vocab and params.top_p >= 1.0


def choose_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[Choice]:
    """`choose` for each row of `logits` [rows, vocab] (module invariants)."""
    rows, vocab = logits.shape
    together = [i for i in range(rows) if _batchable(params[i], vocab)]
    out: dict[int, Choice] = {i: choose(logits[i], params[i], generators[i])
                              for i in range(rows) if not _batchable(params[i], vocab)}
    if together:
        x = logits[together].float() if len(together) < rows else logits.float()
        scaled = x.clone()
        drawn = [k for k, i in enumerate(together) if params[i].temperature > 0.0]
        for temperature in {params[together[k]].temperature for k in drawn}:  # as `choose` divides
            idx = [k for k in drawn if params[together[k]].temperature == temperature]
            scaled[idx] = x[idx] / temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        token = torch.argmax(x, dim=-1)
        if drawn:
            probs = torch.softmax(scaled[drawn], dim=-1)
            q = torch.empty_like(probs)
            for j, k in enumerate(drawn):  # each row's own generator, as multinomial draws it
                q[j].exponential_(1.0, generator=generators[together[k]])
            ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0.0)
            at = torch.tensor(drawn, device=x.device)
            token[at] = torch.where(ok, torch.argmax(probs / q, dim=-1), token[at])
            bad = ~ok & ~torch.isfinite(logprobs[at]).all(dim=-1)  # `choose`'s fallback to untempered
            logprobs[at] = torch.where(bad[:, None], torch.log_softmax(x[at], dim=-1), logprobs[at])
        picked = logprobs.gather(1, token[:, None])[:, 0]
        ids, lps = torch.stack([token.double(), picked.double()]).tolist()  # the one read of the device
        for k, i in enumerate(together):
            out[i] = Choice(int(ids[k]), float(lps[k]), ())
    return [out[i] for i in range(rows)]
