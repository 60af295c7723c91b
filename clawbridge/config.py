"""Configuration: every option from CLI flag > environment (`CLAWBRIDGE_*`) > TOML file > default.

Invariants:
- `Settings` holds the options the core reads. A backend's own options (local, tinker,
  fireworks, a third-party one) live in its settings model, filled from `[backends.<name>]` and
  `CLAWBRIDGE_<NAME>_*` (`clawbridge.backend_settings`); a flat top-level key of a backend
  (`engine`, `tinker_base_url`) is refused naming where it moved, never silently ignored.
- Secrets are `SecretStr` so they never print by accident (and `privacy_patterns`, which may spell
  one out, is masked too); `masked_dump` (with `masked_section` for the backend sections) is
  what `clawbridge config show` prints.
- Each default and each allowed-value list is written once, here: the component configs take
  theirs from `default_of` and the `Literal` aliases above `Settings`.
- Settings sit at the bottom: this module imports no other clawbridge module (the backend
  registry above it, `clawbridge.plugins`, teaches it where a backend's old flat option moved
  through `explain_unknown_options`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_STATE_DIR = Path("~/.clawbridge")

SECRET_WORDS = re.compile(r"key|secret|token|password", re.IGNORECASE)
"""Options whose names match are masked by `masked_section` (and by `Settings.masked_dump`)."""


def masked_section(section: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    """A section as plain values with its secrets masked (module invariants): `***` for a set
    secret, `None` for an unset one."""
    items = section.model_dump().items() if isinstance(section, BaseModel) else section.items()
    out: dict[str, Any] = {}
    for key, value in items:
        if isinstance(value, SecretStr) or (value is not None and SECRET_WORDS.search(key)):
            out[key] = "***"
        else:
            out[key] = value
    return out


class OptionMoved(Exception):
    """A backend's old flat top-level option was given (`moved_option` says where it went).

    Deliberately not a `ValueError`: pydantic would wrap that in a `ValidationError` that prints
    every input value, the keys among them."""


UnknownOptionHint = Callable[[str], "str | None"]
"""Says where an unknown top-level option went (a message), or None when it knows nothing of it."""
_unknown_option_hints: list[UnknownOptionHint] = []


def explain_unknown_options(hint: UnknownOptionHint) -> None:
    """Have `Settings` refuse an unknown option that `hint` knows with `OptionMoved` and its message
    (the backend registry registers `clawbridge.plugins.moved_option`); any other unknown option
    is refused by pydantic as before."""
    if hint not in _unknown_option_hints:
        _unknown_option_hints.append(hint)


TRACKERS = ("tensorboard", "wandb")
"""The experiment trackers `report_to` may name (`clawbridge.telemetry.reporting` writes to them)."""


def parse_report_to(value: str) -> list[str]:
    """'tensorboard,wandb' -> ['tensorboard', 'wandb']; raises ValueError naming a bad entry."""
    names = [p.strip().lower() for p in value.split(",") if p.strip()]
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise ValueError(f"report_to: unknown tracker(s) {bad}; choose from {', '.join(TRACKERS)}")
    return list(dict.fromkeys(names))


LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
)
"""Default LoRA targets: every weight matrix of attention and MLP plus the unembedding, as Tinker's
`LoraConfig(train_attn, train_mlp, train_unembed)` defaults. Without `lm_head` a model whose output
layer cannot be steered through its normalized hidden state learns nothing: on the tiny random
model the most any hidden state can do is raise the 'e'-token share from 0.397 to 0.415."""

FULL_LEARNING_RATE = 1e-5
"""Default full fine-tuning learning rate (a common RL rate for 0.1B-10B models)."""
LORA_LEARNING_RATE = 3e-4
"""Default LoRA learning rate. Thinking Machines' "LoRA Without Regret" finds the best LoRA rate
~10x the full fine-tuning one (1e-4 here until 2026-11-29); Tinker's recommended LoRA rate,
5e-4 x (2000 / hidden size) ** 0.781, is 2.9e-4 for 4096-wide models and 1.3e-3 for SmolLM2-135M.
Measured through `clawbridge up` on SmolLM2 taught by talk (docs/training.md, "Changed: the LoRA
rate 1e-4 -> 3e-4"): held-out preference after 32 sessions 0.31-0.56 at 1e-4, 0.75-1.00 at 3e-4,
the gate never serving a version below the base's facts; 1.3e-3 turned answers to word salad."""


LossName = Literal["importance_sampling", "ppo", "cispo"]
"""Policy-gradient losses (`loss`; `clawbridge.backend.LossConfig`)."""
BaselineRule = Literal["none", "running_mean", "group_mean", "group_mean_std"]
"""Advantage baselines (`baseline`; rule 3 of `clawbridge.trainer.advantages`)."""
NormalizationRule = Literal["token_mean", "sequence_mean", "sum"]
"""Advantage scalings (`advantage_normalization`; rule 4)."""
StalePolicy = Literal["drop", "importance_weight"]
"""What the trainer does with stale datums (`stale_policy`)."""
ExplicitRule = Literal["override", "add"]
"""Explicit rewards vs judge verdicts (`explicit_reward_rule`; rule 1b)."""
RewardMethod = Literal["rl", "opd", "combine"]
"""Per-token advantage method (`method`; rule 5)."""
NotesPlace = Literal["system", "user"]
"""Where a call carries its user's notes (`notes_place`; `clawbridge.rewards.notes.noted_messages`)."""


class Settings(BaseSettings):
    """Resolved clawbridge configuration."""

    model_config = SettingsConfigDict(env_prefix="CLAWBRIDGE_", extra="forbid", populate_by_name=True)

    # Where the TOML file is read from; set by `--config` or CLAWBRIDGE_CONFIG.
    _toml_path: ClassVar[Path | None] = None
    # CLI flags that set a backend's option (`up --yes`: fireworks `yes`); see `backend_flags`.
    _backend_flags: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)

    # --- [server]
    host: str = Field("127.0.0.1", description="Address to bind. Non-loopback needs keys set in the environment.")
    port: int = Field(8400, description="Port to bind.")
    state_dir: Path = Field(DEFAULT_STATE_DIR, description="Where the store, keys and checkpoints live.")
    log_level: str = Field("info", description="debug, info, warning or error.")

    # --- [serving] (the `backends` table is each backend's own)
    backend: str = Field(
        "local", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Which backend serves and trains: local, tinker, fireworks, or another installed in the "
        "`clawbridge.backends` entry point group (checked when it is selected).",
    )
    backends: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per-backend option sections, TOML `[backends.<name>]` (environment: CLAWBRIDGE_<NAME>_<OPTION>), "
        "read by the backend's own settings model and validated when it is selected (see clawbridge.backend_settings).",
    )
    model: str = Field("", description="Model to serve: a local folder or a Hugging Face id.")
    served_model_name: str = Field("", description="Name the model answers to (default: the model's folder or id).")
    default_max_tokens: int = Field(1024, description="max_tokens when a request gives none.")
    tokenizer: str = Field("", description="Tokenizer (with chat template) path or id; default: the model.")

    # --- [proxy]
    api_key: SecretStr | None = Field(None, description="Client key for model calls (generated if unset).")
    admin_key: SecretStr | None = Field(None, description="Admin key for /rl/* management (generated if unset).")
    metrics_key: SecretStr | None = Field(None, description="Key that may read /metrics (besides the admin key); environment only.")
    trust_user_header: bool = Field(False, description="Let the shared client key name its user with an X-User-Id header (single-tenant convenience; users' own keys need no header; see docs/users.md).")
    report_to: str = Field("", description="Also send training step metrics to: tensorboard, wandb or both (comma-separated); off when empty.")
    report_dir: str = Field("", description="Where tensorboard event files and wandb runs go (default: <state_dir>/runs).")
    wandb_project: str = Field("clawbridge", description="report_to wandb: the W&B project (WANDB_MODE=offline works without a network).")
    max_body_bytes: int = Field(8 * 1024 * 1024, description="Request bodies above this get 413.")
    session_idle_timeout_s: float = Field(1800.0, description="Sessions idle this long end by themselves.")
    request_timeout_s: float = Field(600.0, description="A model call that takes longer gets 504.")
    max_messages: int = Field(4096, ge=1, description="Requests with more messages get 400 before any validation or rendering.")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host header names accepted besides loopback names and the bind address (DNS-rebinding guard; '*' turns it off).",
    )
    header_timeout_s: float = Field(10.0, gt=0, description="A connection that has not sent a request's headers this long after opening (or after its last response) is closed.")
    body_timeout_s: float = Field(60.0, gt=0, description="A request body not fully received this long after its headers gets 408.")
    max_connections: int = Field(512, ge=1, description="Open connections (and requests) beyond this get 503 at once.")
    drain_grace_s: float = Field(10.0, ge=0, description="On SIGTERM: stop accepting, let running calls finish this long, then end them with an error.")
    min_free_disk_bytes: int = Field(
        64 * 1024 * 1024, ge=0, description="Model calls get 507 (before sampling) while the state dir's disk has less free space than this."
    )
    store_budget_bytes: int = Field(
        8 * 1024**3, ge=0, description="`status` warns when the store (db + WAL) grows past this (0: no budget)."
    )

    # --- [training]
    lora_rank: int = Field(32, description="LoRA rank; 0 trains all weights (local and fireworks only).")
    lora_alpha: float = Field(32.0, description="LoRA alpha (scaling = alpha / rank).")
    lora_target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGET_MODULES),
        description="Modules LoRA adapts (local backend): attention, MLP and the unembedding (lm_head), as Tinker's LoRA.",
    )
    learning_rate: float | None = Field(
        None,
        description=f"AdamW / Adam learning rate (unset: {LORA_LEARNING_RATE:g} with LoRA, "
        f"{FULL_LEARNING_RATE:g} for full fine-tuning; see `effective_learning_rate`).",
    )

    # --- [trainer]
    train: bool = Field(True, description="Run the trainer loop when the backend can train (false: record and serve only).")
    batch_size: int = Field(
        8, ge=1, description="Rewarded main turns per training step; a step runs once this many are ready "
        "(turns merged into one sequence count one each).",
    )
    updates_per_step: int = Field(
        1, ge=1, le=16, description="Optimizer updates on each batch before its version is published (PPO's epochs). "
        "Every update after the first sees the recorded sampler logprobs as stale ones: ppo stops pushing a token once "
        "its ratio passes the clip, so the batch's pull is bounded; cispo only caps each token's weight at "
        "1 + clip_high and keeps pushing. One version, one checkpoint and one gate decision per step, whatever the count.",
    )
    loss: LossName = Field(
        "cispo", description="Policy-gradient loss (Tinker / Fireworks semantics). cispo (default): the ratio to the "
        "recorded sampler logprob weights each token, clipped to [1 - clip_low, 1 + clip_high] (every token keeps its "
        "gradient; a token the policy already pushed far cannot pull itself further); importance_sampling: the same "
        "weight unclipped (on stale data it collapsed a run in 8 under load; docs/training.md, 'Stale data'); ppo zeroes the "
        "gradient of clipped tokens.",
    )
    clip_low: float = Field(0.2, ge=0.0, description="ppo/cispo: ratio floor is 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0.0, description="ppo/cispo: ratio ceiling is 1 + clip_high.")
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty toward the base policy (0: off).")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Turn discount: r[i] += gamma * r[i+1], last turn first.")
    baseline: BaselineRule = Field(
        "group_mean",
        description="Advantage baseline: group_* over sessions sharing a task_id (others: running_mean per source).",
    )
    advantage_normalization: NormalizationRule = Field(
        "token_mean", description="How advantages are scaled so every backend's token-sum loss means the same."
    )
    max_off_policy_steps: int = Field(2, ge=0, description="Datums sampled more policy versions ago than this are stale.")
    stale_policy: StalePolicy = Field(
        "importance_weight",
        description="Datums sampled by an older policy: importance_weight trains them (the recorded sampler logprobs "
        "weight them, clipped by the loss), drop drops those more than max_off_policy_steps behind (counted).",
    )
    drop_stale_after: int = Field(
        0, ge=0, description="importance_weight: still drop datums more than this many versions behind (0: never drop)."
    )
    merge_session_turns: bool = Field(
        True, description="Train a session's turns as ONE sequence where each prompt starts with the previous turn's "
        "prompt + completion (token exact; the loss on every sampled span): the same loss, far fewer tokens sent. "
        "Where the prefix breaks (a template that strips earlier reasoning, an edited history) turns train separately.",
    )
    max_batch_tokens: int = Field(
        4096, ge=0, description="A trainer behind its backlog trains larger steps, up to this many sampled tokens "
        "(never fewer than batch_size turns; 0: always batch_size).",
    )
    capacity_mode: bool = Field(False, description="Answer /rl/start_session 429 while the training backlog is full.")
    max_backlog: int = Field(0, ge=0, description="Capacity-mode bound in datums (0: batch_size * (max_off_policy_steps + 1)).")
    reward_wait_s: float = Field(600.0, gt=0, description="Ended sessions still without any reward this long are dropped.")
    batch_wait_s: float = Field(
        30.0, ge=0, description="Fewer than batch_size ready datums train as a short batch once they have waited "
        "this long, so the last turns before agents go quiet are trained (0: always wait for a full batch). Under a "
        "group baseline, also the longest a task's ready turns wait for its other sessions to be rewarded (0: never).",
    )
    default_session_reward: bool = Field(
        True, description="AReaL's rule: a /rl/start_session session or a Claw-R1 trajectory that is refreshed or "
        "ended (by any route, the dashboard, `clawbridge sessions end` or the idle timeout) with no reward gets "
        "default_reward_value on its last turn (never when a judge is configured: its verdicts are the reward).")
    default_reward_value: float = Field(0.0, description="The reward default_session_reward assigns.")
    trainer_poll_interval_s: float = Field(1.0, gt=0, description="How often the trainer loop looks for a ready batch.")
    keep_checkpoints: int = Field(
        3, ge=1, description="Checkpoints kept: those of the newest N committed policy versions (older ones are "
        "deleted after each step and shown as pruned by `clawbridge checkpoints list`; the served one, the base and "
        "promotion's anchor always stay).",
    )
    per_user_adapters: bool = Field(
        False, description="Train an adapter per user: each user's rewarded turns train their own LoRA adapter "
        "(own optimizer, checkpoints and policy versions) and their calls are answered by it once it has trained; "
        "calls without a user train and get the shared policy (LoRA; local backend or Tinker; see docs/users.md).",
    )
    max_user_adapters: int = Field(
        16, ge=1, description="per_user_adapters: users' adapters kept loaded in the engine at once, least recently "
        "used unloaded (reloaded from its checkpoint at that user's next call).",
    )

    # --- [rewards]
    judge: Literal["off", "endpoint", "base"] = Field(
        "off", description="Judge of each main turn from its next state: off, endpoint (OpenAI-compatible) or base (the backend's base model)."
    )
    judge_base_url: str = Field("", description="judge endpoint: base URL of an OpenAI-compatible API (…/v1).")
    judge_model: str = Field("", description="judge endpoint: model name to ask.")
    judge_api_key: SecretStr | None = Field(None, description="judge endpoint: its own API key (environment only, never logged).")
    judge_votes: int = Field(3, ge=1, description="Judge samples per turn; the verdict is their majority (ties and failed votes: 0).")
    judge_temperature: float = Field(0.6, ge=0.0, description="Sampling temperature of the judge's votes.")
    judge_max_tokens: int = Field(512, ge=16, description="Max tokens of one judge answer.")
    judge_concurrency: int = Field(2, ge=1, description="Judge calls in flight at once (with judge=base: at most this many sampler slots).")
    judge_retries: int = Field(2, ge=0, description="Retries of one failed judge call (backoff doubles from 0.5 s).")
    judge_timeout_s: float = Field(60.0, gt=0, description="One judge call longer than this fails.")
    judge_max_attempts: int = Field(3, ge=1, description="Judge a turn at most this many times when every vote fails; then it gets no verdict.")
    judge_poll_interval_s: float = Field(1.0, gt=0, description="How often the judge worker looks for ended sessions.")
    judge_promote_best: bool = Field(
        False, description="The 'at least one' rule: a session whose verdicts are all 0 gets its best turn's mean vote (if > 0) as reward."
    )
    explicit_reward_rule: ExplicitRule = Field(
        "override", description="Explicit rewards (API, CLI) on a turn: override its judge verdict, or add to it."
    )
    method: RewardMethod = Field(
        "combine", description="Per-token advantage: rl (rewards), opd (teacher - sampler logprobs) or combine (w_opd·opd + w_rl·rl)."
    )
    w_rl: float = Field(1.0, ge=0.0, description="combine: weight of the reward (RL) advantage.")
    w_opd: float = Field(1.0, ge=0.0, description="combine: weight of the OPD advantage.")
    opd_coef: float = Field(1.0, ge=0.0, description="OPD advantage = opd_coef · (teacher logprob − sampler logprob); a turn served with notes: "
                          "minus the base model's logprob on its plain prompt (docs/rewards.md).")
    rewrite_coef: float = Field(
        0.0, ge=0.0, description="A correction the judge rewrote (the answer as the user asked for it) trains as a "
        "demonstration on the turn's plain prompt, each token with this advantage (0, the default: off; measured on "
        "SmolLM2 in docs/training.md; docs/rewards.md).",
    )
    notes: bool = Field(
        True, description="Learn at once from talk: the judge's hint from a user's correction becomes a note that "
        "the user's next calls carry (where notes_place says) while training teaches it to the weights "
        "(noted turns train on the prompt without the note); notes retire once sessions served without them are "
        "accepted. List and delete them with `clawbridge notes` (docs/rewards.md).",
    )
    notes_place: NotesPlace = Field(
        "user", description="Where a call carries its user's notes: `user` (a hint appended to the last user "
        "message, as OPD's teacher sees it) or `system` (a line added to the system message, one made when the call "
        "has none). bench/note_effect.py measures how much each moves the model's answers (docs/training.md).",
    )
    notes_max: int = Field(3, ge=1, le=20, description="Active notes kept per user (the oldest retires).")
    notes_best_of: int = Field(
        4, ge=1, le=16, description="A call with notes samples this many answers and serves the one its notes "
        "explain best (mean log p(answer | notes) - log p(answer | no notes) per token; an answer that echoes "
        "its note only if all do). It is served when all are done, so a streamed answer starts later. 1: one "
        "sample. Needs a sampler that scores (local, tinker); sampled calls only (docs/rewards.md).",
    )
    notes_pick: Literal["auto", "likelihood", "judge"] = Field(
        "auto", description="How best of n picks among a noted call's answers: `likelihood` (the note score "
        "above alone), `judge` (the judge first says which answers follow the notes, one call at temperature 0; "
        "the note score picks among those), auto: judge with judge=endpoint, else likelihood (docs/rewards.md).",
    )
    notes_best_of_more: int = Field(
        12, ge=0, le=16, description="When the judge checks a noted call's answers (notes_pick) and says none "
        "of them follows the notes (or only ones that echo the note), sample this many more once and let it "
        "check those: a rare layout is found more often, and only those calls wait for a second round. "
        "0: never (docs/rewards.md).",
    )
    notes_pick_timeout_s: float = Field(
        20.0, gt=0, description="A judge's check of a noted call's answers longer than this is not waited for: the "
        "likelihood picks alone (the person is waiting).",
    )
    notes_check_share: float = Field(
        0.25, ge=0.0, le=1.0, description="Share of a user's new sessions served without their notes once the notes "
        "are notes_check_after_steps steps old, to see whether the weights carry them.",
    )
    notes_check_after_steps: int = Field(
        2, ge=0, description="Training steps of a user's lane after their newest note (or their last check session that "
        "missed) before check sessions start (again).")
    notes_check_after_met: int = Field(
        3, ge=0, description="Check sessions also wait until the user's last this many sessions served with their "
        "notes (first answers, since the newest note and their last check session that missed) were all accepted: "
        "while the note itself does not work, the weights cannot carry it and a session without it would only show "
        "the user a miss (0: by steps alone).")
    notes_retire_after: int = Field(
        3, ge=1, description="A user's notes retire once this many check sessions in a row were accepted.")

    # --- [promotion]
    promotion_mode: Literal["auto", "off", "probe", "eval", "canary"] = Field(
        "auto", description="auto: eval when eval_set names a file, else probe; off: every trained version serves at "
        "once; probe: a new version serves only if it still passes the built-in capability probe about as well as the "
        "serving version and the anchor (capability_probe_slack), else training resumes from the serving version; "
        "eval: a new version is evaluated "
        "on the eval set (or held-out sessions) and serves only if it is not worse than the serving one by more than "
        "promotion_tolerance, else training resumes from the serving version; canary: it answers canary_share of new "
        "sessions until a sequential test of their rewards decides (docs/promotion.md). TOML: also `[promotion] mode`.",
    )
    eval_set: str = Field(
        "", description="eval: a JSONL file, one {\"messages\": [...], \"expect\": \"REGEX\"} (passes when the greedy "
        "answer matches, case-insensitive) or {\"messages\": [...], \"rubric\": \"...\"} (scored by the judge) per line. "
        "Empty: held_out_share of the recorded sessions is never trained and scores versions instead.",
    )
    promotion_tolerance: float | None = Field(
        None, ge=0.0, le=1.0, description="How much lower (0..1) a candidate's score may be than the serving version's "
        "and still be promoted (unset: 0 for an eval set of regex lines only, 0.05 for rubric lines, held-out sessions "
        "and canary rewards, which are noisier).",
    )
    capability_probe: bool = Field(
        True, description="Every candidate (modes probe, eval and canary) must also pass the built-in capability "
        "probe: 40 short factual questions, greedy, each passed when its answer names the fact; a candidate that "
        "scores more than capability_probe_slack items below the serving version or the anchor is rejected "
        "(docs/promotion.md).",
    )
    capability_probe_slack: int = Field(
        1, ge=0, description="Capability probe items a candidate may score below the serving version and the anchor "
        "(a small model's answer to one question flips as its style changes).",
    )
    capability_probe_nats: float = Field(
        0.1, ge=0.0, le=5.0, description="Also hold every candidate within this many nats per token of the "
        "anchor's likelihood of its own correct probe answers (0: off). The greedy probe misses a model that "
        "still answers right greedily but samples nonsense; the local torch engine and Tinker measure it in one "
        "forward pass per answer; Fireworks and SGLang skip it, saying so in the log (docs/promotion.md).")
    everyday_guard_nats: float = Field(
        0.25, ge=0.0, le=5.0, description="Also hold every candidate within this many nats per token of the "
        "anchor's likelihood of its own answers to 12 everyday questions, asked plainly and again as an agent "
        "serves them, with a profile and a note (0: off; on with the capability probe). "
        "Fact checks miss a model whose everyday answers fall apart into word salad while it keeps its facts; "
        "measured on SmolLM2 (bench/everyday_guard.py), runs that learned their users' preferences drifted 0.12 "
        "and 0.17 nats per token in 30-35 steps, word salad at a 13x rate 0.6-0.8 (docs/promotion.md). Local torch "
        "engine and Tinker only, like capability_probe_nats.")
    content_check: bool = Field(
        True, description="Also ask every candidate (with the capability probe) 12 everyday questions in the "
        "agent's own context, the system prompt and notes of the latest call that trains the shared policy, and "
        "reject it when fewer of its greedy answers talk about their question than the serving version's and the "
        "anchor's, less content_check_slack (a lexical check that stays on this machine). Measured on SmolLM2 "
        "taught a user's name: answers that became 'I'm Sam, your personal assistant' passed every other check "
        "(docs/promotion.md, 'The content check').")
    content_check_slack: int = Field(
        1, ge=0, le=11, description="Everyday answers on topic a candidate may have fewer of than the serving "
        "version and the anchor (content_check).")
    step_backoff: float = Field(
        0.5, ge=0.1, le=1.0, description="After each candidate the gate rejects, the next step's learning rate is "
        "multiplied by this (down to step_backoff_floor), and after each promotion divided by it (up to the "
        "configured rate): a rejected step was too far from the serving version, so the next one is shorter "
        "(a trust region). 1: off. docs/promotion.md, 'Smaller steps after a rejection'.")
    step_backoff_floor: float = Field(
        0.125, gt=0.0, le=1.0, description="The smallest learning-rate scale step_backoff reaches.")
    rehearsal_coef: float = Field(
        1.0, ge=0.0, le=10.0, description="Train a few of the anchor's own correct answers to built-in factual "
        "questions beside every step's turns, each token with this advantage (times the batch's mean token scale), "
        "so that a preference taught by talk does not cost what the model knew (0: off; 1 is the value measured, docs/training.md). Needs a gate and a sampler "
        "that scores given tokens (the local torch engine, Tinker); docs/promotion.md, 'Rehearsal'.")
    rehearsal_items: int = Field(
        8, ge=1, le=64, description="Rehearsed answers per step (rehearsal_coef > 0), in turn from the built-in set.")
    capability_probe_max_tokens: int = Field(
        32, ge=8, description="Longest greedy answer per capability probe question (an answer stops as soon as "
        "it names the fact).")
    held_out_share: float = Field(
        0.1, ge=0.0, le=0.5, description="Without an eval_set (eval mode): this share of sessions (a hash of the "
        "session id) is never trained (dropped: held_out) and scores versions by their recorded verdicts.",
    )
    eval_max_tokens: int = Field(256, ge=1, description="Longest greedy answer sampled per evaluation item.")
    eval_max_items: int = Field(200, ge=1, description="Held-out evaluation: at most this many (newest) turns.")
    canary_share: float = Field(
        0.2, gt=0.0, le=1.0, description="canary: the share of NEW sessions the candidate answers (sticky per session).")
    canary_min_sessions: int = Field(
        20, ge=1, description="canary: rewarded sessions each side needs before the test may decide.")
    canary_max_sessions: int = Field(
        200, ge=1, description="canary: once both sides have this many rewarded sessions and the test has not shown "
        "the candidate not worse, it is rolled back (never worse by default).")
    canary_confidence: float = Field(
        0.95, gt=0.5, lt=1.0, description="canary: the sequential test (by betting, valid however often it looks) "
        "promotes a candidate worse by the tolerance or more, or rolls back one that is not worse, with probability "
        "at most 1 - this; it decides once its evidence reaches 1 / (1 - this).")
    promotion_poll_interval_s: float = Field(
        2.0, gt=0, description="canary: how often the rewards of the candidate's and the incumbent's sessions are tested.")

    # --- [probe]
    probe_timeout_s: float = Field(
        10.0, gt=0, description="Hosted backends: each start-up check of the service (reachable, key accepted, model "
        "offered) gives up after this long, so `up` says what is wrong in seconds.",
    )

    # --- [privacy]
    privacy: Literal["auto", "on", "off"] = Field(
        "auto", description="Privacy filter on training data sent to a hosted backend and on judge prompts sent to an "
        "endpoint: auto (on for hosted backends and judge=endpoint), on, off. Found prompt spans are replaced by "
        "placeholders; a turn whose sampled answer holds one is not trained (`dropped: private`). docs/privacy.md.",
    )
    privacy_detectors: list[str] = Field(
        default_factory=lambda: ["keys", "email", "phone", "card", "iban"],
        description="What the privacy filter looks for: keys (API keys, tokens, private keys: detect-secrets), "
        "email, phone (phonenumbers), card (Luhn-checked), iban (checksum-checked).",
    )
    privacy_patterns: list[str] = Field(
        default_factory=list, description="Extra regular expressions the privacy filter masks (as [REDACTED]).",
    )
    privacy_phone_regions: list[str] = Field(
        default_factory=lambda: ["US"], description="Regions whose national phone formats are recognised (numbers "
        "written with +country code always are).",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_options(cls, data: Any) -> Any:
        """A backend's old flat key (`tinker_base_url = ...`) says where it moved (module invariants)."""
        if isinstance(data, dict):
            data = _flatten_sections(data)

            unknown = [k for k in data if isinstance(k, str) and k not in cls.model_fields]
            moved = [m for m in (next((h(k) for h in _unknown_option_hints if h(k)), None) for k in unknown) if m]
            if moved:
                raise OptionMoved("; ".join(moved))
        return data

    @model_validator(mode="after")
    def _resolve_promotion_mode(self) -> Settings:
        """`promotion_mode = "auto"` is read once here: an eval set of the user's own makes it `eval`,
        none makes it `probe` (the built-in capability probe: never worse by default); every reader
        sees only off, probe, eval or canary."""
        if self.promotion_mode == "auto":
            self.promotion_mode = "eval" if self.eval_set else "probe"
        return self

    @field_validator("privacy_detectors", "privacy_patterns", "privacy_phone_regions")
    @classmethod
    def _privacy_options(cls, value: list[str], info: Any) -> list[str]:
        from clawbridge.privacy.detect import check_option

        return check_option(info.field_name, value)

    @field_validator("report_to")
    @classmethod
    def _known_trackers(cls, value: str) -> str:
        return ",".join(parse_report_to(value))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_path = cls._toml_path
        if toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)

    @property
    def backend_flags(self) -> dict[str, dict[str, Any]]:
        """Backend options set by CLI flags, by backend name: they win over the environment
        (`clawbridge.backend_settings`)."""
        return self._backend_flags

    @property
    def state_path(self) -> Path:
        """The state dir, with `~` expanded."""
        return Path(os.path.expanduser(str(self.state_dir)))

    @property
    def effective_learning_rate(self) -> float:
        """`learning_rate` if set, else the default of the mode: `LORA_LEARNING_RATE` with LoRA
        (`lora_rank > 0`), `FULL_LEARNING_RATE` for full fine-tuning."""
        if self.learning_rate is not None:
            return self.learning_rate
        return LORA_LEARNING_RATE if self.lora_rank > 0 else FULL_LEARNING_RATE

    @property
    def notes_pick_by_judge(self) -> bool:
        """Whether best of n asks the judge which answers follow the notes (`notes_pick`; auto: with
        judge=endpoint, a capable judge, not the served model's own base)."""
        return self.notes_pick == "judge" or (self.notes_pick == "auto" and self.judge == "endpoint")

    @property
    def tokenizer_source(self) -> str:
        """Where the tokenizer loads from: `tokenizer`, else `model`."""
        return self.tokenizer or self.model

    @property
    def model_name(self) -> str:
        """The name the served model answers to."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model.rstrip("/")).name if self.model else "default"

    def masked_dump(self) -> dict[str, Any]:
        """Every option, secrets replaced by `***` (or `null` when unset)."""
        out: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                out[name] = "***"
            elif isinstance(value, Path):
                out[name] = str(value)
            elif name == "privacy_patterns":  # a pattern may spell out the very secret it guards
                out[name] = ["***"] * len(value)
            elif name == "backends":  # a backend's secrets are its own business: never print them
                out[name] = {b: masked_section(section) for b, section in value.items()}
            else:
                out[name] = value
        return out


def default_of(name: str) -> Any:
    """The default of option `name`: the one place it is written. The component configs built
    from `Settings` (`TrainerConfig`, `LossConfig`, `RewardMix`, `WorkerConfig`, `VoteConfig`)
    take their defaults from here, so one built directly trains as production does."""
    return Settings.model_fields[name].get_default(call_default_factory=True)


@dataclass(frozen=True)
class Section:
    """A group of options: a TOML table (`[trainer]`) and a table of the configuration reference."""

    table: str
    first: str
    """Its first option: a section holds the options declared from this one to the next section's."""
    title: str
    """What it is about (the reference's heading)."""


