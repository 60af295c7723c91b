"""Trainer lanes (per-user adapters) on a real SQLite store with the fake per-user backend: versions
and steps per lane, steps that never mix users, lanes that take turns, routing, restart and forget.
(Learning through `clawbridge up` with the real model code: tests/test_user_adapters.py.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from clawbridge.access import OPERATOR, Denied, Principal
from clawbridge.backend import ModelInfo
from clawbridge.config import Settings
from clawbridge.serving.sampler import FakeSampler
from clawbridge.serving.versions import FakeVersionedBackend, VersionNotFound, VersionRouter
from clawbridge.store import Store, StoreError, TurnRecord
from clawbridge.store.training import TrainingStore
from clawbridge.store.versions import VersionStore
from clawbridge.trainer import FakeTrainingBackend, TrainerLoop
from clawbridge.trainer.checkpoints import CheckpointKeeper, NoCheckpoint
from clawbridge.trainer.fake import FakePerUserBackend
from clawbridge.trainer.lanes import UserLanes, per_user_problem

INFO = ModelInfo(name="tiny", tokenizer_path="unused", context_window=4096, max_output_tokens=256)


def settings(tmp_path: Path, **kw: object) -> Settings:
    base: dict[str, object] = {"state_dir": str(tmp_path / "state"), "per_user_adapters": True, "batch_size": 2,
                               "baseline": "none", "max_batch_tokens": 0, "trainer_poll_interval_s": 0.05,
                               "promotion_mode": "off", "lora_rank": 8}
    base.update(kw)
    return Settings(**base)  # type: ignore[arg-type]


def rewarded(store: Store, sid: str, user: str | None, reward: float = 1.0) -> str:
    now = time.time()
    turn = TurnRecord(session_id=sid, turn_type="main", status="ok", model="tiny", prompt_token_ids=[1, 2, 3],
                      completion_token_ids=[4, 5], completion_logprobs=[-0.1, -0.2], policy_version=0,
                      finish_reason="stop", request_json="{}", response_json=None, created_at=now, completed_at=now,
                      user_id=user)
    tid = store.record_turn(turn, "header")
    store.add_reward(sid, reward, "api", tid)
    store.end_session(sid, "end_session")
    return tid


def step_users(store: Store) -> list[tuple[int, str, set[str]]]:
    """(step, lane, users of its samples) for every ok step, in order."""
    with store.read() as c:
        rows = c.execute("SELECT st.step, st.lane, COALESCE(s.user_id, '') FROM steps st JOIN samples sa "
                         "ON sa.consumed_step = st.step JOIN sessions s ON s.session_id = sa.session_id "
                         "WHERE st.status='ok' ORDER BY st.step").fetchall()
    out: dict[int, tuple[str, set[str]]] = {}
    for step, lane, user in rows:
        out.setdefault(int(step), (str(lane), set()))[1].add(str(user))
    return [(s, lane, users) for s, (lane, users) in sorted(out.items())]


def test_versions_of_lanes_share_numbers_but_not_history(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    shared, alice, bob = VersionStore(store), VersionStore(store, "alice"), VersionStore(store, "bob")
    shared.commit_base("ck/base", None)
    alice.commit_base("ck/alice-base", None)
    a_step = alice.reserve("step", step=1)
    b_step = bob.reserve("step", step=2)
    assert 0 < a_step < b_step  # one sequence for every lane
    alice.commit(a_step, "ck/alice-1", None)
    last_alice = alice.last_committed()
    last_shared = shared.last_committed()
    assert last_alice is not None and last_alice.version == a_step and last_alice.lane == "alice"
    assert last_shared is not None and last_shared.version == 0 and bob.last_committed() is None
    assert [r.version for r in alice.listing()] == [a_step, a_step - 1]
    # `get` is bound to the lane (no keeper, rollback or promoter takes another lane's version);
    # `find` looks in every lane and says whose it is (the router's lookup, checked by `clawbridge.access`).
    assert shared.get(a_step) is None and bob.get(a_step) is None and alice.get(0) is None
    got, row = alice.get(a_step), shared.find(a_step)
    assert got is not None and got.lane == "alice" and row is not None and row.lane == "alice"
    assert bob.abandon_reserved() == 1 and alice.abandon_reserved() == 0  # a lane abandons only its own
    assert alice.prunable(1) == [] and shared.prunable(1) == []  # a lane's base is a base: never pruned
    with pytest.raises(StoreError):
        shared.delete_lane()
    assert alice.delete_lane() == {"policy_versions": 2, "steps": 0, "samples": 0}
    assert shared.find(a_step) is None and shared.last_committed() is not None
    store.close()


def test_per_user_adapters_refuse_what_cannot_run(tmp_path: Path) -> None:
    plain = FakeTrainingBackend(FakeSampler([7]), INFO)
    assert "cannot train an adapter per user" in (per_user_problem(settings(tmp_path), plain) or "")
    per_user = FakePerUserBackend(FakeSampler([7]), INFO)
    assert per_user_problem(settings(tmp_path), per_user) is None
    assert "promotion" in (per_user_problem(settings(tmp_path, promotion_mode="eval", eval_set="x.jsonl"),
                                            per_user) or "")
    assert per_user_problem(settings(tmp_path, per_user_adapters=False), plain) is None


async def _train_all(tmp_path: Path, delay_s: float) -> tuple[Store, FakePerUserBackend, UserLanes, TrainerLoop]:
    s = settings(tmp_path)
    store = Store.open(s.state_path)
    for i in range(6):  # alice is busy: three steps' worth
        rewarded(store, f"a{i}", "alice")
    for i in range(2):  # bob: one step
        rewarded(store, f"b{i}", "bob")
    rewarded(store, "s0", None)
    rewarded(store, "s1", None)
    backend = FakePerUserBackend(FakeSampler([7, 8]), INFO, step_delay_s=delay_s)
    lock = asyncio.Lock()
    shared = TrainerLoop.from_settings(s, store, backend, CheckpointKeeper(store, backend), lane="", step_lock=lock)
    lanes = UserLanes(s, store, backend, lock)
    await shared.start()
    await lanes.start()

    def caught_up(user: str) -> bool:
        # The step's row commits in a worker thread before the lane's keeper takes the version in
        # memory; a lane has caught up when both say the same newest version.
        last = VersionStore(store, user).last_committed()
        return last is not None and lanes.version_for(user) == last.version

    def done() -> bool:
        with store.read() as c:
            consumed = c.execute("SELECT COUNT(*) FROM samples WHERE consumed_step IS NULL").fetchone()[0] == 0 \
                and c.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 10
        return consumed and caught_up("alice") and caught_up("bob")
    for _ in range(400):
        if done():
            break
        await asyncio.sleep(0.05)
    assert done()
    return store, backend, lanes, shared


def test_lanes_train_each_user_apart_and_take_turns(tmp_path: Path) -> None:
    async def main() -> None:
        store, backend, lanes, shared = await _train_all(tmp_path, delay_s=0.05)
        try:
            steps = step_users(store)
            assert all(users == {lane} for _, lane, users in steps), steps  # a step never mixes users
            order = [lane for _, lane, _ in steps]
            assert sorted(order) == ["", "alice", "alice", "alice", "bob"], order
            # Taking turns: bob's one step never waits behind all of alice's.
            assert order.index("bob") < max(i for i, lane in enumerate(order) if lane == "alice"), order
            by_user = {lane.user: lane for lane in backend.lanes}
            assert len(by_user["alice"].batches) == 3 and len(by_user["bob"].batches) == 1
            assert len(backend.batches) == 1  # the shared policy trained the turns without a user
            # Each user's calls get their lane's newest version; the shared key gets the shared one.
            alice_v = VersionStore(store, "alice").last_committed()
            assert alice_v is not None and lanes.version_for("alice") == alice_v.version
            assert lanes.version_for(None) is None and lanes.version_for("carol") is None
            st = lanes.status()
            assert st["alice"]["steps"]["ok"] == 3 and st["bob"]["steps"]["ok"] == 1
            assert st["alice"]["reward_trend"] == [1.0, 1.0, 1.0] and st["bob"]["pending_turns"] == 0
        finally:
            await lanes.stop()
            await shared.stop()
            store.close()

    asyncio.run(main())


def test_a_user_version_answers_only_its_user(tmp_path: Path) -> None:
    async def main() -> None:
        store, _, lanes, shared = await _train_all(tmp_path, delay_s=0.0)
        try:
            served = FakeVersionedBackend(lambda v: [v], INFO, published=shared.backend.sampler().policy_version,
                                          max_loaded=8)
            router = VersionRouter(served, VersionStore(store), ("tiny", "default"), lanes=lanes)
            bob_v = lanes.version_for("bob")
            assert bob_v is not None
            bob, bobs_session = Principal("user", user="bob"), Principal("session", user="bob", session_id="s")
            assert (await router.route("tiny", "s", bob)).version == bob_v
            assert (await router.route("tiny", "s", bobs_session)).reason == "user"
            assert (await router.route(f"tiny@{bob_v}", "s", bob)).version == bob_v
            for caller in (Principal("user", user="alice"), Principal("client"), Principal("session", user="alice")):
                with pytest.raises(VersionNotFound, match="does not exist"):
                    await router.route(f"tiny@{bob_v}", "s", caller)
            with pytest.raises(Denied, match="bob's adapter"):  # the admin is told why (it sees every lane)
                await router.route(f"tiny@{bob_v}", "s", OPERATOR)
            assert (await router.route("tiny", "s", Principal("client"))).reason == "serving"
            # Evaluating is the admin's to do on any lane; serving one needs the lane named.
            assert (await router.sampler_for(bob_v, OPERATOR, "evaluate")).policy_version == bob_v
            with pytest.raises(Denied, match="--user bob"):
                await router.sampler_for(bob_v, OPERATOR, "serve")
            assert (await router.sampler_for(bob_v, OPERATOR.in_lane("bob"), "serve")).policy_version == bob_v
        finally:
            await lanes.stop()
            await shared.stop()
            store.close()

    asyncio.run(main())


def test_the_admin_rolls_a_users_lane_back_only_to_her_own_versions(tmp_path: Path) -> None:
    """`clawbridge rollback N --user alice` (`UserLanes.rollback`): N's checkpoint serves her calls
    under a new version of her lane, which trains on from it; a version of another lane (bob's, the
    shared base) is not hers and is refused before anything is restored."""
    async def main() -> None:
        store, backend, lanes, shared = await _train_all(tmp_path, delay_s=0.0)
        try:
            hers = VersionStore(store, "alice").listing()  # newest first: 3 steps, then her base
            first, newest = hers[-2], hers[0]
            bob_v = lanes.version_for("bob")
            alice = {lane.user: lane for lane in backend.lanes}["alice"]
            restores = list(alice.restores)
            for other in (bob_v, 0):
                with pytest.raises(NoCheckpoint):
                    await lanes.rollback("alice", other)
            assert alice.restores == restores and lanes.version_for("alice") == newest.version
            with pytest.raises(LookupError):
                await lanes.rollback("carol", first.version)
            previous, new = await lanes.rollback("alice", first.version)
            row = VersionStore(store, "alice").get(new)
            assert previous == newest.version and row is not None and row.kind == "rollback"
            assert row.source_version == first.version and row.checkpoint == first.checkpoint
            assert lanes.version_for("alice") == new and lanes.version_for("bob") == bob_v
            assert alice.restores[-1] == (first.checkpoint, new)
            assert VersionStore(store).find(new) == row and VersionStore(store).get(new) is None
        finally:
            await lanes.stop()
            await shared.stop()
            store.close()

    asyncio.run(main())


def test_lanes_resume_after_a_restart_and_forget_deletes_a_lane(tmp_path: Path) -> None:
    async def main() -> None:
        store, backend, lanes, shared = await _train_all(tmp_path, delay_s=0.0)
        alice_v, bob_v = lanes.version_for("alice"), lanes.version_for("bob")
        disks = {lane.user: lane.disk for lane in backend.lanes}
        await lanes.stop()
        await shared.stop()
        assert all(lane.closed for lane in backend.lanes)
        # A restart: new lanes resume each user's newest committed checkpoint.
        s = settings(tmp_path)
        again = FakePerUserBackend(FakeSampler([7, 8]), INFO)
        orig = again.user_lane

        def with_disk(user: str) -> object:
            lane = orig(user)
            lane.disk.update(disks.get(user, {}))
            return lane
        again.user_lane = with_disk  # type: ignore[method-assign, assignment]
        lanes2 = UserLanes(s, store, again, asyncio.Lock())
        await lanes2.start()
        try:
            assert lanes2.version_for("alice") == alice_v and lanes2.version_for("bob") == bob_v
            resumed = {lane.user: lane for lane in again.lanes}
            assert resumed["alice"].fake_sampler.version == alice_v  # serving its restored adapter
            deleted = await lanes2.forget_user("bob")
            assert deleted["adapter_versions"] == 2 and deleted["steps"] == 1 and deleted["samples"] == 2, deleted
            assert deleted["adapter_checkpoints"] >= 1 and resumed["bob"].forgotten
            assert bob_v in again.unloaded and lanes2.version_for("bob") is None
            assert VersionStore(store, "bob").last_committed() is None
            # Until the store's part of forgetting is over, bob's turns start no lane; after it, a
            # bob who comes back gets a new one.
            rewarded(store, "b-new", "bob")
            TrainingStore(store).ingest_ended()
            assert await lanes2.scan() == []
            lanes2.forgotten("bob")
            assert await lanes2.scan() == ["bob"]
            assert lanes2.version_for("bob") is None and lanes2.version_for("alice") == alice_v
        finally:
            await lanes2.stop()
            store.close()

    asyncio.run(main())


def test_the_local_backend_says_what_per_user_adapters_need(tmp_path: Path) -> None:
    local = pytest.importorskip("clawbridge_local.backend")

    def problem(**kw: object) -> str | None:
        return per_user_problem(settings(tmp_path, model="unused", **kw), local.LocalBackend(settings(
            tmp_path, model="unused", **kw)))

    assert problem() is None
    assert "LoRA" in (problem(lora_rank=0) or "")
    assert problem(backends={"local": {"engine": "sglang"}}) is None  # adapters as per-request lora_path
    assert "in this process" in (problem(backends={"local": {"train_world_size": 2}}) or "")


def test_status_line_of_a_users_adapter() -> None:
    from clawbridge.cli.status import lane_text, sparkline

    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█" and sparkline([0.3, 0.3]) == "▁▁" and sparkline([]) == ""
    lane = {"serving_version": 12, "in_step": True, "steps": {"ok": 3, "failed": 0}, "pending_turns": 2,
            "reward_trend": [0.25, 0.5, 1.0], "last_error": None}
    assert lane_text(lane) == "; own adapter v12 (not gated), 3 step(s), training now, step reward 0.25 -> 1.00 ▁▃█"
    assert lane_text({**lane, "in_step": False, "rehearsed": 8}) == (
        "; own adapter v12 (not gated), 3 step(s), 8 known facts rehearsed per step, step reward 0.25 -> 1.00 ▁▃█")
    assert "not trained yet" in lane_text({**lane, "serving_version": None, "reward_trend": []})
    assert "nothing to train yet" in lane_text(None)


def test_a_lane_step_log_names_its_user_and_a_loss_the_backend_did_not_report(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`training step 3 ok ... policy v5` said neither whose adapter trained nor why the loss was
    `None` (a hosted service that reports none, like SkyRL's Tinker server)."""
    from clawbridge.backend import Datum, LossConfig, StepResult
    from clawbridge.trainer.fake import FakeLaneBackend

    class NoLoss(FakeLaneBackend):
        async def train_step(self, batch: list[Datum], loss: LossConfig) -> StepResult:  # type: ignore[override]
            metrics = dict((await super().train_step(batch, loss)).metrics)
            del metrics["loss"]
            return StepResult(metrics=metrics)

    async def main() -> None:
        s = settings(tmp_path)
        store = Store.open(s.state_path)
        try:
            for i in range(2):
                rewarded(store, f"a{i}", "alice")
            lane = NoLoss("alice", FakeSampler([7, 8]), INFO)
            loop = TrainerLoop.from_settings(s, store, lane, CheckpointKeeper(store, lane, lane="alice"), lane="alice")
            report = await loop.run_once()
            assert report is not None and report.ok
        finally:
            store.close()

    with caplog.at_level("INFO", logger="clawbridge.trainer"):
        asyncio.run(main())
    (line,) = [r.getMessage() for r in caplog.records if "training step" in r.getMessage()]
    assert line.startswith("training step 1 (user alice) ok:") and "loss not reported" in line, line


