"""The in-process trainer's step costs what the plain loop's does (issue 36): it reads the device
once a step, keeps activations where memory allows (`activation_checkpointing = "auto"`), and the
activation estimate that decides it bounds what a layer really keeps.

Real torch on CPU, the tiny Qwen3 model and scaled Qwen3 shapes with their real layer sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from clawbridge_local.trainer import step as step_module  # noqa: E402
from clawbridge_local.trainer.config import LoraSettings, TrainerConfig  # noqa: E402
from clawbridge_local.trainer.step import TrainerCore  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from clawbridge.backend import Datum, LossConfig  # noqa: E402
from clawbridge.devtools.tinymodel import build_tiny_model  # noqa: E402

LOSS = LossConfig("ppo", clip_low=0.2, clip_high=0.3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def batch(n: int = 6) -> list[Datum]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(10, 900, (12 + i,), generator=gen).tolist()
        out.append(Datum.from_turn(ids[:5], ids[5:], [-7.0] * (len(ids) - 5), [0.5 - (i % 2)] * (len(ids) - 5), 0))
    return out


class ScalarReads(TorchDispatchMode):
    """Counts `aten._local_scalar_dense`: a number read off a tensor (`.item()`, `float(t)`, `bool(t)`),
    on a GPU a wait for everything queued before it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and not self.paused:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def uncounted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` with its reads left out."""
        def call(*args: Any, **kwargs: Any) -> Any:
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False
        return call


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_step_reads_no_number_off_the_device_per_micro_batch(tiny: Path, lora: bool) -> None:
    """Three micro-batches, one step: the step's own code reads no scalar (the loss sums, the grad
    norm and the clip stay tensors until one `.tolist()` at the end); the only reads left are the
    model forwards' own, counted by running the same forwards alone. AdamW's reads of its step
    counters are not counted: they are CPU scalars, on CUDA too, and the plain loop has them."""
    from clawbridge_local.trainer.batch import collate, micro_batches
    from clawbridge_local.trainer.logprobs import token_logprobs

    config = TrainerConfig(model_path=str(tiny), lora=LoraSettings(rank=4) if lora else None, micro_batch_size=2,
                           max_grad_norm=0.5)
    core = TrainerCore(config)
    data = batch()
    forwards = ScalarReads()
    with forwards, torch.no_grad():
        for micro in micro_batches(data, 0, 1, 2):
            token_logprobs(core.model, collate(micro))
    in_step = ScalarReads()
    core.optimizer.step = in_step.uncounted(core.optimizer.step)  # type: ignore[method-assign]
    with in_step:
        metrics = core.train_step(data, LOSS)
    assert metrics["micro_batches"] == 3 and metrics["grad_norm"] > 0.5  # clipped: the clip ran
    assert in_step.count == forwards.count, (in_step.count, forwards.count)


def test_clipping_on_the_device_equals_the_host_rule(tiny: Path) -> None:
    """The clip scale min(1, max / (norm + 1e-6)) leaves gradients bit-identical below the bound
    and scales them by max / (norm + 1e-6) above it (the rule the host-side clip applied)."""
    for bound in (1e6, 0.25):
        core = TrainerCore(TrainerConfig(model_path=str(tiny), max_grad_norm=bound))
        ref = TrainerCore(TrainerConfig(model_path=str(tiny), max_grad_norm=0.0))
        grads = []
        for c in (core, ref):
            c.optimizer.zero_grad(set_to_none=True)
            c._forward_backward([batch(2)], LOSS)
        norm = float(core._grad_norm_and_clip())
        ref_grads = {n: p.grad for n, p in ref.model.named_parameters() if p.grad is not None}
        scale = torch.tensor(bound / (norm + 1e-6), dtype=torch.float32)
        for n, p in core.model.named_parameters():
            if p.grad is None:
                continue
            grads.append(n)
            assert torch.equal(p.grad, ref_grads[n] if bound > norm else ref_grads[n] * scale), n
        assert grads and (bound > norm) == (bound == 1e6)


def fake_memory(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    """`available_bytes` as a GPU would report it (CPU reports 0: `auto` then recomputes)."""
    monkeypatch.setattr(step_module, "available_bytes", lambda device: free)


def test_auto_checkpointing_keeps_activations_when_they_fit(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = batch()
    on_cpu = TrainerCore(TrainerConfig(model_path=str(tiny))).train_step(data, LOSS)
    assert on_cpu["activation_checkpointing"] == 1.0  # CPU: the proxy's memory, recompute
    fake_memory(monkeypatch, 64 * 2**30)
    roomy = TrainerCore(TrainerConfig(model_path=str(tiny))).train_step(data, LOSS)
    fake_memory(monkeypatch, 1024)
    tight = TrainerCore(TrainerConfig(model_path=str(tiny))).train_step(data, LOSS)
    assert roomy["activation_checkpointing"] == 0.0 and tight["activation_checkpointing"] == 1.0
    for key in ("loss", "grad_norm", "kl", "ratio_mean"):
        assert roomy[key] == tight[key] == on_cpu[key], key  # the same gradients either way
    always = TrainerCore(TrainerConfig(model_path=str(tiny), activation_checkpointing=True)).train_step(data, LOSS)
    never = TrainerCore(TrainerConfig(model_path=str(tiny), activation_checkpointing=False)).train_step(data, LOSS)
    assert always["activation_checkpointing"] == 1.0 and never["activation_checkpointing"] == 0.0


def test_out_of_memory_keeping_activations_runs_the_step_again_recomputing(
        tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first try (activations kept) fails inside the backward pass; the step runs again with
    recompute and takes exactly the step a recomputing trainer takes; later steps recompute."""
    data = batch()
    expected = TrainerCore(TrainerConfig(model_path=str(tiny), activation_checkpointing=True))
    want = [expected.train_step(data, LOSS), expected.train_step(data, LOSS)]
    fake_memory(monkeypatch, 64 * 2**30)
    core = TrainerCore(TrainerConfig(model_path=str(tiny)))
    real: Callable[..., Any] = core._forward_backward
    tries: list[bool] = []

    def flaky(micros: Any, loss: LossConfig) -> Any:
        kept = not core._checkpointed[0].gradient_checkpointing
        tries.append(kept)
        totals = real(micros, loss)  # gradients accumulate, then the failure: the retry must start clean
        if kept:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return totals

    monkeypatch.setattr(core, "_forward_backward", flaky)
    got = [core.train_step(data, LOSS), core.train_step(data, LOSS)]
    assert tries == [True, False, False]
    for g, w in zip(got, want, strict=True):
        assert g["activation_checkpointing"] == 1.0
        for key in ("loss", "grad_norm", "step"):
            assert g[key] == w[key], key
    for (n, p), (_, q) in zip(core.model.named_parameters(), expected.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-1.7b"])
def test_activation_estimate_bounds_what_a_layer_keeps(tmp_path: Path, shape: str) -> None:
    """Saved-tensor hooks count what one more decoder layer keeps per token (weights left out), on
    the shape's real layer sizes; `activation_bytes` is above it, by less than a third."""
    from clawbridge_local.trainer.model import activation_bytes
    from transformers import AutoModelForCausalLM

    from clawbridge.devtools.shapes import SHAPES, build_shape, scaled

    tokens = 64
    kept: dict[int, int] = {}
    model: Any = None
    for layers in (1, 2):
        hidden = SHAPES[shape].hidden_size
        folder = build_shape(tmp_path / str(layers), scaled(SHAPES[shape], layers=layers, hidden=hidden, vocab=6000),
                             dtype="fp32")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: set[int] = set()
        total = [0]

        def pack(t: Any, seen: set[int] = seen, total: list[int] = total, weights: set[int] = weights) -> Any:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights and ptr not in seen:
                seen.add(ptr)
                total[0] += t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, 6000, (1, tokens), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(input_ids=ids)
        kept[layers] = total[0]
    per_layer = kept[2] - kept[1]
    estimate = activation_bytes(model, tokens) // 2  # the two-layer model's estimate, per layer
    assert per_layer <= estimate <= 1.33 * per_layer, (per_layer, estimate)


def test_a_step_scale_scales_that_step_s_update_only(tiny: Path) -> None:
    """`LossConfig.lr_scale` (smaller steps after a rejected version, `clawbridge.promotion.backoff`):
    from the same weights, AdamW's first update at scale 0.5 is half the update at scale 1 (its step
    is proportional to the rate, decay included), and the step after it runs at the configured rate."""
    data = batch(2)
    half, full = (TrainerCore(TrainerConfig(model_path=str(tiny), learning_rate=1e-3)) for _ in range(2))
    before = {n: p.detach().clone() for n, p in full.model.named_parameters()}
    m_half = half.train_step(data, LossConfig("ppo", clip_low=0.2, clip_high=0.3, lr_scale=0.5))
    m_full = full.train_step(data, LOSS)
    assert m_half["learning_rate"] == pytest.approx(5e-4) and m_full["learning_rate"] == pytest.approx(1e-3)
    moved = 0
    for (n, p_half), p_full in zip(half.model.named_parameters(), full.model.parameters(), strict=True):
        d_full, d_half = p_full.detach() - before[n], p_half.detach() - before[n]
        if d_full.abs().max() > 0:
            moved += 1
            torch.testing.assert_close(d_half, d_full * 0.5, rtol=1e-3, atol=1e-7)
    assert moved > 0
    assert half.train_step(data, LOSS)["learning_rate"] == pytest.approx(1e-3)
    assert all(g["lr"] == pytest.approx(1e-3) for g in half.optimizer.param_groups)
