"""Which answer should best of n serve? Pick rules compared on the same sampled answers, offline.

    python bench/best_of_rules.py                                  # SmolLM2, the 4 personas, 8 samples, n = 4
    python bench/best_of_rules.py --persona name --samples 16 --n 4 --seed 1

A noted call is served best of n (`clawbridge.serving.best_of`): n answers sampled with the noted
prompt, the one with the highest note score served. This harness asks which score: for each
persona's held-out questions (`clawbridge.devtools.personas.HELD_OUT_QUESTIONS`, the system prompt
an OpenClaw agent carries) and its correction as a capable judge writes it (bench/note_effect.py's
`INSTRUCTIONS`, appended as the proxy appends a note: `clawbridge.rewards.notes.noted_messages`),
it samples `--samples` answers at temperature 1 with the noted prompt (transformers on the model's
weights, no adapter), scores every token under the noted and the plain prompt, splits each
question's answers into groups of `--n`, and prints, per persona and rule, how often the answer the
rule picks meets the persona's preference (an answer that echoes its note is left out unless all
do, as the product does). Rows: `one sample` (the group's first), `any` (the best a rule could do),
and the rules on the per-token log-likelihood ratio r_t = log p(t | noted) - log p(t | plain):
`mean` (the product's), `sum`, `sum/sqrt(len)`, `max` (the single token the note moved most),
`mean + max/len`; and two on the logprobs themselves: `noted mean` (the answer the noted prompt
finds likeliest) and `noted + ratio` (that plus the mean ratio).

This drives the model directly, outside `clawbridge up` (a harness: it may add rows, never the
headline); what a rule does for a person is measured through `up` (bench/note_effect.py
`--best-of`, bench/learn_from_talk.py).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import exit_on_sigterm, model_folder, set_threads_from_argv
from note_effect import INSTRUCTIONS

from clawbridge.serving.best_of import Candidate, note_score, pick

set_threads_from_argv(2)

Rule = Callable[[Sequence[float], Sequence[float]], float]
"""A note score from an answer's per-token logprobs with the note and without it."""


def _ratios(noted: Sequence[float], plain: Sequence[float]) -> list[float]:
    return [a - b for a, b in zip(noted, plain, strict=True)]


RULES: dict[str, Rule] = {
    "mean": note_score,  # the product's (`clawbridge.serving.best_of`)
    "sum": lambda noted, plain: float(sum(_ratios(noted, plain))),
    "sum/sqrt(len)": lambda noted, plain: sum(_ratios(noted, plain)) / math.sqrt(len(noted)) if noted else 0.0,
    "max": lambda noted, plain: max(_ratios(noted, plain), default=0.0),
    "mean + max/len": lambda noted, plain: (sum(_ratios(noted, plain)) + max(_ratios(noted, plain), default=0.0))
    / len(noted) if noted else 0.0,
    "noted mean": lambda noted, plain: sum(noted) / len(noted) if noted else 0.0,
    "noted + ratio": lambda noted, plain: (2 * sum(noted) - sum(plain)) / len(noted) if noted else 0.0,
}
"""The rules compared: on the per-token ratio noted - plain (the mean, the product's; the sum;
sum / sqrt(len); the largest; mean + largest / len), and on the logprobs themselves (the mean
noted logprob: the answer the noted prompt finds likeliest; that plus the mean ratio)."""


def token_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion token | prompt + the tokens before it), one forward, float32."""
    import torch

    ids = torch.tensor([prompt + completion])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def sample_answers(model: Any, tok: Any, prompt: list[int], k: int, max_tokens: int) -> list[list[int]]:
    """`k` answers to `prompt` at temperature 1 (no top-p, no top-k), each up to its end token."""
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, num_return_sequences=k, max_new_tokens=max_tokens,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    answers = []
    for row in out[:, len(prompt):].tolist():
        if tok.eos_token_id in row:
            row = row[:row.index(tok.eos_token_id) + 1]  # the end token is sampled, and scored, too
        answers.append(row)
    return answers


def run(model_dir: str, personas: list[str], samples: int, n: int, seed: int, max_tokens: int) -> dict[str, dict[str, float]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clawbridge.chat.messages import ChatMessage
    from clawbridge.chat.render import Renderer
    from clawbridge.devtools.personas import HELD_OUT_QUESTIONS, PERSONAS
    from clawbridge.rewards.notes import echoes_note, noted_messages

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    renderer = Renderer.from_pretrained(model_dir)

    def render(messages: Sequence[ChatMessage]) -> list[int]:
        """The prompt ids the proxy would render (its chat template, no tools)."""
        return [int(t) for t in renderer.render([m.model_dump(exclude_none=True) for m in messages], None, None)]

    table: dict[str, dict[str, float]] = {}
    for key in personas:
        persona, note = PERSONAS[key], INSTRUCTIONS[key]
        hits: dict[str, list[bool]] = {name: [] for name in ("one sample", "any", *RULES)}
        started = time.monotonic()
        for qi, question in enumerate(HELD_OUT_QUESTIONS):
            print(f"  {key}: question {qi + 1}/{len(HELD_OUT_QUESTIONS)} ({time.monotonic() - started:.0f} s)", flush=True)
            plain_msgs = [ChatMessage(role="system", content=persona.system_prompt()),
                          ChatMessage(role="user", content=question)]
            plain, noted = render(plain_msgs), render(noted_messages(plain_msgs, note))
            answers = sample_answers(model, tok, noted, samples, max_tokens)
            scored = []  # (noted logprobs, plain logprobs, meets, echoes)
            for ids in answers:
                text = str(tok.decode(ids, skip_special_tokens=True))
                scored.append((token_logprobs(model, noted, ids), token_logprobs(model, plain, ids),
                               persona.meets(text), echoes_note(text, note)))
            for g in range(0, len(scored) - n + 1, n):
                group = scored[g:g + n]
                hits["one sample"].append(group[0][2])
                hits["any"].append(any(c[2] for c in group))
                for name, rule in RULES.items():
                    # the product's pick: the highest score, echoes only when every answer echoes
                    chosen = pick([Candidate([], "stop", rule(c[0], c[1]), c[3]) for c in group])
                    hits[name].append(group[chosen][2])
        table[key] = {name: statistics.fmean(v) for name, v in hits.items()}
        table[key]["seconds"] = time.monotonic() - started
        print(f"{key}: " + ", ".join(f"{name} {v:.2f}" for name, v in table[key].items() if name != "seconds")
              + f" ({len(hits['any'])} picks, {table[key]['seconds']:.0f} s)", flush=True)
    return table


def main() -> None:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (the real model) or a model folder")
    ap.add_argument("--persona", default="brief,name,lead,plain", help="comma-separated (clawbridge.devtools.personas)")
    ap.add_argument("--samples", type=int, default=8, help="answers sampled per question")
    ap.add_argument("--n", type=int, default=4, help="answers a rule picks among (notes_best_of)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=64, help="as the talk benchmark asks (TalkConfig.max_tokens)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model if Path(args.model).is_dir() else model_folder(args.model, tmp)
        table = run(folder, args.persona.split(","), args.samples, args.n, args.seed, args.max_tokens)
    names = ["one sample", *RULES, "any"]
    print(f"\n| persona | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
    for key, row in table.items():
        print(f"| {key} | " + " | ".join(f"{row[name]:.2f}" for name in names) + " |")


if __name__ == "__main__":
    main()