def test_version_and_step_numbers_are_given_once_across_forget_and_restart(tmp_path: Path) -> None:
    """A user's lane holds the newest versions and steps; forgetting it deletes their rows. The
    next numbers are still new ones, also after a restart: a number of the forgotten user's
    (`v{N}`, an adapter name SGLang may still hold) never names anyone else's weights."""
    store = Store.open(tmp_path)
    shared, alice = VersionStore(store), VersionStore(store, "alice")
    tshared, talice = TrainingStore(store), TrainingStore(store, lane="alice")
    shared.commit_base("ck/base", None)
    first = shared.reserve("step", step=tshared.begin_step())
    shared.commit(first, "ck/shared-1", None)
    alice.commit_base("ck/alice-base", None)
    her_step = talice.begin_step()
    her_version = alice.reserve("step", step=her_step)
    alice.commit(her_version, "ck/alice-1", None)
    assert alice.delete_lane()["policy_versions"] == 2
    given = {first, her_version, her_version - 1}
    nxt = shared.reserve("step")
    assert nxt > max(given), (nxt, given)
    step = tshared.begin_step()
    assert step > her_step, (step, her_step)
    store.close()
    store = Store.open(tmp_path)  # a restart
    again = VersionStore(store).reserve("step")
    assert again > nxt and TrainingStore(store).begin_step() > step
    store.close()


