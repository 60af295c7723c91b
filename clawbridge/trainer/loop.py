"""The trainer loop: ready samples -> batches -> `train_step` -> `publish` -> one committed step.

Runs as one asyncio task beside the proxy (`start()` / `stop()`); the step is awaited on the same
event loop, so serving never pauses (backends do their heavy work off the loop) and the proxy
never answers 503 because of training.

Invariants:
- When a turn becomes trainable: its session has ended (end_session, X-Session-Done, idle, a
  replaced session key, a one-call session) and it has at least one reward. See
  `clawbridge.store.training` for the sample lifecycle.
- A step = `train_step(batch, LossConfig)` (`updates_per_step` times on the same batch: every update
  after the first sees the batch's recorded sampler logprobs as stale ones, weighted and clipped
  by the loss like any stale sample), then `publish(v)` of a version `v` reserved in the
  store, then a checkpoint of the trainer state, and only then, in ONE transaction, the `steps`
  row becomes ok (with v, its checkpoint and metrics), v becomes committed and the batch's samples
  get `consumed_step`. A raise anywhere records the step as failed with its error and leaves the
  samples for the next step; so does a cancel. Checkpoints and versions: see
  `clawbridge.trainer.checkpoints`.
- Exactly-once in the store AND in the weights: after a failed step the trainer state is reloaded
  from the newest committed checkpoint before another step runs, and a process killed after
  `train_step` (or `publish`, or the checkpoint) but before the commit restarts from that
  checkpoint; the step's `running` row is marked failed (`recover_interrupted`) and its samples
  are trained again, onto weights that never saw them.
- Staleness is checked when a batch is formed. Under `stale_policy='importance_weight'` (the
  default in `Settings`) every sample is trained: the recorded sampler logprobs make the loss
  ratio an importance weight (`cispo`/`ppo` clip it; the grad-norm clip bounds a step); only a
  sample more than `drop_stale_after` versions behind is dropped, when the user sets that bound
  (> 0). Under
  `'drop'` a sample more than `max_off_policy_steps` behind is dropped. Dropped samples get
  `dropped_reason='stale'` and are counted in the next step's metrics.
- No step without a learning signal: under a group baseline, a batch of grouped turns (each with
  a task id) whose every advantage is 0 (all answers of each group rewarded alike: a policy that
  has converged, or collapsed) and no KL term is not sent; its samples are dropped as `no_signal`
  and no version is published (the fallback running means it computed are kept in memory and
  saved with the next committed step). An optimizer step on zeros is not a no-op: Adam's momentum
  (and weight decay) kept moving the weights in an old direction at the learning rate, and the
  tiny judge demo drifted from every answer accepted to every answer corrected in 9 such steps
  (CI, 0.387 -> 0.057), where a group baseline has nothing to learn from.
- A trainer that falls behind trains larger steps: when more than `batch_size` samples are
  ready, a batch takes as many as fit in `max_batch_tokens` sampled tokens (`select_batch`).
- A session's turns whose prompts extend each other train as one datum (`merge_turns`,
  `clawbridge.trainer.merge`); batch size, token budget and consumed samples count turns. The
  merge counts of committed steps are summed since start-up in `status()["merging"]`.
- How long a ready sample waits for a full batch (then trains in a short one) or, under a group
  baseline, for the rest of its task's group: `clawbridge.trainer.waiting`, both bounded by
  `batch_wait_s`.
- The running-mean baselines (advantages rule 3) advance only when a step commits and are saved
  in that step's row (metrics `running_means`), so a restart continues from them exactly like
  the weights continue from the step's checkpoint.
- With a privacy guard that filters training (`clawbridge.privacy`), every batch passes the filter
  before `train_step`: a turn whose sampled answer holds a finding is dropped as `private` (never
  sent, never consumed), found prompt text is replaced by placeholders in the tokens sent, and a
  batch left empty runs no step.
- With a `VersionGate` (promotion, `clawbridge.promotion.promoter`), before every step the gate
  settles the newest committed version: while it is on trial no step runs (`hold`, shown in
  status), and when it was rejected the trainer state is first reloaded from the serving version's
  checkpoint (`rollback`, a new version carrying those weights), so a step never builds on a
  version that does not serve. Turns of held-out sessions (`gate.held_out`) are dropped as
  `held_out`: never trained, they score versions. Every step trains at the learning-rate scale the
  gate answered last (`LossConfig.lr_scale`, smaller after rejections: `clawbridge.promotion.backoff`),
  recorded in the step's metrics as `lr_scale`. A step that has turns to train (after the
  no-signal check and the privacy filter) asks the gate for its rehearsal set
  (`VersionGate.rehearsal`, `clawbridge.promotion.rehearsal`) and appends it; an idle loop never
  asks, so a server that only serves never generates for it.
- Per-user adapters (`clawbridge.trainer.lanes`): a loop bound to a lane (`lane` not None) trains
  only that lane's samples into that lane's versions (`clawbridge.store.training`), so a step
  never mixes users; the loops of all lanes share one `step_lock` (asyncio's lock wakes waiters
  in arrival order), so the steps of busy and quiet lanes take turns and one user cannot starve
  another.
- Capacity mode only ever refuses NEW sessions (`backlog_exceeded` for `/rl/start_session`),
  never a model call.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from clawbridge.backend import LossConfig, TrainingBackend
from clawbridge.config import BaselineRule, NormalizationRule, Settings, StalePolicy, default_of
from clawbridge.privacy.guard import DROP_REASON
from clawbridge.promotion.backoff import FULL
from clawbridge.promotion.rehearsal import Rehearsal, mean_token_scale
from clawbridge.runtime.background import Background
from clawbridge.runtime.faults import fault_point
from clawbridge.store import Store
from clawbridge.store.training import PendingSample, TrainingStore
from clawbridge.trainer.advantages import GROUP_BASELINES, RewardMix, RunningMeans
from clawbridge.trainer.checkpoints import CheckpointKeeper
from clawbridge.trainer.datums import PreparedBatch, prepare_batch, screen, select_batch
from clawbridge.trainer.gate import VersionGate
from clawbridge.trainer.merge import MergeStats
from clawbridge.trainer.waiting import BatchWaits

if TYPE_CHECKING:
    from clawbridge.privacy.guard import PrivacyGuard

log = logging.getLogger("clawbridge.trainer")

RUNNING_MEANS_KEY = "running_means"
"""The committed step's metrics key holding the running-mean baselines after it (restored at start)."""


