"""The trainer loop on a real SQLite store: datums, batching, exactly-once, staleness, capacity,
and a full round trip through the real proxy with the fake training backend."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from clawbridge.backend import LossConfig, ModelInfo, TrainingBackend
from clawbridge.chat.render import Renderer
from clawbridge.config import Settings
from clawbridge.runtime.clock import FakeClock
from clawbridge.serving.sampler import FakeSampler
from clawbridge.store import Store, TurnRecord
from clawbridge.store.training import INTERRUPTED_ERROR, PendingSample, TrainingStore
from clawbridge.trainer import FakeTrainingBackend, TrainerConfig, TrainerLoop
from clawbridge.trainer.datums import select_batch
from clawbridge.trainer.fake import SimulatedCrash
from tests.fake_proxy import script_for
from tests.support import free_port, wait_healthy

INFO = ModelInfo(name="tiny", tokenizer_path="unused", context_window=4096, max_output_tokens=256)


def backend(version: int = 0, **kw: Any) -> FakeTrainingBackend:
    return FakeTrainingBackend(FakeSampler(script=[7, 8], version=version), INFO, **kw)


def record(
    store: Store,
    sid: str,
    turn_type: str = "main",
    prompt: Sequence[int] = (1, 2, 3),
    completion: Sequence[int] = (4, 5),
    version: int = 0,
    status: str = "ok",
) -> str:
    now = time.time()
    turn = TurnRecord(
        session_id=sid,
        turn_type=turn_type,
        status=status,
        model="tiny",
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[-0.1 * (i + 1) - 1e-9 for i in range(len(completion))],
        policy_version=version,
        finish_reason="stop",
        request_json="{}",
        response_json=None,
        created_at=now,
        completed_at=now,
    )
    return store.record_turn(turn, "header")


def rewarded_session(
    store: Store, sid: str, reward: float = 1.0, n_main: int = 1, version: int = 0
) -> list[str]:
    ids = [record(store, sid, version=version) for _ in range(n_main)]
    store.add_reward(sid, reward, "api", ids[-1])
    store.end_session(sid, "end_session")
    return ids


def loop_for(store: Store, b: FakeTrainingBackend, **cfg: Any) -> TrainerLoop:
    """A loop over production's defaults, except: no baseline, and batches of exactly batch_size
    (no catching up with larger steps) unless a test asks for them."""
    cfg.setdefault("baseline", "none")
    cfg.setdefault("max_batch_tokens", 0)
    return TrainerLoop(store, b, TrainerConfig(**cfg))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def consumed(store: Store) -> dict[str, int | None]:
    with store.read() as c:
        rows = c.execute("SELECT turn_id, consumed_step FROM samples").fetchall()
    return {str(r[0]): r[1] for r in rows}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path)
    yield s
    s.close()


def test_fake_backend_is_a_training_backend() -> None:
    assert isinstance(backend(), TrainingBackend)


def test_datums_mask_prompt_exclude_side_turns_and_carry_advantages(store: Store) -> None:
    m0 = record(store, "s1", prompt=(1, 2, 3), completion=(4, 5))
    side = record(store, "s1", turn_type="side", prompt=(9, 9), completion=(9,))
    m1 = record(store, "s1", prompt=(1, 2, 3, 4, 5, 6), completion=(10, 11, 12))
    record(store, "s1", status="cancelled")
    store.add_reward("s1", 1.0, "api", m0)
    store.add_reward("s1", 2.0, "api", side)  # credited to m0, the main turn before it
    store.add_reward("s1", 4.0, "api", None)  # session reward: on the last main turn
    store.end_session("s1", "end_session")
    b = backend()
    loop = loop_for(  # one datum per turn here; merged sessions: tests/test_session_merge.py
        store, b, batch_size=2, gamma=0.5, loss=LossConfig(name="ppo", clip_low=0.1, clip_high=0.3),
        merge_turns=False,
    )
    report = run(loop.run_once())
    assert report is not None and report.ok, report
    (batch,) = b.batches
    assert b.losses == [LossConfig(name="ppo", clip_low=0.1, clip_high=0.3)]
    assert [d.turn_id for d in batch] == [m0, m1]  # side and cancelled turns never trained
    turns = {t["turn_id"]: t for t in store.session_turns("s1")}
    returns = {m1: 4.0, m0: 3.0 + 0.5 * 4.0}
    total_tokens = 5
    for d in batch:
        t = turns[d.turn_id]
        p, c = t["prompt_token_ids"], t["completion_token_ids"]
        assert list(d.tokens) == p + c and d.prompt_len == len(p)
        assert d.mask == (0.0,) * (len(p) - 1) + (1.0,) * len(c)
        assert d.sampler_logprobs[len(p) - 1 :] == tuple(t["completion_logprobs"])  # bit for bit
        assert all(a == 0.0 for a in d.advantages[: len(p) - 1])
        assert d.advantages[len(p) - 1 :] == pytest.approx([returns[d.turn_id] / total_tokens] * len(c))
    assert report.metrics["tokens"] == 5.0 and report.metrics["reward_mean"] == 7.0
    assert set(consumed(store)) == {m0, m1}


def test_only_ended_rewarded_sessions_train_and_batches_wait_for_batch_size(store: Store) -> None:
    b = backend()
    loop = loop_for(store, b, batch_size=3)
    t1 = record(store, "a")
    store.add_reward("a", 1.0, "api", t1)
    assert run(loop.run_once()) is None  # still active
    rewarded_session(store, "b")
    record(store, "c")
    store.end_session("c", "end_session")  # ended, but no reward yet
    store.end_session("a", "end_session")
    assert run(loop.run_once()) is None  # 2 ready < 3
    assert b.batches == [] and TrainingStore(store).steps() == []
    store.add_reward("c", 0.0, "api", None)
    report = run(loop.run_once())
    assert report is not None and report.ok and len(report.turn_ids) == 3
    (row,) = TrainingStore(store).steps()
    assert row.status == "ok" and row.policy_version == 1 and row.samples == 3
    for key in ("loss", "reward_mean", "kl", "clip_fraction", "tokens", "seconds"):
        assert key in row.metrics
    assert set(consumed(store).values()) == {row.step}
    assert b.fake_sampler.version == 1
    assert run(loop.run_once()) is None  # nothing is trained twice
    assert store.stats()["training_steps"] == 1 and store.stats()["last_trained_policy_version"] == 1


def test_a_short_batch_trains_after_batch_wait_s(tmp_path: Path) -> None:
    clock = FakeClock()
    store = Store.open(tmp_path, clock)
    never = loop_for(store, backend(), batch_size=4, batch_wait_s=0)  # wait for a full batch
    short = [rewarded_session(store, sid)[0] for sid in ("a", "b")]
    for _ in range(3):
        assert run(never.run_once()) is None
    assert never.status()["waiting"]["short_batch_in_s"] is None

    b = backend()
    loop = loop_for(store, b, batch_size=4, batch_wait_s=30.0)
    assert run(loop.run_once()) is None  # the wait starts when the short batch is first seen
    assert loop.status()["waiting"]["short_batch_in_s"] == 30.0
    clock.advance(29.0)
    assert run(loop.run_once()) is None and loop.status()["waiting"]["short_batch_in_s"] == 1.0
    clock.advance(1.0)
    report = run(loop.run_once())
    assert report is not None and report.ok and sorted(report.turn_ids) == sorted(short)
    assert loop.status()["waiting"]["short_batch_in_s"] is None
    assert run(loop.run_once()) is None  # nothing left, nothing trained twice
    store.close()


def test_a_group_is_trained_whole_once_its_sessions_settle(tmp_path: Path) -> None:
    # A group baseline compares a task's sessions: ready samples of a task with a session still
    # active, or ended but unrewarded, wait for it (up to batch_wait_s), so the group is one batch.
    clock = FakeClock()
    store = Store.open(tmp_path, clock)
    b = backend()
    loop = loop_for(store, b, batch_size=2, baseline="group_mean", batch_wait_s=30.0)
    for sid in ("a", "b", "c"):
        store.ensure_session(sid, "header", task_id="t")
    ready = [rewarded_session(store, sid, reward=1.0)[0] for sid in ("a", "b")]
    late = record(store, "c")  # c is still active: its verdict may differ from a's and b's
    assert run(loop.run_once()) is None and b.batches == []
    assert loop.status()["waiting"]["held_for_group"] == 2
    store.end_session("c", "end_session")  # ended without a reward yet: still unsettled
    assert run(loop.run_once()) is None and loop.status()["waiting"]["held_for_group"] == 2
    store.add_reward("c", 0.0, "api", late)
    report = run(loop.run_once())
    assert report is not None and report.ok and sorted(report.turn_ids) == sorted([*ready, late])
    assert loop.status()["waiting"]["held_for_group"] == 0

    # The hold is bounded: a session that never settles lets the rest train after batch_wait_s.
    for sid in ("d", "e", "f"):
        store.ensure_session(sid, "header", task_id="u")
    first = [rewarded_session(store, sid, reward=r)[0] for sid, r in (("d", 1.0), ("e", 0.0))]
    record(store, "f")
    assert run(loop.run_once()) is None
    clock.advance(29.0)
    assert run(loop.run_once()) is None
    clock.advance(1.0)
    report = run(loop.run_once())
    assert report is not None and report.ok and sorted(report.turn_ids) == sorted(first)
    # Without a wait (batch_wait_s 0) nothing is held: the old behaviour.
    for sid in ("g", "h"):
        store.ensure_session(sid, "header", task_id="v")
    now = [rewarded_session(store, sid, reward=r)[0] for sid, r in (("g", 1.0), ("h", 0.0))]
    store.ensure_session("i", "header", task_id="v")
    record(store, "i")
    eager = loop_for(store, backend(), batch_size=2, baseline="group_mean", batch_wait_s=0)
    report = run(eager.run_once())
    assert report is not None and sorted(report.turn_ids) == sorted(now)
    store.close()


def test_settings_turn_short_batches_on_by_default() -> None:
    assert TrainerConfig.from_settings(Settings()).batch_wait_s == 30.0


def test_batch_keeps_sessions_and_groups_whole() -> None:
    def s(tid: str, sid: str, task: str | None) -> PendingSample:
        return PendingSample(tid, sid, 0, 0, task, "header", 2, 0.0)

    ready = [s("a1", "A", "t"), s("b1", "B", None), s("a2", "A", "t"), s("c1", "C", "t"), s("d1", "D", None)]
    assert [x.turn_id for x in select_batch(ready, 2, whole_groups=False)] == ["a1", "b1", "a2"]
    assert [x.turn_id for x in select_batch(ready, 2, whole_groups=True)] == ["a1", "b1", "a2", "c1"]
    assert select_batch(ready, 6, whole_groups=True) == []


@pytest.mark.parametrize("where", ["train", "publish"])
def test_failed_step_leaves_samples_then_one_success_consumes_them_once(store: Store, where: str) -> None:
    ids = rewarded_session(store, "s1", n_main=2)
    b = backend()
    if where == "train":
        b.fail_train = 1
    else:
        b.fail_publish = 1
    loop = loop_for(store, b, batch_size=2)
    failed = run(loop.run_once())
    assert failed is not None and not failed.ok and "FakeStepError" in (failed.error or "")
    assert consumed(store) == dict.fromkeys(ids)
    ts = TrainingStore(store)
    last = ts.last_error()
    assert last is not None and last.step == failed.step and "fake" in (last.error or "")
    assert ts.training_stats()["steps"] == {"ok": 0, "failed": 1, "running": 0}

    ok = run(loop.run_once())
    assert ok is not None and ok.ok and ok.step != failed.step
    assert [d.turn_id for d in b.batches[0]] == [d.turn_id for d in b.batches[1]] == ids
    assert consumed(store) == dict.fromkeys(ids, ok.step)
    assert run(loop.run_once()) is None
    assert len(b.batches) == 2
    # The failed update was undone before the retry: the weights hold each sample exactly once.
    assert b.applied == ids
    # A failed publish may have left anything served: the committed base is served again under a
    # new number (v2) and the retried step publishes v3; v1 is never used again.
    assert b.published == ([1] if where == "train" else [2, 3])
    assert loop.status()["last_error"]["step"] == failed.step


def test_several_updates_per_step_train_one_batch_into_one_version(store: Store) -> None:
    """`updates_per_step` 3: three train_step calls on the same datums, then one publish and one
    committed step; a failure in a later update fails the whole step, undoes every update and
    leaves the samples for the next step."""
    ids = rewarded_session(store, "s1", n_main=2)
    b = backend()
    loop = loop_for(store, b, batch_size=2, updates_per_step=3)
    first = run(loop.run_once())
    assert first is not None and first.ok and first.policy_version == 1
    assert len(b.batches) == 3 and all(batch == b.batches[0] for batch in b.batches)
    assert b.published == [1] and consumed(store) == dict.fromkeys(ids, first.step)
    assert first.metrics["updates"] == 3.0 and first.metrics["first_update_loss"] == first.metrics["loss"]

    more = rewarded_session(store, "s2", n_main=2)
    calls = len(b.batches)
    real_step = b.train_step

    async def second_update_fails(batch: Sequence[Any], loss: LossConfig) -> Any:
        if len(b.batches) == calls + 1:  # the step's second update: applied, then it fails
            b.fail_train, b.fail_after_apply = 1, True
        return await real_step(batch, loss)

    b.train_step = second_update_fails  # type: ignore[method-assign]
    failed = run(loop.run_once())
    assert failed is not None and not failed.ok and len(b.batches) == calls + 2
    assert consumed(store) == {**dict.fromkeys(ids, first.step), **dict.fromkeys(more)}
    assert b.applied == ids * 3  # undone: the weights hold step 1's three updates and nothing of s2
    ok = run(loop.run_once())
    assert ok is not None and ok.ok and len(b.batches) == calls + 2 + 3
    assert b.applied == ids * 3 + more * 3 and b.published[-1] == ok.policy_version


def test_killed_between_train_step_and_commit_retrains_after_restart(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    ids = rewarded_session(store, "s1", n_main=2)
    b1 = backend()
    b1.crash_after_train = True
    with pytest.raises(SimulatedCrash):
        run(loop_for(store, b1, batch_size=2).run_once())
    (row,) = TrainingStore(store).steps()
    assert row.status == "running" and consumed(store) == dict.fromkeys(ids)
    store.close()  # "the process died"

    store = Store.open(tmp_path)
    b2 = backend()
    report = run(loop_for(store, b2, batch_size=2).run_once())
    assert report is not None and report.ok
    steps = {s.step: s for s in TrainingStore(store).steps()}
    assert steps[row.step].status == "failed" and steps[row.step].error == INTERRUPTED_ERROR
    # At-least-once at the backend (both saw the samples), exactly-once in the store.
    assert [d.turn_id for d in b1.batches[0]] == [d.turn_id for d in b2.batches[0]] == ids
    assert consumed(store) == dict.fromkeys(ids, report.step)
    store.close()


@pytest.mark.parametrize("policy", ["drop", "importance_weight"])
def test_stale_samples_are_dropped_or_kept(store: Store, policy: str) -> None:
    old = rewarded_session(store, "old", version=1)
    fresh = rewarded_session(store, "new", version=3) + rewarded_session(store, "new2", version=4)
    b = backend(version=4)
    loop = loop_for(store, b, batch_size=2, max_off_policy_steps=2, stale_policy=policy)
    report = run(loop.run_once())
    assert report is not None and report.ok
    if policy == "drop":
        assert list(report.turn_ids) == fresh and report.metrics["dropped_stale"] == 1.0
        assert TrainingStore(store).training_stats()["samples"]["dropped"] == {"stale": 1}
        assert consumed(store)[old[0]] is None
    else:
        assert list(report.turn_ids) == [*old, fresh[0]] and report.metrics["dropped_stale"] == 0.0
        assert report.metrics["staleness_max"] == 3.0


def test_unrewarded_sessions_are_dropped_after_the_wait(tmp_path: Path) -> None:
    clock = FakeClock()
    store = Store.open(tmp_path, clock)
    record(store, "quiet")
    store.end_session("quiet", "idle")
    loop = loop_for(store, backend(), batch_size=1, reward_wait_s=600.0)
    assert run(loop.run_once()) is None
    assert TrainingStore(store).training_stats()["samples"]["dropped"] == {}  # still within the wait
    clock.advance(601.0)
    assert run(loop.run_once()) is None
    assert TrainingStore(store).training_stats()["samples"]["dropped"] == {"no_reward": 1}
    store.close()


def test_capacity_backlog_bound(store: Store) -> None:
    loop = loop_for(store, backend(), batch_size=2, max_off_policy_steps=0, capacity_mode=True)
    assert loop.backlog_exceeded() == (False, 0.0)
    store.start_keyed_session("k" * 20, None)  # an active session counts as 1 datum on its way
    assert loop.backlog_exceeded() == (False, 0.0)
    rewarded_session(store, "done")
    over, retry = loop.backlog_exceeded()
    assert over and 1.0 <= retry <= 60.0
    assert loop_for(store, backend(), batch_size=2, capacity_mode=False).backlog_exceeded() == (False, 0.0)


def test_background_task_trains_serves_and_stops_mid_step(store: Store) -> None:
    async def scenario() -> None:
        b = backend(step_delay_s=0.2)
        loop = loop_for(store, b, batch_size=1, poll_interval_s=0.05)
        await loop.start()
        await loop.start()  # idempotent
        rewarded_session(store, "s1")
        loop.notify()
        for _ in range(100):
            if b.published:
                break
            await asyncio.sleep(0.05)
        assert b.published == [1] and loop.running
        # A slow step stopped with a short grace: recorded as failed, its sample stays.
        b.step_delay_s = 30.0
        (tid,) = rewarded_session(store, "s2")
        loop.notify()
        for _ in range(100):
            if len(b.batches) == 2:
                break
            await asyncio.sleep(0.02)
        await loop.stop(timeout_s=0.1)
        assert not loop.running
        assert consumed(store)[tid] is None
        last = TrainingStore(store).last_error()
        assert last is not None and "cancelled" in (last.error or "")

    run(scenario())


# -------------------------------------------------------------------------------- through the proxy


class TrainingProxy:
    """The real app under uvicorn on a thread with the trainer loop started the way the lead
    wires it: state.trainer = TrainerLoop.from_settings(...); await start() before serving;
    await stop() after."""

    def __init__(self, settings: Settings, backend: FakeTrainingBackend) -> None:
        self.settings, self.backend = settings, backend
        self.state: Any = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.base = f"http://127.0.0.1:{settings.port}"

    def start(self) -> TrainingProxy:
        from clawbridge.proxy.app import build_app
        from clawbridge.server import build_state

        ready = threading.Event()

        async def main() -> None:
            self.state = await build_state(self.settings, self.backend)
            if self.state.trainer is None:
                self.state.trainer = TrainerLoop.from_settings(self.settings, self.state.store, self.backend)
            self._server = uvicorn.Server(
                uvicorn.Config(
                    build_app(self.state), host="127.0.0.1", port=self.settings.port, log_level="warning"
                )
            )
            await self.state.trainer.start()
            ready.set()
            try:
                await self._server.serve()
            finally:
                await self.state.trainer.stop()
                self.state.writer.close()
                self.state.store.close()

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self._thread.start()
        assert ready.wait(60)
        wait_healthy(self.base, 30)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)


def test_round_trip_through_the_proxy_trains_publishes_and_limits_new_sessions(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    renderer = Renderer.from_pretrained(str(tiny_model_dir))
    sampler = FakeSampler(script=script_for(renderer, "ok"))
    values: dict[str, Any] = {
        "port": free_port(),
        "state_dir": tmp_path,
        "model": str(tiny_model_dir),
        "served_model_name": "tiny",
        "batch_size": 3,
        "baseline": "running_mean",
        "trainer_poll_interval_s": 0.05,
        "capacity_mode": True,
        "max_backlog": 3,
    }
    settings = Settings(**values)
    info = ModelInfo(
        name="tiny", tokenizer_path=str(tiny_model_dir), context_window=4096, max_output_tokens=256
    )
    b = FakeTrainingBackend(sampler, info, step_delay_s=1.0)
    proxy = TrainingProxy(settings, b).start()
    try:
        admin = {"Authorization": f"Bearer {proxy.state.keys.admin}"}
        c = openai.OpenAI(base_url=proxy.base + "/v1", api_key=proxy.state.keys.client, max_retries=0)
        msg = [{"role": "user", "content": "hi"}]

        def chat(sid: str, turn_type: str = "main") -> Any:
            return c.chat.completions.create(
                model="tiny",
                messages=msg,  # type: ignore[arg-type]
                extra_headers={"X-Session-Id": sid, "X-Turn-Type": turn_type},
            )

        for sid, reward in (("rt-1", 1.0), ("rt-2", 0.0)):
            chat(sid)
            chat(sid)
            chat(sid, "side")
            r = httpx.post(
                proxy.base + "/rl/set_reward", json={"reward": reward, "session_id": sid}, headers=admin
            )
            assert r.status_code == 200, r.text
            r = httpx.post(proxy.base + "/rl/end_session", json={"session_id": sid}, headers=admin)
            assert r.status_code == 200 and r.json()["ended"] is True
        deadline = time.monotonic() + 20
        while not proxy.state.trainer.status()["in_step"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert chat("rt-3").system_fingerprint == "policy-v0"  # served while the step runs,
        assert not b.published  # not after it: the 1 s step has not finished
        while not b.published and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.published == [1]
        (batch,) = b.batches
        assert len(batch) == 4 and all(d.policy_version == 0 for d in batch)  # 2 sessions x 2 main turns
        # running_mean baseline: returns (gamma 1) are 1, 1, 0, 0 -> mean 0.5; token_mean scaling.
        tokens = sum(sum(d.mask) for d in batch)
        firsts = [d.advantages[d.prompt_len - 1] * tokens for d in batch]
        assert firsts == pytest.approx([0.5, 0.5, -0.5, -0.5])

        resp = chat("rt-3")
        assert resp.system_fingerprint == "policy-v1"
        view = httpx.get(proxy.base + "/rl/sessions/rt-3", headers=admin).json()
        assert [t["policy_version"] for t in view["turns"]] == [0, 1]
        assert proxy.state.store.stats()["last_trained_policy_version"] == 1

        # Capacity: rt-3 is active (2 datums on their way); one more session fits the bound of 3.
        assert httpx.post(proxy.base + "/rl/start_session", json={}, headers=admin).status_code == 200
        r = httpx.post(proxy.base + "/rl/start_session", json={}, headers=admin)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "training_backlog"
        assert chat("rt-3").choices[0].message.content  # model calls are never refused
        status = proxy.state.trainer.status()
        assert status["steps"]["ok"] == 1 and status["backlog"] >= 3
    finally:
        proxy.stop()


def test_a_backlog_trains_in_larger_steps_up_to_the_token_budget() -> None:
    def s(tid: str, tokens: int) -> PendingSample:
        return PendingSample(tid, tid, 0, 0, None, "header", tokens, 0.0)

    ready = [s("a", 5), s("b", 5), s("c", 5), s("d", 5), s("e", 5)]
    # Not behind: exactly batch_size. Behind: as many as fit in the budget of sampled tokens.
    assert [x.turn_id for x in select_batch(ready[:2], 2, False, max_tokens=100)] == ["a", "b"]
    assert [x.turn_id for x in select_batch(ready, 2, False, max_tokens=16)] == ["a", "b", "c"]
    assert len(select_batch(ready, 2, False, max_tokens=100)) == 5
    assert [x.turn_id for x in select_batch(ready, 2, False, max_tokens=0)] == ["a", "b"]
    # The budget never shrinks a batch below batch_size.
    assert [x.turn_id for x in select_batch(ready, 2, False, max_tokens=3)] == ["a", "b"]


def test_importance_weight_keeps_stale_samples_and_drops_only_past_the_user_bound(store: Store) -> None:
    ancient = rewarded_session(store, "ancient", version=0)
    old = rewarded_session(store, "old", version=3)
    fresh = rewarded_session(store, "new", version=9) + rewarded_session(store, "new2", version=10)
    loop = loop_for(store, backend(version=10), batch_size=2, max_off_policy_steps=2,
                    stale_policy="importance_weight", drop_stale_after=8, max_batch_tokens=1000)
    report = run(loop.run_once())
    assert report is not None and report.ok
    # 7 versions behind is far past max_off_policy_steps but within drop_stale_after: trained.
    assert list(report.turn_ids) == [*old, *fresh] and report.metrics["dropped_stale"] == 1.0
    assert report.metrics["staleness_max"] == 7.0
    assert consumed(store)[ancient[0]] is None
    assert TrainingStore(store).training_stats()["samples"]["dropped"] == {"stale": 1}


def test_a_batch_without_signal_is_not_a_step(store: Store) -> None:
    # Every session of the task rewarded alike: under a group baseline every advantage is 0. Such a
    # batch is not sent (an optimizer step on zeros still moves the weights by Adam's momentum): its
    # samples are dropped as no_signal, no step row, no new version; the next batch with a signal trains.
    b = backend()
    loop = loop_for(store, b, batch_size=2, baseline="group_mean")
    for sid in ("a", "b"):
        store.ensure_session(sid, "header", task_id="t")
        rewarded_session(store, sid, reward=1.0)
    assert run(loop.run_once()) is None
    assert b.batches == [] and TrainingStore(store).steps() == [] and b.fake_sampler.version == 0
    with store.read() as c:
        assert {r[0] for r in c.execute("SELECT dropped_reason FROM samples")} == {"no_signal"}
    for sid, reward in (("c", 1.0), ("d", 0.0)):
        store.ensure_session(sid, "header", task_id="u")
        rewarded_session(store, sid, reward=reward)
    report = run(loop.run_once())
    assert report is not None and report.ok and b.fake_sampler.version == 1
    assert report.metrics["dropped_no_signal"] == 2.0
    # A KL penalty is a signal of its own: the same zero-advantage batch then trains.
    kl = loop_for(store, backend(), batch_size=2, baseline="group_mean", loss=LossConfig(kl_coef=0.1))
    for sid in ("e", "f"):
        store.ensure_session(sid, "header", task_id="v")
        rewarded_session(store, sid, reward=1.0)
    kl_report = run(kl.run_once())
    assert kl_report is not None and kl_report.ok