SECTIONS: tuple[Section, ...] = (
    Section("server", "host", "server"),
    Section("serving", "backend", "model and backend"),
    Section("proxy", "api_key", "proxy"),
    Section("training", "lora_rank", "training, shared by every backend"),
    Section("trainer", "train", "trainer loop (clawbridge/trainer)"),
    Section("rewards", "judge", "rewards (clawbridge/rewards): judge, on-policy distillation and how they combine"),
    Section("promotion", "promotion_mode", "promotion (clawbridge/promotion): a new version serves only once it "
            "is not worse"),
    Section("probe", "probe_timeout_s", "hosted backends' (tinker, fireworks) start-up probe (clawbridge.probe)"),
    Section("privacy", "privacy", "privacy (clawbridge/privacy): what may leave the machine"),
)
"""The sections of `Settings`, in declaration order; every option but `backends` (each backend's own
`[backends.<name>]` table) is in exactly one."""


def _section_options() -> dict[str, tuple[str, ...]]:
    names = [n for n in Settings.model_fields if n != "backends"]
    starts = [names.index(sec.first) for sec in SECTIONS]
    assert starts == sorted(starts) and starts[0] == 0, "SECTIONS must follow the declaration order of Settings"
    ends = [*starts[1:], len(names)]
    return {sec.table: tuple(names[a:b]) for sec, a, b in zip(SECTIONS, starts, ends, strict=True)}