@dataclass(frozen=True)
class TrainerConfig:
    """The trainer loop's options (`Settings`' "trainer loop" section, see `from_settings`)."""

    batch_size: int = default_of("batch_size")
    """Ready turns (samples) needed before a step runs (a batch may hold more: whole
    sessions/groups); merged turns count one each."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Loss name, clip thresholds and KL coefficient sent with every step."""
    updates_per_step: int = default_of("updates_per_step")
    """`train_step` calls on each batch before its one publish (module invariants)."""
    gamma: float = default_of("gamma")
    """Turn discount (advantages rule 2)."""
    baseline: BaselineRule = default_of("baseline")
    """Advantages rule 3."""
    normalization: NormalizationRule = default_of("advantage_normalization")
    """Advantages rule 4."""
    max_off_policy_steps: int = default_of("max_off_policy_steps")
    """Datums sampled more than this many versions before the serving one are stale."""
    stale_policy: StalePolicy = default_of("stale_policy")
    drop_stale_after: int = default_of("drop_stale_after")
    """importance_weight: still drop samples more than this many versions behind (0: never)."""
    max_batch_tokens: int = default_of("max_batch_tokens")
    """A backlog trains in steps of up to this many sampled tokens (0: exactly batch_size)."""
    capacity_mode: bool = default_of("capacity_mode")
    """Refuse new sessions (429) while the backlog is at its bound."""
    max_backlog: int = default_of("max_backlog")
    """The capacity bound in datums; 0: batch_size * (max_off_policy_steps + 1)."""
    reward_wait_s: float = default_of("reward_wait_s")
    """Samples of sessions ended this long ago without any reward are dropped (`no_reward`)."""
    batch_wait_s: float = default_of("batch_wait_s")
    """Fewer than batch_size samples ready this long train as a short batch (0: wait for a full one)."""
    poll_interval_s: float = default_of("trainer_poll_interval_s")
    """How often the loop looks for a ready batch when idle."""
    mix: RewardMix = field(default_factory=RewardMix)
    """Explicit vs judge rewards, the "at least one" rule and the method (advantages rules 1b-5)."""
    wait_for_judge: bool = default_of("judge") != "off"
    """A judge is configured: train a session only after the judge finished it."""
    merge_turns: bool = default_of("merge_session_turns")
    """Train a session's turns as one datum where each prompt extends the previous turn's."""
    rehearsal_coef: float = default_of("rehearsal_coef")
    """Advantage of each rehearsed token (`clawbridge.promotion.rehearsal`; 0: off)."""
    rehearsal_items: int = default_of("rehearsal_items")
    """Rehearsed answers per step."""

    @classmethod
    def from_settings(cls, s: Settings) -> TrainerConfig:
        return cls(
            batch_size=s.batch_size,
            loss=LossConfig(name=s.loss, clip_low=s.clip_low, clip_high=s.clip_high, kl_coef=s.kl_coef),
            updates_per_step=s.updates_per_step,
            gamma=s.gamma,
            baseline=s.baseline,
            normalization=s.advantage_normalization,
            max_off_policy_steps=s.max_off_policy_steps,
            stale_policy=s.stale_policy,
            drop_stale_after=s.drop_stale_after,
            max_batch_tokens=s.max_batch_tokens,
            capacity_mode=s.capacity_mode,
            max_backlog=s.max_backlog,
            reward_wait_s=s.reward_wait_s,
            batch_wait_s=s.batch_wait_s,
            poll_interval_s=s.trainer_poll_interval_s,
            mix=RewardMix.from_settings(s),
            wait_for_judge=s.judge != "off",
            merge_turns=s.merge_session_turns,
            rehearsal_coef=s.rehearsal_coef,
            rehearsal_items=s.rehearsal_items,
        )

    @property
    def backlog_bound(self) -> int:
        return self.max_backlog or self.batch_size * (self.max_off_policy_steps + 1)


