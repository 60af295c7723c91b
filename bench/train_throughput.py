"""Training tokens/s of the local FSDP trainer against a plain transformers+peft loop, same run.

What is compared, for full fine-tuning and for LoRA (peft, rank 8, all 7 projections):
- `plain`: the baseline. `AutoModelForCausalLM` (+ `get_peft_model`), AdamW, the importance-sampling
  token-sum loss `-(exp(logp - logp_sampler) * adv * mask).sum()`, grad-norm clip 1.0, written here
  from scratch (own padding, own loss) so it shares no code with the trainer.
- `fsdp-1`: ours, `FsdpTrainerClient` in-process (world size 1: `TrainerCore`, no process group and
  no FSDP wrapping), with the default `activation_checkpointing = "auto"` (on CPU: each decoder
  layer's forward runs again in the backward; on CUDA: activations kept where they fit).
- `fsdp-1-keep`: the same with `activation_checkpointing = false` (activations kept, as `plain`).
- `fsdp-2`: `FsdpTrainerClient` (default checkpointing) under `torchrun --nproc_per_node=2` (FSDP2
  `fully_shard`, gloo), including the client's real overhead (batch file, request/response files).
Same model, same batch, same hyperparameters (lr 1e-5, betas 0.9/0.95, eps 1e-8, no weight
decay, micro-batch = whole batch). Steps of the three run interleaved (plain, fsdp-1, fsdp-2,
plain, ...) so load from other processes on the machine hits them alike. The first
`--warmup` steps are not timed. The loss of the last step (after warmup + steps updates) is printed:
equal across runners means they took the same optimizer steps.

tokens/s counts model-input positions per optimizer step (sum of len(tokens) - 1 over the batch)
divided by the median wall time of a step as the caller sees it.

Threads: the script sets OMP_NUM_THREADS (default `--threads 2`) for this process, which runs
`plain` and `fsdp-1`; each torchrun rank gets threads // 2 (so the 2-rank group uses the same
2 cores in total).

`--profile` adds, per in-process runner, a torch profile of one more step (ops by self time) and
its scalar reads (`aten::_local_scalar_dense`: `.item()`/`float(t)`, each a wait for the GPU's
queue on CUDA). `--shape qwen3-0.6b` measures a published shape (scaled to `--layers`/`--hidden`
with its real 151,936-token vocabulary, or `--full-shape`).

Run (about 1-2 minutes on 2 CPU cores):
    . .venv/bin/activate && python bench/train_throughput.py
    python bench/train_throughput.py --model tiny --steps 4 --no-torchrun   # quicker
    python bench/train_throughput.py --no-torchrun --profile               # where a step goes
    python bench/train_throughput.py --device cuda --shape qwen3-0.6b --full-shape --batch 8 \
        --prompt-len 256 --completion-len 256 --no-torchrun --profile          # the same on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_common import model_specs, set_threads_from_argv  # noqa: E402

set_threads_from_argv(default=2)

import torch  # noqa: E402
from clawbridge_local.trainer.client import FsdpTrainerClient  # noqa: E402
from clawbridge_local.trainer.config import Checkpointing, LoraSettings, TrainerConfig  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from clawbridge.backend import Datum, LossConfig  # noqa: E402
from clawbridge.devtools.tinymodel import build_tiny_model  # noqa: E402

MODEL_SPECS = model_specs()
"""`tiny` is the test model (~1.2M parameters); `small` (~5M) makes compute weigh more than overhead."""
LR = 1e-5
BETAS = (0.9, 0.95)
EPS = 1e-8
MAX_GRAD_NORM = 1.0
LORA = LoraSettings(rank=8, alpha=16)


@contextmanager
def env(**values: str) -> Any:
    """Temporarily set environment variables (for the torchrun children)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_batch(model_dir: Path, n: int, prompt_len: int, completion_len: int, seed: int = 0,
               device: str = "cpu") -> list[Datum]:
    """Random prompt/completion ids, sampler logprobs from the base model (ratio 1 at step 1),
    advantages -0.5/0.5/1.5 per datum."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    base: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).to(device)
    vocab = int(base.config.vocab_size)
    out: list[Datum] = []
    for i in range(n):
        ids = torch.randint(0, vocab, (prompt_len + completion_len,), generator=g)
        with torch.no_grad():
            logp = torch.log_softmax(base(input_ids=ids[None, :-1].to(device)).logits[0].float(), -1).cpu()
        lps = logp[torch.arange(len(ids) - 1), ids[1:]][prompt_len - 1 :].tolist()
        adv = (i % 3) - 0.5  # -0.5, 0.5, 1.5: a non-zero, mixed-sign signal
        toks = ids.tolist()
        out.append(
            Datum.from_turn(toks[:prompt_len], toks[prompt_len:], lps, [adv] * completion_len, 0, f"d{i}")
        )
    return out


class PlainLoop:
    """The baseline: transformers (+ peft) and a hand-written IS token-sum loss, AdamW. On CUDA:
    fp32 weights under bf16 autocast (the trainer's mixed precision)."""

    def __init__(self, model_dir: Path, lora: LoraSettings | None, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.device = device
        model: Any = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, local_files_only=True
        ).to(device)
        model.config.use_cache = False
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            cfg = LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=0.0,
                target_modules=list(lora.target_modules),
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, cfg)
        model.train()
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)

    def step(self, batch: list[Datum], loss_cfg: LossConfig) -> float:
        del loss_cfg  # always importance_sampling here
        width = max(len(d.tokens) - 1 for d in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        tgt = torch.zeros_like(ids)
        att = torch.zeros_like(ids)
        slp, adv, mask = (torch.zeros((len(batch), width)) for _ in range(3))
        for b, d in enumerate(batch):
            n = len(d.tokens) - 1
            ids[b, :n] = torch.tensor(d.tokens[:-1])
            tgt[b, :n] = torch.tensor(d.tokens[1:])
            att[b, :n] = 1
            slp[b, :n] = torch.tensor(d.sampler_logprobs)
            adv[b, :n] = torch.tensor(d.advantages)
            mask[b, :n] = torch.tensor(d.mask)
        ids, tgt, att, slp, adv, mask = (t.to(self.device) for t in (ids, tgt, att, slp, adv, mask))
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.startswith("cuda")):
            logits = self.model(input_ids=ids, attention_mask=att).logits.float()
        logp = torch.log_softmax(logits, -1).gather(-1, tgt[..., None])[..., 0]
        ratio = torch.exp(torch.where(mask > 0, logp - slp, torch.zeros_like(logp)))
        loss = -(ratio * adv * mask).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
        self.opt.step()
        return float(loss.detach())