SECTION_OPTIONS: dict[str, tuple[str, ...]] = _section_options()
"""{TOML table: the option names it holds}."""


def section_of(name: str) -> str | None:
    """The TOML table option `name` belongs to (None: `backends`, or not an option)."""
    return next((t for t, names in SECTION_OPTIONS.items() if name in names), None)


def section_key(table: str, key: str) -> str | None:
    """The option a key of TOML table `table` names: the option itself (`[trainer] batch_size`), the
    option with the table's name before it (`[promotion] mode` -> `promotion_mode`, `[privacy]
    detectors` -> `privacy_detectors`), or `mode` for the option named like its table (`[privacy]
    mode` -> `privacy`); None when the table holds no such option."""
    options = SECTION_OPTIONS.get(table, ())
    for name in (key, f"{table}_{key}", table if key == "mode" else ""):
        if name in options:
            return name
    return None


def _flatten_sections(data: dict[str, Any]) -> dict[str, Any]:
    """The TOML section tables in `data` as the flat options they name (`[trainer] batch_size` ->
    `batch_size`). Top-level keys still work; a value already flat in `data` (a flag or the
    environment) wins. A key that is not an option of its table is refused, naming where it is."""
    out = dict(data)
    for table in SECTION_OPTIONS:
        values = out.get(table)
        if not isinstance(values, dict):  # absent, or `privacy = "on"`: the option, not the table
            continue
        del out[table]
        for key, value in values.items():
            name = section_key(table, str(key))
            if name is None:
                home = section_of(str(key))
                where = f" ({key} is an option of [{home}])" if home else ""
                raise ValueError(f"[{table}] has no option {key!r}{where}; it holds: "
                                 + ", ".join(SECTION_OPTIONS[table]))
            out.setdefault(name, value)
    return out


def load_settings(config_file: Path | None = None, *, backend_flags: dict[str, dict[str, Any]] | None = None,
                  **overrides: Any) -> Settings:
    """Build Settings from CLI overrides (None values ignored), env, and the TOML file.
    `backend_flags` are CLI flags that set a backend's options (`{"fireworks": {"yes": True}}`)."""
    if config_file is None and os.environ.get("CLAWBRIDGE_CONFIG"):
        config_file = Path(os.environ["CLAWBRIDGE_CONFIG"])
    if config_file is not None and not config_file.expanduser().is_file():
        raise FileNotFoundError(f"config file not found: {config_file}")
    clean = {k: v for k, v in overrides.items() if v is not None}
    Settings._toml_path = config_file.expanduser() if config_file else None
    try:
        settings = Settings(**clean)
    finally:
        Settings._toml_path = None
    settings._backend_flags = {b: dict(opts) for b, opts in (backend_flags or {}).items() if opts}
    return settings