@dataclass(frozen=True)
class StepReport:
    """The outcome of one attempted step."""

    step: int
    ok: bool
    policy_version: int | None
    """The version `publish()` returned (None when the step failed)."""
    metrics: dict[str, Any]
    error: str | None
    turn_ids: tuple[str, ...]


class TrainerLoop:
    """Turns ended, rewarded sessions into training steps on a `TrainingBackend`."""

    def __init__(
        self,
        store: Store,
        backend: TrainingBackend,
        config: TrainerConfig | None = None,
        keeper: CheckpointKeeper | None = None,
        privacy: PrivacyGuard | None = None,
        lane: str | None = None,
        step_lock: asyncio.Lock | None = None,
    ) -> None:
        self.store = store
        self.lane = lane
        """The lane this loop trains (module invariants); None: every sample (per-user adapters off)."""
        self.step_lock = step_lock or asyncio.Lock()
        """Held for each step's train / publish / checkpoint / commit; shared by all lanes' loops."""
        self.privacy = privacy if privacy is not None and privacy.train else None
        """Filters every batch before it is sent (module invariants); None: off."""
        self.backend = backend
        self.config = config or TrainerConfig()
        self.keeper = keeper or CheckpointKeeper(store, backend, lane=lane or "")
        """Checkpoints and policy versions (`resume()` it at start-up, before serving)."""
        self.tstore = TrainingStore(store, wait_for_judge=self.config.wait_for_judge, lane=lane)
        self.running_means = RunningMeans()
        """Running-mean baselines, advanced only when a step commits."""
        self.last_report: StepReport | None = None
        self._watermark = 0.0
        self._recovered = False
        self._dropped = {"stale": 0, "empty": 0, "no_reward": 0, "no_signal": 0, "private": 0, "held_out": 0}
        self.gate: VersionGate | None = None
        """Promotion (module invariants); None: every committed version serves at once."""
        self.holding: str | None = None
        """Why the loop runs no step now (the gate's hold), for status."""
        self.step_scale = FULL
        """The gate's learning-rate scale for the next step (1 without a gate)."""
        self.merge_totals = MergeStats()
        """Merge counts of the steps committed since start-up."""
        self._last_step_s: float | None = None
        self._in_step = False
        self.waits = BatchWaits(self.config.batch_wait_s)
        """The short-batch and whole-group waits (`clawbridge.trainer.waiting`)."""
        self._lock = asyncio.Lock()
        self.background = Background("clawbridge-trainer", store.clock)
        """The loop's task (start / stop / notify)."""

    @classmethod
    def from_settings(
        cls, settings: Settings, store: Store, backend: TrainingBackend, keeper: CheckpointKeeper | None = None,
        privacy: PrivacyGuard | None = None, lane: str | None = None, step_lock: asyncio.Lock | None = None,
    ) -> TrainerLoop:
        keeper = keeper or CheckpointKeeper(store, backend, keep=settings.keep_checkpoints, lane=lane or "")
        return cls(store, backend, TrainerConfig.from_settings(settings), keeper, privacy, lane, step_lock)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the background task (idempotent)."""
        self.background.start(self._run)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Let a step in progress finish for up to `timeout_s`, then cancel it (it is recorded as
        failed and its samples stay). Idempotent."""
        await self.background.stop(timeout_s, cancel_first=False)

    def notify(self) -> None:
        """Look for a ready batch now instead of at the next poll (e.g. after a session ends)."""
        self.background.notify()

    @property
    def in_step(self) -> bool:
        """A step is being trained, published, checkpointed or committed now."""
        return self._in_step

    @property
    def running(self) -> bool:
        return self.background.running

    async def _run(self) -> None:
        failures = 0
        while not self.background.stopping:
            try:
                report = await self.run_once()
            except Exception:
                log.exception("trainer loop iteration failed; retrying")
                report = None
                failures += 1
            else:
                failures = failures + 1 if report is not None and not report.ok else 0
            if report is not None and report.ok:
                continue  # another batch may already be ready
            delay = self.config.poll_interval_s * (2 ** min(failures, 6) if failures else 1)
            await self.background.sleep(min(delay, max(60.0, self.config.poll_interval_s)))

    # ------------------------------------------------------------------ one iteration
    async def run_once(self) -> StepReport | None:
        """Ingest ended sessions, drop what must be dropped, and run one step if a batch is ready.
        Returns None when no batch was ready, else the step's report (ok or failed)."""
        async with self._lock:
            if self.keeper.dirty:  # a failed step or undo: never train on top of an uncommitted update
                await self.keeper.undo()
            if self.gate is not None and not await self._settle(self.gate):
                return None
            batch = await asyncio.to_thread(self._collect)
            if not batch:
                return None
            try:
                prepared: PreparedBatch | None = await asyncio.to_thread(self._prepare, batch)
            except Exception:
                prepared = None  # _step prepares again and records the failure as a failed step
            if prepared is not None and not prepared.datums:
                return None  # every turn of the batch was dropped as private: nothing to send
            if prepared is not None and not self._has_signal(batch, prepared):
                n = await asyncio.to_thread(self.tstore.drop_samples, (s.turn_id for s in batch), "no_signal")
                self._dropped["no_signal"] += n
                self.running_means = prepared.running  # saved with the next committed step
                log.info("skipped a batch of %d turn(s) without a learning signal (every advantage 0): "
                         "no optimizer step, no new version", n)
                return None
            async with self.step_lock:
                return await self._step(batch, prepared)

    async def _settle(self, gate: VersionGate) -> bool:
        """Let the gate decide the pending version; False while it holds training (module invariants)."""
        settled = await gate.settle()
        if settled.resume_from is not None:
            version = await self.keeper.rollback(settled.resume_from)
            log.info("trainer state reloaded from the serving v%d's checkpoint (now v%d); training goes on from it",
                     settled.resume_from, version)
        if settled.step != self.step_scale:
            log.info("next steps%s at %s", self._of_lane(), settled.step.words())
        self.step_scale = settled.step
        if settled.hold != self.holding and settled.hold is not None:
            log.info("no training step while %s", settled.hold)
        self.holding = settled.hold
        return settled.hold is None

    def _collect(self) -> list[PendingSample]:
        cfg = self.config
        if not self._recovered:
            n = self.tstore.recover_interrupted()
            if n:
                log.warning(
                    "marked %d interrupted training step(s) failed; their samples will be retrained", n
                )
            self.running_means = self._saved_running_means()
            self._recovered = True
        _, self._watermark = self.tstore.ingest_ended(self._watermark)
        self._dropped["no_reward"] += self.tstore.drop_unrewarded(cfg.reward_wait_s)
        current = self.backend.sampler().policy_version
        ready = self.tstore.ready_samples()
        if self.gate is not None:
            gate = self.gate
            held = [s.turn_id for s in ready if gate.held_out(s.session_id)]
            if held:
                self._dropped["held_out"] += self.tstore.drop_samples(held, "held_out")
                ready = [s for s in ready if not gate.held_out(s.session_id)]
        if cfg.stale_policy == "drop":
            screened = screen(ready, current, cfg.max_off_policy_steps, True)
        else:
            bound = cfg.drop_stale_after
            screened = screen(ready, current, bound, bound > 0)
        if screened.stale:
            self._dropped["stale"] += self.tstore.drop_samples((s.turn_id for s in screened.stale), "stale")
            log.info(
                "dropped %d stale sample(s) (policy v%d, max %d behind)",
                len(screened.stale),
                current,
                cfg.max_off_policy_steps if cfg.stale_policy == "drop" else cfg.drop_stale_after,
            )
        if screened.empty:
            self._dropped["empty"] += self.tstore.drop_samples((s.turn_id for s in screened.empty), "empty")
        whole_groups = cfg.baseline in GROUP_BASELINES
        now = self.store.clock.monotonic()  # the store's clock: tests move it (clawbridge.runtime.clock)
        usable = screened.usable
        if whole_groups:
            tasks = {s.task_id for s in usable if s.task_id}
            unsettled = self.tstore.unsettled_tasks() & tasks if tasks and cfg.batch_wait_s > 0 else set()
            usable = self.waits.settled_groups(usable, unsettled, now)
        batch = select_batch(usable, cfg.batch_size, whole_groups, cfg.max_batch_tokens)
        if batch or not usable:
            self.waits.reset_short()
            return batch
        if not self.waits.short_batch_due(now):
            return []
        log.info("training a short batch: %d sample(s) ready for %.0f s, fewer than batch_size %d",
                 len(usable), cfg.batch_wait_s, cfg.batch_size)
        return select_batch(usable, len(usable), whole_groups, cfg.max_batch_tokens)

    def _saved_running_means(self) -> RunningMeans:
        """The running-mean baselines as the newest committed step left them (in its metrics)."""
        for row in self.tstore.lane_steps(200):
            saved = row.metrics.get(RUNNING_MEANS_KEY) if row.status == "ok" and row.metrics else None
            if isinstance(saved, dict):
                return RunningMeans(dict(saved.get("sums", {})), dict(saved.get("counts", {})))
        return RunningMeans()

    def _prepare(self, batch: list[PendingSample]) -> PreparedBatch:
        cfg = self.config
        prepared = prepare_batch(
            self.tstore,
            batch,
            gamma=cfg.gamma,
            baseline=cfg.baseline,
            normalization=cfg.normalization,
            running=self.running_means,
            current_version=self.backend.sampler().policy_version,
            mix=cfg.mix,
            merge=cfg.merge_turns,
        )
        return prepared if self.privacy is None else self._redact(prepared)

    def _redact(self, prepared: PreparedBatch) -> PreparedBatch:
        """The batch through the privacy filter; turns whose answers hold a finding are dropped
        as private in the store at once (the filter is deterministic: they could never be sent)."""
        assert self.privacy is not None
        r = self.privacy.redact_batch(prepared.datums)
        if r.dropped_turns:
            n = self.tstore.drop_samples(r.dropped_turns, DROP_REASON)
            self._dropped["private"] += n
            log.info("privacy: %d turn(s) not sent for training: their sampled answers hold a secret or "
                     "personal data (dropped: private)", n)
        gone = set(r.dropped_turns)
        metrics = {**prepared.metrics, **{f"privacy_masked_{k}": float(v) for k, v in r.masked.items()}}
        return replace(prepared, datums=r.datums, turn_ids=[t for t in prepared.turn_ids if t not in gone],
                       metrics=metrics, masked=r.masked)

    async def _with_rehearsal(self, prepared: PreparedBatch, step: int) -> PreparedBatch:
        """`prepared` with the step's rehearsed answers appended (`clawbridge.promotion.rehearsal`),
        each token weighted like an average token of the batch times `rehearsal_coef`. The gate is
        asked here, by a step that trains, so an idle server never builds the set."""
        cfg = self.config
        if self.gate is None or cfg.rehearsal_coef <= 0:
            return prepared
        rehearsal: Rehearsal | None = await self.gate.rehearsal()
        if rehearsal is None:
            return prepared
        loss_tokens = int(prepared.metrics.get("tokens", 0) + prepared.metrics.get("rewrite_tokens", 0))
        advantage = cfg.rehearsal_coef * mean_token_scale(cfg.normalization, loss_tokens)
        extra = rehearsal.datums(step, cfg.rehearsal_items, advantage)
        metrics = {**prepared.metrics, "rehearsal_datums": float(len(extra)),
                   "rehearsal_tokens": float(sum(int(sum(d.mask)) for d in extra)),
                   "rehearsal_anchor": float(rehearsal.anchor)}
        return replace(prepared, datums=[*prepared.datums, *extra], metrics=metrics)

    def _has_signal(self, batch: list[PendingSample], prepared: PreparedBatch) -> bool:
        """Whether a step on `prepared` would push the policy anywhere: some advantage is nonzero,
        or a KL penalty pulls toward the base. (A step on nothing but zeros is not a no-op: Adam's
        momentum and weight decay still move the weights, lr-sized, in an old direction.) Judged
        only when every turn of the batch is in a group (a task id under a group baseline): there a
        group rewarded alike is the no-signal case, while a running-mean baseline (also the group
        baselines' fallback for turns without a task id) is state that must advance with each batch
        (its first sample under a key always gets advantage 0), so such batches still step."""
        grouped = self.config.baseline in GROUP_BASELINES and all(s.task_id for s in batch)
        if self.config.loss.kl_coef > 0 or not grouped:
            return True  # a running-mean baseline's state advances only with a committed step
        return any(a != 0.0 for d in prepared.datums for a, m in zip(d.advantages, d.mask, strict=True) if m)

    async def _step(self, batch: list[PendingSample], prepared_in: PreparedBatch | None = None) -> StepReport:
        turn_ids = tuple(prepared_in.turn_ids if prepared_in is not None else (s.turn_id for s in batch))
        step = await asyncio.to_thread(self.tstore.begin_step)
        self._in_step = True
        metrics: dict[str, Any] = {}
        keeper = self.keeper
        version: int | None = None
        try:
            prepared: PreparedBatch = (
                prepared_in if prepared_in is not None else await asyncio.to_thread(self._prepare, batch))
            metrics.update(prepared.metrics)
            turn_ids = tuple(prepared.turn_ids)
            if not prepared.datums:
                raise RuntimeError("every turn of the batch was dropped as private; nothing to train")
            prepared = await self._with_rehearsal(prepared, step)
            await keeper.ensure_base()
            keeper.dirty = True  # from here on the trainer state may hold this step's update
            t0 = time.monotonic()
            loss_config = replace(self.config.loss, lr_scale=self.step_scale.scale)
            result = await self.backend.train_step(prepared.datums, loss_config)
            first_loss = result.metrics.get("loss")
            for _ in range(self.config.updates_per_step - 1):  # the same batch again, its ratio clipped by the loss
                result = await self.backend.train_step(prepared.datums, loss_config)
            t1 = time.monotonic()
            await fault_point("step.trained")
            version = await asyncio.to_thread(keeper.reserve_step, step)
            await keeper.publish(version)
            t2 = time.monotonic()
            await fault_point("step.published")
            checkpoint = await keeper.save(version)
            await fault_point("step.checkpointed")
            metrics = self._step_metrics(prepared, result.metrics, t1 - t0, t2 - t1)
            if self.config.updates_per_step > 1:  # the backend's figures are the last update's
                metrics["updates"] = float(self.config.updates_per_step)
                metrics["first_update_loss"] = first_loss if _finite(first_loss) else None
            metrics["checkpoint_seconds"] = time.monotonic() - t2
            metrics["lr_scale"] = loss_config.lr_scale
            metrics[RUNNING_MEANS_KEY] = {"sums": dict(prepared.running.sums), "counts": dict(prepared.running.counts)}
            await asyncio.to_thread(
                self.tstore.commit_step, step, version, metrics, turn_ids, checkpoint, keeper.identity
            )
            keeper.committed(version, checkpoint)
            if self.privacy is not None:
                self.privacy.count_trained(prepared.masked)
        except asyncio.CancelledError:
            self.tstore.fail_step(step, "cancelled: the trainer stopped during this step", metrics)
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.error(
                "training step %d%s failed (%d samples stay for the next step): %s", step, self._of_lane(), len(batch),
                error,
            )
            await asyncio.to_thread(self.tstore.fail_step, step, error, metrics)
            if version is not None:
                await asyncio.to_thread(keeper.versions.abandon, version)
            self.last_report = StepReport(step, False, None, metrics, error, turn_ids)
            if keeper.dirty:
                try:
                    await keeper.undo()
                except Exception:
                    log.exception("could not reload the last committed checkpoint; retrying before the next step")
            return self.last_report
        finally:
            self._in_step = False
        self.running_means = prepared.running
        self.merge_totals += prepared.merge
        self._last_step_s = t2 - t0
        await keeper.prune()  # retention: only after the new checkpoint committed
        self._dropped = dict.fromkeys(self._dropped, 0)
        mg = prepared.merge
        loss = metrics.get("loss")
        log.info(
            "training step %d%s ok: %d turns in %d datums (%d merged into an earlier turn's sequence, "
            "%d prefix breaks; %d tokens sent, %d without merging), policy v%d, loss %s, reward mean %.4f",
            step,
            self._of_lane(),
            len(turn_ids),
            mg.datums,
            mg.merged,
            mg.breaks,
            mg.tokens_sent,
            mg.tokens_unmerged,
            version,
            "not reported" if loss is None else f"{loss:.6g}",
            metrics["reward_mean"],
        )
        self.last_report = StepReport(step, True, version, metrics, None, turn_ids)
        return self.last_report

    def _of_lane(self) -> str:
        """How a log line names this loop's lane: ' (user NAME)' for a user's adapter, else ''."""
        return f" (user {self.lane})" if self.lane else ""

    def _step_metrics(
        self, prepared: PreparedBatch, backend_metrics: dict[str, float], train_s: float, publish_s: float
    ) -> dict[str, Any]:
        m: dict[str, Any] = {k: float(v) for k, v in backend_metrics.items() if _finite(v)}
        m.update(prepared.metrics)
        for key in ("loss", "kl", "clip_fraction"):
            m.setdefault(key, None)
        m.update(
            {
                "seconds": train_s + publish_s,
                "train_seconds": train_s,
                "publish_seconds": publish_s,
                "dropped_stale": float(self._dropped["stale"]),
                "dropped_empty": float(self._dropped["empty"]),
                "dropped_no_reward": float(self._dropped["no_reward"]),
                "dropped_no_signal": float(self._dropped["no_signal"]),
                "dropped_private": float(self._dropped["private"]),
                "normalization": self.config.normalization,
                "baseline": self.config.baseline,
            }
        )
        return m

    @property
    def lock(self) -> asyncio.Lock:
        """Held for each iteration (a step, the gate's decision); hold it to change what the
        trainer trains from without racing them (promotion's admin actions)."""
        return self._lock

    async def rollback(self, version: int) -> int:
        """Serve committed `version`'s checkpoint under a new version and train on from it (waits
        for a step in progress); returns the new version."""
        async with self._lock:
            return await self.keeper.rollback(version)

    # ------------------------------------------------------------------ for the proxy and status
    def backlog_exceeded(self) -> tuple[bool, float]:
        """Capacity mode: (True, retry_after_s) when starting one more session would take the
        backlog (`TrainingStore.backlog`, in datums) past its bound; always (False, 0) when off."""
        if not self.config.capacity_mode:
            return False, 0.0
        if self.tstore.backlog(self._watermark) < self.config.backlog_bound:
            return False, 0.0
        expected = self._last_step_s if self._last_step_s is not None else self.config.poll_interval_s
        return True, float(min(60.0, max(1.0, math.ceil(expected))))

    def status(self) -> dict[str, Any]:
        """The trainer section for `/rl/status` and `clawbridge status`."""
        cfg = self.config
        return {
            "enabled": True,
            "running": self.running,
            "in_step": self._in_step,
            "holding": self.holding,
            "serving_policy_version": self.backend.sampler().policy_version,
            "backlog": self.tstore.backlog(self._watermark),
            "waiting": {**self.tstore.waiting(cfg.reward_wait_s, cfg.batch_size),
                        "short_batch_in_s": self.waits.short_batch_in(self.store.clock.monotonic()),
                        "held_for_group": self.waits.held_for_group},
            "needs_restore": self.keeper.dirty,
            "capacity": {"mode": cfg.capacity_mode, "bound": cfg.backlog_bound},
            "merging": {"enabled": cfg.merge_turns, **self.merge_totals.as_dict()},
            "config": {
                "batch_size": cfg.batch_size,
                "loss": cfg.loss.name,
                "gamma": cfg.gamma,
                "baseline": cfg.baseline,
                "normalization": cfg.normalization,
                "max_off_policy_steps": cfg.max_off_policy_steps,
                "stale_policy": cfg.stale_policy,
                "drop_stale_after": cfg.drop_stale_after,
                "max_batch_tokens": cfg.max_batch_tokens,
                "batch_wait_s": cfg.batch_wait_s,
                "method": cfg.mix.method,
                "explicit_reward_rule": cfg.mix.explicit_rule,
                "merge_session_turns": cfg.merge_turns,
            },
            **self.tstore.training_stats(),
        }


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and math.isfinite(float(v))
