"""`clawbridge demo --model smollm2`: a real instruct model learns a user's preference from conversation.

SmolLM2-135M-Instruct (`clawbridge model get`, cached) is served by `clawbridge up` (local
backend, LoRA, training on). A scripted user asks everyday questions; each answer is answered in
the same session by the user, as a person would: "Too long. Keep it short." unless it finished within
`short_tokens` tokens; else "No, that's wrong." when the question has a known answer
(`TRAIN_ANSWERS`) and the answer names none of it; else "Thanks, that helps.". The agent answers
that too and the session ends. No reward is set by hand: the proxy's judge worker reads each turn's next state (the user's
reply) and asks the RULE-BASED judge endpoint (`clawbridge.devtools.judge_server`: keyword rules,
not a language model), whose +1 / -1 verdicts are the only rewards. The trainer trains LoRA and
publishes in the background.

Measured on prompts never trained on, before and after training, through the same proxy:
- preference rate: share of sampled answers (temperature 1, the same seeds before and after) to
  HELD_OUT questions that the scripted user would accept (short);
- capability: share of FACTS questions whose greedy answer names the right entity (a bound on how much
  it may fall is the caller's: the CLI prints it, the test asserts it).

Invariants: the demo only talks to the proxy over HTTP, as any agent would; the evaluation turns
are single-turn sessions with no next state and no reward, so they are never trained on; the
training, held-out and fact prompts are disjoint (checked at import).
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

TRAIN_PROMPTS: tuple[str, ...] = (
    "Give me a word that rhymes with cat.",
    "What is a synonym for happy?",
    "What is 5 plus 7?",
    "How are you today?",
    "Give me a word that rhymes with tree.",
    "What is a synonym for fast?",
    "What is 9 minus 4?",
    "What is the opposite of hot?",
    "Name a color.",
    "What day comes after Monday?",
    "Give me a girl's name that starts with A.",
    "What is a good name for a cat?",
    "Is water wet?",
    "What is a synonym for smart?",
    "What is 3 times 3?",
    "Name a fruit that is yellow.",
)
"""Quick everyday questions the scripted user asks while training (the base model answers some
of them briefly and most at length: the spread the reward needs)."""

HELD_OUT: tuple[str, ...] = (
    "Give me a word that rhymes with dog.",
    "What is a synonym for big?",
    "What is 6 plus 8?",
    "What is the opposite of up?",
    "Name an animal that can fly.",
    "What month comes after June?",
    "Give me a boy's name that starts with J.",
    "What is a good name for a dog?",
    "What is a synonym for sad?",
    "What is 10 minus 3?",
    "Name a vegetable that is green.",
    "Is ice cold?",
)
"""Quick questions never trained on: the preference rate is measured on these."""

FACTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What is the capital of France?", ("paris",)),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Italy?", ("rome",)),
    ("What is the capital of Germany?", ("berlin",)),
    ("What is the capital of Spain?", ("madrid",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("Which planet is known as the Red Planet?", ("mars",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("What is the tallest mountain in the world?", ("everest",)),
    ("Who painted the Mona Lisa?", ("leonardo", "da vinci")),
    ("What language is mainly spoken in Brazil?", ("portuguese",)),
)
"""Factual questions with the names an answer must contain (any of them, case-insensitive)."""

def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


TRAIN_ANSWERS: dict[str, frozenset[str]] = {
    "Give me a word that rhymes with cat.": _words("hat bat mat rat sat fat pat that flat chat brat spat vat gnat splat format"),
    "What is a synonym for happy?": _words("joyful glad cheerful content delighted pleased joyous elated merry jolly thrilled ecstatic"),
    "What is 5 plus 7?": frozenset({"12", "twelve"}),
    "Give me a word that rhymes with tree.": _words("bee see free three knee tea sea me he she we key flea glee fee sree agree degree"),
    "What is a synonym for fast?": _words("quick rapid swift speedy hasty fleet brisk"),
    "What is 9 minus 4?": frozenset({"5", "five"}),
    "What is the opposite of hot?": _words("cold cool chilly freezing icy"),
    "Name a color.": _words("red blue green yellow orange purple pink black white brown gray grey violet"),
    "What day comes after Monday?": frozenset({"tuesday"}),
    "What is a synonym for smart?": _words("intelligent clever bright brilliant wise sharp brainy"),
    "What is 3 times 3?": frozenset({"9", "nine"}),
    "Name a fruit that is yellow.": _words("banana bananas lemon lemons pineapple mango papaya grapefruit"),
    "Give me a girl's name that starts with A.": _words(
        "anna ann anne annie alice amy ava amelia abigail alexandra alexis andrea angela ashley audrey aria ada "
        "alicia amanda april autumn allison alyssa aurora adele agnes alina amber anastasia arianna athena"),
    "What is a good name for a cat?": _words(
        "whiskers luna simba oliver milo leo bella max charlie tiger shadow smokey mittens felix garfield tom "
        "kitty lucy chloe coco oreo ginger pumpkin salem nala cleo jasper loki mochi snowball fluffy socks boots "
        "misty pepper daisy lily molly sophie lola tigger"),
    "Is water wet?": _words("yes no wet"),
}
"""The words a right answer names (any one, as a whole word, case-insensitive); the one training
question not listed here has no wrong answer ("How are you today?"). Only training questions are
checked: the user would also say so when a short answer is wrong, so the reward asks for short AND
right, not for the shortest text. A user who only ever said "too long" taught the model to answer
one odd word, and the fact check fell (docs/real-model.md); one who let four open questions
pass any short answer taught it short filler ("Awesome question, friend!" to "What is the capital
of Spain?": capability 0.75 -> 0.08, seed 2 with 128 sessions)."""


def names_answer(prompt: str, text: str) -> bool:
    """Whether `text` is a right answer to training question `prompt` (always, if it has no key)."""
    words = TRAIN_ANSWERS.get(prompt)
    return words is None or bool(words & set(re.findall(r"[a-z0-9]+", text.lower())))


def facts_eval_set(path: Path) -> Path:
    """Write FACTS as a promotion eval set (`clawbridge.promotion.evalset`): one greedy question per
    line whose `expect` matches, case-insensitive and anywhere in the answer, exactly the names the
    capability check accepts. A version's eval score is then its capability."""
    lines = [json.dumps({"id": f"fact-{i}", "messages": [{"role": "user", "content": q}],
                         "expect": "|".join(re.escape(n) for n in names)})
             for i, (q, names) in enumerate(FACTS)]
    path.write_text("\n".join(lines) + "\n")
    return path


assert set(TRAIN_ANSWERS) <= set(TRAIN_PROMPTS)
assert not (set(TRAIN_PROMPTS) & set(HELD_OUT)) and not (set(TRAIN_PROMPTS) & {q for q, _ in FACTS})

THANKS = "Thanks, that helps."
COMPLAINT = "Too long. Keep it short."
WRONG = "No, that's wrong."


def user_reply(prompt: str, text: str, short: bool) -> str:
    """What the scripted user says to an answer (see the module docstring)."""
    if not short:
        return COMPLAINT
    return THANKS if names_answer(prompt, text) else WRONG


@dataclass(frozen=True)
class RealDemoConfig:
    """Knobs of one real-model demo run. The learning rate and sizes are first choices, not yet
    tuned by finished runs (docs/real-model.md)."""

    group_size: int = 4
    """Sessions per training question (one task id: the group baseline compares them)."""
    rounds: int = 2
    """Passes over the training questions (2: 128 sessions; with 1, seed 2 went 0.42 -> 0.33 at
    lr 1e-3: 5 of 64 answers thanked left too few mixed groups to learn from)."""
    train_prompts: int = len(TRAIN_PROMPTS)
    """How many of TRAIN_PROMPTS to use (the first ones)."""
    eval_samples: int = 2
    """Sampled answers (temperature 1, fixed seeds) per held-out question for the preference rate."""
    concurrency: int = 8
    short_tokens: int = 32
    """An answer is short (the user says thanks) if it stops within this many tokens."""
    max_tokens: int = 32
    """Cap on a training answer (an answer cut here is long)."""
    reply_max_tokens: int = 4
    """Cap on the agent's answer to the user's reply (it is not trained: no next state)."""
    eval_max_tokens: int = 32
    batch_size: int = 8
    learning_rate: float = 1e-3
    lora_rank: int = 8
    lora_alpha: float = 16.0
    seed: int = 0
    promotion: str = "off"
    """off: every trained version serves at once; eval: the FACTS are the eval set (`facts_eval_set`)
    and a version serves only if it names at most `tolerance` of them fewer than the serving one and
    the anchor (docs/promotion.md)."""
    tolerance: float = 0.09
    """eval: the promotion tolerance, one fact of 12 (1/12 = 0.083). At 0 a step that loses one fact
    while it shortens the answers never serves, and seed 0 learned nothing (preference 0.29 ->
    0.33); one fact of slack learned 0.29 -> 0.96 and still rejected the steps that lost 2-7
    facts (docs/promotion.md, "The real model")."""
    settings: dict[str, str] = field(default_factory=dict)
    """Extra CLAWBRIDGE_* variables for the proxy (they win over the demo's own)."""

    @property
    def sessions(self) -> int:
        return self.train_prompts * self.group_size * self.rounds


@dataclass
class Answer:
    """One evaluation answer."""

    prompt: str
    text: str
    tokens: int
    finish_reason: str


@dataclass
class Evaluation:
    """Answers to the held-out (sampled) and fact (greedy) prompts under one policy version."""

    policy_version: int
    held_out: list[Answer]
    facts: list[Answer]
    short_tokens: int

    def is_short(self, a: Answer) -> bool:
        return a.finish_reason == "stop" and a.tokens <= self.short_tokens

    @property
    def preference_rate(self) -> float:
        return sum(self.is_short(a) for a in self.held_out) / len(self.held_out)

    @property
    def capability(self) -> float:
        names = dict(FACTS)
        return sum(any(n in a.text.lower() for n in names[a.prompt]) for a in self.facts) / len(self.facts)

    @property
    def mean_tokens(self) -> float:
        return sum(a.tokens for a in self.held_out) / len(self.held_out)


@dataclass
class TrainEpisode:
    index: int
    policy_version: int
    tokens: int
    short: bool
    thanked: bool = False
    """The user said thanks (short and, where the question has a known answer, right)."""


@dataclass
class RealDemoResult:
    before: Evaluation | None = None
    after: Evaluation | None = None
    episodes: list[TrainEpisode] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    plot: Path | None = None
    judge_calls: int = 0
    promotion: dict[str, Any] | None = None
    """/rl/status' `promotion` object at the end (mode, serving version, decisions)."""


def _client(base: str, key: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=3, timeout=600)


def _ask(client: Any, prompt: str, max_tokens: int, seed: int | None = None) -> Answer:
    """Greedy (`seed` None) or sampled at temperature 1 with `seed`."""
    resp = client.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=max_tokens, temperature=0 if seed is None else 1.0,
                                          seed=seed)
    c = resp.choices[0]
    return Answer(prompt, c.message.content or "", resp.usage.completion_tokens if resp.usage else 0,
                  c.finish_reason or "")


