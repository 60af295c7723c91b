"""kill -9 during training, for real, on the hosted backends: `clawbridge up --backend tinker`
(or `fireworks`) in a subprocess against the protocol servers the tests run on 127.0.0.1 (the
real, unmodified SDKs), rewarded sessions through the `openai` SDK, SIGKILL at each named moment
of a step (`clawbridge.runtime.faults`; see `tests.test_kill` for what a restart must keep).

On top of the store's records, the service's own record shows exactly-once: the protocol servers
keep, per trained model, the datums of every applied optim step (and a loaded checkpoint brings
the ones it held), so the final weights' list must hold every consumed sample exactly once,
although the killed step's datums were sent to the service twice. Optimizer state: the restore
call carried the committed checkpoint's path, with its optimizer state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.kill_support import REWARDS, StoreView, check_killed_run, killed_run
from tests.support import ProxyProcess

COMMON = {
    "CLAWBRIDGE_BASELINE": "none",
    "CLAWBRIDGE_MAX_BATCH_TOKENS": "0",
    "CLAWBRIDGE_TRAINER_POLL_INTERVAL_S": "0.2",
    "CLAWBRIDGE_PROMOTION_MODE": "off",  # every publish serves at once: the kill points name served versions
}
ARGS = ("--batch-size", "2", "--method", "rl")


def _starter(model: Path, state: Path, backend: tuple[str, ...], env: dict[str, str]
             ) -> Callable[[dict[str, str]], ProxyProcess]:
    def start(fault: dict[str, str]) -> ProxyProcess:
        return ProxyProcess(model, state, extra_args=ARGS, backend_args=backend,
                            env={**COMMON, **env, **fault}).start(timeout_s=300)

    return start


def _check_trained_once(trained: list[tuple[int, ...]], view: StoreView) -> None:
    counts = Counter(trained)
    assert all(n == 1 for n in counts.values()), "a datum is in the weights twice"
    assert sorted(counts) == sorted(view.sequences(list(REWARDS)))


# ---------------------------------------------------------------------------------- tinker

TINKER_MODEL = "test/tiny-qwen3"


@pytest.fixture
def tinker_server() -> Iterator[object]:
    pytest.importorskip("tinker")
    pytest.importorskip("clawbridge_tinker")
    from tests.tinker_server import TinkerProtocolServer

    server = TinkerProtocolServer(models=(TINKER_MODEL,))
    server.vocab = 4000  # below the tiny tokenizer's vocabulary
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("point", ("step.trained", "publish.mid", "checkpoint.mid"))
def test_kill_9_mid_step_on_tinker(tiny_model_dir: Path, tmp_path: Path, point: str, tinker_server: object) -> None:
    from tests.tinker_server import TinkerProtocolServer, sample_output

    server = tinker_server
    assert isinstance(server, TinkerProtocolServer)
    state = tmp_path / "state"
    start = _starter(tiny_model_dir, state, ("--backend", "tinker", "--model", TINKER_MODEL), {
        "CLAWBRIDGE_TOKENIZER": str(tiny_model_dir),
        "CLAWBRIDGE_TINKER_BASE_URL": server.base_url,
        "TINKER_API_KEY": "tml-test-key",
    })
    out = killed_run(start, state, point)
    view = StoreView(state)
    check_killed_run(out, view)

    # the restart loaded v1's checkpoint, weights and optimizer state
    v1_checkpoint = out["versions"][1][2]
    (load,) = server.bodies("load_weights")
    assert load["path"] == v1_checkpoint and load.get("optimizer") is True, load
    # the final weights: three applied steps, every consumed sample in them once
    final = server.models[server.bodies("optim_step")[-1]["model_id"]]
    assert final.step == 3
    _check_trained_once(final.trained, view)
    assert Counter(d for b in server.bodies("forward_backward") for d in map(lambda x: tuple(x["model_input"]), b["data"])
                   ).most_common(1)[0][1] == 2  # the killed step's datums were sent twice
    # which weights answered: the frozen server's uncommitted v2 (2 steps), the final v4 (3 steps)
    if "during" in out and out["during"]["policy_version"] == 2:
        d = out["during"]
        assert d["completion"] == sample_output(d["prompt"], 2, len(d["completion"]), None, 4000)[0]
    p = out["probe"]
    assert p["completion"] == sample_output(p["prompt"], 3, len(p["completion"]), None, 4000)[0]
    # retention (keep_checkpoints 3): the base checkpoint and its sampler weights (NAME@N) are never deleted
    base = out["versions"][0][2]
    assert base not in server.deleted and base.replace("/weights/", "/sampler_weights/") not in server.deleted


# ---------------------------------------------------------------------------------- fireworks

FIREWORKS_MODEL = "accounts/fireworks/models/qwen3-test"


@pytest.mark.parametrize("point", ("publish.mid", "checkpoint.mid", "step.published"))
def test_kill_9_mid_step_on_fireworks(tiny_model_dir: Path, tmp_path: Path, point: str) -> None:
    pytest.importorskip("clawbridge_fireworks")
    pytest.importorskip("fireworks.training.sdk")
    from tokenizers import Tokenizer

    from tests.fireworks_server import FakeFireworks, ServerThread

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    fw = FakeFireworks()
    fw.completion_ids = [*tok.encode("fine, thanks", add_special_tokens=False).ids, tok.token_to_id("<|im_end|>")]
    state = tmp_path / "state"
    with ServerThread(fw) as srv:
        start = _starter(tiny_model_dir, state, ("--backend", "fireworks", "--model", FIREWORKS_MODEL), {
            "CLAWBRIDGE_TOKENIZER": str(tiny_model_dir),
            "FIREWORKS_API_KEY": "fw-test-key",
            "FIREWORKS_ACCOUNT_ID": "acct-test",
            "CLAWBRIDGE_FIREWORKS_BASE_URL": srv.url,
            "CLAWBRIDGE_FIREWORKS_TRAINING_SHAPE": "accounts/fireworks/trainingShapes/ts-test",
            "CLAWBRIDGE_FIREWORKS_YES": "true",
            "CLAWBRIDGE_FIREWORKS_POLL_INTERVAL_S": "0.05",
            "CLAWBRIDGE_FIREWORKS_RETRY_BUDGET_S": "5",
            "CLAWBRIDGE_FIREWORKS_STEP_TIMEOUT_S": "60",
            "CLAWBRIDGE_LORA_RANK": "8",
        })
        # mid-publish the deployment's gate is closed until the hot load is recorded: calls wait
        out = killed_run(start, state, point, call_while_frozen=point != "publish.mid")
    view = StoreView(state)
    check_killed_run(out, view)

    v1_checkpoint = out["versions"][1][2]
    loads = fw.bodies("trainer.load_weights")
    assert [b["path"] for b in loads] == [v1_checkpoint], loads
    assert loads[0].get("optimizer") is True, loads[0]
    final_id = fw.bodies("trainer.optim_step")[-1]["model_id"]
    final = fw.models[final_id]
    assert final.steps == 3
    _check_trained_once(final.trained, view)
    # the deployment serves what the store calls the last committed version
    manifest_v = out["served"]
    hot = fw.bodies("hotload")
    assert fw.current_identity == hot[-1]["identity"] and manifest_v == 4 - (point == "step.trained")
