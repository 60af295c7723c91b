"""`BaseModelScorer`: the local backend's base model (never trained, no adapters) for the rewards
side: teacher logprobs for OPD (`compute_logprobs`) and a base-model `Sampler` for `judge=base`.

Invariants:
- It is a SEPARATE copy of the base weights, loaded lazily on first use (a serving-only or
  judge-off proxy pays nothing); publishes never touch it, so it is the base model forever.
  Memory: one more copy of the model on `device` (the cost of a base-model teacher/judge).
- `score` returns, per sequence, logprob(tokens[i] | tokens[:i]) for i in [prompt_len, len), in
  float32 `log_softmax` of the untempered logits: the same numbers the torch engine reports when
  sampling at temperature 1 from the same weights (tested).
- The judge's base `TorchEngine` runs on the same module with at most `max_running` requests; it
  shares no slot with the serving engine. Forwards from `score` and from the engine may run at the
  same time: both only read the weights.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from clawbridge_local.engine import TorchEngine
from clawbridge_local.loading import load_causal_lm, resolve_device, resolve_dtype


class BaseModelScorer:
    """Lazily loaded base model: `score` (blocking) and `engine()` for base-model sampling."""

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", max_running: int = 2) -> None:
        self.model_source = model
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_running = max_running
        self._lm: Any = None
        self._engine: TorchEngine | None = None
        self._lock = threading.Lock()

    def _model(self) -> Any:
        with self._lock:
            if self._lm is None:
                self._lm = load_causal_lm(self.model_source, self.device, self.dtype, progress=False)
            return self._lm

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> list[list[float]]:
        """Teacher logprobs of every token after its prompt (see module invariants). Blocking."""
        lm = self._model()
        out: list[list[float]] = []
        for seq, p in zip(sequences, prompt_lens, strict=True):
            n = len(seq)
            if not 1 <= p <= n:
                raise ValueError(f"prompt_len {p} must be in [1, {n}]")
            if p == n:
                out.append([])
                continue
            ids = torch.tensor([list(seq)], dtype=torch.long, device=self.device)
            # Positions p-1 .. n-2 predict tokens p .. n-1: keep the last n-p+1 logits, drop the final one.
            logits = lm(input_ids=ids, use_cache=False, logits_to_keep=n - p + 1).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1)
            target = ids[0, p:].unsqueeze(-1)
            out.append(lp.gather(-1, target).squeeze(-1).tolist())
        return out

    def engine(self) -> TorchEngine:
        """A `TorchEngine` over the base weights for judge sampling (created once). Blocking."""
        lm = self._model()
        with self._lock:
            if self._engine is None:
                self._engine = TorchEngine(lm, max_running=self.max_running, max_queued=1024)
            return self._engine

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
        self._lm = None