@dataclass
class Runner:
    """One contender: a name, a step function returning the loss, and its timings."""

    name: str
    step: Callable[[list[Datum], LossConfig], float]
    close: Callable[[], None]
    seconds: list[float]
    last_loss: float = float("nan")
    metrics: dict[str, float] = field(default_factory=dict)
    """The last step's metrics (the trainer's; empty for the plain loop)."""


def trainer_config(model_dir: Path, lora: LoraSettings | None, checkpointing: Checkpointing = "auto",
                   device: str = "auto") -> TrainerConfig:
    """The trainer under measurement: the plain loop's optimizer settings, one micro-batch per step."""
    return TrainerConfig(model_path=str(model_dir), lora=lora, learning_rate=LR, betas=BETAS, eps=EPS,
                         max_grad_norm=MAX_GRAD_NORM, micro_batch_size=1024, activation_checkpointing=checkpointing,
                         device=device)


def fsdp_runner(
    name: str, model_dir: Path, work: Path, lora: LoraSettings | None, world: int, threads: int,
    checkpointing: Checkpointing = "auto", device: str = "auto",
) -> Runner:
    client = FsdpTrainerClient(trainer_config(model_dir, lora, checkpointing, device), work,
                               launcher="inprocess" if world == 1 else "torchrun")
    t0 = time.perf_counter()
    with env(OMP_NUM_THREADS=str(max(1, threads // world))):
        client.start(world)
    print(f"  {name}: started in {time.perf_counter() - t0:.1f}s")

    def step(batch: list[Datum], loss: LossConfig) -> float:
        runner.metrics = client.train_step(batch, loss).metrics
        return runner.metrics["loss"]

    runner = Runner(name, step, client.close, [])
    return runner


def profile_step(r: Runner, batch: list[Datum], loss: LossConfig, top: int = 14) -> None:
    """One more step of `r` under the torch profiler: its ops by self time (where a step goes)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_initialized()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        r.step(batch, loss)
    events = prof.key_averages()
    reads = sum(e.count for e in events if e.key == "aten::_local_scalar_dense")
    by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"\n  profile of one {r.name} step ({by}, top {top}); scalar reads: {reads}")
    table = events.table(sort_by=by, row_limit=top, max_name_column_width=48)
    print("\n".join("    " + line for line in table.splitlines()))


def bench_mode(
    label: str, model_dir: Path, lora: LoraSettings | None, batch: list[Datum], args: argparse.Namespace
) -> None:
    print(f"\n== {label}")
    tokens = sum(len(d.tokens) - 1 for d in batch)
    plain = PlainLoop(model_dir, lora, device=args.device)
    runners = [Runner("plain", plain.step, lambda: None, [])]
    with tempfile.TemporaryDirectory() as tmp:
        runners.append(fsdp_runner("fsdp-1", model_dir, Path(tmp) / "w1", lora, 1, args.threads, device=args.device))
        runners.append(fsdp_runner("fsdp-1-keep", model_dir, Path(tmp) / "w1k", lora, 1, args.threads,
                                   checkpointing=False, device=args.device))
        if not args.no_torchrun:
            runners.append(fsdp_runner("fsdp-2", model_dir, Path(tmp) / "w2", lora, 2, args.threads))
        loss = LossConfig("importance_sampling")
        try:
            for i in range(args.warmup + args.steps):
                for r in runners:
                    t0 = time.perf_counter()
                    value = r.step(batch, loss)
                    dt = time.perf_counter() - t0
                    r.last_loss = value
                    if i >= args.warmup:
                        r.seconds.append(dt)
            if args.profile:
                for r in runners:
                    if r.name != "fsdp-2":  # another process: the profiler sees only its client
                        profile_step(r, batch, loss)
        finally:
            for r in runners:
                r.close()
    base = tokens / statistics.median(runners[0].seconds)
    print(
        f"  batch: {len(batch)} datums, {tokens} tokens/step; {args.steps} timed steps after {args.warmup} warmup"
    )
    print(
        f"  {'runner':11} {'step p50 s':>10} {'min s':>8} {'tokens/s':>10} {'vs plain':>9} {'last loss':>12}"
    )
    for r in runners:
        p50 = statistics.median(r.seconds)
        tps = tokens / p50
        print(
            f"  {r.name:11} {p50:10.3f} {min(r.seconds):8.3f} {tps:10.0f} {tps / base:8.2f}x {r.last_loss:12.5f}"
        )


def build_model(out: Path, args: argparse.Namespace) -> Path:
    """The measured model: a tiny spec, or a (scaled) published shape with its real vocabulary."""
    if args.shape is None:
        return build_tiny_model(out, spec=MODEL_SPECS[args.model])
    from clawbridge.devtools.shapes import SHAPES, build_shape, scaled

    shape = SHAPES[args.shape]
    if not args.full_shape:
        shape = scaled(shape, layers=args.layers, hidden=args.hidden, vocab=shape.vocab_size)
    return build_shape(out, shape, dtype="fp32", seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODEL_SPECS), default="small")
    ap.add_argument("--shape", default=None, help="a published shape instead (clawbridge.devtools.shapes, e.g. "
                    "qwen3-0.6b), scaled by --layers/--hidden with its real vocabulary unless --full-shape")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--full-shape", action="store_true", help="with --shape: every layer, the real hidden size")
    ap.add_argument("--profile", action="store_true", help="after timing: a torch profile of one step per runner")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the plain loop and ours run "
                    "(cuda: use --no-torchrun; the plain loop and ours are in memory together)")
    ap.add_argument("--batch", type=int, default=8, help="datums per step")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per runner")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--threads", type=int, default=2, help="torch threads here; torchrun ranks get threads // 2"
    )
    ap.add_argument("--mode", choices=["full", "lora", "both"], default="both")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the 2-rank FSDP group")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args)
        n_params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
        print(
            f"model {args.shape or args.model}: {n_params / 1e6:.2f}M parameters; torch {torch.__version__}; "
            f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} here, {max(1, args.threads // 2)} per torchrun rank; "
            f"cpu_count={os.cpu_count()}"
        )
        batch = make_batch(model_dir, args.batch, args.prompt_len, args.completion_len, device=args.device)
        if args.mode in ("full", "both"):
            bench_mode("full fine-tuning", model_dir, None, batch, args)
        if args.mode in ("lora", "both"):
            bench_mode(f"LoRA r={LORA.rank} alpha={LORA.alpha}", model_dir, LORA, batch, args)
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
