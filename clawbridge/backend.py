"""The backend seam: what the proxy and the trainer need from local, tinker or fireworks: the
types (`ModelInfo`, `Datum`, `LossConfig`, `StepResult`, `Capabilities`) and protocols
(`ServingBackend`, `TrainingBackend`, `LogprobScorer`, `CheckpointDeleter`, `RemoteCheckpoints`), with their fakes
(`FakeServingBackend`, `FakeLogprobScorer`). Finding and creating a backend is `clawbridge.plugins`.

Invariants:
- `start()` is called once, before `sampler()` is used; `close()` once, at shutdown.
- `publish(version)` makes the newly trained weights the ones `sampler()` serves under `version`
  (strictly greater than the one served; the trainer loop takes it from the store, which never
  hands out a number twice) and returns it. Streams already running finish on their old version.
- `train_step` either completes (returning metrics) or raises. A raise may still have changed the
  trainer's state (a hosted step that timed out, an export that failed after the optimizer ran),
  so the trainer loop never trusts it: it restores the last committed checkpoint before the next
  step (`clawbridge.trainer.checkpoints`).
- Checkpoints belong to the trainer loop: a backend only saves (`save_checkpoint`) and restores
  (`restore_checkpoint`) them when told, and never restores one by itself at `start()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from clawbridge.config import LossName, Settings, default_of
from clawbridge.serving.sampler import Sampler


@dataclass(frozen=True)
class ModelInfo:
    """What the proxy needs to know about the served model."""

    name: str
    """The served model name (`--served-model-name`); the proxy also answers to `default`."""
    tokenizer_path: str
    """A local folder or Hugging Face id the tokenizer (with its chat template) loads from."""
    context_window: int
    """Maximum prompt + completion tokens."""
    max_output_tokens: int
    """Default and upper bound for max_tokens when a request gives none."""


@dataclass(frozen=True)
class Span:
    """One sampled completion inside a `Datum`: the target positions [start, end) it covers.

    A datum holds one span per turn it trains (several when turns of a session were merged, see
    `clawbridge.trainer.merge`); each keeps what its own turn recorded."""

    start: int
    """First target position (index into the per-position lists) of the completion."""
    end: int
    """One past its last target position."""
    policy_version: int
    """The version that sampled this completion (staleness and importance weights are per span)."""
    turn_id: str = ""
    """The recorded turn it came from (for exactly-once bookkeeping)."""


@dataclass(frozen=True)
class Datum:
    """One training sequence, position aligned (see ARCHITECTURE.md, "Training datum").

    `tokens` is prompt + sampled completion, or, for a merged session, the last turn's prompt +
    completion, whose prompt holds every earlier turn's prompt and completion. Position i predicts
    tokens[i + 1] from tokens[:i + 1]: `model_input = tokens[:-1]`, `target_tokens = tokens[1:]`.
    Per-position lists below have length len(tokens) - 1. Positions outside every span (prompt,
    tool results, user messages) carry mask 0, advantage 0 and logprob 0.
    """

    tokens: tuple[int, ...]
    prompt_len: int
    """How many of `tokens` precede the first sampled token; the loss starts at target position
    prompt_len - 1."""
    sampler_logprobs: tuple[float, ...]
    """Per position: logprob of the target token under the sampling policy (0 on prompt)."""
    advantages: tuple[float, ...]
    """Per position: the advantage of the target token (0 on prompt)."""
    mask: tuple[float, ...]
    """Per position: 1.0 where the loss applies (sampled tokens), 0.0 elsewhere."""
    policy_version: int
    """The version that sampled the completion (merged: the oldest of its spans')."""
    turn_id: str = ""
    """The recorded turn it came from (merged: the first span's turn; see `turn_ids`)."""
    spans: tuple[Span, ...] = ()
    """The sampled completions, in order, disjoint; mask is 1 exactly on them. Empty in a datum
    built by hand: then one span from prompt_len - 1 to the end is meant (`sampled_spans`)."""

    @property
    def model_input(self) -> tuple[int, ...]:
        return self.tokens[:-1]

    @property
    def target_tokens(self) -> tuple[int, ...]:
        return self.tokens[1:]

    @property
    def sampled_spans(self) -> tuple[Span, ...]:
        """`spans`, or the single span a hand-built datum without them means."""
        if self.spans:
            return self.spans
        return (Span(self.prompt_len - 1, len(self.tokens) - 1, self.policy_version, self.turn_id),)

    @property
    def turn_ids(self) -> tuple[str, ...]:
        """Every turn this datum trains, in order."""
        return tuple(s.turn_id for s in self.sampled_spans)

    @staticmethod
    def from_turn(
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        completion_logprobs: Sequence[float],
        completion_advantages: Sequence[float],
        policy_version: int,
        turn_id: str = "",
    ) -> Datum:
        """Build the aligned datum from what the proxy recorded for one turn."""
        if not prompt_ids or not completion_ids:
            raise ValueError("a datum needs at least one prompt and one completion token")
        if not (len(completion_ids) == len(completion_logprobs) == len(completion_advantages)):
            raise ValueError("completion ids, logprobs and advantages must have one entry each")
        n_prompt_pos = len(prompt_ids) - 1
        return Datum(
            tokens=tuple(prompt_ids) + tuple(completion_ids),
            prompt_len=len(prompt_ids),
            sampler_logprobs=(0.0,) * n_prompt_pos + tuple(float(x) for x in completion_logprobs),
            advantages=(0.0,) * n_prompt_pos + tuple(float(x) for x in completion_advantages),
            mask=(0.0,) * n_prompt_pos + (1.0,) * len(completion_ids),
            policy_version=policy_version,
            turn_id=turn_id,
            spans=(Span(n_prompt_pos, n_prompt_pos + len(completion_ids), policy_version, turn_id),),
        )


@dataclass(frozen=True)
class LossInputs:
    """A datum as the per-position arrays hosted losses take (`loss_fn_inputs`): masked positions
    carry advantage 0 and logprob 0, so no separate mask is sent."""

    model_input: list[int]
    target_tokens: Any
    """int64 numpy array, length len(tokens) - 1."""
    logprobs: Any
    """float32 numpy array: sampler logprobs, 0 where masked."""
    advantages: Any
    """float32 numpy array: advantages, 0 where masked."""


def check_datum(datum: Datum) -> None:
    """Raise ValueError unless the per-position fields have len(tokens) - 1 entries and the spans
    are non-empty, in order, disjoint and inside them (every backend checks before it sends)."""
    n = len(datum.tokens) - 1
    if n < 1:
        raise ValueError(f"datum {datum.turn_id!r}: a datum needs at least two tokens")
    for name in ("sampler_logprobs", "advantages", "mask"):
        if len(getattr(datum, name)) != n:
            raise ValueError(f"datum {datum.turn_id!r}: {name} has {len(getattr(datum, name))} entries, expected {n}")
    end = 0
    for span in datum.spans:
        if not (end <= span.start < span.end <= n):
            raise ValueError(f"datum {datum.turn_id!r}: span {span.start}..{span.end} of turn {span.turn_id!r} is "
                             f"empty, overlaps the one before or leaves the {n} positions")
        end = span.end


def loss_inputs(datum: Datum) -> LossInputs:
    """Check a datum's alignment and turn it into `LossInputs` (shared by the hosted backends).
    A datum with several spans (a merged session) needs nothing special: mask, advantages and
    sampler logprobs are per position."""
    import numpy as np

    check_datum(datum)
    mask = np.asarray(datum.mask, dtype=np.float32)
    return LossInputs(
        model_input=list(datum.model_input),
        target_tokens=np.asarray(datum.target_tokens, dtype=np.int64),
        logprobs=np.asarray(datum.sampler_logprobs, dtype=np.float32) * mask,
        advantages=np.asarray(datum.advantages, dtype=np.float32) * mask,
    )




@dataclass(frozen=True)
class LossConfig:
    """Which policy-gradient loss to apply; semantics match Tinker's and Fireworks' built-ins."""

    name: LossName = default_of("loss")
    clip_low: float = default_of("clip_low")
    """ppo/cispo: lower clip threshold, ratio floor = 1 - clip_low."""
    clip_high: float = default_of("clip_high")
    """ppo/cispo: upper clip threshold, ratio ceiling = 1 + clip_high."""
    kl_coef: float = default_of("kl_coef")
    """Optional penalty toward the base policy (0: off)."""
    lr_scale: float = 1.0
    """Multiplier of the configured learning rate for this step (the trainer lowers it after rejected
    versions, `clawbridge.promotion.backoff`); every backend applies it to this step only."""


@dataclass(frozen=True)
class StepResult:
    """What a finished training step reports."""

    metrics: dict[str, float] = field(default_factory=dict)
    """At least `loss` and `tokens` where the backend can compute them."""


@dataclass(frozen=True)
class Capabilities:
    """What a training backend can do, declared as a class attribute `capabilities` so the core
    checks the settings against it at start-up, before anything loads (`check_capabilities`),
    instead of failing every step. A backend without the attribute is assumed to do all of it."""

    kl: bool = True
    """Accepts `kl_coef > 0`."""
    full_finetune: bool = True
    """Trains all weights (`lora_rank = 0`); False: LoRA only."""
    checkpoints: bool = True
    """Saves and restores weights + optimizer state (the trainer loop needs it to train)."""
    hosted: bool = False
    """Sends training data off this machine (a hosted training API): the privacy filter is on for
    it by default (`clawbridge.privacy.guard`)."""


def check_capabilities(settings: Settings, backend: object) -> list[str]:
    """What in `settings` the backend cannot do, each with how to fix it (empty: all fine).
    Only training settings are checked, and only when training is on."""
    caps = getattr(backend, "capabilities", None)
    if not settings.train or not isinstance(caps, Capabilities):
        return []
    name = getattr(backend, "name", "this backend")
    problems = []
    if settings.kl_coef > 0 and not caps.kl:
        problems.append(f"backend {name} has no KL penalty: set kl_coef = 0 (CLAWBRIDGE_KL_COEF)")
    if settings.lora_rank == 0 and not caps.full_finetune:
        problems.append(f"backend {name} trains LoRA only: set lora_rank > 0 (--lora-rank)")
    if not caps.checkpoints:
        problems.append(f"backend {name} cannot checkpoint, so its training cannot be trusted across restarts: "
                        "pass --no-train to only serve and record")
    return problems


class UnsupportedSettings(ValueError):
    """The settings ask a backend for something it cannot do (see `check_capabilities`)."""


class CheckpointDamaged(RuntimeError):
    """`restore_checkpoint` found the checkpoint torn (a file missing or cut short, as a power loss
    may leave one written before its files were flushed): raised before anything was loaded, so
    the trainer loop may restore an older, intact one (`clawbridge.trainer.checkpoints`). Any
    other failure to restore (a service that does not answer) is not this."""


@runtime_checkable
class ServingBackend(Protocol):
    """A backend that can serve: every backend is at least this.

    Fake: `FakeServingBackend` below. Tested by tests/test_backend_settings.py (loading through
    entry points) and every proxy test (`tests/fake_proxy.start_fake_proxy`)."""

    name: str

    async def start(self) -> None:
        """Load or connect to the model. May take long; shows progress."""
        ...

    def model_info(self) -> ModelInfo: ...

    def sampler(self) -> Sampler: ...

    async def close(self) -> None: ...


@runtime_checkable
class TrainingBackend(ServingBackend, Protocol):
    """A backend that can also train and publish new weights.

    Fake: `clawbridge.trainer.fake.FakeTrainingBackend`. Tested by tests/test_trainer_loop.py and
    tests/test_checkpoints.py (the loop over the fake), tests/test_local_training.py,
    tests/test_tinker_backend.py and tests/test_fireworks_backend.py (the real backends)."""

    async def train_step(self, batch: Sequence[Datum], loss: LossConfig) -> StepResult: ...

    async def publish(self, version: int | None = None) -> int:
        """Serve the latest trained weights as `version` (default: the served one + 1); return it."""
        ...

    async def save_checkpoint(self, name: str) -> str:
        """Save the trainer's weights + optimizer state; return where it went (a path or URI that
        `restore_checkpoint` takes)."""
        ...

    async def restore_checkpoint(self, path: str, version: int | None = None) -> int:
        """Load weights + optimizer state written by `save_checkpoint` into the trainer and serve
        those weights as `version` (default: the version recorded with the checkpoint); return the
        served version. When `version` equals the version served now, the caller guarantees that
        those weights are already served: only the trainer state is loaded (a hosted backend may
        serve the same weights again from the new trainer state, when its old sampler would end
        with the trainer it replaces). Raises `CheckpointDamaged` (nothing loaded) when the
        checkpoint's files are torn."""
        ...


@runtime_checkable
class CheckpointDeleter(Protocol):
    """A training backend that can delete its own checkpoints (the trainer loop prunes old ones,
    see `clawbridge.trainer.checkpoints`). Backends without it keep every checkpoint.

    Fake: `clawbridge.trainer.fake.FakeTrainingBackend`. Tested by tests/test_checkpoints.py and
    tests/test_versions_hosted.py."""

    async def delete_checkpoint(self, path: str) -> None:
        """Delete what `save_checkpoint` returned as `path`; a checkpoint already gone is fine.
        Never called for the checkpoint being restored or the one served."""
        ...


@dataclass(frozen=True)
class RemoteObject:
    """One thing a hosted backend keeps on its service for us (a checkpoint is one or more)."""

    path: str
    """What names it on the service (Tinker: a `tinker://` path, or a training client's id)."""
    kind: str
    """What the backend says it is (Tinker: `state`, `sampler` or `training_client`); handed back
    to `delete_remote`."""


@runtime_checkable
class RemoteCheckpoints(Protocol):
    """A backend whose checkpoints (and other state) live on a hosted service. Deleting them is
    owed work (`clawbridge.trainer.deletions`): every object is recorded in the store before the
    first try and stays there until the service confirmed it gone, retried with backoff, for
    retention and for forgetting a user alike.

    Fake: `clawbridge.trainer.fake.FakeHostedBackend`. Tested by tests/test_deletions.py,
    tests/test_tinker_restart.py and tests/test_tinker_lanes.py."""

    name: str

    def checkpoint_objects(self, path: str) -> list[RemoteObject]:
        """The objects checkpoint `path` (what `save_checkpoint` returned) is made of."""
        ...

    def remote_objects(self) -> list[RemoteObject]:
        """Everything of this backend's still kept on the service (a user lane's: what forgetting
        the user owes); read after `close()`, so released trainers are not among them."""
        ...

    async def delete_remote(self, obj: RemoteObject) -> None:
        """Delete `obj` on the service. One the service no longer has counts as deleted; raises
        when it could not be deleted now (the caller tries again later)."""
        ...


# --------------------------------------------------------------------------------------------
# Fake, for tests and benchmarks.


class FakeServingBackend:
    """Serves a `Sampler` you give it (typically `FakeSampler`) with a real tokenizer folder."""

    name = "fake"

    def __init__(self, sampler: Sampler, info: ModelInfo) -> None:
        self._sampler = sampler
        self._info = info
        self.started = False
        self.closed = False

    async def start(self) -> None:
        self.started = True

    def model_info(self) -> ModelInfo:
        return self._info

    def sampler(self) -> Sampler:
        return self._sampler

    async def close(self) -> None:
        self.closed = True


# --------------------------------------------------------------------------------------------
# Optional capability: scoring token ids under the BASE model (the OPD teacher).


@runtime_checkable
class LogprobScorer(Protocol):
    """A backend that can score given token ids under its base model (no adapters, no trained
    weights): the teacher of on-policy distillation (`clawbridge.rewards.opd`). Optional: check
    with `isinstance(backend, LogprobScorer)`.

    Invariant: token exact. For each sequence, the result holds logprob(tokens[i] | tokens[:i])
    for every i in [prompt_len, len(tokens)), in order: exactly len(tokens) - prompt_len floats,
    untempered (temperature 1, no truncation).

    Fake: `FakeLogprobScorer` below. Tested by tests/test_rewards_trainer.py (the fake),
    tests/test_tinker_logprobs.py and tests/test_fireworks_logprobs.py (the hosted scorers)."""

    async def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]
    ) -> list[list[float]]: ...


class FakeLogprobScorer:
    """A `LogprobScorer` for tests: `fn(tokens, position) -> logprob`, recording every call."""

    def __init__(self, fn: Any = None) -> None:
        self.fn = fn or (lambda tokens, i: -1.0)
        self.calls: list[tuple[list[int], int]] = []

    async def compute_logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]
    ) -> list[list[float]]:
        out: list[list[float]] = []
        for seq, p in zip(sequences, prompt_lens, strict=True):
            self.calls.append((list(seq), p))
            out.append([float(self.fn(list(seq), i)) for i in range(p, len(seq))])
        return out