def evaluate(base: str, key: str, cfg: RealDemoConfig, version: int) -> Evaluation:
    """`eval_samples` sampled answers (fixed seeds: the same before and after) to each HELD_OUT
    question and greedy answers to FACTS; each call is its own one-turn session, never trained."""
    client = _client(base, key)
    jobs: list[tuple[str, int | None]] = [(q, 1_000_003 * cfg.seed + 7919 * k + i)
                                          for k in range(cfg.eval_samples) for i, q in enumerate(HELD_OUT)]
    jobs += [(q, None) for q, _ in FACTS]
    with ThreadPoolExecutor(cfg.concurrency) as pool:
        answers = list(pool.map(lambda j: _ask(client, j[0], cfg.eval_max_tokens, j[1]), jobs))
    n = len(HELD_OUT) * cfg.eval_samples
    return Evaluation(version, answers[:n], answers[n:], cfg.short_tokens)


def _episode(base: str, admin: str, index: int, cfg: RealDemoConfig) -> TrainEpisode:
    task = index // cfg.group_size
    prompt = TRAIN_PROMPTS[task % cfg.train_prompts]
    h = {"Authorization": f"Bearer {admin}"}
    r = httpx.post(f"{base}/rl/start_session", json={"task_id": f"q-{task}"}, headers=h, timeout=60)
    r.raise_for_status()
    key = r.json()["api_key"]
    client = _client(base, key)
    resp = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], max_tokens=cfg.max_tokens,
        temperature=1.0, seed=cfg.seed * 100_003 + index)
    c = resp.choices[0]
    n = resp.usage.completion_tokens if resp.usage else 0
    short = c.finish_reason == "stop" and n <= cfg.short_tokens
    reply = user_reply(prompt, c.message.content or "", short)
    history: list[Any] = [{"role": "user", "content": prompt},
                          {"role": "assistant", "content": c.message.content or ""},
                          {"role": "user", "content": reply}]
    client.chat.completions.create(model="default", messages=history, max_tokens=cfg.reply_max_tokens,
                                   temperature=1.0, seed=cfg.seed * 100_003 + index + 7)
    httpx.post(f"{base}/rl/end_session", json={}, headers={"Authorization": f"Bearer {key}"},
               timeout=60).raise_for_status()
    version = int((resp.system_fingerprint or "policy-v0").removeprefix("policy-v"))
    return TrainEpisode(index, version, n, short, reply == THANKS)