def test_a_lane_is_not_gated_but_its_steps_rehearse_the_shared_gates_set(tmp_path: Path) -> None:
    """A user's adapter serves its user once committed (no gate of its own), so its steps add the
    shared gate's rehearsal set as the shared policy's do: the lane's batch is its user's two turns,
    then two rehearsed answers; a lane never settles the shared gate nor holds anything out."""
    from clawbridge.promotion.evalset import EvalItem
    from clawbridge.promotion.rehearsal import Rehearsal
    from clawbridge.trainer.gate import FakeGate

    items = tuple(EvalItem("held_out", f"q{i}", prompt_ids=(1, 2), completion_ids=(20 + i, 99),
                           completion_logprobs=(-0.5, -0.25), verdict=1) for i in range(3))

    async def main() -> None:
        s = settings(tmp_path, rehearsal_items=2)
        store = Store.open(s.state_path)
        for i in range(2):
            rewarded(store, f"a{i}", "alice")
        backend = FakePerUserBackend(FakeSampler([7, 8]), INFO)
        lock = asyncio.Lock()
        shared = TrainerLoop.from_settings(s, store, backend, CheckpointKeeper(store, backend), lane="", step_lock=lock)
        lanes = UserLanes(s, store, backend, lock)
        source = lanes.rehearsals = FakeGate(rehearsals=[Rehearsal(0, items)])
        await shared.start()  # it turns ended sessions into samples, the lanes' too
        await lanes.start()
        try:
            for _ in range(400):
                if any(lane.batches for lane in backend.lanes):
                    break
                await asyncio.sleep(0.05)
            (alice,) = backend.lanes
            (batch,) = alice.batches
            assert [d.turn_id != "" for d in batch] == [True, True, False, False]
            assert {d.tokens[2] for d in batch[2:]} <= {20, 21, 22} and len({d.tokens[2] for d in batch[2:]}) == 2
            assert source.rehearsal_calls == 1 and source.calls == 0  # never the shared gate's settle
            (step,) = [st for st in TrainingStore(store, "alice").lane_steps(10) if st.status == "ok"]
            assert step.metrics["rehearsal_datums"] == 2.0 and step.metrics["turns"] == 2.0
            assert lanes.status()["alice"]["rehearsed"] == 2
        finally:
            await lanes.stop()
            await shared.stop()
            store.close()

    asyncio.run(main())
