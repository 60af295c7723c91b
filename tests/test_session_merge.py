"""One datum per session where the prompt extends (`clawbridge.trainer.merge`): the datum's shape,
the fallback where the prefix breaks, the counts, the same loss and gradient as separate datums
under the local trainer's own torch code on the tiny model, and the trainer loop's counters."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from clawbridge.backend import Datum, LossConfig, ModelInfo, Span, check_datum
from clawbridge.chat.render import Renderer
from clawbridge.serving.sampler import FakeSampler
from clawbridge.store import Store
from clawbridge.trainer import FakeTrainingBackend, TrainerConfig, TrainerLoop
from clawbridge.trainer.merge import MergeStats, TurnPiece, build_datums
from tests.test_trainer_loop import record

P1 = [1, 2, 3, 4]
C1 = [10, 11]
P2 = P1 + C1 + [5, 6, 7]  # + a tool result
C2 = [12, 13, 14]
P3 = P2 + C2 + [8]
C3 = [15]


def piece(tid: str, prompt: Sequence[int], completion: Sequence[int], version: int = 0, adv: float = 1.0,
          sid: str = "s") -> TurnPiece:
    lp = [-0.1 * (i + 1) - version for i in range(len(completion))]
    return TurnPiece(tid, sid, list(prompt), list(completion), lp, [adv] * len(completion), version)


def three_turns() -> list[TurnPiece]:
    return [piece("t1", P1, C1, 0, 1.0), piece("t2", P2, C2, 1, -2.0), piece("t3", P3, C3, 2, 0.5)]


def test_extending_turns_become_one_datum_with_a_span_per_turn() -> None:
    pieces = three_turns()
    (d,), stats = build_datums(pieces)
    check_datum(d)
    assert list(d.tokens) == P3 + C3 and d.prompt_len == len(P1)
    assert d.turn_ids == ("t1", "t2", "t3") and d.turn_id == "t1"
    assert d.policy_version == 0  # the oldest span's
    assert [(s.policy_version, s.turn_id) for s in d.spans] == [(0, "t1"), (1, "t2"), (2, "t3")]
    on_span: set[int] = set()
    for span, p in zip(d.spans, pieces, strict=True):
        positions = range(span.start, span.end)
        on_span.update(positions)
        # each span predicts exactly its turn's completion, from exactly its turn's prompt
        assert [d.target_tokens[i] for i in positions] == p.completion_ids
        assert list(d.tokens[: span.start + 1]) == p.prompt_ids
        assert [d.sampler_logprobs[i] for i in positions] == p.logprobs  # bit for bit, per span
        assert [d.advantages[i] for i in positions] == p.advantages
        assert all(d.mask[i] == 1.0 for i in positions)
    off = [i for i in range(len(d.tokens) - 1) if i not in on_span]
    assert off and all(d.mask[i] == 0.0 and d.advantages[i] == 0.0 and d.sampler_logprobs[i] == 0.0 for i in off)
    assert stats == MergeStats(turns=3, datums=1, merged=2, breaks=0, tokens_sent=len(P3) + len(C3),
                               tokens_unmerged=len(P1 + C1) + len(P2 + C2) + len(P3 + C3))


def test_a_broken_prefix_starts_a_new_datum_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    edited = [1, 2, 3, 4, 10, 99, 5, 6, 7]  # the client rewrote the first answer's last token
    pieces = [piece("t1", P1, C1), piece("t2", edited, C2), piece("t3", [*edited, *C2, 8], C3)]
    caplog.set_level(logging.DEBUG, logger="clawbridge.trainer")
    datums, stats = build_datums(pieces)
    assert "turn t2 does not extend its session's sequence" in caplog.text
    assert "first difference at token 5" in caplog.text
    assert [d.turn_ids for d in datums] == [("t1",), ("t2", "t3")]
    assert stats.breaks == 1 and stats.merged == 1 and stats.datums == 2 and stats.turns == 3
    assert datums[0] == Datum.from_turn(P1, C1, pieces[0].logprobs, pieces[0].advantages, 0, "t1")
    # a shorter prompt (history truncated) breaks too
    short = [piece("t1", P1, C1), piece("t2", P1[:2], C2)]
    assert build_datums(short)[1].breaks == 1


def test_sessions_never_merge_and_order_is_kept() -> None:
    pieces = [piece("a1", P1, C1, sid="a"), piece("b1", P1, C1, sid="b"), piece("a2", P2, C2, sid="a"),
              piece("b2", P2, C2, sid="b")]
    datums, stats = build_datums(pieces)
    assert [d.turn_ids for d in datums] == [("a1", "a2"), ("b1", "b2")]
    assert stats.merged == 2 and stats.breaks == 0


def test_merge_off_gives_one_from_turn_datum_per_turn() -> None:
    pieces = three_turns()
    datums, stats = build_datums(pieces, merge=False)
    assert datums == [Datum.from_turn(p.prompt_ids, p.completion_ids, p.logprobs, p.advantages, p.policy_version,
                                      p.turn_id) for p in pieces]
    assert stats.merged == 0 and stats.breaks == 0 and stats.tokens_sent == stats.tokens_unmerged


def test_a_turn_left_out_of_the_batch_is_context_with_no_loss() -> None:
    t1, _, t3 = three_turns()  # t2 was dropped (stale) or trained earlier
    (d,), stats = build_datums([t1, t3])
    assert d.turn_ids == ("t1", "t3") and stats.merged == 1
    c2_positions = range(len(P2) - 1, len(P2) - 1 + len(C2))
    assert [d.target_tokens[i] for i in c2_positions] == C2
    assert all(d.mask[i] == 0.0 for i in c2_positions)


def test_bad_spans_and_bad_pieces_are_refused() -> None:
    (d,), _ = build_datums(three_turns())
    overlapping = (Span(3, 6, 0, "x"), Span(5, 7, 0, "y"))
    for spans in (overlapping, (Span(3, 3, 0, "x"),), (Span(3, len(d.tokens), 0, "x"),)):
        with pytest.raises(ValueError, match="span"):
            check_datum(Datum(d.tokens, d.prompt_len, d.sampler_logprobs, d.advantages, d.mask, 0, "x", spans))
    with pytest.raises(ValueError, match="one entry each"):
        build_datums([TurnPiece("t", "s", P1, C1, [-1.0], [1.0, 1.0], 0)])
    with pytest.raises(ValueError, match="at least one"):
        build_datums([TurnPiece("t", "s", P1, [], [], [], 0)])


def test_spans_round_trip_through_the_local_trainer_batch_file(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from clawbridge_local.trainer.batch import read_batch, write_batch

    datums, _ = build_datums([*three_turns(), piece("x1", [9, 9], [8], sid="x")])
    write_batch(tmp_path / "batch.json", datums)
    assert read_batch(tmp_path / "batch.json") == datums
    old_shape = json.loads((tmp_path / "batch.json").read_text())
    for raw in old_shape:
        del raw["spans"]  # a batch file written before spans existed still reads
    (tmp_path / "old.json").write_text(json.dumps(old_shape))
    assert [d.turn_ids for d in read_batch(tmp_path / "old.json")] == [("t1",), ("x1",)]


# ------------------------------------------------------------------ same loss, real torch


def rendered_session(renderer: Renderer, turns: int) -> list[TurnPiece]:
    """A tool-calling session rendered by the product's renderer: each completion is the template's
    text for the reply, ids as the tokenizer gives them; the client sends back what the parser
    returned. Versions and advantages differ per turn; logprobs are placeholders (`near_model`)."""
    tools = [{"type": "function", "function": {"name": "exec", "description": "Run a command.",
                                               "parameters": {"type": "object",
                                                              "properties": {"command": {"type": "string"}}}}}]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent. " * 20},
                                      {"role": "user", "content": "Fix the build."}]
    out: list[TurnPiece] = []
    for k in range(turns):
        prompt = renderer.render_prompt(messages, tools)
        last = k == turns - 1
        call = f'<tool_call>\n{{"name": "exec", "arguments": {{"command": "make {k}"}}}}\n</tool_call>'
        text = f"<think>\nstep {k}\n</think>\n\n{'All fixed.' if last else call}<|im_end|>"
        ids = renderer.encode(text)
        advantages = [(k - 1.5) / 40.0] * len(ids)
        out.append(TurnPiece(f"t{k}", "s", prompt.ids, ids, [0.0] * len(ids), advantages, k))
        reply = renderer.parse(text, prompt).to_openai()
        messages.append(reply)
        for c in reply.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": f"ok {k}\n" * 3})
    return out


def near_model(model: Any, pieces: Sequence[TurnPiece]) -> list[TurnPiece]:
    """The pieces with sampler logprobs = the model's own logprob of each completion token (its
    separate datum's forward) shifted by up to +-0.4: ratios 0.67-1.49, so ppo/cispo clip some."""
    import torch
    from clawbridge_local.trainer.batch import collate
    from clawbridge_local.trainer.step import token_logprobs

    out = []
    for k, p in enumerate(pieces):
        d = Datum.from_turn(p.prompt_ids, p.completion_ids, [0.0] * len(p.completion_ids), p.advantages, 0)
        with torch.no_grad():
            logp = token_logprobs(model, collate([d]))[0, len(p.prompt_ids) - 1:]
        shift = [0.4 * (((i * 7 + k) % 9) - 4) / 4 for i in range(len(p.completion_ids))]
        lps = [float(x) + dx for x, dx in zip(logp.tolist(), shift, strict=True)]
        out.append(TurnPiece(p.turn_id, p.session_id, p.prompt_ids, p.completion_ids, lps, p.advantages,
                             p.policy_version))
    return out


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def session(tiny_model_dir: Path, torch_one_thread: None) -> list[TurnPiece]:
    """A 4-turn rendered session on the tiny model, sampler logprobs near the model's own."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return near_model(model, rendered_session(Renderer.from_pretrained(str(tiny_model_dir)), turns=4))


def loss_and_grads(model: Any, datums: Sequence[Datum], config: LossConfig) -> tuple[float, float, dict[str, Any]]:
    """The local trainer's own forward + token-sum loss over `datums` (one micro-batch each):
    (loss, clipped token count, gradients)."""
    from clawbridge_local.losses import LossInputs, compute_loss
    from clawbridge_local.trainer.batch import collate
    from clawbridge_local.trainer.step import token_logprobs

    model.zero_grad(set_to_none=True)
    total = clipped = 0.0
    for d in datums:
        c = collate([d])
        out = compute_loss(config, LossInputs(token_logprobs(model, c), c.sampler_logprobs, c.advantages, c.mask))
        out.loss.backward()
        total += float(out.loss.detach())
        clipped += out.sums.values["clipped"]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, clipped, grads


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo"])
def test_merged_and_separate_give_the_same_loss_and_gradient(
    tiny_model_dir: Path, session: list[TurnPiece], loss: str
) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    merged, stats = build_datums(session)
    separate, _ = build_datums(session, merge=False)
    assert stats.datums == 1 and stats.merged == 3, "the tiny template's prompts extend: the session merges"
    assert stats.tokens_sent < stats.tokens_unmerged
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.train()
    config = LossConfig(loss, clip_low=0.2, clip_high=0.2)
    loss_m, clipped_m, grads_m = loss_and_grads(model, merged, config)
    loss_s, clipped_s, grads_s = loss_and_grads(model, separate, config)
    assert loss_m != 0.0 and clipped_m == clipped_s
    if loss != "importance_sampling":
        assert clipped_m > 0, "some ratios leave [0.8, 1.2]: each span is weighted against its own sampler"
    assert loss_m == pytest.approx(loss_s, rel=1e-5, abs=1e-7)
    assert grads_m.keys() == grads_s.keys() and grads_m
    for name, g in grads_m.items():
        scale = float(grads_s[name].abs().max()) + 1e-8
        assert float((g - grads_s[name]).abs().max()) <= 1e-4 * scale + 1e-7, name


def test_local_trainer_step_is_the_same_merged_or_separate(
    tiny_model_dir: Path, session: list[TurnPiece], tmp_path: Path
) -> None:
    """The local backend's real train_step (AdamW, grad-norm clip) on the merged datum and on the
    separate ones: the same loss, grad norm and updated weights."""
    pytest.importorskip("torch")
    from clawbridge_local.trainer import FsdpTrainerClient, TrainerConfig

    results = []
    for merge in (True, False):
        datums, _ = build_datums(session, merge=merge)
        client = FsdpTrainerClient(TrainerConfig(model_path=str(tiny_model_dir), learning_rate=1e-3,
                                                 micro_batch_size=4), tmp_path / f"merge-{merge}")
        client.start(1)
        try:
            m = client.train_step(datums, LossConfig("cispo")).metrics
            params = {n: p.detach().clone() for n, p in client.core.model.named_parameters()}
        finally:
            client.close()
        results.append((m, params))
    (m_merged, p_merged), (m_sep, p_sep) = results
    assert m_merged["datums"] == 1.0 and m_sep["datums"] == 4.0
    for key in ("loss", "pg_loss", "clip_fraction", "ratio_mean", "tokens", "grad_norm"):
        assert m_merged[key] == pytest.approx(m_sep[key], rel=1e-5, abs=1e-7), key
    # The merged datum sums the same per-token terms in another order (and the loss's chunked
    # logits split them at other places), so gradients differ by float rounding. AdamW's first step
    # is ~lr * g / (|g| + eps): a weight whose gradient is near 0 turns rounding into a visible part
    # of a step. Measured here: 8 of 1.32M weights differ by more than 1e-6, the worst by 2.5e-5
    # (2.5% of a step of lr = 1e-3). So: (almost) every weight takes the same step, none differs by
    # more than a tenth of a step, and the step is a real one.
    from safetensors.torch import load_file

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    diffs = [(p_merged[k] - p_sep[k]).abs().flatten() for k in p_merged]
    total = sum(d.numel() for d in diffs)
    off = sum(int((d > 1e-6).sum()) for d in diffs)
    assert off <= 1e-4 * total, f"{off} of {total} weights took another step"
    assert max(float(d.max()) for d in diffs) <= 0.1 * 1e-3
    assert max(float((p_merged[k] - base[k]).abs().max()) for k in base if k in p_merged) > 0.5e-3


# ------------------------------------------------------------------ the trainer loop's counters

INFO = ModelInfo(name="tiny", tokenizer_path="unused", context_window=4096, max_output_tokens=256)


def test_loop_trains_merged_datums_counts_merges_and_breaks(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    try:
        a = [record(store, "a", prompt=P1, completion=C1), record(store, "a", prompt=P2, completion=C2),
             record(store, "a", prompt=P3, completion=C3)]
        b = [record(store, "b", prompt=P1, completion=C1), record(store, "b", prompt=[1, 2, 9], completion=C2)]
        for sid, ids in (("a", a), ("b", b)):
            store.add_reward(sid, 1.0, "api", ids[-1])
            store.end_session(sid, "end_session")
        backend = FakeTrainingBackend(FakeSampler(script=[7, 8]), INFO)
        loop = TrainerLoop(store, backend, TrainerConfig(batch_size=5, baseline="none"))
        report = asyncio.run(loop.run_once())
        assert report is not None and report.ok, report
        (batch,) = backend.batches
        assert [d.turn_ids for d in batch] == [tuple(a), (b[0],), (b[1],)]
        assert sorted(backend.applied) == sorted(a + b)  # every turn trained once
        m = report.metrics
        assert (m["turns"], m["datums"], m["merged_turns"], m["merge_breaks"]) == (5.0, 3.0, 2.0, 1.0)
        assert m["tokens"] == float(2 * len(C1) + 2 * len(C2) + len(C3))  # loss tokens: unchanged by merging
        assert m["tokens_sent"] == float(len(P3 + C3) + len(P1 + C1) + 3 + len(C2)) < m["tokens_unmerged"]
        status = loop.status()
        assert status["merging"] == {"enabled": True, "turns": 5, "datums": 3, "merged": 2, "breaks": 1,
                                     "tokens_sent": int(m["tokens_sent"]),
                                     "tokens_unmerged": int(m["tokens_unmerged"])}
        assert status["samples"]["consumed"] == 5
    finally:
        store.close()


def test_clawbridge_status_prints_the_merge_counts() -> None:
    import io

    from rich.console import Console

    from clawbridge.cli.status import print_trainer

    def printed(merging: dict[str, Any]) -> str:
        out = io.StringIO()
        trainer = {"samples": {"pending": 0, "consumed": 5, "dropped": {}}, "steps": {"ok": 1, "failed": 0},
                   "merging": merging}
        print_trainer(Console(file=out, width=200), trainer)
        return out.getvalue()

    counts = {"enabled": True, "turns": 5, "datums": 3, "merged": 2, "breaks": 1, "tokens_sent": 40,
              "tokens_unmerged": 61}
    assert ("merging: 2 of 5 trained turns joined their session's sequence (3 datums), 1 prefix breaks; "
            "40 tokens sent instead of 61") in printed(counts)
    assert "merging: off" in printed({**counts, "enabled": False})
