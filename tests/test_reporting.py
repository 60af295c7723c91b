"""`report_to`: committed steps reach TensorBoard event files and W&B (a fake `wandb` module:
the real one is not a dependency), and a tracker that hangs or fails never holds training up."""

from __future__ import annotations

import struct
import sys
import threading
import types
from pathlib import Path
from typing import Any

import pytest
from clawbridge_fireworks.settings import FireworksSettings
from pydantic import ValidationError

from clawbridge.config import Settings
from clawbridge.store import Store
from clawbridge.store.training import TrainingStore
from clawbridge.telemetry.reporting import StepReporter
from tests.dashboard_support import start_trained_proxy, wait_for


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the event files under `logdir`, read with tensorboardX's own protobufs
    (TFRecord framing: u64 length, u32 crc, payload, u32 crc)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            payload = data[pos + 12:pos + 12 + length]
            if len(payload) < length:
                break  # a record still being written
            pos += 12 + length + 4
            event = event_pb2.Event.FromString(payload)
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


class FakeWandb:
    """Stands in for the `wandb` module: records init/log/finish; `log` waits while `hold` is set."""

    def __init__(self) -> None:
        self.inits: list[dict[str, Any]] = []
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.finished = False
        self.release = threading.Event()

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("wandb")
        fake = self

        class Run:
            def log(self, metrics: dict[str, float], step: int) -> None:
                assert fake.release.wait(60), "the test never released the fake tracker"
                fake.logged.append((step, dict(metrics)))

            def finish(self) -> None:
                fake.finished = True

        def init(**kwargs: Any) -> Run:
            fake.inits.append(kwargs)
            return Run()

        mod.init = init  # type: ignore[attr-defined]
        return mod


def test_steps_reach_tensorboard_and_wandb_and_a_hung_tracker_never_blocks_training(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake.module())
    runs = tmp_path / "runs"
    # wandb hangs in log() until released: start_trained_proxy still sees both steps publish
    t = start_trained_proxy(tiny_model_dir, tmp_path / "state", report_to="tensorboard,wandb",
                            report_dir=str(runs))
    try:
        assert t.backend.published == [1, 2] and fake.logged == []

        def both_steps() -> dict[str, dict[int, float]] | None:
            s = tensorboard_scalars(runs / "tensorboard")  # every tag of both steps written
            return s if s and all(v.keys() == {1, 2} for v in s.values()) else None

        scalars = wait_for(both_steps, what="both steps in the tensorboard event files")
        assert scalars["train/policy_version"] == {1: 1.0, 2: 2.0}
        assert scalars["train/samples"] == {1: 2.0, 2: 2.0}
        assert {"train/kl", "train/clip_fraction", "train/train_seconds", "train/publish_seconds"} <= set(scalars)
        fake.release.set()
        wait_for(lambda: len(fake.logged) == 2, what="wandb to get both steps once released")
        assert [s for s, _ in fake.logged] == [1, 2] and fake.logged[0][1]["train/loss"] == pytest.approx(scalars["train/loss"][1])
        (init,) = fake.inits
        assert init["project"] == "clawbridge" and init["dir"] == str(runs / "wandb")
        assert init["config"]["batch_size"] == 2 and "***" not in init["config"].values()
        assert init["config"]["backends"]["fireworks"]["base_url"] == FireworksSettings().base_url  # resolved
    finally:
        fake.release.set()
        t.proxy.stop()
    assert fake.finished


class Recording:
    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail
        self.logged: list[int] = []
        self.closed = False

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.fail:
            raise ConnectionError("tracker unreachable")
        self.logged.append(step)

    def close(self) -> None:
        self.closed = True


def test_a_failing_tracker_does_not_stop_the_others(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    store = Store.open(tmp_path)
    ts = TrainingStore(store)
    old = ts.begin_step()
    ts.commit_step(old, 1, {"loss": 0.5}, [])  # committed before the reporter started: not re-sent
    good, bad = Recording("good"), Recording("bad", fail=True)
    reporter = StepReporter(store, [bad, good], poll_interval_s=3600)

    async def run() -> None:
        await reporter.start()
        ok = ts.begin_step()
        ts.commit_step(ok, 2, {"loss": 0.25, "kl": float("nan")}, [])
        failed = ts.begin_step()
        ts.fail_step(failed, "boom")
        running = ts.begin_step()
        assert await reporter.poll_once() == 3
        assert reporter.last_step == failed  # stops at the running step, reports it once settled
        ts.commit_step(running, 3, {"loss": 0.125}, [])
        await reporter.poll_once()
        await asyncio.to_thread(wait_for, lambda: good.logged == [ok, running], 10.0, f"the good tracker {good.logged}")
        await reporter.stop()

    try:
        asyncio.run(run())
    finally:
        store.close()
    assert good.closed and bad.closed and bad.logged == []
    assert sum("failed (training goes on)" in r.message for r in caplog.records) == 1  # once per streak


def test_unknown_tracker_is_a_configuration_error() -> None:
    with pytest.raises(ValidationError, match="mlflow"):
        Settings(report_to="tensorboard,mlflow")
    assert Settings(report_to=" TensorBoard , tensorboard ").report_to == "tensorboard"
