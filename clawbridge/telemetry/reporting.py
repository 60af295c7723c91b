"""Step metrics to experiment trackers (`report_to = "tensorboard,wandb"`), off by default.

The reporter reads COMMITTED steps from the store (`ObserveStore.steps`) on its own asyncio task
and hands each to every sink on that sink's own thread, so:
- training never waits for a tracker: the trainer loop does not know the reporter exists;
- a tracker that is down, slow or raising delays only itself: its queue holds at most
  `QUEUE_MAX` steps (the oldest are dropped with one warning), its errors are logged (once per
  failure streak) and it gets the next step anyway;
- a step is reported once per server run; steps committed before the server started are not
  reported again (the tracker already has them from the run that made them).

Sinks: `TensorBoardSink` (tensorboardX event files under `report_dir`), `WandbSink` (the `wandb`
package if installed; honour `WANDB_MODE=offline`), `StepSink` is the seam (fakes in tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
from pathlib import Path
from typing import Any, Protocol

from clawbridge.config import Settings, parse_report_to
from clawbridge.store import Store
from clawbridge.store.observe import ObserveStore

log = logging.getLogger("clawbridge.telemetry.reporting")

QUEUE_MAX = 1000


class StepSink(Protocol):
    """Where step metrics go. `log` and `close` run on the sink's own thread.

    Fakes: tests/test_reporting.py's `Recording` sink and `FakeWandb` module; the TensorBoard sink
    is tested on real event files there."""

    name: str

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def step_scalars(step: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a step row, plus its sample count and policy version."""
    out = {f"train/{k}": float(v) for k, v in step["metrics"].items()
           if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))}
    out["train/samples"] = float(step["samples"])
    if step["policy_version"] is not None:
        out["train/policy_version"] = float(step["policy_version"])
    return out


class TensorBoardSink:
    """tensorboardX event files, one scalar per metric (`train/loss`, ...). tensorboardX writes
    from its own thread and reaches the file within `FLUSH_S` seconds (its `flush()` does not
    drain that thread's queue)."""

    FLUSH_S = 1

    name = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.logdir = logdir
        self._writer = SummaryWriter(logdir=str(logdir), flush_secs=self.FLUSH_S)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases, through the `wandb` package (not a clawbridge dependency)."""

    name = "wandb"

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ValueError("report_to wandb needs the wandb package: pip install wandb") from None
        self._wandb = wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, dir=str(run_dir), config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class _SinkWorker:
    """One sink on its own daemon thread with a bounded queue."""

    def __init__(self, sink: StepSink) -> None:
        self.sink = sink
        self.queue: queue.Queue[tuple[int, dict[str, float]] | None] = queue.Queue(QUEUE_MAX)
        self.failing = False
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name=f"clawbridge-report-{sink.name}", daemon=True)
        self.thread.start()

    def put(self, step: int, metrics: dict[str, float]) -> None:
        while True:
            try:
                self.queue.put_nowait((step, metrics))
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self.queue.get_nowait()
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("%s is not keeping up; dropping its oldest queued steps", self.sink.name)

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            step, metrics = item
            try:
                self.sink.log(step, metrics)
            except Exception as exc:
                if not self.failing:
                    log.warning("reporting step %d to %s failed (training goes on): %s", step, self.sink.name, exc)
                self.failing = True
            else:
                if self.failing:
                    log.info("reporting to %s works again (step %d)", self.sink.name, step)
                self.failing = False
        try:
            self.sink.close()
        except Exception as exc:
            log.warning("closing %s failed: %s", self.sink.name, exc)

    def stop(self, timeout_s: float) -> None:
        with contextlib.suppress(queue.Full):
            self.queue.put(None, timeout=timeout_s)
        self.thread.join(timeout_s)


class StepReporter:
    """Polls the store for newly committed steps and fans them out to the sinks."""

    def __init__(self, store: Store, sinks: list[StepSink], poll_interval_s: float = 1.0) -> None:
        self.observe = ObserveStore(store)
        self.sinks = sinks
        self.poll_interval_s = poll_interval_s
        self.last_step = 0
        self._workers: list[_SinkWorker] = []
        self._task: asyncio.Task[None] | None = None
        self._poll_lock = asyncio.Lock()

    async def start(self) -> None:
        done = await asyncio.to_thread(self.observe.steps, 1)
        self.last_step = done[-1]["step"] if done else 0
        self._workers = [_SinkWorker(s) for s in self.sinks]
        self._task = asyncio.create_task(self._run(), name="clawbridge-reporter")
        log.info("reporting training steps to %s", ", ".join(s.name for s in self.sinks))

    async def poll_once(self) -> int:
        """Hand every step committed since the last poll to the sinks; returns how many rows it
        read. Polls never overlap (a step is handed over once)."""
        async with self._poll_lock:
            rows = await asyncio.to_thread(self.observe.steps_after, self.last_step)
            for row in rows:
                if row["status"] == "running":
                    break  # report in order: wait until it is settled
                self.last_step = row["step"]
                if row["status"] != "ok":
                    continue
                scalars = step_scalars(row)
                for w in self._workers:
                    w.put(row["step"], scalars)
            return len(rows)

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:
                log.exception("reading steps to report failed; will retry")
            await asyncio.sleep(self.poll_interval_s)

    async def stop(self, timeout_s: float = 5.0) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self.poll_once()  # the last steps committed before shutdown
        for w in self._workers:
            await asyncio.to_thread(w.stop, timeout_s)


def build_reporter(settings: Settings, store: Store) -> StepReporter | None:
    """The reporter `settings.report_to` asks for (None when empty); ValueError on a bad setup."""
    names = parse_report_to(settings.report_to)
    if not names:
        return None
    base = Path(settings.report_dir).expanduser() if settings.report_dir else settings.state_path / "runs"
    sinks: list[StepSink] = []
    for name in names:
        if name == "tensorboard":
            sinks.append(TensorBoardSink(base / "tensorboard"))
        else:
            from clawbridge.plugins import resolved_config

            sinks.append(WandbSink(settings.wandb_project, base / "wandb",
                                   {k: v for k, v in resolved_config(settings)[0].items() if v != "***"}))
    return StepReporter(store, sinks, poll_interval_s=settings.trainer_poll_interval_s)
