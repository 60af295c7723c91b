"""The privacy filter: detection against the labelled case set, and its token-level application to
training datums (alignment of tokens, mask, advantages and logprobs) with the tiny model's real
tokenizer; settings that are refused; the judge prompt masked before it is sent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from clawbridge.backend import Datum, Span, check_datum
from clawbridge.chat.render import Renderer
from clawbridge.config import Settings
from clawbridge.devtools.privacy_eval import evaluate, load_cases
from clawbridge.privacy.detect import DetectorFilter, FakePrivacyFilter, PrivacyFilter
from clawbridge.privacy.guard import PrivacyGuard, build_guard
from clawbridge.privacy.tokens import redact_datum, token_text

EMAIL = "alice.w@example.org"
KEY = "ghp_4Fz9kQw2Lm8Xc3Vb7Np1Rt6Yh0Ju5Ie2OsAa"
CARD = "4111 1111 1111 1111"
HOLDOUT = Path(__file__).parent / "data" / "privacy_holdout.jsonl"


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> Renderer:
    return Renderer.from_pretrained(str(tiny_model_dir))


def test_detectors_on_the_case_set() -> None:
    cases = load_cases()
    assert len(cases) >= 50
    assert sum(1 for c in cases if c["find"]) >= 25 and sum(1 for c in cases if not c["find"]) >= 25
    score = evaluate(DetectorFilter(), cases)
    print(f"privacy filter on {len(cases)} cases: recall {score.recall:.3f} ({score.found}/{score.expected}), "
          f"false-positive rate {score.false_positive_rate:.3f} ({score.false_positives}/{score.negatives}), "
          f"extra findings {score.extra}; missed: {score.misses}")
    assert score.recall >= 0.9
    assert score.false_positive_rate <= 0.05 and score.extra == 0
    assert isinstance(DetectorFilter(), PrivacyFilter) and isinstance(FakePrivacyFilter({}), PrivacyFilter)


def test_detectors_on_a_holdout_set_written_apart() -> None:
    """tests/data/privacy_holdout.jsonl was written apart from the case set the detectors were
    tuned on (issue 35): real-shaped secrets of many kinds, among them Google API keys and AWS
    secret access keys beside their names in env files, INI, JSON, Terraform, YAML and prose, and
    look-alikes (40-character base64 and hex strings, placeholders and `${{ secrets.X }}` references
    beside the same names, ids, digests). Every Google and AWS key is found; the whole set meets
    the bars of the tuned set."""
    cases = load_cases(HOLDOUT)
    assert len(cases) >= 60 and sum(1 for c in cases if c["group"] in ("google", "aws")) >= 10
    score = evaluate(DetectorFilter(), cases)
    print(f"privacy filter on the holdout ({len(cases)} cases): recall {score.recall:.3f} "
          f"({score.found}/{score.expected}), false-positive rate {score.false_positive_rate:.3f} "
          f"({score.false_positives}/{score.negatives}); missed: {score.misses}; flagged: {score.flagged}")
    assert [m for m in score.misses if m.startswith(("google:", "aws:"))] == []
    assert score.recall >= 0.9 and score.false_positive_rate <= 0.05 and score.extra == 0


def test_user_patterns_and_detector_choice() -> None:
    f = DetectorFilter(detectors=("email",), patterns=[r"ACME-\d{6}"])
    text = f"ticket ACME-123456 from {EMAIL}, card {CARD}"
    found = f.find(text)
    assert [(x.kind, text[x.start:x.end]) for x in found] == [("custom", "ACME-123456"), ("email", EMAIL)]


def test_token_text_maps_every_token(renderer: Renderer) -> None:
    text = "café ☕ 日本語 — naïve 🙂 x"
    ids = renderer.encode(text)
    mapped = token_text(ids, renderer)
    assert mapped.text == text and len(mapped.spans) == len(ids)
    for (lo, hi), (lo2, _) in zip(mapped.spans, mapped.spans[1:], strict=False):
        assert lo <= hi and lo2 >= lo  # in order; partial-character tokens share the span of the character


def _turn(renderer: Renderer, user: str, answer: str, turn_id: str = "t1") -> Datum:
    prompt = renderer.render([{"role": "user", "content": user}])
    completion = renderer.encode(answer + "<|im_end|>")
    lps = [-0.01 * (i + 1) for i in range(len(completion))]
    advs = [0.5 + i for i in range(len(completion))]
    return Datum.from_turn(prompt, completion, lps, advs, policy_version=3, turn_id=turn_id)


def test_prompt_finding_replaced_and_sampled_tokens_stay_aligned(renderer: Renderer) -> None:
    user = f"日本 mail {EMAIL}☕ and key {KEY}. Thanks"
    d = _turn(renderer, user, "Done, I will write to them.")
    r = redact_datum(d, renderer, DetectorFilter())
    assert r.dropped_turns == () and r.masked == {"email": 1, "secret": 1}
    out = r.datum
    assert out is not None
    check_datum(out)
    before = renderer.decode(d.tokens)
    assert renderer.decode(out.tokens) == before.replace(EMAIL, "[EMAIL]").replace(KEY, "[SECRET]")
    (old,), (new,) = d.sampled_spans, out.sampled_spans
    n = old.end - old.start
    assert new.end - new.start == n and new.turn_id == "t1" and new.policy_version == 3
    # the sampled tokens, their logprobs, advantages and mask: unchanged, at the shifted positions
    assert out.tokens[new.start + 1:new.end + 1] == d.tokens[old.start + 1:old.end + 1]
    assert out.sampler_logprobs[new.start:new.end] == d.sampler_logprobs[old.start:old.end]
    assert out.advantages[new.start:new.end] == d.advantages[old.start:old.end]
    assert out.mask[new.start:new.end] == (1.0,) * n
    assert set(out.mask[:new.start]) == {0.0} and set(out.advantages[:new.start]) == {0.0}
    assert set(out.sampler_logprobs[:new.start]) == {0.0}
    assert out.prompt_len == new.start + 1 and out.target_tokens[new.start] == d.target_tokens[old.start]


def test_a_sampled_finding_drops_the_turn(renderer: Renderer) -> None:
    d = _turn(renderer, "What card do I have on file?", f"Your card is {CARD}.")
    r = redact_datum(d, renderer, DetectorFilter())
    assert r.datum is None and r.dropped_turns == ("t1",)


def test_merged_session_drops_only_the_turn_whose_answer_leaked(renderer: Renderer) -> None:
    first = _turn(renderer, "Which address did I use?", f"You used {EMAIL}.", "t1")
    follow = renderer.encode("<|im_start|>user\nThanks! Now count to three.<|im_end|>\n<|im_start|>assistant\n")
    answer = renderer.encode("One, two, three.<|im_end|>")
    tokens = first.tokens + tuple(follow) + tuple(answer)
    n_pos = len(tokens) - 1
    s1 = first.sampled_spans[0]
    s2 = Span(len(first.tokens) + len(follow) - 1, n_pos, 4, "t2")
    lps = list(first.sampler_logprobs) + [0.0] * len(follow) + [-0.2 - i for i in range(len(answer))]
    advs = list(first.advantages) + [0.0] * len(follow) + [2.0 + i for i in range(len(answer))]
    mask = list(first.mask) + [0.0] * len(follow) + [1.0] * len(answer)
    merged = Datum(tokens, first.prompt_len, tuple(lps), tuple(advs), tuple(mask), 3, "t1", (s1, s2))
    check_datum(merged)
    r = redact_datum(merged, renderer, DetectorFilter())
    assert r.dropped_turns == ("t1",) and r.masked == {"email": 1}
    out = r.datum
    assert out is not None and [s.turn_id for s in out.spans] == ["t2"] and out.policy_version == 4
    assert renderer.decode(out.tokens) == renderer.decode(tokens).replace(EMAIL, "[EMAIL]")
    (new,) = out.spans
    assert out.tokens[new.start + 1:] == tuple(answer)
    assert out.sampler_logprobs[new.start:] == tuple(lps[s2.start:])
    assert out.advantages[new.start:] == tuple(advs[s2.start:])
    assert out.mask == (0.0,) * new.start + (1.0,) * len(answer)
    assert out.prompt_len == new.start + 1


def test_planted_findings_at_every_offset_keep_alignment(renderer: Renderer) -> None:
    """A fake filter marks a 5-character window at each offset of a multilingual prompt: the result
    always decodes to the masked text and keeps the answer aligned."""
    d = _turn(renderer, "Grüße aus Köln ☕ — see 日本語 notes", "ok")
    text = renderer.decode(d.tokens)
    start = text.index("Grüße")
    end = text.index("notes") + len("notes")
    for i in range(start, end - 5):
        needle = text[i:i + 5]
        r = redact_datum(d, renderer, FakePrivacyFilter({needle: "custom"}))
        assert r.datum is not None, needle
        assert renderer.decode(r.datum.tokens) == text.replace(needle, "[REDACTED]")
        (new,) = r.datum.spans
        assert r.datum.tokens[new.start + 1:] == d.tokens[d.spans[0].start + 1:]
        assert r.datum.sampler_logprobs[new.start:] == d.sampler_logprobs[d.spans[0].start:]


def test_settings_refuse_bad_privacy_options(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="privacy_patterns\\[0\\] is not a regular expression"):
        Settings(privacy_patterns=["(unclosed"], state_dir=tmp_path)
    with pytest.raises(ValidationError, match="unknown privacy detector"):
        Settings(privacy_detectors=["ssn"], state_dir=tmp_path)
    with pytest.raises(ValidationError, match="unknown phone region"):
        Settings(privacy_phone_regions=["XX"], state_dir=tmp_path)
    with pytest.raises(ValidationError, match="auto"):
        Settings(privacy="maybe", state_dir=tmp_path)  # type: ignore[arg-type]


def test_user_patterns_are_never_shown(tmp_path: Path) -> None:
    """`config show`, the dashboard and the W&B run config show `masked_dump`: a pattern may spell
    out the very secret it guards."""
    s = Settings(privacy_patterns=["hunter2", r"ACME-\d{6}"], state_dir=tmp_path)
    assert s.masked_dump()["privacy_patterns"] == ["***", "***"]


def test_auto_mode_follows_the_backend_and_the_judge(renderer: Renderer, tmp_path: Path) -> None:
    from clawbridge_tinker import TinkerBackend

    local = object()
    hosted = TinkerBackend.__new__(TinkerBackend)
    auto = Settings(state_dir=tmp_path)
    assert build_guard(auto, local, renderer) is None
    g = build_guard(auto, hosted, renderer)
    assert g is not None and g.train and not g.judge
    g = build_guard(Settings(state_dir=tmp_path, judge="endpoint"), local, renderer)
    assert g is not None and not g.train and g.judge
    assert build_guard(Settings(state_dir=tmp_path, privacy="off", judge="endpoint"), hosted, renderer) is None
    g = build_guard(Settings(state_dir=tmp_path, privacy="on"), local, renderer)
    assert g is not None and g.train and g.judge


def test_judge_prompt_is_masked_once_before_it_is_sent(renderer: Renderer, tmp_path: Path) -> None:
    from clawbridge.rewards.judge import ScriptedJudge
    from clawbridge.rewards.worker import RewardWorker, WorkerConfig
    from clawbridge.store import Store
    from tests.rewards_support import assistant, record, user

    guard = PrivacyGuard(DetectorFilter(), renderer, train=False, judge=True)
    judge = ScriptedJudge(["fine\nSCORE: +1"])
    store = Store.open(tmp_path)
    try:
        first = [user(f"mail {EMAIL} please")]
        record(store, "s1", first, assistant("Sent."))
        record(store, "s1", [*first, assistant("Sent."), user(f"no, use key {KEY}")], assistant("Done."))
        store.end_session("s1", "end_session")
        worker = RewardWorker(store, judge, WorkerConfig(opd=False), privacy=guard)
        assert asyncio.run(worker.run_once()) == 1
    finally:
        store.close()
    sent = repr(judge.calls)
    assert len(judge.calls) == 3 and EMAIL not in sent and KEY not in sent  # one turn judged, 3 votes
    assert "[EMAIL]" in sent and "[SECRET]" in sent
    assert guard.status()["masked"]["judge"] == {"email": 1, "secret": 1}
