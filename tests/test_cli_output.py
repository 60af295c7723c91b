"""Command output read in a pipe or a log, as a script or `grep` sees it (`clawbridge.cli.common`):
nothing cut at 80 columns, no progress bar frames, words instead of Python reprs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawbridge.store import Store
from clawbridge.store.versions import VersionStore
from tests.support import ProxyProcess
from tests.test_cli import _seed_store

BAR_FRAMES = ("\r", "%|", "it/s")
"""What tqdm draws for a progress bar (carriage returns, the bar's edge, rates)."""


def piped(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`clawbridge ARGS` with stdout and stderr pipes (not a terminal), as `| cat` runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWBRIDGE_") and k != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "clawbridge.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_piped_tables_are_whole(tmp_path: Path) -> None:
    """`config show | grep keep` shows the whole option; `checkpoints list` the whole path."""
    out = piped("config", "show", "--state-dir", str(tmp_path))
    [line] = [ln for ln in out.stdout.splitlines() if "keep_checkpoints" in ln]
    assert "trainer.keep_checkpoints" in line and "CLAWBRIDGE_KEEP_CHECKPOINTS" in line, line
    assert "…" not in out.stdout
    long_path = str(tmp_path / ("checkpoints-of-a-long-named-experiment-" * 4) / "v00000001-step")
    store = Store.open(tmp_path)
    versions = VersionStore(store)
    versions.commit(versions.reserve("step", 1), long_path, {"model": "a-model-with-a-long-name" * 3})
    store.close()
    listed = piped("checkpoints", "list", "--state-dir", str(tmp_path)).stdout
    assert long_path in listed and "a-model-with-a-long-name" * 3 in listed and "…" not in listed, listed


def test_status_says_none_in_words(tmp_path: Path) -> None:
    _seed_store(tmp_path)
    out = piped("status", "--state-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "last trained policy: none yet" in out.stdout and "None" not in out.stdout, out.stdout
    assert out.stderr.startswith(f"using state dir {tmp_path} (--state-dir)")


def test_real_demo_progress_is_words() -> None:
    from clawbridge.devtools.realdemo import progress_line

    line = progress_line({"policy_version": 3, "trainer": {"steps": {"ok": 11, "failed": 0, "running": 1},
                                                            "backlog": 24},
                          "judge": {"judgements": {"done": 38, "failed": 2}, "scores": {"-1.0": 18, "1.0": 20}}})
    assert line == ("policy v3: training steps 11 ok, 0 failed, 1 running; 24 turn(s) waiting to train; "
                    "judge verdicts 38 done, 2 failed (20 scored +1, 18 scored -1)")
    assert "{" not in progress_line({"policy_version": 0, "trainer": {}, "judge": {}})


@pytest.mark.slow
def test_a_servers_log_holds_no_progress_bars(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`up` with its output in a file (as the demos and a service manager run it)."""
    proxy = ProxyProcess(tiny_model_dir, tmp_path / "state").start()
    proxy.stop()
    assert proxy.log_path is not None
    log = proxy.log_path.read_text()
    assert "clawbridge serving" in log
    assert not [frame for frame in BAR_FRAMES if frame in log], log[:3000]


@pytest.mark.slow
def test_the_demo_piped_prints_progress_lines_not_bars(tmp_path: Path) -> None:
    out = piped("demo", "--sessions", "16", "--out", str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "16/16 sessions: policy v" in out.stdout, out.stdout
    assert not [frame for frame in BAR_FRAMES if frame in out.stdout + out.stderr], out.stdout
    bars = [ln for ln in out.stdout.splitlines() if "━" in ln and ("reward (last" in ln or "loading model" in ln)]
    assert not bars, bars  # rich's bar (━ glyphs beside the task's description) is drawn only in a terminal
    assert not [frame for frame in BAR_FRAMES if frame in (tmp_path / "state" / "proxy.log").read_text()]


def test_a_failed_step_in_status_names_no_version_in_words() -> None:
    import io

    from rich.console import Console

    from clawbridge.cli.status import print_trainer

    out = io.StringIO()
    print_trainer(Console(file=out, width=200), {
        "samples": {"pending": 8, "consumed": 0, "dropped": {}}, "steps": {"ok": 0, "failed": 1},
        "recent_steps": [{"step": 3, "status": "failed", "policy_version": None, "metrics": None}]})
    assert "step 3 failed (no version committed)" in out.getvalue() and "None" not in out.getvalue()