def _status(base: str, admin: str) -> dict[str, Any]:
    r = httpx.get(f"{base}/rl/status", headers={"Authorization": f"Bearer {admin}"}, timeout=60)
    r.raise_for_status()
    return dict(r.json())


def wait_trained(base: str, admin: str, expected_datums: int, timeout_s: float,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """Poll /rl/status until the judge is idle and every rewarded turn is trained (`_settled`)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        st = _status(base, admin)
        trainer = st.get("trainer") or {}
        judge = st.get("judge") or {}
        line = progress_line(st)
        if line != last:
            say(line)
            last = line
        steps = int((trainer.get("steps") or {}).get("ok", 0))
        if _settled(trainer, judge, expected_datums) and _gate_settled(st.get("promotion"), steps):
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"training did not settle within {timeout_s:.0f}s: {line}")
        time.sleep(1.0)


def _gate_settled(promotion: dict[str, Any] | None, steps: int) -> bool:
    """Off, or nothing on trial and every step's version decided (eval mode decides each one
    before the next step; the last one on the trainer's next poll)."""
    if not promotion or promotion.get("mode") == "off":
        return True
    decided = sum(1 for d in promotion.get("decisions") or [] if d.get("source") != "admin")
    return not promotion.get("holding") and decided >= min(steps, 20)


def _counts(counts: dict[str, Any] | None, empty: str = "none") -> str:
    """`{'ok': 11, 'failed': 0}` as `11 ok, 0 failed` (in words, not a Python dict)."""
    return ", ".join(f"{n} {name}" for name, n in (counts or {}).items()) or empty


def progress_line(st: dict[str, Any]) -> str:
    """One line of training progress from `/rl/status`, in words."""
    trainer = st.get("trainer") or {}
    judge = st.get("judge") or {}
    scores = ", ".join(f"{n} scored {float(score):+g}" for score, n in sorted(
        (judge.get("scores") or {}).items(), key=lambda kv: -float(kv[0])))
    return (f"policy v{st.get('policy_version')}: training steps {_counts(trainer.get('steps'))}; "
            f"{trainer.get('backlog', 0)} turn(s) waiting to train; judge verdicts "
            f"{_counts(judge.get('judgements'))}" + (f" ({scores})" if scores else ""))


def _settled(trainer: dict[str, Any], judge: dict[str, Any], expected_datums: int) -> bool:
    """Every training session judged, no step running, and nothing rewarded left to train: all the
    backlog still holds is unrewarded turns (the evaluation calls, never trained). Waiting instead
    for the backlog to fall under a batch idled ~5 minutes a run, until the evaluation calls' samples
    were dropped as no_reward, and left the last short batch untrained."""
    judged = sum(int(v) for k, v in (judge.get("judgements") or {}).items() if k in ("done", "failed"))
    unrewarded = int((trainer.get("waiting") or {}).get("unrewarded_turns", 0))
    untrained = int(trainer.get("backlog", 0)) - unrewarded
    return judged >= expected_datums and not trainer.get("in_step") and untrained <= 0


def plot(result: RealDemoResult, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    b, a = result.before, result.after
    if b is None or a is None:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    labels = ["preference rate\n(held-out, short)", "capability\n(facts named)"]
    xs = range(len(labels))
    ax1.bar([x - 0.2 for x in xs], [b.preference_rate, b.capability], width=0.4, label=f"before (v{b.policy_version})")
    ax1.bar([x + 0.2 for x in xs], [a.preference_rate, a.capability], width=0.4, label=f"after (v{a.policy_version})")
    ax1.set_xticks(list(xs), labels)
    ax1.set_ylim(0, 1.05)
    ax1.legend(loc="upper left")
    ax1.set_title("held-out prompts")
    eps = sorted(result.episodes, key=lambda e: e.index)
    ax2.scatter([e.index for e in eps], [e.tokens for e in eps], s=10, alpha=0.5,
                c=["C2" if e.thanked else "C3" for e in eps])
    ax2.axhline(b.short_tokens, color="grey", lw=1, ls="--", label=f"short = stops within {b.short_tokens} tokens")
    ax2.set_xlabel("training session")
    ax2.set_ylabel("answer tokens (green: user thanked)")
    ax2.legend(loc="upper right")
    ax2.set_title("training sessions")
    fig.suptitle(f"SmolLM2-135M-Instruct learns 'keep it short': preference {b.preference_rate:.2f} -> "
                 f"{a.preference_rate:.2f}, capability {b.capability:.2f} -> {a.capability:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_real_demo(cfg: RealDemoConfig, out_dir: Path, say: Callable[[str], None] = print,
                  on_episode: Callable[[TrainEpisode], None] | None = None,
                  model_dir: Path | None = None, settle_timeout_s: float = 900.0) -> RealDemoResult:
    """Run the real-model demo end to end; `out_dir` gets the state, log, results and plot."""
    from clawbridge.devtools.demo import free_port, launch_proxy, run_episodes, stop_proxy, wait_healthy
    from clawbridge.devtools.judge_server import JudgeServer
    from clawbridge.models import cached_model

    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = model_dir or cached_model("smollm2-135m-instruct", progress=say)
    state_dir = out_dir / "state"
    state_dir.mkdir(exist_ok=True)
    judge = JudgeServer(model="rule-based").start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        "CLAWBRIDGE_TRAIN": "true", "CLAWBRIDGE_BATCH_SIZE": str(cfg.batch_size),
        "CLAWBRIDGE_LORA_RANK": str(cfg.lora_rank), "CLAWBRIDGE_LORA_ALPHA": str(cfg.lora_alpha),
        "CLAWBRIDGE_LEARNING_RATE": str(cfg.learning_rate), "CLAWBRIDGE_BASELINE": "group_mean",
        "CLAWBRIDGE_GAMMA": "0", "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.5",
        "CLAWBRIDGE_MAX_OFF_POLICY_STEPS": "4", "CLAWBRIDGE_MAX_RUNNING_REQUESTS": str(cfg.concurrency),
        "CLAWBRIDGE_JUDGE": "endpoint", "CLAWBRIDGE_JUDGE_BASE_URL": judge.base_url,
        "CLAWBRIDGE_JUDGE_MODEL": "rule-based", "CLAWBRIDGE_JUDGE_POLL_INTERVAL_S": "0.5",
        "CLAWBRIDGE_METHOD": "rl",
        # its own process: the trainer's and the engine's Python would otherwise take turns on one GIL
        "CLAWBRIDGE_TRAIN_LAUNCHER": "torchrun",
        # one batch per step: 64 sessions make ~8 optimizer steps. Catching up in larger steps (the
        # default token budget) trained the whole backlog in 2 steps once sessions outran the
        # trainer, and a run learned nothing (preference 0.25 -> 0.25)
        "CLAWBRIDGE_MAX_BATCH_TOKENS": "0",
        # its figures (docs/real-model.md) were measured without rehearsal (docs/training.md,
        # "Measured: rehearsal"), whatever its default
        "CLAWBRIDGE_REHEARSAL_COEF": "0",
        # and with one sample per noted call (`notes_best_of`, "Kept: best of n for noted calls")
        "CLAWBRIDGE_NOTES_BEST_OF": "1",
    }
    env["CLAWBRIDGE_PROMOTION_MODE"] = cfg.promotion
    if cfg.promotion == "eval":
        env["CLAWBRIDGE_EVAL_SET"] = str(facts_eval_set(out_dir / "facts.jsonl"))
        env["CLAWBRIDGE_EVAL_MAX_TOKENS"] = str(cfg.eval_max_tokens)  # the capability check's greedy answers
        env["CLAWBRIDGE_PROMOTION_TOLERANCE"] = f"{cfg.tolerance:g}"
    env.update(cfg.settings)
    result = RealDemoResult()
    proc = launch_proxy(model, state_dir, port, env, served_name="smollm2")
    try:
        say(f"loading the model into clawbridge up ({base}) ...")
        wait_healthy(base, proc, timeout_s=600)
        admin = (state_dir / "admin_key").read_text().strip()
        client_key = (state_dir / "client_key").read_text().strip()
        say(f"evaluating the base model on {len(HELD_OUT)} held-out questions and {len(FACTS)} facts ...")
        result.before = evaluate(base, client_key, cfg, _status(base, admin)["policy_version"])
        say(f"before: preference rate {result.before.preference_rate:.2f}, capability {result.before.capability:.2f}, "
            f"mean answer {result.before.mean_tokens:.1f} tokens")
        say(f"training: {cfg.sessions} sessions ({cfg.train_prompts} questions x {cfg.group_size} x {cfg.rounds}) ...")

        run_episodes(lambda i: _episode(base, admin, i, cfg), cfg.sessions, cfg.concurrency,
                     result.episodes, on_episode)
        say("waiting for the judge and the trainer to finish the last batch ...")
        st = wait_trained(base, admin, cfg.sessions, settle_timeout_s, say)
        result.steps = int(((st.get("trainer") or {}).get("steps") or {}).get("ok", 0))  # {"ok": n, "failed": ...}
        result.promotion = st.get("promotion")
        serving = (result.promotion or {}).get("serving_version")
        # what plain requests get: the serving version (with promotion on, not always the newest)
        result.after = evaluate(base, client_key, cfg, st["policy_version"] if serving is None else int(serving))
        say(f"after:  preference rate {result.after.preference_rate:.2f}, capability {result.after.capability:.2f}, "
            f"mean answer {result.after.mean_tokens:.1f} tokens")
    finally:
        stop_proxy(proc)
        result.judge_calls = len(judge.requests)
        judge.stop()
    result.seconds = time.monotonic() - t0
    (out_dir / "result.json").write_text(json.dumps(
        {"config": asdict(cfg), "seconds": result.seconds, "steps": result.steps, "promotion": result.promotion,
         "before": asdict(result.before) if result.before else None,
         "after": asdict(result.after) if result.after else None,
         "episodes": [asdict(e) for e in sorted(result.episodes, key=lambda e: e.index)]}, indent=1))
    result.plot = plot(result, out_dir / "preference.png")
    return result


def samples(result: RealDemoResult, n: int = 3) -> Sequence[tuple[str, str, str]]:
    """(question, answer before, answer after) for the first `n` held-out questions (first seed)."""
    if result.before is None or result.after is None:
        return []
    return [(b.prompt, b.text, a.text) for b, a in zip(result.before.held_out[:n], result.after.held_out[:n], strict=True)]


def default_out_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="clawbridge-demo-smollm2-"))


