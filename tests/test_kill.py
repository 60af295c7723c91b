"""kill -9 during training, for real, on the local backend: `clawbridge up` (tiny model) in a
subprocess, rewarded sessions through the `openai` SDK, SIGKILL at each named moment of a step.

The moment is made exact by the test-only fault hook (`clawbridge.runtime.faults`): the armed server
freezes there and writes a marker file; the test then kills it (never a sleep). A restart on the
same state dir must (`tests.kill_support.check_killed_run`):
- serve the last committed version (it says so when it restores; at the end `/health` serves the
  store's newest committed version);
- never reuse a version number: the one the dead process reserved (and, past publish, served a
  turn under) is abandoned, and every later step gets a higher number;
- train every consumed sample exactly once: in the store, each sample consumed by one ok step and
  the interrupted step failed; in the weights, every step's loss (computed before its update)
  equals that of an uninterrupted run on the same data, to float tolerance, and the final weights
  answer a probe with the same logprobs. That also shows the optimizer state came back: step 3's
  update depends on the Adam moments of steps 1 and 2.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.kill_support import StoreView, check_killed_run, killed_run, uninterrupted_run
from tests.support import ProxyProcess

LOCAL_POINTS = ("publish.mid", "checkpoint.mid", "step.checkpointed")
"""Each kill costs two starts of the server (~30 s each on a loaded machine), so each backend gets
three of the five points; together the three backends' files cover all of `POINTS`."""

ENV = {
    "CLAWBRIDGE_BASELINE": "running_mean",  # trainer state besides the weights: restored from the store
    "CLAWBRIDGE_MAX_BATCH_TOKENS": "0",  # exactly batch_size per step: both runs form the same batches
    "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.2",
    "CLAWBRIDGE_PROMOTION_MODE": "off",  # every publish serves at once: the kill points name served versions
    "CLAWBRIDGE_LEARNING_RATE": "0.01",  # large enough that one update more or less shows in every loss
    "CLAWBRIDGE_LORA_RANK": "4",
}


def _starter(model: Path, state: Path) -> Callable[[dict[str, str]], ProxyProcess]:
    def start(env: dict[str, str]) -> ProxyProcess:
        return ProxyProcess(model, state, extra_args=("--batch-size", "2", "--method", "rl"),
                            env={**ENV, **env}).start(timeout_s=300)

    return start


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    state = tmp_path_factory.mktemp("uninterrupted")
    return uninterrupted_run(_starter(tiny_model_dir, state), state)


@pytest.mark.parametrize("point", LOCAL_POINTS)
def test_kill_9_mid_step_on_the_local_backend(tiny_model_dir: Path, tmp_path: Path, point: str,
                                              reference: dict[str, Any]) -> None:
    state = tmp_path / "state"
    out = killed_run(_starter(tiny_model_dir, state), state, point)
    view = StoreView(state)
    check_killed_run(out, view)
    # in the weights: the losses of an uninterrupted run on the same data, and the same final weights
    losses = [s.metrics["loss"] for s in out["steps"] if s.status == "ok"]
    assert losses == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)
    assert len({round(x, 5) for x in losses}) == 3  # the steps differ, so equal losses mean equal state
    assert out["probe"]["completion"] == reference["probe"]["completion"]
    assert out["probe"]["logprobs"] == pytest.approx(reference["probe"]["logprobs"], rel=1e-5, abs=1e-6)
    # on disk: the newest 3 committed versions' checkpoints (keep_checkpoints) and the base's (never
    # pruned); anything the killed step had written (a complete folder or a partial .tmp-* one) was
    committed = view.committed()
    kept = {Path(out["versions"][v][2]).name for v in [0, *committed[-3:]]}
    assert {p.name for p in (state / "checkpoints" / "local").iterdir()} == kept
